"""Paged Qwen3 forward vs transformers' full-sequence forward on tiny random models."""

import random
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
import transformers

from hkv.models.batch import ForwardBatch
from hkv.models.loader import load_model
from hkv.models.qwen3 import Qwen3Config, Qwen3ForCausalLM, WeightLoadError
from hkv.storage.kv_pool import KVPool


@dataclass
class _Seq:
    tokens: list[int]  # prompt followed by the tokens fed one at a time as decode steps
    prompt_len: int
    start_step: int  # first step at which the sequence joins the batch
    done: int = 0  # tokens already in KV
    pages: list[int] = field(default_factory=list)


def run_paged(model, kv: KVPool, seqs: list[_Seq], chunk_sizes: list[int], free_pages: list[int]) -> list[torch.Tensor]:
    """Feed every sequence through `model` in mixed prefill/decode batches; returns fp32 logits per token."""
    page_size = kv.page_size
    logits = [[] for _ in seqs]
    step = 0
    while any(s.done < len(s.tokens) for s in seqs):
        rows = []  # (seq index, new token count)
        for i, s in enumerate(seqs):
            if step < s.start_step or s.done == len(s.tokens):
                continue
            n = 1 if s.done >= s.prompt_len else min(chunk_sizes[(step + i) % len(chunk_sizes)], s.prompt_len - s.done)
            while len(s.pages) * page_size < s.done + n:
                s.pages.append(free_pages.pop())
            rows.append((i, n))
        batch = _batch(seqs, rows, page_size)
        out = model(batch, kv)
        assert out.dtype == torch.float32 and out.shape[0] == batch.logits_indices.shape[0]
        offset = 0
        for i, n in rows:
            logits[i].append(out[offset : offset + n])
            offset += n
            seqs[i].done += n
        step += 1
    return [torch.cat(per_seq) for per_seq in logits]


