"""argparse value types of hkv-launch's flags: each raises ArgumentTypeError with the rule it checks."""

from __future__ import annotations

import argparse


def positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def non_negative_float(text: str) -> float:
    value = float(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def positive_float(text: str) -> float:
    value = float(text)
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text}")
    return value


def fraction(text: str) -> float:
    value = float(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {text}")
    return value


MAX_GRAMMAR_THREADS = 256


def grammar_threads(text: str) -> int:
    """--grammar-threads: llguidance's mask threads on a rank."""
    value = int(text)
    if not 1 <= value <= MAX_GRAMMAR_THREADS:
        raise argparse.ArgumentTypeError(f"must be in 1..{MAX_GRAMMAR_THREADS}, got {text}")
    return value


MASK_CACHE_VALUES = {"": "on", "1": "on", "0": "off", "verify": "verify"}  # $HKV_GRAMMAR_MASK_CACHE -> mode


def mask_cache_mode(text: str) -> str:
    """$HKV_GRAMMAR_MASK_CACHE (unset or 1: on, 0: off, verify) as grammar.MASK_CACHE_MODES' mode; ValueError
    on any other value, so that a typo never leaves the cache in a mode nobody asked for."""
    mode = MASK_CACHE_VALUES.get(text.strip())
    if mode is None:
        raise ValueError("unset or 1 (on, the default), 0 (off) or verify")
    return mode


def batch_sizes(text: str, limit: int) -> tuple[int, ...]:
    """Comma-separated batch sizes, each from 1 to limit, sorted without repeats; ValueError says the rule."""
    try:
        sizes = tuple(sorted({int(part) for part in text.split(",")}))
    except ValueError:
        raise ValueError("decode batch sizes separated by commas, e.g. 1,32,64") from None
    if sizes[0] < 1 or sizes[-1] > limit:
        raise ValueError(f"batch sizes from 1 to --max-running-requests ({limit})")
    return sizes
