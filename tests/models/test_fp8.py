"""Block-FP8 checkpoints (hkv/models/fp8.py): a tiny checkpoint in Qwen's published FP8 layout (weights
in float8_e4m3fn with 128 x 128 `weight_scale_inv`, the router, gates and GDN a/b projections left out)
loads with its projections in FP8 and computes what transformers computes on the same weights
dequantized (transformers cannot load the FP8 format on a CPU-only machine without accelerate, so the
reference is its float model over tools/fp8_checkpoint.write_dequantized_copy); `--quantize fp8` of the
float checkpoint loads the same bytes; other quantizations are refused naming quant_method."""

import json
import shutil

import pytest
import torch
import transformers as tf
from torch import nn

from hkv.models.fp8 import Fp8Linear
from hkv.models.loader import ModelLoadError, cache_fingerprint, describe_model, load_model, read_hf_config
from hkv.models.moe import Fp8Experts
from tests.models.test_qwen3_5 import TEXT_CONFIG, PagedRun, build_hf, ragged_parity
from tests.models.test_qwen3_next import BASE, VARIANTS
from tests.reference import assert_greedy_parity
from tools.fp8_checkpoint import write_dequantized_copy, write_fp8_copy

# wider than the other tiny models, so projections span several 128 x 128 blocks, the last ones partial
WIDE = dict(hidden_size=160, intermediate_size=288)
# the float path itself differs from transformers by 1.5e-4 at this width (fp32, another reduction order)
WIDE_TOL = 5e-4
FAMILIES = {
    "qwen3_5": (tf.Qwen3_5ForCausalLM, lambda: tf.Qwen3_5TextConfig(**{**TEXT_CONFIG, **WIDE})),
    "qwen3_next": (tf.Qwen3NextForCausalLM, lambda: tf.Qwen3NextConfig(
        **{**BASE, **WIDE, "moe_intermediate_size": 136}, **VARIANTS["renorm"])),
}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def fp8_ckpt(request, tmp_path_factory):
    """(float checkpoint, its FP8 twin, transformers over the FP8 weights dequantized to fp32)."""
    root = tmp_path_factory.mktemp(f"fp8_{request.param}")
    cls, config = FAMILIES[request.param]
    build_hf(cls, config(), root / "float", seed=21)
    write_fp8_copy(root / "float", root / "fp8")
    write_dequantized_copy(root / "fp8", root / "dequantized")
    ref = cls.from_pretrained(root / "dequantized", dtype=torch.float32).eval()
    return root / "float", root / "fp8", ref


def _paged_logits(model, tokens: list[int], kv_dtype: str = "float32") -> torch.Tensor:
    run = PagedRun(model, num_pages=64, num_slots=2, kv_dtype=kv_dtype)
    run.add("p", 1)
    return torch.cat([run.step([("p", tokens[:9])])[0], run.step([("p", tokens[9:])])[0]])


def _greedy(model, prompt: list[int], steps: int) -> list[int]:
    run = PagedRun(model, num_pages=64, num_slots=2)
    run.add("p", 1)
    out = [int(run.step([("p", prompt)])[0][-1].argmax())]
    while len(out) < steps:
        out.append(int(run.step([("p", out[-1:])])[0][-1].argmax()))
    return out


