"""Train the built-in model `tiny-hybrid` on the Python standard library's source, and evaluate it.

    python -m tools.train.train_tiny --out hkv/models/builtin/tiny-hybrid            # one H200: under 10 minutes
    python -m tools.train.train_tiny --eval [--model hkv/models/builtin/tiny-hybrid]
    python -m tools.train.train_tiny --out /tmp/toy --max-files 60 --steps 300 --batch 8 --seq 128   # CPU toy

Corpus (tools/train/tiny_corpus.py): every *.py file of `sysconfig.get_paths()["stdlib"]`,
sorted by relative path, minus site-packages and the few non-UTF-8 files. Held
out for evaluation: the packages json, email, http and tomllib (their files are
the evaluation text; their tests, test/test_json*, test/test_email*,
test/test_http*, test/test_tomllib*, are left out of training too).

Tokenizer: hkv's byte-level BPE recipe (hkv/models/tiny.py: Qwen2's pre-tokenizer
split, NFC, byte alphabet), 4,096 tokens trained on the training files, with
<|endoftext|>, <|im_start|>, <|im_end|> as ids 0-2 and tiny.py's Qwen-style chat
template in tokenizer_config.json.

Model: `qwen3_5_text` (transformers' Qwen3_5ForCausalLM): 8 layers,
[linear, linear, linear, full] x 2 (Gated DeltaNet and gated full attention),
hidden 256, MLP 512, 4 query / 2 KV heads of 64, GDN 2 key / 4 value heads of
64, partial rope (0.25, theta 10,000), tied embeddings: 6.3 M parameters, plus
one MTP module (0.79 M) trained jointly on the token after next, loss
main + 0.3 * mtp, gradients of both reaching the trunk (DeepSeek-V3's recipe).
The MTP convention and tensor names are in tools/train/tiny_mtp.py (vLLM's
qwen3_next_mtp: final-norm hidden state of t, embedding of t+1, predicts t+2).
The bf16 model.safetensors is 14.2 MB.

Training: random windows of --seq + 2 tokens from the token stream (each file's
tokens then <|endoftext|>), drawn by a generator seeded with --seed; AdamW
(betas 0.9/0.95, weight decay 0.1 on matrices), linear warm-up then cosine to a
tenth of the peak, gradient clipping at 1.0, bf16 autocast on CUDA (fp32 on
CPU). The corpus is small (about 3 M tokens from Python 3.12's library), so
the default 500 steps of 64 x 512 tokens read it about 5 times: a 2000-step run
on an H200 reached a training loss of 0.47 while the held-out loss rose from
3.13 at step 500 to 4.28 (memorized, 1.87 bits/byte). On the GPU,
transformers' torch Gated DeltaNet is used (see _torch_linear_attention).
A line every --log-every steps; loss.json and loss.png (matplotlib, if
installed) at the end. --max-train-minutes stops a slow machine early (recorded
in train_info.json) so a run always ends with a checkpoint.

Output folder (written beside it, then swapped in): config.json,
generation_config.json, model.safetensors (bf16, mtp.* included),
tokenizer.json, tokenizer_config.json, train_info.json, loss.json, loss.png and
digests.json (sha256 and size of the serving files; tests/models/test_builtin.py
checks the shipped folder against it). `--eval` adds eval.json
(tools/train/tiny_eval.py).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shutil
import sys
import tempfile
import time
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from hkv.models.tiny import ENDOFTEXT, IM_END, SHIPPED_DIR, qwen3_5_text_config, tokenizer_config
from tools.train.tiny_corpus import HELD_OUT, encode, load_corpus, train_tokenizer
from tools.train.tiny_mtp import MTPHead, window_forward

SERVING_FILES = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                 "tokenizer_config.json")
MAX_FOLDER_BYTES = 16_000_000
LAYER_TYPES = ["linear_attention"] * 3 + ["full_attention"]


@dataclass(frozen=True)
class Curve:
    """The loss curve: one entry per logged step (train) and per validation (held-out)."""

    train: list[dict]
    val: list[dict]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m tools.train.train_tiny", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, help="training: the checkpoint folder to write (replaced if it exists)")
    p.add_argument("--eval", action="store_true", help="evaluate --model instead of training (writes eval.json there)")
    p.add_argument("--model", type=Path, default=SHIPPED_DIR,
                   help=f"--eval: the checkpoint folder to evaluate (default: {SHIPPED_DIR})")
    p.add_argument("--seed", type=int, default=0, help="seed of the init and the window sampler (default: 0)")
    p.add_argument("--steps", type=int, default=500,
                   help="optimizer steps (default: 500, about 5 passes over the corpus; longer runs overfit it)")
    p.add_argument("--batch", type=int, default=64, help="windows per step (default: 64)")
    p.add_argument("--seq", type=int, default=512, help="tokens per window the target reads (default: 512)")
    p.add_argument("--lr", type=float, default=2e-3, help="peak learning rate (default: 2e-3)")
    p.add_argument("--warmup", type=int, default=50, help="linear warm-up steps (default: 50)")
    p.add_argument("--mtp-weight", type=float, default=0.3, help="weight of the MTP loss (default: 0.3)")
    p.add_argument("--vocab", type=int, default=4096, help="BPE vocabulary, special tokens included (default: 4096)")
    p.add_argument("--stdlib", type=Path, default=None,
                   help="read the *.py sources from this folder (default: this Python's standard library; "
                        "--eval: the folder training read, if it exists)")
    p.add_argument("--max-files", type=int, default=None,
                   help="train on at most this many stdlib files, spread evenly (default: all)")
    p.add_argument("--max-eval-files", type=int, default=None,
                   help="evaluate on at most this many held-out files, spread evenly (default: all)")
    p.add_argument("--log-every", type=int, default=50, help="steps between loss lines (default: 50)")
    p.add_argument("--val-every", type=int, default=250, help="steps between held-out losses (default: 250)")
    p.add_argument("--val-windows", type=int, default=16, help="held-out windows per validation (default: 16)")
    p.add_argument("--max-train-minutes", type=float, default=7.5,
                   help="stop training after this long, keeping what was learnt (default: 7.5)")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="where to train or evaluate (default: auto = cuda when available)")
    p.add_argument("--threads", type=int, default=None, help="CPU: torch intra-op threads (default: torch's)")
    p.add_argument("--gen-tokens", type=int, default=128,
                   help="--eval: greedy tokens after each function header (default: 128)")
    p.add_argument("--headers", type=int, default=20,
                   help="--eval: held-out function headers to continue (default: 20)")
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = build_parser()
    args = p.parse_args(argv)
    if not args.eval and args.out is None:
        p.error("training needs --out (or give --eval)")
    if args.seq < 8 or args.batch < 1 or args.steps < 1:
        p.error("--seq must be at least 8, --batch and --steps at least 1")
    return args


def resolve_device(choice: str) -> str:
    if choice == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if choice == "cuda" and not torch.cuda.is_available():
        raise SystemExit("train_tiny: --device cuda but no CUDA device is visible")
    return choice


def model_config(vocab: int, eot: int, im_end: int) -> dict:
    """config.json of the built-in model (a qwen3_5_text checkpoint with one MTP layer)."""
    return qwen3_5_text_config(vocab, eot, im_end, **{
        "hidden_size": 256,
        "intermediate_size": 512,
        "num_hidden_layers": 8,
        "layer_types": LAYER_TYPES * 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": 64,
        "linear_value_head_dim": 64,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        # trained on 512-token windows; longer prompts run (GDN carries state) but were never seen
        "max_position_embeddings": 4096,
        # rotary dims 16 = 8 frequency pairs; text positions make mrope plain 1-D rope
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
                            "mrope_section": [3, 3, 2], "mrope_interleaved": True},
        "tie_word_embeddings": True,
        "mtp_num_hidden_layers": 1,
    })


def build_model(config: dict, seed: int):
    """transformers' Qwen3_5ForCausalLM and the MTP head, initialized on the CPU from `seed` (fp32)."""
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    torch.manual_seed(seed)
    model = Qwen3_5ForCausalLM(Qwen3_5TextConfig.from_dict(config))
    mtp = MTPHead(model.config)
    return model, mtp


