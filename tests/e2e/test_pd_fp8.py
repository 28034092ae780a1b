"""FP8 KV pages through prefill/decode (issue 39 deliverable 4: PD transfers carry FP8 pages as they are).

One start of every instance (CPU CI has two cores): an FP8-KV instance alone, an FP8-KV prefill instance
with a pair group (`--pd-transfer pair`), two FP8-KV decode instances, one on the pair path and one on
the CPU-tier path (`--pd-transfer tier`: it pulls the pages the prefill instance copied to its CPU tier),
and a decode instance with model-dtype pages (`--kv-cache-dtype auto`, `--pd-transfer pair`), each pair
behind its own master.

1. Greedy tokens through either path equal the single FP8-KV instance's, for prompts of several pages;
   every page came from the prefill instance, by the path asked for.
2. The model-dtype decode instance refuses the FP8 prefill instance's pages: the client gets the line
   naming both KV dtypes (a 502 from the master that carries it), no page moved and nothing stays reserved.
"""

from __future__ import annotations

import asyncio
import signal

import pytest

from tests.e2e.harness import launch
from tests.e2e.test_pd import PAGE, TIMEOUT_S, _body, _launch_all, _post_all, _prompts, _secret, _settled_metric
from tests.e2e.test_pd import _wait_in_use_zero, stop_all

pytestmark = pytest.mark.e2e
MODEL = ["--model", "tiny-hybrid-random"]
FP8 = ["--kv-cache-dtype", "fp8_e4m3"]
LENGTHS = [70, 333]  # 4 and 20 pages move
REFUSAL = ("another KV cache dtype (--kv-cache-dtype): the prefill instance stores float8_e4m3fn pages, "
           "the decode instance float32")


class Fp8Pd:
    """The instances above and their masters; every one checked clean at the end."""

    def __init__(self, tmp_path):
        self.secret = _secret(tmp_path)
        common = [*MODEL, "--secret-file", str(self.secret), "--pd-timeout", str(TIMEOUT_S),
                  "--max-total-tokens", "4096", "--cpu-cache-gb", "0.05"]
        specs = [[*MODEL, *FP8, "--max-total-tokens", "4096"],
                 [*common, *FP8, "--mode", "prefill", "--pd-transfer", "pair"],
                 [*common, *FP8, "--mode", "decode", "--pd-transfer", "pair"],
                 [*common, *FP8, "--mode", "decode", "--pd-transfer", "tier"],
                 [*common, "--mode", "decode", "--pd-transfer", "pair"]]
        started = _launch_all([(args, None, None) for args in specs], tmp_path)
        self.single, self.prefill, self.pair, self.tier, self.model_dtype = started
        self.masters = {}
        try:
            for role in ("pair", "tier", "model_dtype"):
                self.masters[role] = launch(["--mode", "pd-master", "--secret-file", str(self.secret),
                                             "--prefill-url", self.prefill.url, "--decode-url",
                                             getattr(self, role).url], tmp_path)
        except BaseException:
            for server in [*started, *self.masters.values()]:
                server.stop(signal.SIGKILL)
            raise
        self.pids = [pid for server in self.servers() for pid in server.actor_pids()]

    def servers(self):
        return [*self.masters.values(), self.single, self.prefill, self.pair, self.tier, self.model_dtype]


@pytest.fixture(scope="module")
def fp8_pd(tmp_path_factory):
    pd = Fp8Pd(tmp_path_factory.mktemp("pd-fp8"))
    yield pd
    stop_all(pd.servers(), pd.pids)


def _tokens(answers) -> list[list[int]]:
    for status, answer in answers:
        assert status == 200, answer
    return [answer["choices"][0]["token_ids"] for _, answer in answers]


def _received(server) -> tuple[float, float]:
    return (_settled_metric(server.url, "hkv_pd_pages_total", '{direction="received"}'),
            _settled_metric(server.url, "hkv_pd_pair_pages_total"))


def test_fp8_pages_through_either_path_give_the_single_instance_tokens(fp8_pd):
    prompts = _prompts(39, LENGTHS)
    bodies = [_body(p) for p in prompts]
    single = _tokens(asyncio.run(_post_all(fp8_pd.single.url, bodies)))
    pages = sum((len(p) - 1) // PAGE for p in prompts)
    for role, moved in (("pair", (0, pages)), ("tier", (pages, 0))):
        decode = getattr(fp8_pd, role)
        before = _received(decode)
        answers = asyncio.run(_post_all(fp8_pd.masters[role].url, bodies))
        assert _tokens(answers) == single, role
        for prompt, (_, answer) in zip(prompts, answers):
            assert answer["usage"]["cache"]["peer"] == (len(prompt) - 1) // PAGE * PAGE, (role, answer["usage"])
        after = _received(decode)
        assert (after[0] - before[0], after[1] - before[1]) == moved, role
        assert "float8_e4m3fn KV" in decode.log(), role


def test_a_model_dtype_decode_instance_refuses_fp8_pages_with_one_clear_line(fp8_pd):
    prompt = _prompts(40, [100])[0]
    ((status, answer),) = asyncio.run(_post_all(fp8_pd.masters["model_dtype"].url, [_body(prompt)]))
    assert status == 502, answer
    assert REFUSAL in answer["error"]["message"], answer
    assert _received(fp8_pd.model_dtype) == (0, 0)
    for pool in ("cpu_pages", "gpu_pages"):  # nothing stays reserved on the decode side
        _wait_in_use_zero(fp8_pd.model_dtype.name, pool)
