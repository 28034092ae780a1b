"""`python -m tools.train.train_tiny --eval`: the built-in model on the held-out packages, against baselines.

Bits per byte (bpb). The held-out files (train_info.json names the packages and
the training subset) become one token stream, a leading <|endoftext|> then each
file's tokens and an <|endoftext|>; bits are -log2 p of every token after the
leading one (the closing <|endoftext|> of each file counts), bytes are the
files' UTF-8 bytes. The model reads the stream in consecutive windows of
--seq tokens (its training length; context restarts at each window). Rows:

- the model, and its MTP head on the token after next (cross-entropy and top-1
  accuracy; top-1 is about the acceptance rate of one drafted token);
- token bigram, interpolated Kneser-Ney: counts of the training stream the
  model saw (same files, same tokenizer), absolute discount D = n1 / (n1 + 2 n2),
  continuation unigram add-one smoothed so no token has p = 0; the same
  predicted tokens as the model, so the two compare directly;
- byte bigram, add-one, counted on the training files' bytes (files joined),
  evaluated on the held-out bytes joined the same way (the first byte costs 8 bits);
- lzma -9 of the held-out bytes, which uses no training data at all.

Continuations. Every function with a docstring in the held-out files (sorted
files, source order); --headers of them evenly spaced. The prompt is the `def`
line(s) through the docstring's first line, shifted to column 0; greedy
continuation of --gen-tokens tokens (transformers' generate) or up to
<|endoftext|>. The text is cut where the function ends (the first later
non-blank line at column 0), else after its last complete line; valid means
`ast.parse` accepts the cut text and it holds at least one non-blank line the
model wrote (a one-line docstring makes the prompt alone a whole function).
"""

from __future__ import annotations

import argparse
import ast
import json
import lzma
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from hkv.models.tiny import ENDOFTEXT, IM_END
from tools.train.tiny_corpus import SourceFile, encode, load_corpus, text_bytes
from tools.train.tiny_mtp import MTPHead, window_forward

EVAL_BATCH = 8  # windows per forward
# the README's "try it" request (temperature 0, max_tokens README_TOKENS); hkv's greedy equals this one
README_PROMPT = 'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n'
README_TOKENS = 64


@dataclass(frozen=True)
class Header:
    path: str
    line: int  # 1-based line of the `def`
    name: str
    prompt: str


@dataclass(frozen=True)
class Continuation:
    path: str
    line: int
    name: str
    prompt: str
    continuation: str
    ended: bool  # the function ended (a later column-0 line) or the model wrote <|endoftext|>
    wrote_line: bool  # the cut text has a non-blank line the model wrote
    valid: bool  # it did, and the cut text parses


def load_checkpoint(folder: Path, device: str):
    """The folder's target (transformers, fp32) and its MTP head from the mtp.* tensors."""
    from safetensors.torch import load_file
    from transformers import Qwen3_5ForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    model = Qwen3_5ForCausalLM.from_pretrained(folder, dtype=torch.float32).to(device).eval()
    mtp = MTPHead(model.config)
    mtp.load_checkpoint_tensors({k: v.float() for k, v in load_file(str(folder / "model.safetensors")).items()
                                 if k.startswith("mtp.")})
    return model, mtp.to(device).eval()


@torch.no_grad()
def model_bits(model, mtp, stream: torch.Tensor, seq: int, device: str) -> dict:
    """Sums over the stream's tokens after the first: target bits, MTP bits, top-1 hits (see the docstring)."""
    length = stream.numel()
    windows = max(1, math.ceil((length - 1) / seq))
    pad = windows * seq + 2 - length
    padded = torch.cat([stream, stream.new_zeros(pad)])
    starts = torch.arange(windows) * seq
    totals = {"tokens": 0, "bits": 0.0, "mtp_tokens": 0, "mtp_bits": 0.0, "hits": 0, "mtp_hits": 0}
    for first in range(0, windows, EVAL_BATCH):
        chunk = starts[first:first + EVAL_BATCH]
        batch = torch.stack([padded[s:s + seq + 2] for s in chunk.tolist()]).to(device)
        out = window_forward(model, mtp, batch)
        target = (chunk[:, None] + 1 + torch.arange(seq)).to(device)  # stream index each row predicts
        real, mtp_real = target < length, target + 1 < length
        totals["tokens"] += int(real.sum())
        totals["bits"] += float(out.nll[real].sum()) / math.log(2)
        totals["hits"] += int(out.hits[real].sum())
        totals["mtp_tokens"] += int(mtp_real.sum())
        totals["mtp_bits"] += float(out.mtp_nll[mtp_real].sum()) / math.log(2)
        totals["mtp_hits"] += int(out.mtp_hits[mtp_real].sum())
    return totals


