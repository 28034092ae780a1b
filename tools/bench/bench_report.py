"""What `hkv-bench` reports: latency statistics, throughput, cache hits against the ideal, server step
figures from /metrics deltas, the stdout table and the PNG plots.

Latencies are in milliseconds (`*_ms`), throughputs per second of the timed
phase (first request sent to last one finished).
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from pathlib import Path

from tools.bench.bench_client import RequestResult

TIERS = ("gpu", "cpu", "disk", "peer")
# the names a speculative decoder is expected to export; other hkv_spec_* counters are reported raw
SPEC_DRAFTED, SPEC_ACCEPTED = "hkv_spec_draft_tokens_total", "hkv_spec_accepted_tokens_total"


def served_figures(doc: dict) -> dict:
    """TPOT (mean), the median inter-token latency (ms) and output tokens/s of a report this module wrote as JSON
    (hkv-bench --json); KeyError or TypeError where `doc` is not one."""
    latency = doc["latency"]
    return {"tpot_ms": latency["tpot_ms"]["mean"], "itl_median_ms": latency["itl_ms"]["median"],
            "output_tokens_per_s": doc["throughput"]["output_tokens_per_s"]}


def latency_stats(seconds: Sequence[float]) -> dict[str, float | None]:
    """mean / median / p99 in milliseconds (p99 by linear interpolation); None for no samples."""
    if not seconds:
        return {"mean": None, "median": None, "p99": None}
    ms = sorted(s * 1e3 for s in seconds)
    rank = 0.99 * (len(ms) - 1)
    low = int(rank)
    high = min(low + 1, len(ms) - 1)
    p99 = ms[low] + (ms[high] - ms[low]) * (rank - low)
    return {"mean": statistics.fmean(ms), "median": statistics.median(ms), "p99": p99}


def _ratio(numerator: float | None, denominator: float | None) -> float | None:
    if numerator is None or not denominator:
        return None
    return numerator / denominator


def cache_hits(done: Sequence[RequestResult], ideal_tokens: int) -> dict:
    """Measured hits (usage.cache per tier, usage.prompt_tokens_details.cached_tokens in all) against the ideal."""
    prompt = sum(r.usage["prompt_tokens"] for r in done)
    cached = sum((r.usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0) for r in done)
    per_tier = {}
    for tier in TIERS:
        tokens = sum((r.usage.get("cache") or {}).get(tier, 0) for r in done)
        per_tier[tier] = {"tokens": tokens, "rate": _ratio(tokens, prompt)}
    measured, ideal = _ratio(cached, prompt), _ratio(ideal_tokens, prompt)
    return {
        "prompt_tokens": prompt, "cached_tokens": cached, "per_tier": per_tier, "measured_rate": measured,
        "ideal_tokens": ideal_tokens, "ideal_rate": ideal, "of_ideal": _ratio(measured, ideal),
    }


def throughput(done: Sequence[RequestResult], duration: float) -> dict:
    prompt = sum(len(r.prompt) for r in done)
    output = sum(len(r.output) for r in done)
    return {
        "duration_s": duration,
        "requests_per_s": _ratio(len(done), duration),
        "input_tokens_per_s": _ratio(prompt, duration),
        "output_tokens_per_s": _ratio(output, duration),
        "total_tokens_per_s": _ratio(prompt + output, duration),
    }


def latencies(done: Sequence[RequestResult]) -> dict:
    return {
        "ttft_ms": latency_stats([r.ttft for r in done if r.ttft is not None]),
        "tpot_ms": latency_stats([r.tpot for r in done if r.tpot is not None]),
        "itl_ms": latency_stats([gap for r in done for gap in r.itls()]),
        "e2e_ms": latency_stats([r.e2e for r in done if r.e2e is not None]),
    }


def _delta(before: dict | None, after: dict | None, name: str) -> float | None:
    if before is None or after is None or name not in after:
        return None
    return after[name] - before.get(name, 0.0)


def server_figures(before: dict | None, after: dict | None) -> dict:
    """Router step figures over the timed phase, from /metrics read before and after it."""
    steps = _delta(before, after, "hkv_engine_steps_total")
    step_s = _delta(before, after, "hkv_engine_step_seconds_total")
    forward_s = _delta(before, after, "hkv_engine_forward_seconds_total")
    return {
        "steps": steps,
        "step_seconds_mean": _ratio(step_s, steps),
        "forward_seconds_mean": _ratio(forward_s, steps),
        "forward_share": _ratio(forward_s, step_s),
        "prefill_tokens": _delta(before, after, "hkv_engine_prefill_tokens_total"),
        "generation_tokens": _delta(before, after, "hkv_generation_tokens_total"),
        "preemptions": _delta(before, after, "hkv_engine_preemptions_total"),
        "cache_hit_tokens": {t: _delta(before, after, f'hkv_cache_hit_tokens_total{{tier="{t}"}}')
                             for t in ("gpu", "cpu", "disk")},
    }


def speculative(before: dict | None, after: dict | None) -> dict | None:
    """hkv_spec_* counter deltas and drafted/accepted when the server exports them; None when it has none."""
    if after is None:
        return None
    counters = {name: _delta(before, after, name) for name in sorted(after) if name.startswith("hkv_spec_")}
    if not counters:
        return None
    # the acceptance histogram: verify steps of one sequence by drafts accepted (cumulative buckets -> counts)
    cumulative = sorted((float(name.split('le="')[1].rstrip('"}')), value) for name, value in counters.items()
                        if name.startswith("hkv_spec_acceptance_length_bucket") and "+Inf" not in name)
    histogram = {str(int(le)): c - (cumulative[i - 1][1] if i else 0) for i, (le, c) in enumerate(cumulative)}
    steps = counters.get("hkv_spec_acceptance_length_count")
    return {"counters": counters, "acceptance_rate": _ratio(counters.get(SPEC_ACCEPTED), counters.get(SPEC_DRAFTED)),
            "verify_steps": steps, "histogram": {k: v for k, v in histogram.items() if v},
            # tokens a verify step emits on average: the accepted drafts plus the target's own token
            "mean_accepted": _ratio(counters.get("hkv_spec_acceptance_length_sum"), steps)}


def _fmt(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _rate(value: float | None) -> str:
    return "-" if value is None else f"{value:.1%}"


def table(report: dict) -> str:
    """The human-readable summary printed on stdout."""
    tput, hits, server = report["throughput"], report["cache"], report["server"]
    rows = [
        ("workload", report["workload"]["name"]),
        ("requests (failed)", f"{report['requests']['completed']} ({report['requests']['failed']})"),
        ("prompt / output tokens", f"{hits['prompt_tokens']} / {report['requests']['output_tokens']}"),
        ("duration s", _fmt(tput["duration_s"])),
        ("requests/s", _fmt(tput["requests_per_s"], 3)),
        ("output tokens/s", _fmt(tput["output_tokens_per_s"], 1)),
        ("total tokens/s", _fmt(tput["total_tokens_per_s"], 1)),
    ]
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        stats = report["latency"][key]
        rows.append((f"{key[:-3].upper()} ms mean/median/p99",
                     " / ".join(_fmt(stats[k]) for k in ("mean", "median", "p99"))))
    tiers = " ".join(f"{t} {_rate(hits['per_tier'][t]['rate'])}" for t in TIERS)
    rows += [
        ("hit rate measured / ideal", f"{_rate(hits['measured_rate'])} / {_rate(hits['ideal_rate'])}"
                                      f" (of ideal {_fmt(hits['of_ideal'])})"),
        ("hit rate per tier", tiers),
        ("server steps", _fmt(server["steps"], 0)),
        ("step / forward ms mean", f"{_fmt(_ms(server['step_seconds_mean']), 3)} / "
                                   f"{_fmt(_ms(server['forward_seconds_mean']), 3)}"),
        ("speculative acceptance", _fmt((report["speculative"] or {}).get("acceptance_rate"), 3)),
        ("drafts accepted per verify step", _fmt((report["speculative"] or {}).get("mean_accepted"), 3)),
    ]
    baseline = report.get("baseline")
    if baseline is not None:
        rows += [("HF generate output tokens/s", _fmt(baseline["output_tokens_per_s"], 1)),
                 ("hkv / HF output tokens/s", _fmt(baseline["hkv_over_hf"], 2))]
    width = max(len(name) for name, _ in rows)
    return "\n".join(f"{name:<{width}}  {value}" for name, value in rows)


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1e3


def write_plots(done: Sequence[RequestResult], start: float, out_dir: Path) -> list[Path]:
    """ttft.png and itl.png (histograms) and throughput.png (output tokens/s over time); returns the paths."""
    import matplotlib

    matplotlib.use("Agg")  # files only; never a display
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    series = (("ttft.png", "TTFT (ms)", [r.ttft * 1e3 for r in done if r.ttft is not None]),
              ("itl.png", "inter-token latency (ms)", [g * 1e3 for r in done for g in r.itls()]))
    paths = []
    for name, label, values in series:
        fig, ax = plt.subplots(figsize=(6, 4))
        ax.hist(values, bins=50)
        ax.set_xlabel(label)
        ax.set_ylabel("count")
        fig.tight_layout()
        fig.savefig(out_dir / name)
        plt.close(fig)
        paths.append(out_dir / name)
    paths.append(_throughput_plot(plt, done, start, out_dir / "throughput.png"))
    return paths


def _throughput_plot(plt, done: Sequence[RequestResult], start: float, path: Path) -> Path:
    events = [(at - start, count) for r in done for at, count in r.events]
    end = max((at for at, _ in events), default=1.0)
    # about 20 token events per bin at least, so a short run does not plot step-by-step noise
    bins = max(1, min(50, len(events) // 20))
    width = end / bins or 1.0
    counts = [0] * bins
    for at, count in events:
        counts[min(int(at / width), bins - 1)] += count
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot([(i + 0.5) * width for i in range(bins)], [c / width for c in counts], marker="o")
    ax.set_xlabel("seconds since the first request")
    ax.set_ylabel("output tokens/s")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path
