"""The KV cache scales a checkpoint carries (hkv/models/kv_scales.py), and the --kv-cache-dtype flag."""

import pytest
import torch

from hkv.models.kv_scales import KVScaleError, KVScaleReader
from hkv.storage.host_pool import kv_dtype_of
from hkv.storage.kv_pool import KVLayout, KVPool


def _read(named, full=(0, 3)):
    reader = KVScaleReader()
    rest = list(reader.absorb(named))
    return rest, reader.scales(full)


def test_scales_come_out_of_the_stream_under_vllms_names():
    one = torch.tensor(1.0)
    rest, scales = _read([
        ("model.layers.0.self_attn.k_scale", torch.tensor(0.5)),
        ("model.layers.0.self_attn.q_proj.weight", one),
        ("model.language_model.layers.3.self_attn.kv_scale", torch.tensor([2.0])),
        ("model.layers.3.self_attn.attn.v_scale", torch.tensor(4.0)),
        ("mtp.layers.0.self_attn.k_scale", torch.tensor(3.0)),
    ])
    assert [name for name, _ in rest] == ["model.layers.0.self_attn.q_proj.weight"]
    assert scales == {0: (0.5, 1.0), 3: (2.0, 4.0)}  # kv_scale fills the one not given


@pytest.mark.parametrize("name,value,why", [
    ("model.layers.0.self_attn.k_scale", torch.tensor([1.0, 2.0]), "one number"),
    ("model.layers.0.self_attn.k_scale", torch.tensor(0.0), "finite and positive"),
    ("model.layers.0.self_attn.v_scale", torch.tensor(float("nan")), "finite and positive"),
    ("model.layers.1.self_attn.k_scale", torch.tensor(1.0), "not a full-attention layer"),
])
def test_bad_scales_are_refused(name, value, why):
    with pytest.raises(KVScaleError, match=why):
        _read([(name, value)])


def test_fp8_pool_writes_quantized_and_validates_scales():
    layout = KVLayout(1, 2, 4, 1, 2, "float8_e4m3fn", "cpu")
    pool = KVPool(layout, {5: 0}, scales={0: (0.5, 2.0)})
    assert pool.fp8 and pool.scales(5) == (0.5, 2.0) and pool.attn_dtype == torch.bfloat16
    pool.write(5, torch.tensor([1, 6]), torch.tensor([[[1.0, 300.0]]] * 2), torch.tensor([[[3.0, -1e4]]] * 2))
    k, v = pool.gather(5, torch.tensor([0, 1]), 8)
    assert k.dtype == torch.float8_e4m3fn and layout.bytes_per_page() == 2 * 4 * 2
    assert k[1, 0].float().tolist() == [2.0, 448.0]  # 1 / 0.5; 300 / 0.5 saturates
    assert v[6, 0].float().tolist() == [1.5, -448.0]
    with pytest.raises(ValueError, match="finite and positive"):
        KVPool(layout, {5: 0}, scales={0: (0.0, 1.0)})
    with pytest.raises(ValueError, match="FP8 pages only"):
        KVPool(KVLayout(1, 2, 4, 1, 2, "bfloat16", "cpu"), {5: 0}, scales={0: (0.5, 1.0)})


def test_layout_descriptor_names_the_kv_dtype():
    assert kv_dtype_of("kv:2x4x16x2x64:float8_e4m3fn|state:conv1x2x3+rec1x2x3x4:float32") == "float8_e4m3fn"
    assert kv_dtype_of("garbage") == ""


def test_kv_cache_dtype_flag(monkeypatch, tmp_path):
    from hkv.config import ConfigError, parse_cli  # noqa: F401

    monkeypatch.setenv("HKV_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    cfg = parse_cli(["--model", "tiny-dense", "--device", "cpu", "--kv-cache-dtype", "fp8_e4m3",
                     "--compile-cache-dir", str(tmp_path / "cc")])
    assert cfg.model.kv_cache_dtype == "float8_e4m3fn" and cfg.model.dtype == "float32"
    assert cfg.model.cache_dtype_name == "float32/kv:float8_e4m3fn"
    auto = parse_cli(["--model", "tiny-dense", "--device", "cpu", "--compile-cache-dir", str(tmp_path / "cc")])
    assert auto.model.kv_cache_dtype == "float32" and auto.model.cache_dtype_name == "float32"
    with pytest.raises(SystemExit) as exc:
        parse_cli(["--kv-cache-dtype", "int8"])
    assert exc.value.code == 2
