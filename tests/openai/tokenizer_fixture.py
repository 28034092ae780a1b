"""The built-in tiny-dense checkpoint and its tokenizer, shared by the api tests.

The folder lives in the usual built-in cache (written once, reused by later
runs), so only the first run pays for writing the weights.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path

from hkv.config import builtin_cache_dir
from hkv.models.tokenizer import Tokenizer


@cache
def tiny_dense_folder() -> Path:
    from hkv.models.tiny import ensure_builtin  # imports torch: only when a test needs the folder

    return Path(ensure_builtin("tiny-dense", Path(builtin_cache_dir())))


@cache
def tiny_tokenizer() -> Tokenizer:
    return Tokenizer.from_folder(tiny_dense_folder())
