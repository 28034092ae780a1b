"""The rank actor's process set-up (hkv/actors/rank.py); its steps are tested through ModelRunner in tests/engine."""

from __future__ import annotations

import dataclasses
import os
import tempfile

from hkv.actors import rank
from tests.actors.actor_config import make_cfg


def test_the_rank_compiles_its_kernels_under_the_compile_cache(tmp_path, monkeypatch):
    for name in ("TRITON_CACHE_DIR", "TRITON_CACHE_AUTOTUNING"):
        monkeypatch.setenv(name, "left by the user")  # (restored after the test)
    cfg = make_cfg(tempfile.gettempdir())
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, compile_cache_dir=str(tmp_path)))
    rank.use_compile_cache(cfg)
    assert os.environ["TRITON_CACHE_DIR"] == str(tmp_path / "triton")
    import triton

    # what Triton itself reads: compiled kernels there, and every autotuner's results kept with them
    assert triton.knobs.cache.dir == str(tmp_path / "triton") and triton.knobs.autotuning.cache is True
