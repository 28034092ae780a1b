"""Built-in tiny checkpoints: the shipped trained model and deterministic random-weight HF folders.

    tiny-hybrid         the default: qwen3_5_text (Gated DeltaNet + gated attention, one MTP layer)
                        trained on the Python standard library by tools/train/train_tiny.py; its folder
                        ships inside the package (SHIPPED_DIR, docs/builtin_model.md)
    tiny-hybrid-random  qwen3_5_text (Qwen3_5ForCausalLM), random weights, MTP head: the tests' hybrid
    tiny-dense          qwen3 (Qwen3ForCausalLM), random weights, tied embeddings: the tests' dense model

The random folders are written on first use under the cache folder. Every
tensor comes from its own torch.Generator seeded by a hash of the model and
tensor name, so the same bytes come out on every machine (no transformers init
involved) and adding a tensor never changes the others. Their tokenizer is a
byte-level BPE trained by `tokenizers` on the fixed corpus below. A folder is
written under a temporary name and renamed into place, so concurrent first
uses never see half a checkpoint.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
import zlib
from collections.abc import Iterable
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, pre_tokenizers
from tokenizers.models import BPE
from tokenizers.trainers import BpeTrainer

BUILTIN_VERSION = "v1"
# where the trained built-in model ships (tools/train/train_tiny.py writes it)
SHIPPED_DIR = Path(__file__).with_name("builtin") / "tiny-hybrid"
ENDOFTEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END)  # ids 0, 1, 2
TOKENIZER_VOCAB = 1536  # BPE target size, special tokens included

# Qwen2's pre-tokenizer split: contractions, words, single digits, punctuation runs, newlines, spaces
PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"""
    r"""| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

CHAT_TEMPLATE = (
    "{%- for message in messages %}\n"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}\n"
    "{%- if message['content'] is string %}\n"
    "{{- message['content'] }}\n"
    "{%- else %}\n"
    "{%- for part in message['content'] %}\n"
    "{%- if part['type'] == 'text' %}{{- part['text'] }}{%- endif %}\n"
    "{%- endfor %}\n"
    "{%- endif %}\n"
    "{{- '<|im_end|>\\n' }}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "{{- '<|im_start|>assistant\\n' }}\n"
    "{%- endif %}\n"
)

CORPUS = """\
The quick brown fox jumps over the lazy dog. A serving system keeps the attention keys and values of
every request in pages, and a prefix cache lets a new request reuse the pages of an old one when their
prompts start the same way. When the cache is full, the least recently used pages are evicted first.
Hello, world! How are you today? I am fine, thank you. What would you like to talk about?
The model reads a prompt, predicts the next token, appends it, and repeats until it meets the end of the
sequence or the length limit. Greedy decoding always picks the most likely token; sampling draws one.
Speculative decoding drafts a few tokens cheaply and verifies them in a single forward pass.
Linear attention keeps a fixed-size state instead of a growing cache, so long prompts cost less memory.
A checkpoint of that state at a page boundary lets a hybrid model resume from a cached prefix.
Numbers: 0 1 2 3 4 5 6 7 8 9 10 42 100 256 1024 2048 4096 3.14159 2.71828 -1 +7 50% $20 #1 @user
Dates and times: 2024-01-15 12:30:45, Monday, Tuesday, Wednesday, Thursday, Friday, Saturday, Sunday.
Questions and answers: Why is the sky blue? Because air scatters blue light more than red light.
Where is the library? It is next to the station, on the left side of the street.

def fibonacci(n: int) -> int:
    \"\"\"Return the n-th Fibonacci number.\"\"\"
    a, b = 0, 1
    for _ in range(n):
        a, b = b, a + b
    return a


class PagePool:
    def __init__(self, num_pages: int) -> None:
        self.free = list(range(num_pages))
        self.refcount = [0] * num_pages

    def allocate(self, count: int) -> list[int]:
        if count > len(self.free):
            raise MemoryError("not enough free pages")
        pages, self.free = self.free[:count], self.free[count:]
        return pages

import torch
x = torch.randn(4, 8)
y = x @ x.T + torch.ones(4, 4)
print(f"shape={y.shape}, mean={y.mean().item():.3f}")

for (int i = 0; i < n; ++i) { sum += values[i] * weights[i]; }
if (ptr == NULL) { return -1; } else { return 0; }
{"model": "tiny", "messages": [{"role": "user", "content": "Hi!"}], "max_tokens": 16, "stream": true}
$ curl -s http://127.0.0.1:8000/v1/completions -H 'Content-Type: application/json' -d @req.json
<html><body><p>Hello &amp; welcome</p></body></html>
SELECT name, count(*) FROM requests WHERE status = 'done' GROUP BY name ORDER BY 2 DESC;