class KneserNeyBigram:
    """Interpolated Kneser-Ney token bigram counted on a training stream (see the module docstring)."""

    def __init__(self, train: torch.Tensor, vocab: int) -> None:
        counts = torch.bincount(train[:-1] * vocab + train[1:], minlength=vocab * vocab).view(vocab, vocab)
        seen = counts > 0
        n1, n2 = int((counts == 1).sum()), int((counts == 2).sum())
        self.discount = n1 / (n1 + 2 * n2) if n1 else 0.5
        self.counts = counts
        self.context_total = counts.sum(1).double()  # c(v)
        self.context_types = seen.sum(1).double()  # N1+(v .)
        continuation = seen.sum(0).double()  # N1+(. w)
        self.p_cont = (continuation + 1) / (continuation.sum() + vocab)

    def prob(self, prev: torch.Tensor, nxt: torch.Tensor) -> torch.Tensor:
        """p(nxt | prev), elementwise over equal-shaped id tensors (float64)."""
        total = self.context_total[prev]
        safe = total.clamp(min=1)
        seen = (self.counts[prev, nxt].double() - self.discount).clamp(min=0) / safe
        p = seen + self.discount * self.context_types[prev] / safe * self.p_cont[nxt]
        return torch.where(total > 0, p, self.p_cont[nxt])

    def bits(self, stream: torch.Tensor) -> float:
        """-log2 p of stream[1:], each token given the one before it."""
        return float(-torch.log2(self.prob(stream[:-1], stream[1:])).sum())


def byte_bigram_bits(train: bytes, held_out: bytes) -> float:
    """Bits of held_out under an add-one byte bigram counted on `train`; the first byte costs 8 bits."""
    t = torch.frombuffer(bytearray(train), dtype=torch.uint8).long()
    h = torch.frombuffer(bytearray(held_out), dtype=torch.uint8).long()
    counts = torch.bincount(t[:-1] * 256 + t[1:], minlength=256 * 256).view(256, 256).double()
    p = (counts[h[:-1], h[1:]] + 1) / (counts.sum(1)[h[:-1]] + 256)
    return 8.0 + float(-torch.log2(p).sum())