def test_published_layout_keeps_the_left_out_modules_in_their_dtype(fp8_ckpt):
    _, fp8, _ = fp8_ckpt
    quant = read_hf_config(fp8)["quantization_config"]
    assert quant["quant_method"] == "fp8" and quant["weight_block_size"] == [128, 128]
    kept = set(quant["modules_to_not_convert"])
    assert "lm_head" in kept and any(k.endswith("in_proj_a") or k.endswith("in_proj_ba") for k in kept)
    model = load_model(fp8, "float32", "cpu").model
    modules = dict(model.named_modules())
    for name in kept:
        assert type(modules[name]) is nn.Linear and modules[name].weight.dtype == torch.float32, name
    fp8_linears = [n for n, m in modules.items() if isinstance(m, Fp8Linear)]
    assert len(fp8_linears) >= 4 and all(modules[n].weight.dtype == torch.float8_e4m3fn for n in fp8_linears)
    q_proj = next(m for m in modules.values() if isinstance(m, Fp8Linear) and m.out_features > 128)
    assert q_proj.weight_scale_inv.shape == (-(-q_proj.out_features // 128), -(-q_proj.in_features // 128))
    assert model.model.embed_tokens.weight.dtype == torch.float32
    if "moe" in type(model.model.layers[0].mlp).__name__.lower():
        assert isinstance(model.model.layers[0].mlp.experts, Fp8Experts)
        assert type(model.model.layers[0].mlp.gate) is nn.Linear  # the router


def test_fp8_checkpoint_matches_the_dequantized_reference(fp8_ckpt):
    """Teacher-forced over ragged prefill chunks and decodes, then greedy."""
    _, fp8, ref = fp8_ckpt
    ours = load_model(fp8, "float32", "cpu").model
    assert ragged_parity(ours, ref, ref.config.vocab_size, seed=5) < WIDE_TOL
    # and exactly what hkv's own float path computes over the dequantized weights
    dequantized = load_model(fp8.parent / "dequantized", "float32", "cpu").model
    tokens = list(range(3, 40))
    assert torch.equal(_paged_logits(ours, tokens), _paged_logits(dequantized, tokens))
    prompt = torch.randint(0, ref.config.vocab_size, (11,), generator=torch.Generator().manual_seed(2)).tolist()
    assert_greedy_parity(ref, prompt, _greedy(ours, prompt, 12))


def test_quantize_fp8_loads_the_published_bytes(fp8_ckpt):
    """--quantize fp8 of the float checkpoint: the same FP8 weights and scales as the FP8 checkpoint."""
    float_dir, fp8, ref = fp8_ckpt
    quantized = load_model(float_dir, "float32", "cpu", quantize="fp8").model
    published = dict(load_model(fp8, "float32", "cpu").model.named_parameters())
    params = dict(quantized.named_parameters())
    assert params.keys() == published.keys()
    for name, param in params.items():
        assert param.dtype == published[name].dtype and torch.equal(param.float(), published[name].float()), name
    assert ragged_parity(quantized, ref, ref.config.vocab_size, seed=6) < WIDE_TOL


def test_bfloat16_activations_over_fp8_weights(fp8_ckpt):
    """bf16: the FP8 weights dequantize to bf16 as a bf16 load of the dequantized checkpoint rounds them,
    so the two models compute the same logits."""
    _, fp8, _ = fp8_ckpt
    ours = load_model(fp8, "bfloat16", "cpu").model
    linear = next(m for m in ours.modules() if isinstance(m, Fp8Linear))
    assert linear.weight.dtype == torch.float8_e4m3fn and linear.weight_scale_inv.dtype == torch.float32
    dequantized = load_model(fp8.parent / "dequantized", "bfloat16", "cpu").model
    tokens = list(range(3, 30))
    assert torch.equal(_paged_logits(ours, tokens, "bfloat16"), _paged_logits(dequantized, tokens, "bfloat16"))


def test_fingerprint_tells_fp8_from_float_and_quantized(fp8_ckpt):
    float_dir, fp8, _ = fp8_ckpt
    args = ("float32", 16, 1, "cpu")
    plain, published = cache_fingerprint(float_dir, *args), cache_fingerprint(fp8, *args)
    quantized = cache_fingerprint(float_dir, *args, quantize="fp8")
    assert len({plain.root_key(), published.root_key(), quantized.root_key()}) == 3


@pytest.mark.parametrize("change,message", [
    ({"quant_method": "gptq", "bits": 4}, "quant_method 'gptq' is not supported"),
    ({"quant_method": "awq"}, "quant_method 'awq' is not supported"),
    ({"weight_block_size": [64, 64]}, "weight_block_size [64, 64]"),
    ({"activation_scheme": "static"}, "activation_scheme 'static'"),
], ids=["gptq", "awq", "block-64", "static"])
def test_unsupported_quantization_is_refused_naming_it(fp8_ckpt, tmp_path, change, message):
    _, fp8, _ = fp8_ckpt
    folder = shutil.copytree(fp8, tmp_path / "other")
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {**config["quantization_config"], **change}
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match=message.replace("[", r"\[").replace("]", r"\]")):
        describe_model(folder)
    with pytest.raises(ModelLoadError, match="quant_method"):
        load_model(folder, "float32", "cpu")


def test_fp8_weights_in_a_float_checkpoint_are_refused(fp8_ckpt, tmp_path):
    """FP8 tensors without quantization_config: no scales to read them by."""
    _, fp8, _ = fp8_ckpt
    folder = shutil.copytree(fp8, tmp_path / "unmarked")
    config = json.loads((folder / "config.json").read_text())
    del config["quantization_config"]
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="float8_e4m3fn"):
        load_model(folder, "float32", "cpu")


@pytest.mark.parametrize("outs,fused_fp8", [((256, 128, 40), True), ((200, 128), False)],
                         ids=["whole-blocks", "split-block"])
def test_fused_projection_groups_fp8_parts_apart_from_plain_ones(outs, fused_fp8):
    """FusedLinear.fuse (CUDA's path, called here on CPU tensors): FP8 parts concatenate with their scales
    when every part but the last keeps whole 128-row blocks, else run alone; plain parts fuse together;
    outputs come back in the parts' order, equal to the unfused ones."""
    from hkv.models.qwen3 import FusedLinear
    from hkv_kernels.fp8_gemm.reference import quantize

    gen = torch.Generator().manual_seed(0)
    parts = []
    for i, out in enumerate(outs):
        fp8 = Fp8Linear(160, out, None)
        fp8.weight.data, fp8.weight_scale_inv.data = quantize(torch.randn(out, 160, generator=gen))
        plain = nn.Linear(160, 24 + i, bias=True)
        parts += [fp8, plain]
    fused = FusedLinear(tuple(parts))
    x = torch.randn(5, 160, generator=gen)
    want = fused(x)
    fused.fuse()
    assert [len(g) for g, _ in fused.groups] == [len(outs)] + ([len(outs)] if fused_fp8 else [1] * len(outs))
    got = fused(x)
    assert len(got) == len(want) and all(torch.allclose(a, b, atol=1e-5) for a, b in zip(got, want))
    assert parts[0].weight.untyped_storage().data_ptr() == fused.groups[1][1].weight.untyped_storage().data_ptr()


def test_tp_refuses_an_fp8_checkpoint_for_now(fp8_ckpt):
    """Block scales split with their weights need block-aligned shard plans: until then --tp > 1 exits 2."""
    from hkv.models.loader import check_tp
    from hkv.models.parallel import TPConfigError

    float_dir, fp8, _ = fp8_ckpt
    check_tp(float_dir, 2)
    with pytest.raises(TPConfigError, match="an FP8 checkpoint runs on one rank"):
        check_tp(fp8, 2)
