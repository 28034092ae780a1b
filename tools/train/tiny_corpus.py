"""The corpus of the built-in model (tools/train/train_tiny.py): the Python standard library's own source.

Files: every `*.py` under `sysconfig.get_paths()["stdlib"]`, sorted by their
POSIX path relative to that folder, without `site-packages`, `dist-packages`
and `__pycache__`, and without the few files that are not UTF-8 (the stdlib's
own encoding tests). A held-out package P is kept out of training twice over:
its files (`P/...`) are the evaluation text, and its tests (`test/test_P*`)
are dropped, so no test code that quotes P's source leaks in.

Token stream: each file's tokens followed by <|endoftext|>, in file order; the
model learns where a file ends, and a window may span two files.
"""

from __future__ import annotations

import hashlib
import math
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch
from tokenizers import Tokenizer

from hkv.models.tiny import ENDOFTEXT, train_bpe

HELD_OUT = ("json", "email", "http", "tomllib")
_SKIPPED_DIRS = {"site-packages", "dist-packages", "__pycache__"}


@dataclass(frozen=True)
class SourceFile:
    path: str  # POSIX path relative to the stdlib folder, e.g. "json/decoder.py"
    text: str


@dataclass(frozen=True)
class Corpus:
    root: str  # the stdlib folder read
    train: tuple[SourceFile, ...]
    held_out: tuple[SourceFile, ...]  # the held-out packages' own files, the evaluation text
    held_out_packages: tuple[str, ...]
    skipped: tuple[str, ...]  # files that are not UTF-8, or held-out tests

    def summary(self) -> dict:
        """What train_info.json records about the corpus: counts, bytes and digests of names and contents."""
        return {
            "stdlib": self.root,
            "held_out_packages": list(self.held_out_packages),
            "train_files": len(self.train),
            "train_bytes": text_bytes(self.train),
            "train_files_sha256": _names_digest(self.train),
            "train_content_sha256": _content_digest(self.train),
            "held_out_files": len(self.held_out),
            "held_out_bytes": text_bytes(self.held_out),
            "held_out_files_sha256": _names_digest(self.held_out),
            "skipped_files": len(self.skipped),
        }


def text_bytes(files: tuple[SourceFile, ...]) -> int:
    return sum(len(f.text.encode("utf-8")) for f in files)


def _names_digest(files: tuple[SourceFile, ...]) -> str:
    return hashlib.sha256("\n".join(f.path for f in files).encode()).hexdigest()


def _content_digest(files: tuple[SourceFile, ...]) -> str:
    digest = hashlib.sha256()
    for f in files:
        digest.update(f.path.encode() + b"\0" + f.text.encode("utf-8") + b"\0")
    return digest.hexdigest()


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def _package_of(path: str, packages: tuple[str, ...]) -> tuple[str | None, bool]:
    """(the held-out package `path` belongs to or tests, None if neither; whether it is a test file)."""
    parts = path.split("/")
    if parts[0] in packages:
        return parts[0], False
    if parts[0] == "test" and len(parts) > 1:
        for package in packages:
            if parts[1].startswith(f"test_{package}"):
                return package, True
    return None, False


def _subset(files: list[SourceFile], limit: int | None) -> list[SourceFile]:
    """At most `limit` files spread evenly over the sorted list (every k-th), so a small
    corpus still samples every part of the library."""
    if limit is None or len(files) <= limit:
        return files
    step = math.ceil(len(files) / limit)
    return files[::step][:limit]


def load_corpus(root: Path | None = None, held_out: tuple[str, ...] = HELD_OUT, max_files: int | None = None,
                max_eval_files: int | None = None) -> Corpus:
    """Read the stdlib sources and split them; max_files / max_eval_files shrink the corpus for CPU runs."""
    root = stdlib_root() if root is None else root
    train, evaluation, skipped = [], [], []
    for file in sorted(root.rglob("*.py"), key=lambda p: p.relative_to(root).as_posix()):
        rel = file.relative_to(root)
        if _SKIPPED_DIRS.intersection(rel.parts) or not file.is_file():
            continue
        path = rel.as_posix()
        package, is_test = _package_of(path, held_out)
        try:
            text = file.read_bytes().decode("utf-8")
        except UnicodeDecodeError:
            skipped.append(path)
            continue
        if is_test:
            skipped.append(path)
        elif package is not None:
            evaluation.append(SourceFile(path, text))
        else:
            train.append(SourceFile(path, text))
    return Corpus(str(root), tuple(_subset(train, max_files)), tuple(_subset(evaluation, max_eval_files)),
                  tuple(held_out), tuple(skipped))


def train_tokenizer(files: tuple[SourceFile, ...], vocab_size: int) -> Tokenizer:
    """The byte-level BPE of tiny.py's recipe, trained on the training files only (whole files as samples)."""
    # merges need a pair seen twice, so no merge memorizes one rare identifier
    return train_bpe((f.text for f in files), vocab_size, min_frequency=2)


def encode(tok: Tokenizer, files: tuple[SourceFile, ...]) -> torch.Tensor:
    """The token stream [N] (int64): each file's ids, then <|endoftext|>."""
    eot = tok.token_to_id(ENDOFTEXT)
    ids: list[int] = []
    for encoding in tok.encode_batch([f.text for f in files], add_special_tokens=False):
        ids += encoding.ids
        ids.append(eot)
    return torch.tensor(ids, dtype=torch.int64)


def encode_each(tok: Tokenizer, files: tuple[SourceFile, ...]) -> list[list[int]]:
    """Each file's ids, without separators."""
    return [e.ids for e in tok.encode_batch([f.text for f in files], add_special_tokens=False)]