Le renard brun rapide saute par-dessus le chien paresseux. C'est déjà l'été, où êtes-vous ?
Der schnelle braune Fuchs springt über den faulen Hund. Größe, Straße, Übung, schön, müde.
El rápido zorro marrón salta sobre el perro perezoso. ¿Cómo estás? ¡Muy bien, gracias! Año, niño.
Быстрая коричневая лиса прыгает через ленивую собаку. Привет, как дела? Спасибо, хорошо.
Η γρήγορη καφέ αλεπού πηδά πάνω από τον τεμπέλη σκύλο. Καλημέρα, ευχαριστώ.
敏捷的棕色狐狸跳过了懒狗。你好，世界！今天天气很好。我们一起学习机器学习和自然语言处理。
素早い茶色の狐がのろまな犬を飛び越える。こんにちは、世界！ありがとうございます。
빠른 갈색 여우가 게으른 개를 뛰어넘는다. 안녕하세요, 세계! 감사합니다.
الثعلب البني السريع يقفز فوق الكلب الكسول. مرحبا بالعالم.
Emoji: 😀 😂 🎉 🚀 ❤️ 👍 🐍 🦊 🌍 ✨ — “quotes”, ‘single’, …ellipsis, naïve café résumé.
"""


def train_bpe(texts: Iterable[str], vocab_size: int, min_frequency: int = 1) -> Tokenizer:
    """A Qwen2-style byte-level BPE (NFC, Qwen2's split, byte fallback alphabet) trained on `texts`.

    The special tokens come first (ids 0, 1, 2); the same texts give the same merges on every run.
    """
    tok = Tokenizer(BPE(unk_token=None, continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        show_progress=False,
        special_tokens=[AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def build_tokenizer() -> Tokenizer:
    """The random built-ins' tokenizer: the BPE trained on CORPUS; the same merges on every run."""
    # three passes weight the corpus without changing which pairs exist
    return train_bpe(CORPUS.splitlines(keepends=True) * 3, TOKENIZER_VOCAB)


def tokenizer_config(tok: Tokenizer) -> dict:
    added = {
        str(tok.token_to_id(t)): {
            "content": t,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for t in SPECIAL_TOKENS
    }
    return {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": added,
        "bos_token": None,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": IM_END,
        "errors": "replace",
        "model_max_length": 4096,
        "pad_token": ENDOFTEXT,
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }


def _dense_config(vocab: int, eot: int, im_end: int) -> dict:
    return {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "vocab_size": vocab,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "hidden_act": "silu",
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
        "tie_word_embeddings": True,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "use_sliding_window": False,
        "initializer_range": 0.02,
        "use_cache": True,
        "bos_token_id": eot,
        "eos_token_id": im_end,
        "pad_token_id": eot,
        "dtype": "bfloat16",
    }


def qwen3_5_text_config(vocab: int, eot: int, im_end: int, **fields) -> dict:
    """config.json of a Qwen3.5 text checkpoint: what every one of ours shares (the built-ins, the
    trained model, the benchmark model), then `fields` (dimensions, layers, rope; they win)."""
    return {
        "architectures": ["Qwen3_5ForCausalLM"], "model_type": "qwen3_5_text", "vocab_size": vocab,
        "hidden_act": "silu", "rms_norm_eps": 1e-6, "attention_bias": False, "attention_dropout": 0.0,
        "initializer_range": 0.02, "use_cache": True, "bos_token_id": eot, "eos_token_id": im_end,
        "pad_token_id": eot, "dtype": "bfloat16", **fields,
    }


def _hybrid_config(vocab: int, eot: int, im_end: int) -> dict:
    return qwen3_5_text_config(vocab, eot, im_end, **{
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 4,
        "layer_types": ["linear_attention", "full_attention", "linear_attention", "full_attention"],
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": 16,
        "linear_value_head_dim": 16,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "max_position_embeddings": 4096,
        # as in released Qwen3.5 configs; with text-only positions mrope equals plain partial rope
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 10000000.0,
            "partial_rotary_factor": 0.25,
            "mrope_section": [2, 1, 1],
            "mrope_interleaved": True,
        },
        "tie_word_embeddings": False,
        "mtp_num_hidden_layers": 1,
    })


class _TensorMaker:
    """Deterministic tensors: one generator per tensor, seeded from the model and tensor names."""

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.tensors: dict[str, torch.Tensor] = {}

    def _gen(self, name: str) -> torch.Generator:
        return torch.Generator(device="cpu").manual_seed(zlib.crc32(f"{self.model_name}/{name}".encode()))

    def normal(self, name: str, shape: tuple[int, ...], std: float = 0.02, mean: float = 0.0) -> None:
        values = torch.empty(shape, dtype=torch.float32).normal_(mean, std, generator=self._gen(name))
        self.tensors[name] = values.to(torch.bfloat16)

    def uniform(self, name: str, shape: tuple[int, ...], low: float, high: float) -> torch.Tensor:
        return torch.empty(shape, dtype=torch.float32).uniform_(low, high, generator=self._gen(name))

    def norm(self, name: str, dim: int, center: float) -> None:
        # small noise around the family's identity value, so a swapped or unloaded norm changes the output
        self.normal(name, (dim,), std=0.1, mean=center)


def _dense_tensors(cfg: dict) -> dict[str, torch.Tensor]:
    """Qwen3 weights; RMSNorm scales by w, so norms sit around 1."""
    make = _TensorMaker("tiny-dense")
    h, inter, d = cfg["hidden_size"], cfg["intermediate_size"], cfg["head_dim"]
    q_dim, kv_dim = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d
    make.normal("model.embed_tokens.weight", (cfg["vocab_size"], h))
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        make.norm(p + "input_layernorm.weight", h, 1.0)
        make.norm(p + "post_attention_layernorm.weight", h, 1.0)
        make.normal(p + "self_attn.q_proj.weight", (q_dim, h))
        make.normal(p + "self_attn.k_proj.weight", (kv_dim, h))
        make.normal(p + "self_attn.v_proj.weight", (kv_dim, h))
        make.normal(p + "self_attn.o_proj.weight", (h, q_dim))
        make.norm(p + "self_attn.q_norm.weight", d, 1.0)
        make.norm(p + "self_attn.k_norm.weight", d, 1.0)
        _mlp(make, p, h, inter)
    make.norm("model.norm.weight", h, 1.0)
    return make.tensors


def _mlp(make: _TensorMaker, p: str, h: int, inter: int) -> None:
    make.normal(p + "mlp.gate_proj.weight", (inter, h))
    make.normal(p + "mlp.up_proj.weight", (inter, h))
    make.normal(p + "mlp.down_proj.weight", (h, inter))


def _gated_attention_layer(make: _TensorMaker, p: str, cfg: dict) -> None:
    """A Qwen3.5 full-attention decoder layer: q_proj also emits the output gate; norms are (1 + w)."""
    h, d = cfg["hidden_size"], cfg["head_dim"]
    q_dim, kv_dim = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d
    make.normal(p + "self_attn.q_proj.weight", (2 * q_dim, h))
    make.normal(p + "self_attn.k_proj.weight", (kv_dim, h))
    make.normal(p + "self_attn.v_proj.weight", (kv_dim, h))
    make.normal(p + "self_attn.o_proj.weight", (h, q_dim))
    make.norm(p + "self_attn.q_norm.weight", d, 0.0)
    make.norm(p + "self_attn.k_norm.weight", d, 0.0)


def _gdn_layer(make: _TensorMaker, p: str, cfg: dict) -> None:
    """A Gated DeltaNet layer; its output norm is a plain (w, centered at 1) gated RMSNorm."""
    h, kernel = cfg["hidden_size"], cfg["linear_conv_kernel_dim"]
    hk, hv = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
    key_dim, value_dim = hk * cfg["linear_key_head_dim"], hv * cfg["linear_value_head_dim"]
    conv_dim = 2 * key_dim + value_dim
    a = p + "linear_attn."
    make.normal(a + "in_proj_qkv.weight", (conv_dim, h))
    make.normal(a + "in_proj_z.weight", (value_dim, h))
    make.normal(a + "in_proj_b.weight", (hv, h))
    make.normal(a + "in_proj_a.weight", (hv, h))
    # depthwise conv at PyTorch's default scale (fan-in = kernel), so the conv passes signal through
    make.normal(a + "conv1d.weight", (conv_dim, 1, kernel), std=1.0 / math.sqrt(kernel))
    make.normal(a + "dt_bias", (hv,), std=0.1, mean=1.0)
    # decay rates A in [0.05, 1): some heads remember tens of tokens, so state bugs show up
    make.tensors[a + "A_log"] = make.uniform(a + "A_log", (hv,), 0.05, 1.0).log().to(torch.bfloat16)
    make.norm(a + "norm.weight", cfg["linear_value_head_dim"], 1.0)
    make.normal(a + "out_proj.weight", (h, value_dim))


def _hybrid_tensors(cfg: dict) -> dict[str, torch.Tensor]:
    """Qwen3.5 text weights plus one MTP layer (mtp.*, ignored by transformers, used for drafting)."""
    # seeded by its name before the trained model took it, so its bytes stay the same
    make = _TensorMaker("tiny-hybrid")
    h, inter = cfg["hidden_size"], cfg["intermediate_size"]
    make.normal("model.embed_tokens.weight", (cfg["vocab_size"], h))
    for i, layer_type in enumerate(cfg["layer_types"]):
        p = f"model.layers.{i}."
        make.norm(p + "input_layernorm.weight", h, 0.0)
        make.norm(p + "post_attention_layernorm.weight", h, 0.0)
        if layer_type == "linear_attention":
            _gdn_layer(make, p, cfg)
        else:
            _gated_attention_layer(make, p, cfg)
        _mlp(make, p, h, inter)
    make.norm("model.norm.weight", h, 0.0)
    make.normal("lm_head.weight", (cfg["vocab_size"], h))
    make.normal("mtp.fc.weight", (h, 2 * h))
    for name in ("mtp.pre_fc_norm_embedding.weight", "mtp.pre_fc_norm_hidden.weight", "mtp.norm.weight"):
        make.norm(name, h, 0.0)
    for i in range(cfg["mtp_num_hidden_layers"]):
        p = f"mtp.layers.{i}."
        make.norm(p + "input_layernorm.weight", h, 0.0)
        make.norm(p + "post_attention_layernorm.weight", h, 0.0)
        _gated_attention_layer(make, p, cfg)
        _mlp(make, p, h, inter)
    return make.tensors


_BUILDERS = {
    "tiny-dense": (_dense_config, _dense_tensors),
    "tiny-hybrid-random": (_hybrid_config, _hybrid_tensors),
}
_SHIPPED = {"tiny-hybrid": SHIPPED_DIR}
BUILTIN_NAMES = tuple(_SHIPPED) + tuple(_BUILDERS)


def _write_json(path: Path, value: dict) -> None:
    path.write_text(json.dumps(value, indent=2, sort_keys=True, ensure_ascii=False) + "\n", encoding="utf-8")


def write_builtin(name: str, folder: Path) -> None:
    """Write the checkpoint files of built-in model `name` into the existing empty `folder`."""
    make_config, make_tensors = _BUILDERS[name]
    tok = build_tokenizer()
    eot, im_end = tok.token_to_id(ENDOFTEXT), tok.token_to_id(IM_END)
    config = make_config(tok.get_vocab_size(with_added_tokens=True), eot, im_end)
    tok.save(str(folder / "tokenizer.json"), pretty=True)
    _write_json(folder / "tokenizer_config.json", tokenizer_config(tok))
    _write_json(folder / "config.json", config)
    generation = {"bos_token_id": eot, "eos_token_id": [im_end, eot], "pad_token_id": eot}
    _write_json(folder / "generation_config.json", generation)
    save_file(make_tensors(config), str(folder / "model.safetensors"), metadata={"format": "pt"})


def ensure_builtin(name: str, cache_dir: Path) -> Path:
    """The folder of random built-in `name` ("tiny-dense" | "tiny-hybrid-random") under cache_dir,
    written on first use.

    Reuses `cache_dir/<name>-v1` when present. Otherwise writes a temporary sibling
    folder and renames it into place; a concurrent writer that wins the rename is
    reused and our copy deleted.
    """
    if name not in _BUILDERS:
        known = ", ".join(sorted(_BUILDERS))
        raise ValueError(f"unknown random built-in model {name!r}; random built-ins: {known}")
    cache_dir = Path(cache_dir)
    final = cache_dir / f"{name}-{BUILTIN_VERSION}"
    if (final / "config.json").is_file():
        return final
    cache_dir.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=cache_dir))
    try:
        write_builtin(name, tmp)
        os.rename(tmp, final)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        if not (final / "config.json").is_file():
            raise
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def builtin_folder(name: str, cache_dir: Path) -> Path:
    """The checkpoint folder of any built-in model: the shipped one, or a random one written on first use."""
    if name in _SHIPPED:
        folder = _SHIPPED[name]
        if not (folder / "config.json").is_file():
            raise FileNotFoundError(f"built-in model {name}: {folder} is missing from this install")
        return folder
    return ensure_builtin(name, cache_dir)