class WindowSampler:
    """Random windows [B, T + 2] of a token stream on the device, from a seeded CPU generator.

    Every step's window starts are drawn up front and moved once, so a step never
    copies from the host (a pageable copy would wait for the GPU's queue to drain).
    """

    def __init__(self, stream: torch.Tensor, batch: int, length: int, steps: int, seed: int, device: str) -> None:
        if stream.numel() < length + 2:
            raise SystemExit(f"train_tiny: {stream.numel()} tokens are too few for windows of {length} + 2")
        self.stream = stream.to(device)
        self.offsets = torch.arange(length + 2, device=device)
        last_start = stream.numel() - self.offsets.numel()
        gen = torch.Generator().manual_seed(seed)
        self.starts = torch.randint(0, last_start + 1, (steps, batch, 1), generator=gen).to(device)

    def window(self, step: int) -> torch.Tensor:
        """The windows of step `step` (0-based)."""
        return self.stream[self.starts[step] + self.offsets]


def lr_at(step: int, args: argparse.Namespace) -> float:
    """Linear warm-up to --lr, then cosine down to a tenth of it at --steps."""
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    progress = (step - args.warmup) / max(1, args.steps - args.warmup)
    return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def make_optimizer(params: list[torch.nn.Parameter], args: argparse.Namespace, device: str) -> torch.optim.AdamW:
    decay = [p for p in params if p.dim() >= 2]
    rest = [p for p in params if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.95), fused=device == "cuda")