def find_headers(files: tuple[SourceFile, ...], count: int) -> list[Header]:
    """`count` functions with a docstring, evenly spaced over all of them (sorted files, source order)."""
    found = []
    for f in files:
        lines = f.text.splitlines(keepends=True)
        nodes = [n for n in ast.walk(ast.parse(f.text)) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
        for node in sorted(nodes, key=lambda n: n.lineno):
            if ast.get_docstring(node, clean=False) is None:
                continue
            block = lines[node.lineno - 1:node.body[0].lineno]  # the def through the docstring's first line
            indent = block[0][:len(block[0]) - len(block[0].lstrip())]
            prompt = "".join(line.removeprefix(indent) for line in block)
            found.append(Header(f.path, node.lineno, node.name, prompt))
    if len(found) <= count:
        return found
    return [found[i * len(found) // count] for i in range(count)]


def cut_function(prompt: str, continuation: str, finished: bool) -> tuple[str, bool]:
    """prompt + continuation up to where the function ends, else its last complete line; (text, ended)."""
    lines = (prompt + continuation).splitlines(keepends=True)
    for i in range(len(prompt.splitlines()), len(lines)):
        if lines[i].strip() and not lines[i][0].isspace():
            return "".join(lines[:i]), True
    if not finished and lines and not lines[-1].endswith("\n"):
        lines = lines[:-1]
    return "".join(lines), finished


def is_valid(text: str) -> bool:
    try:
        ast.parse(text)
    except (SyntaxError, ValueError):
        return False
    return True


@torch.no_grad()
def _generate(model, tok, prompt: str, new_tokens: int, device: str) -> tuple[str, bool]:
    """Greedy text after `prompt` (up to <|endoftext|> or <|im_end|>) and whether the model stopped by itself."""
    stop = [tok.token_to_id(ENDOFTEXT), tok.token_to_id(IM_END)]
    ids = torch.tensor([tok.encode(prompt, add_special_tokens=False).ids], device=device)
    out = model.generate(ids, max_new_tokens=new_tokens, do_sample=False, eos_token_id=stop,
                         pad_token_id=stop[0])[0, ids.shape[1]:].tolist()
    finished = bool(out) and out[-1] in stop
    return tok.decode([t for t in out if t not in stop], skip_special_tokens=True), finished


def continue_headers(model, tok, headers: list[Header], new_tokens: int, device: str) -> list[Continuation]:
    results = []
    for h in headers:
        text, finished = _generate(model, tok, h.prompt, new_tokens, device)
        cut, ended = cut_function(h.prompt, text, finished)
        # a one-line docstring makes the prompt a whole function: only what the model adds may count
        wrote = bool(cut[len(h.prompt):].strip())
        results.append(Continuation(h.path, h.line, h.name, h.prompt, text, ended, wrote, wrote and is_valid(cut)))
    return results


def _training_corpus(folder: Path, args: argparse.Namespace):
    """The corpus as training split it (train_info.json's held-out packages and --max-files)."""
    info = json.loads((folder / "train_info.json").read_text())
    root = args.stdlib
    if root is None and Path(info["corpus"]["stdlib"]).is_dir():
        root = Path(info["corpus"]["stdlib"])
    corpus = load_corpus(root, tuple(info["corpus"]["held_out_packages"]), max_files=info["flags"].get("max_files"),
                         max_eval_files=args.max_eval_files)
    if corpus.summary()["train_files_sha256"] != info["corpus"]["train_files_sha256"]:
        print(f"warning: this Python's standard library ({corpus.root}) differs from the one trained on "
              f"(Python {info['python']}); the baselines are counted on this one")
    return info, corpus


def bpb_table(model, mtp, tok, corpus, seq: int, device: str) -> dict:
    train_stream, held_stream = encode(tok, corpus.train), encode(tok, corpus.held_out)
    stream = torch.cat([torch.tensor([tok.token_to_id(ENDOFTEXT)]), held_stream])
    held_bytes = b"".join(f.text.encode() for f in corpus.held_out)
    train_bytes = b"".join(f.text.encode() for f in corpus.train)
    n_bytes = text_bytes(corpus.held_out)
    sums = model_bits(model, mtp, stream, seq, device)
    vocab = tok.get_vocab_size(with_added_tokens=True)
    return {
        "held_out_bytes": n_bytes,
        "held_out_tokens": sums["tokens"],
        "model_bpb": sums["bits"] / n_bytes,
        "model_bits_per_token": sums["bits"] / sums["tokens"],
        "model_top1": sums["hits"] / sums["tokens"],
        "mtp_bits_per_token": sums["mtp_bits"] / sums["mtp_tokens"],
        "mtp_top1": sums["mtp_hits"] / sums["mtp_tokens"],
        "token_bigram_kn_bpb": KneserNeyBigram(train_stream, vocab).bits(stream) / n_bytes,
        "byte_bigram_add_one_bpb": byte_bigram_bits(train_bytes, held_bytes) / n_bytes,
        "lzma_bpb": len(lzma.compress(held_bytes, preset=9 | lzma.PRESET_EXTREME)) * 8 / n_bytes,
    }


def print_report(bpb: dict, results: list[Continuation]) -> None:
    print(f"\nheld-out: {bpb['held_out_bytes']:,} bytes, {bpb['held_out_tokens']:,} tokens")
    print(f"{'':34}{'bits/byte':>10}")
    rows = [("model (next token)", bpb["model_bpb"]), ("token bigram, Kneser-Ney", bpb["token_bigram_kn_bpb"]),
            ("byte bigram, add-one", bpb["byte_bigram_add_one_bpb"]), ("lzma -9 (no training data)", bpb["lzma_bpb"])]
    for label, value in rows:
        print(f"  {label:32}{value:10.3f}")
    print(f"  next-token top-1 {bpb['model_top1']:.1%}; MTP (token after next): "
          f"{bpb['mtp_bits_per_token']:.2f} bits/token, top-1 {bpb['mtp_top1']:.1%}")
    valid = sum(r.valid for r in results)
    print(f"\ngreedy continuations of held-out function headers: {valid}/{len(results)} valid Python")
    print(f"  {'#':>2}  {'function':44} {'valid':5}  {'ended':5}  first line written")
    for i, r in enumerate(results, 1):
        first = next((ln for ln in r.continuation.splitlines() if ln.strip()), "")
        where = f"{r.path}:{r.line} {r.name}"
        print(f"  {i:2d}  {where[:44]:44} {'yes' if r.valid else 'no':5}  {'yes' if r.ended else 'no':5}  "
              f"{first.strip()[:60]!r}")


def run_eval(args: argparse.Namespace) -> None:
    from tokenizers import Tokenizer

    from tools.train.train_tiny import resolve_device, write_json

    device = resolve_device(args.device)
    if args.threads:
        torch.set_num_threads(args.threads)
    folder, t0 = args.model, time.monotonic()
    info, corpus = _training_corpus(folder, args)
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    model, mtp = load_checkpoint(folder, device)
    seq = info["flags"]["seq"]
    bpb = bpb_table(model, mtp, tok, corpus, seq, device)
    results = continue_headers(model, tok, find_headers(corpus.held_out, args.headers), args.gen_tokens, device)
    readme = _generate(model, tok, README_PROMPT, README_TOKENS, device)[0]
    print_report(bpb, results)
    print(f"\nREADME sample, {README_PROMPT!r} ->\n{readme}")
    report = {"model": str(folder), "held_out_packages": list(corpus.held_out_packages),
              "held_out_files": len(corpus.held_out), "seq": seq, "bpb": bpb,
              "headers_valid": sum(r.valid for r in results), "headers": [asdict(r) for r in results],
              "gen_tokens": args.gen_tokens, "readme_prompt": README_PROMPT, "readme_completion": readme,
              "seconds": round(time.monotonic() - t0, 1)}
    write_json(folder / "eval.json", report)
    print(f"\nwrote {folder / 'eval.json'} in {time.monotonic() - t0:.0f} s")