def _batch(seqs: list[_Seq], rows: list[tuple[int, int]], page_size: int) -> ForwardBatch:
    ids, positions, slots, q_lens, kv_lens = [], [], [], [], []
    max_pages = max(len(seqs[i].pages) for i, _ in rows)
    page_table = torch.zeros(len(rows), max_pages, dtype=torch.int64)
    for b, (i, n) in enumerate(rows):
        s = seqs[i]
        pos = list(range(s.done, s.done + n))
        ids += s.tokens[s.done : s.done + n]
        positions += pos
        slots += [s.pages[p // page_size] * page_size + p % page_size for p in pos]
        q_lens.append(n)
        kv_lens.append(s.done + n)
        page_table[b, : len(s.pages)] = torch.tensor(s.pages)
    total = len(ids)
    return ForwardBatch.from_lists(
        input_ids=ids,
        positions=positions,
        q_lens=q_lens,
        kv_lens=kv_lens,
        page_table=page_table,
        slot_mapping=slots,
        logits_indices=range(total),
    )


def make_seqs(vocab: int, specs: list[tuple[int, int, int]], seed: int) -> list[_Seq]:
    """specs: (prompt_len, decode_steps, start_step) per sequence; random tokens."""
    rng = random.Random(seed)
    return [
        _Seq([rng.randrange(vocab) for _ in range(p + d)], prompt_len=p, start_step=start) for p, d, start in specs
    ]


def hf_tiny_qwen3(tied: bool, bias: bool = False, seed: int = 0) -> transformers.Qwen3ForCausalLM:
    config = transformers.Qwen3Config(
        vocab_size=211,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=512,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        tie_word_embeddings=tied,
        attention_bias=bias,
    )
    torch.manual_seed(seed)
    model = transformers.Qwen3ForCausalLM(config).eval()
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            # HF inits norms to ones and biases to zeros: randomize so a mis-mapped one shows
            if "norm" in name or name.endswith("bias"):
                param.copy_(torch.randn(param.shape, generator=gen) * 0.1 + (1.0 if "norm" in name else 0.0))
    return model


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, tuple[transformers.Qwen3ForCausalLM, Path]]:
    root = tmp_path_factory.mktemp("qwen3")
    out = {}
    for key, tied, bias, shard in (
        ("untied", False, False, None),
        ("tied-sharded", True, False, "40KB"),
        ("bias-sharded", False, True, "60KB"),
    ):
        model = hf_tiny_qwen3(tied, bias)
        folder = root / key
        if shard:
            model.save_pretrained(folder, max_shard_size=shard)
            assert (folder / "model.safetensors.index.json").is_file()
        else:
            model.save_pretrained(folder)
        out[key] = (model, folder)
    return out


def _hf_logits(model, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0].float()


@pytest.mark.parametrize("key", ["untied", "tied-sharded", "bias-sharded"])
@pytest.mark.parametrize("page_size", [4, 16])
def test_paged_chunked_prefill_and_decode_match_transformers(checkpoints, key, page_size):
    hf_model, folder = checkpoints[key]
    loaded = load_model(folder, "float32", "cpu")
    model = loaded.model
    assert isinstance(model, Qwen3ForCausalLM)
    # prompt lengths cross page boundaries; sequences join at different steps, so batches mix prefill and decode
    seqs = make_seqs(211, [(23, 5, 0), (9, 7, 0), (41, 4, 1), (1, 6, 2), (16, 3, 3)], seed=page_size)
    num_pages = 64
    free_pages = list(range(num_pages))
    random.Random(7).shuffle(free_pages)
    kv = KVPool(model.kv_layout(num_pages, page_size, "float32", "cpu"), model.layer_map)
    with torch.no_grad():
        ours = run_paged(model, kv, seqs, chunk_sizes=[5, 3, 7, 1, 9, 2, 13], free_pages=free_pages)
    for s, got in zip(seqs, ours):
        want = _hf_logits(hf_model, s.tokens)
        assert got.shape == want.shape
        assert (got - want).abs().max().item() < 1e-4


def test_logits_indices_select_rows(checkpoints):
    hf_model, folder = checkpoints["untied"]
    model = load_model(folder, "float32", "cpu").model
    kv = KVPool(model.kv_layout(8, 4, "float32", "cpu"), model.layer_map)
    a, b = [3, 4, 5, 6, 7], [8, 9, 10]
    slots = [0, 1, 2, 3, 4 * 4, 2 * 4, 2 * 4 + 1, 2 * 4 + 2]  # a on pages 0 and 4, b on page 2
    batch = ForwardBatch.from_lists(
        input_ids=a + b,
        positions=[0, 1, 2, 3, 4, 0, 1, 2],
        q_lens=[5, 3],
        kv_lens=[5, 3],
        page_table=torch.tensor([[0, 4], [2, 0]]),
        slot_mapping=slots,
        logits_indices=[4, 7],  # the last token of each sequence
    )
    with torch.no_grad():
        out = model(batch, kv)
    assert out.shape == (2, 211)
    assert (out[0] - _hf_logits(hf_model, a)[-1]).abs().max() < 1e-4
    assert (out[1] - _hf_logits(hf_model, b)[-1]).abs().max() < 1e-4


def test_bfloat16_forward_is_close(checkpoints):
    hf_model, folder = checkpoints["untied"]
    model = load_model(folder, "bfloat16", "cpu").model
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    seqs = make_seqs(211, [(12, 2, 0)], seed=3)
    kv = KVPool(model.kv_layout(8, 4, "bfloat16", "cpu"), model.layer_map)
    with torch.no_grad():
        (got,) = run_paged(model, kv, seqs, chunk_sizes=[5], free_pages=list(range(8)))
    want = _hf_logits(hf_model, seqs[0].tokens)
    assert got.dtype == torch.float32
    assert (got - want).abs().max().item() < 0.05


def _hf_dict(**overrides) -> dict:
    d = hf_tiny_qwen3(tied=False).config.to_dict()
    d.update(overrides)
    return d


def test_config_from_hf_reads_new_and_legacy_rope():
    cfg = Qwen3Config.from_hf(_hf_dict())
    assert (cfg.vocab_size, cfg.head_dim, cfg.num_key_value_heads, cfg.max_position_embeddings) == (211, 16, 2, 512)
    assert cfg.rope_theta == 10000.0
    legacy = _hf_dict(rope_parameters=None, rope_theta=1e6, rope_scaling=None)
    assert Qwen3Config.from_hf(legacy).rope_theta == 1e6


@pytest.mark.parametrize(
    "overrides, match",
    [
        ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0}}, "rope type 'yarn'"),
        ({"rope_parameters": None, "rope_scaling": {"type": "linear", "factor": 2.0}}, "rope type 'linear'"),
        ({"use_sliding_window": True}, "sliding-window"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"model_type": "llama"}, "model_type"),
    ],
)
def test_config_refuses_unsupported_variants(overrides, match):
    with pytest.raises(ValueError, match=match):
        Qwen3Config.from_hf(_hf_dict(**overrides))


def test_load_weights_errors():
    hf_model = hf_tiny_qwen3(tied=False)
    model = Qwen3ForCausalLM(Qwen3Config.from_hf(hf_model.config.to_dict()))
    state = dict(hf_model.state_dict())
    missing = {k: v for k, v in state.items() if k != "model.norm.weight"}
    with pytest.raises(WeightLoadError, match=r"1 missing \['model.norm.weight'\]"):
        model.load_weights(missing.items())
    with pytest.raises(WeightLoadError, match="1 unexpected"):
        model.load_weights([*state.items(), ("model.extra.weight", torch.zeros(2))])
    bad_shape = {**state, "model.norm.weight": torch.zeros(3)}
    with pytest.raises(WeightLoadError, match="model.norm.weight: checkpoint shape"):
        model.load_weights(bad_shape.items())
    # rotary tables are ignored, and everything else loads
    model.load_weights([*state.items(), ("model.rotary_emb.inv_freq", torch.zeros(8))])
    assert torch.equal(model.lm_head.weight, state["lm_head.weight"])


def test_dense_has_no_state_layout():
    model = Qwen3ForCausalLM(Qwen3Config.from_hf(_hf_dict()))
    assert model.state_layout() is None
    layout = model.kv_layout(10, 16, "bfloat16", "cpu")
    assert layout.shape == (3, 10, 16, 2, 16) and layout.layer_ids == (0, 1, 2)
    assert model.layer_map == {0: 0, 1: 1, 2: 2}
