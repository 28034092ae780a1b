"""hkv-bench against a fake OpenAI server (aiohttp in this process): request bodies, SSE timing, multi-turn
prompts, the report's arithmetic and flag checking. The real-server run is tests/e2e/test_bench.py."""

from __future__ import annotations

import json

import pytest
from aiohttp import web

from tools import hkv_bench
from tools.bench.bench_client import RequestResult
from tools.bench.bench_report import latency_stats, server_figures, speculative

METRICS = """# TYPE hkv_engine_steps_total counter
hkv_engine_steps_total {steps}
hkv_engine_step_seconds_total {step_s}
hkv_engine_forward_seconds_total {forward_s}
hkv_cache_hit_tokens_total{{tier="gpu"}} {hits}
"""


class FakeServer:
    """Answers every prompt with output_len ids in events of two ids, and counts what it was sent."""

    def __init__(self):
        self.bodies: list[dict] = []
        self.flushes = 0
        self.scrapes = 0
        self.vocab: int | None = None  # the vocab_size its /v1/models card gives (hkv's extension), if any

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.bodies.append(body)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        ids = [1000 + len(body["prompt"]) + i for i in range(body["max_tokens"])]
        for start in range(0, len(ids), 2):
            event = {"choices": [{"index": 0, "text": "", "token_ids": ids[start:start + 2]}], "usage": None}
            await resp.write(b"data: " + json.dumps(event).encode() + b"\n\n")
        cached = 16 if len(body["prompt"]) > 16 else 0
        usage = {"prompt_tokens": len(body["prompt"]), "completion_tokens": len(ids),
                 "prompt_tokens_details": {"cached_tokens": cached},
                 "cache": {"gpu": cached, "cpu": 0, "disk": 0, "peer": 0}}
        await resp.write(b"data: " + json.dumps({"choices": [], "usage": usage}).encode() + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        return resp

    async def models(self, request: web.Request) -> web.Response:
        card = {"id": "fake", "max_model_len": 4096}
        return web.json_response({"data": [card if self.vocab is None else {**card, "vocab_size": self.vocab}]})

    async def flush(self, request: web.Request) -> web.Response:
        self.flushes += 1
        return web.json_response({"flushed": True})

    async def metrics(self, request: web.Request) -> web.Response:
        self.scrapes += 1
        n = self.scrapes
        return web.Response(text=METRICS.format(steps=10 * n, step_s=0.1 * n, forward_s=0.08 * n, hits=5 * n))


@pytest.fixture
async def fake():
    server = FakeServer()
    app = web.Application()
    app.router.add_post("/v1/completions", server.completions)
    app.router.add_get("/v1/models", server.models)
    app.router.add_post("/cache/flush", server.flush)
    app.router.add_get("/metrics", server.metrics)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    server.url = f"http://127.0.0.1:{runner.addresses[0][1]}"
    yield server
    await runner.cleanup()


async def _bench(argv: list[str]) -> dict:
    args = hkv_bench.parse_args([*argv, "--no-progress"])
    run = await hkv_bench.run_benchmark(args)
    return hkv_bench.build_report(args, run)


async def test_shared_prefix_run_and_its_report(fake):
    report = await _bench(["--url", fake.url, "--small", "--output-len", "5"])
    warmup, timed = fake.bodies[0], fake.bodies[1:]
    assert len(timed) == 8 and fake.flushes == 1
    assert all(b["stream"] and b["return_token_ids"] and b["ignore_eos"] and b["temperature"] == 0
               and b["max_tokens"] == 5 and b["stream_options"] == {"include_usage": True} and b["model"] == "fake"
               for b in fake.bodies)
    assert len(warmup["prompt"]) == 272 and {len(b["prompt"]) for b in timed} == {272}
    assert report["requests"] == {"sent": 8, "completed": 8, "failed": 0, "first_error": None,
                                  "output_tokens": 40, "expected_output_tokens": 40}
    cache = report["cache"]
    assert cache["prompt_tokens"] == 8 * 272 and cache["cached_tokens"] == 8 * 16
    assert cache["ideal_tokens"] == 6 * 256 and cache["per_tier"]["gpu"]["tokens"] == 128
    assert cache["of_ideal"] == pytest.approx(128 / 1536)
    # /metrics is read once before and once after the timed phase: the fake's counters grow per read
    assert report["server"]["steps"] == 10 and report["server"]["step_seconds_mean"] == pytest.approx(0.01)
    assert report["server"]["cache_hit_tokens"] == {"gpu": 5, "cpu": None, "disk": None}
    assert report["speculative"] is None
    assert all(report["latency"][k]["p99"] > 0 for k in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"))
    assert report["throughput"]["output_tokens_per_s"] > 0


async def test_multi_turn_prompts_extend_the_previous_answer(fake):
    await _bench(["--url", fake.url, "--workload", "multi-turn", "--conversations", "2", "--turns", "3",
                  "--question-len", "10", "--output-len", "4", "--warmup", "0", "--concurrency", "1"])
    prompts = [b["prompt"] for b in fake.bodies]
    assert [len(p) for p in prompts] == [10, 24, 38, 10, 24, 38]
    answer = [1000 + 10 + i for i in range(4)]
    assert prompts[1][:14] == prompts[0] + answer


def test_itl_spreads_an_event_over_its_ids_and_tpot_excludes_the_first():
    r = RequestResult(prompt=(1,), sent_at=0.0, output=[5, 6, 7, 8],
                      events=[(1.0, 1), (1.5, 1), (2.5, 2)], finished_at=3.0)
    assert r.ttft == 1.0 and r.itls() == [0.5, 0.5, 0.5]
    assert r.tpot == pytest.approx((3.0 - 1.0) / 3)


def test_latency_stats_interpolate_the_p99():
    stats = latency_stats([i / 1000 for i in range(1, 102)])  # 1..101 ms
    assert stats == {"mean": pytest.approx(51), "median": pytest.approx(51), "p99": pytest.approx(100)}
    assert latency_stats([]) == {"mean": None, "median": None, "p99": None}


def test_speculative_counters_are_read_when_present():
    before = {"hkv_spec_draft_tokens_total": 10.0, "hkv_spec_accepted_tokens_total": 5.0}
    after = {"hkv_spec_draft_tokens_total": 110.0, "hkv_spec_accepted_tokens_total": 65.0}
    assert speculative(before, after)["acceptance_rate"] == pytest.approx(0.6)
    assert speculative({}, {"hkv_engine_steps_total": 1.0}) is None
    assert server_figures(None, None)["steps"] is None


@pytest.mark.parametrize("argv, message", [
    (["--groups", "0"], "--groups must be at least 1"),
    (["--request-rate", "0"], "--request-rate must be positive"),
    (["--baseline", "hf"], "--baseline hf needs --model-path"),
    (["--vocab", "10"], "--vocab must exceed 16"),
    (["--workload", "nope"], "invalid choice"),
])
def test_bad_flags_exit_2_with_one_line(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        hkv_bench.main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert exc.value.code == 2 and len(err) == 1 and message in err[0]


async def test_prompt_ids_come_from_the_servers_vocabulary_unless_a_flag_gives_one(fake):
    """Issue 38: a model of fewer than DEFAULT_VOCAB tokens refused the warm-up's ids; /v1/models' vocab_size
    now bounds them."""
    fake.vocab = 300
    report = await _bench(["--url", fake.url, "--small", "--output-len", "2"])
    assert report["config"]["vocab"] == 300 and report["config"]["vocab_source"] == "server"
    assert max(t for b in fake.bodies for t in b["prompt"]) < 300
    report = await _bench(["--url", fake.url, "--small", "--output-len", "2", "--vocab", "200"])
    assert (report["config"]["vocab"], report["config"]["vocab_source"]) == (200, "--vocab")


def test_small_preset_yields_to_explicit_flags(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"text_config": {"vocab_size": 5000}}))
    args = hkv_bench.parse_args(["--small", "--groups", "3", "--model-path", str(tmp_path)])
    assert (args.groups, args.prompts_per_group, args.output_len, args.concurrency) == (3, 4, 8, 4)
    assert (args.vocab, args.vocab_source) == (5000, "--model-path")
    assert hkv_bench.parse_args(["--request-rate", "2"]).concurrency is None
    assert hkv_bench.parse_args([]).concurrency == 16 and hkv_bench.parse_args([]).vocab == 1024


def test_plots_are_written(tmp_path):
    pytest.importorskip("matplotlib")  # the bench extra; CI's test extra does not carry it
    from tools.bench.bench_report import write_plots

    done = [RequestResult((1,), 0.0, output=[1] * 40, events=[(0.1 + 0.01 * i, 1) for i in range(40)],
                          finished_at=0.6)]
    paths = write_plots(done, 0.0, tmp_path / "plots")
    assert [p.name for p in paths] == ["ttft.png", "itl.png", "throughput.png"]
    assert all(p.read_bytes()[:4] == b"\x89PNG" for p in paths)


def test_an_unreachable_server_exits_1_with_one_line(capsys):
    assert hkv_bench.main(["--url", "http://127.0.0.1:9", "--small", "--no-progress"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("hkv-bench: cannot reach http://127.0.0.1:9")
