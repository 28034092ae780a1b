"""Chained 128-bit page keys, rooted in a model fingerprint (used by the CPU and disk tiers).

    h_0 = fingerprint.root_key()
    h_i = BLAKE2b-128(h_{i-1} || tokens of page i as little-endian uint32)

    tokens [ page 1 ][ page 2 ][ page 3 ] ...
    keys    h_1 ----> h_2 ----> h_3        each key names its page *and* everything before it

A key therefore identifies a page's contents only under one model, tokenizer,
dtype, page size and TP layout: a changed model never reads old entries.
"""

from __future__ import annotations

import hashlib
import json
import re
import struct
from dataclasses import asdict, dataclass, replace
from functools import lru_cache

KEY_BYTES = 16  # 128-bit keys
_FINGERPRINT_PERSON = b"hkv-fingerprint1"  # BLAKE2b personalization: the two hash uses never collide
_PAGE_PERSON = b"hkv-page-key-v1"
_TP_LAYOUT = re.compile(r"tp([0-9]+):(.+)")  # what `tp_layout` writes


def tp_layout(tp: int, device: str) -> str:
    """The fingerprint's tp_layout field: "tp2:cuda" (the device is part of the layout: CPU and GPU
    kernels round differently)."""
    return f"tp{tp}:{device}"


@dataclass(frozen=True)
class ModelFingerprint:
    """Everything that changes what a cached page holds.

    architecture: the model family and config digest, e.g. "qwen3_5_text:<config sha>".
    weights_digest: hex digest of the weight files (computed by the loader).
    dtype: the KV pool layout name, e.g. "bfloat16" or "int8-g64".
    page_size: tokens per page.
    tp_layout: how heads are split across ranks, and on which device: `tp_layout(2, "cuda")`, "tp2:cuda".
    tokenizer: hex digest of tokenizer.json (and its config).
    """

    architecture: str
    weights_digest: str
    dtype: str
    page_size: int
    tp_layout: str
    tokenizer: str

    def root_key(self) -> bytes:
        """h_0: BLAKE2b-128 of the fields as canonical JSON."""
        text = json.dumps(asdict(self), sort_keys=True, separators=(",", ":"))
        return hashlib.blake2b(text.encode(), digest_size=KEY_BYTES, person=_FINGERPRINT_PERSON).digest()

    def any_tp_key(self) -> bytes:
        """The root key of this model at any TP degree: tp_layout's N replaced by "*" ("tp*:cuda").

        It roots no page (pages stay keyed by `root_key`, N included); it names the model in records
        that must hold across N, such as which N wrote a disk folder (hkv/cache/disk_owner.py).
        Raises ValueError when tp_layout is not `tp_layout()`'s form.
        """
        match = _TP_LAYOUT.fullmatch(self.tp_layout)
        if match is None:
            raise ValueError(f"tp_layout {self.tp_layout!r} is not tp<N>:<device>")
        return replace(self, tp_layout=f"tp*:{match[2]}").root_key()


@lru_cache(maxsize=64)
def _packer(page_size: int) -> struct.Struct:
    return struct.Struct(f"<{page_size}I")


def page_key(parent: bytes, page_tokens) -> bytes:
    """h_i from h_{i-1} and the page's token ids (each in [0, 2**32)); raises struct.error otherwise."""
    data = _packer(len(page_tokens)).pack(*page_tokens)
    return hashlib.blake2b(parent + data, digest_size=KEY_BYTES, person=_PAGE_PERSON).digest()


def page_keys(parent: bytes, tokens, page_size: int) -> list[bytes]:
    """Keys of the full pages of `tokens`, chained from `parent` (h_0 or a previous page's key).

        tokens [0, P) [P, 2P) ... [kP, kP + r)    r < P: a partial page gets no key
        keys    k_1    k_2         (none)

    Returns one key per full page, in order.
    """
    packer = _packer(page_size)
    keys: list[bytes] = []
    h = parent
    for start in range(0, len(tokens) - page_size + 1, page_size):
        data = packer.pack(*tokens[start : start + page_size])
        h = hashlib.blake2b(h + data, digest_size=KEY_BYTES, person=_PAGE_PERSON).digest()
        keys.append(h)
    return keys