def _autocast(device: str):
    return torch.autocast("cuda", dtype=torch.bfloat16) if device == "cuda" else nullcontext()


@torch.no_grad()
def validate(model, mtp, windows: torch.Tensor, device: str) -> tuple[float, float]:
    model.eval()
    mtp.eval()
    with _autocast(device):
        out = window_forward(model, mtp, windows)
    model.train()
    mtp.train()
    return float(out.nll.mean()), float(out.mtp_nll.mean())


def _clock(seconds: float) -> str:
    return f"{int(seconds) // 60}:{int(seconds) % 60:02d}"


def train(model, mtp, sampler: WindowSampler, val_windows: torch.Tensor, args: argparse.Namespace,
          device: str) -> tuple[Curve, dict]:
    """The training loop; returns the loss curve and how it ended (steps run, time, early stop)."""
    model.to(device).train()
    mtp.to(device).train()
    params = [p for p in model.parameters()] + [p for p in mtp.parameters()]
    opt = make_optimizer(params, args, device)
    curve, start, step = Curve([], []), time.monotonic(), 0
    tokens_per_step = args.batch * args.seq
    stopped_early = False
    while step < args.steps:
        for group in opt.param_groups:
            group["lr"] = lr_at(step, args)
        with _autocast(device):
            out = window_forward(model, mtp, sampler.window(step))
            loss, mtp_loss = out.nll.mean(), out.mtp_nll.mean()
            total = loss + args.mtp_weight * mtp_loss
        loss, mtp_loss = loss.detach(), mtp_loss.detach()
        opt.zero_grad(set_to_none=True)
        total.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        step += 1
        elapsed = time.monotonic() - start
        if step % args.log_every == 0 or step == args.steps or step == 1:
            _log_step(curve, step, args, loss.item(), mtp_loss.item(), elapsed, tokens_per_step)
        if step % args.val_every == 0 or step == args.steps:
            _log_val(curve, step, *validate(model, mtp, val_windows, device))
        if elapsed > 60 * args.max_train_minutes and step < args.steps:
            print(f"stopping at step {step}: --max-train-minutes {args.max_train_minutes} passed", flush=True)
            _log_val(curve, step, *validate(model, mtp, val_windows, device))
            stopped_early = True
            break
    return curve, {"steps_run": step, "train_seconds": round(time.monotonic() - start, 1),
                   "stopped_early": stopped_early}


