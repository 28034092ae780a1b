"""The HkvConfig of in-process actor tests: tiny-dense on CPU, small pools, a private run directory."""

from __future__ import annotations

import dataclasses

from hkv.config import CacheConfig, HkvConfig, ModelConfig, SchedulerConfig, ServerConfig, SpecConfig
from hkv.models.loader import describe_model
from tests.openai.tokenizer_fixture import tiny_dense_folder


def make_cfg(run_dir: str, name: str = "apitest", **server: object) -> HkvConfig:
    base = ServerConfig(
        host="127.0.0.1",
        port=0,
        name=name,
        mode="normal",
        prefill_urls=(),
        decode_urls=(),
        secret_file=None,
        api_key=None,
        log_level="info",
        max_body_bytes=8 * 1024 * 1024,
        drain_timeout_s=5.0,
    )
    return HkvConfig(
        model=ModelConfig("tiny-dense", str(tiny_dense_folder()), "float32", "cpu", 1, 0, 1,
                          describe_model(tiny_dense_folder())),
        cache=CacheConfig(16, 4096, True, False, None, 0, 0.0, None, None),
        scheduler=SchedulerConfig(max_running_requests=8, chunked_prefill_size=512, max_queued_requests=64),
        spec=SpecConfig(0, None),
        server=dataclasses.replace(base, **server),
        run_dir=run_dir,
    )