def _log_step(curve: Curve, step: int, args, loss: float, mtp_loss: float, elapsed: float, tokens: int) -> None:
    rate = step * tokens / max(elapsed, 1e-9)
    eta = (args.steps - step) * elapsed / step
    curve.train.append({"step": step, "loss": round(loss, 4), "mtp_loss": round(mtp_loss, 4),
                        "lr": lr_at(step - 1, args), "elapsed_s": round(elapsed, 1)})
    print(f"step {step:5d}/{args.steps}  loss {loss:.3f}  mtp {mtp_loss:.3f}  lr {lr_at(step - 1, args):.2e}  "
          f"{rate / 1000:.1f}k tok/s  elapsed {_clock(elapsed)}  eta {_clock(eta)}", flush=True)


def _log_val(curve: Curve, step: int, loss: float, mtp_loss: float) -> None:
    if curve.val and curve.val[-1]["step"] == step:
        return
    curve.val.append({"step": step, "loss": round(loss, 4), "mtp_loss": round(mtp_loss, 4)})
    print(f"  held-out at step {step}: loss {loss:.3f}  mtp {mtp_loss:.3f}", flush=True)


def val_windows(stream: torch.Tensor, count: int, length: int, device: str) -> torch.Tensor:
    """`count` fixed windows [count, T + 2] spread evenly over the held-out stream."""
    count = max(1, min(count, stream.numel() // (length + 2)))
    step = (stream.numel() - length - 2) // count
    return torch.stack([stream[i * step:i * step + length + 2] for i in range(count)]).to(device)


def checkpoint_tensors(model, mtp) -> dict[str, torch.Tensor]:
    """Every tensor of the file in bf16: the target (lm_head is tied to the embedding, so absent) and mtp.*."""
    tensors = {name: t for name, t in model.state_dict().items() if name != "lm_head.weight"}
    tensors.update(mtp.checkpoint_tensors())
    return {name: t.detach().to("cpu", torch.bfloat16).contiguous() for name, t in sorted(tensors.items())}


def write_json(path: Path, value: dict) -> None:
    path.write_text(json.dumps(value, indent=2, sort_keys=True, ensure_ascii=False) + "\n", encoding="utf-8")


def write_digests(folder: Path) -> dict:
    """digests.json: sha256 and size of each serving file; returns what it wrote."""
    import hashlib

    digests = {name: {"sha256": hashlib.sha256((folder / name).read_bytes()).hexdigest(),
                      "bytes": (folder / name).stat().st_size} for name in SERVING_FILES}
    write_json(folder / "digests.json", digests)
    return digests


def plot_curve(curve: Curve, path: Path) -> bool:
    """loss.png of the train and held-out curves; False when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    ax.plot([p["step"] for p in curve.train], [p["loss"] for p in curve.train], label="train, next token")
    ax.plot([p["step"] for p in curve.train], [p["mtp_loss"] for p in curve.train], label="train, MTP (t+2)")
    ax.plot([p["step"] for p in curve.val], [p["loss"] for p in curve.val], "o-", label="held-out, next token")
    ax.plot([p["step"] for p in curve.val], [p["mtp_loss"] for p in curve.val], "o--", label="held-out, MTP")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return True


def save_folder(out: Path, config: dict, tok, model, mtp, info: dict, curve: Curve) -> None:
    """Write the checkpoint into a temporary sibling of `out`, then swap it in for any old folder."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    eot, im_end = tok.token_to_id(ENDOFTEXT), tok.token_to_id(IM_END)
    write_json(tmp / "config.json", config)
    write_json(tmp / "generation_config.json", {"bos_token_id": eot, "eos_token_id": [im_end, eot],
                                                "pad_token_id": eot})
    save_file(checkpoint_tensors(model, mtp), str(tmp / "model.safetensors"), metadata={"format": "pt"})
    tok.save(str(tmp / "tokenizer.json"), pretty=True)
    write_json(tmp / "tokenizer_config.json", tokenizer_config(tok))
    write_json(tmp / "loss.json", {"train": curve.train, "held_out": curve.val})
    info["loss_png"] = plot_curve(curve, tmp / "loss.png")
    write_json(tmp / "train_info.json", info)
    write_digests(tmp)
    size = sum(p.stat().st_size for p in tmp.iterdir())
    if size >= MAX_FOLDER_BYTES:
        print(f"warning: the folder holds {size:,} bytes, over the {MAX_FOLDER_BYTES:,} the repository allows")
    os.chmod(tmp, 0o755)  # mkdtemp's 0700 and safetensors' 0600 would keep other users from serving it
    for path in tmp.iterdir():
        os.chmod(path, 0o644)
    old = out.with_name(f".{out.name}.old-{os.getpid()}")
    if out.exists():
        os.rename(out, old)
    os.rename(tmp, out)
    shutil.rmtree(old, ignore_errors=True)
    print(f"wrote {out} ({size / 1e6:.1f} MB)")


def run_training(args: argparse.Namespace) -> None:
    device = resolve_device(args.device)
    if args.threads:
        torch.set_num_threads(args.threads)
    t0 = time.monotonic()
    corpus = load_corpus(args.stdlib, HELD_OUT, max_files=args.max_files, max_eval_files=args.max_eval_files)
    summary = corpus.summary()
    print(f"corpus: {summary['train_files']} files, {summary['train_bytes'] / 1e6:.1f} MB from {corpus.root}; "
          f"held out {', '.join(HELD_OUT)}: {summary['held_out_files']} files", flush=True)
    tok = train_tokenizer(corpus.train, args.vocab)
    stream, held_out = encode(tok, corpus.train), encode(tok, corpus.held_out)
    print(f"tokenizer: {tok.get_vocab_size()} tokens; {stream.numel():,} training tokens "
          f"({summary['train_bytes'] / stream.numel():.2f} bytes/token); ready in {time.monotonic() - t0:.0f} s",
          flush=True)
    config = model_config(tok.get_vocab_size(with_added_tokens=True), tok.token_to_id(ENDOFTEXT),
                          tok.token_to_id(IM_END))
    model, mtp = build_model(config, args.seed)
    print(f"model: {sum(p.numel() for p in model.parameters()) / 1e6:.2f} M parameters, MTP "
          f"{sum(p.numel() for p in mtp.parameters()) / 1e6:.2f} M; {args.steps} steps of {args.batch} x {args.seq} "
          f"tokens on {device}", flush=True)
    sampler = WindowSampler(stream, args.batch, args.seq, args.steps, args.seed, device)
    curve, ended = train(model, mtp, sampler, val_windows(held_out, args.val_windows, args.seq, device), args, device)
    info = train_info(args, summary, stream, device, curve, ended)
    save_folder(args.out, config, tok, model.cpu(), mtp.cpu(), info, curve)
    print(f"done in {_clock(time.monotonic() - t0)}; evaluate with: "
          f"python -m tools.train.train_tiny --eval --model {args.out}")


def train_info(args, summary: dict, stream: torch.Tensor, device: str, curve: Curve, ended: dict) -> dict:
    flags = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k not in ("eval", "model")}
    gpu = torch.cuda.get_device_name() if device == "cuda" else None
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": __import__("transformers").__version__,
        "device": gpu or platform.processor() or "cpu",
        "seed": args.seed,
        "flags": flags,
        "corpus": summary,
        "train_tokens": stream.numel(),
        "steps": args.steps,
        **ended,
        "tokens_seen": ended["steps_run"] * args.batch * args.seq,
        "final_train_loss": curve.train[-1]["loss"],
        "final_train_mtp_loss": curve.train[-1]["mtp_loss"],
        "final_held_out_loss": curve.val[-1]["loss"],
        "final_held_out_mtp_loss": curve.val[-1]["mtp_loss"],
    }


def _torch_linear_attention() -> None:
    """Keep transformers on its own torch Gated DeltaNet, also where fla-core is installed.

    fla 0.6 refuses its chunked backward with Triton >= 3.4, < 3.7.1 on Hopper (fla #640: wrong gradients), which is
    the H200 image's Triton; the model is small enough for the torch path, and one path on every machine keeps the
    training and the evaluation the same computation on the CPU and the GPU. transformers looks fla up with
    `importlib.util.find_spec`, which answers None for a module marked absent in sys.modules.
    """
    if "fla" not in sys.modules:
        sys.modules["fla"] = None  # type: ignore[assignment]


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    _torch_linear_attention()
    if args.eval:
        from tools.train.tiny_eval import run_eval

        run_eval(args)
    else:
        run_training(args)


if __name__ == "__main__":
    main(sys.argv[1:])
