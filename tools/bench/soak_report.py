"""The soak's verdict and plot: does each curve plateau?

A curve plateaus when the mean of its last third exceeds the mean of its
middle third by at most 1% or a floor, whichever is larger (1 MiB of RSS or
disk, two descriptors, a tenth of a pool, whose use follows the traffic). The
first third is warm-up: caches fill, the allocator grows its arenas. Means,
not peaks, so a steady slope shows and a single spike does not. A leak of
pool entries shows at the end: once the traffic stops, nothing is in use.
"""

from __future__ import annotations

from pathlib import Path

GROWTH = 0.01
FLOORS = {"rss_mib": 1.0, "fds": 2.0, "disk_mib": 1.0, "radix": 16.0}
POOL_FLOOR = 0.1  # of the pool's size


def plateaus(values: list[float], floor: float) -> tuple[bool, float, float]:
    """(plateaus, middle third's mean, last third's mean)."""
    third = max(1, len(values) // 3)
    middle, last = values[third: 2 * third] or values, values[2 * third:] or values
    mid, end = sum(middle) / len(middle), sum(last) / len(last)
    return end - mid <= max(GROWTH * abs(mid), floor), mid, end


def series(samples: list[dict]) -> dict[str, list[float]]:
    keys = [k for k in samples[0] if k not in ("t", "done", "failed") and not k.endswith(".total")]
    return {k: [float(s.get(k, 0.0)) for s in samples] for k in keys}


def report(result: dict, png: Path) -> dict:
    """Judge every curve, draw them; returns {"ok", "text", "rows"}."""
    samples = result["samples"]
    rows = []
    for key, values in series(samples).items():
        kind = key.split(".")[0]
        floor = POOL_FLOOR * samples[-1][key.rsplit(".", 1)[0] + ".total"] if kind == "pool" else FLOORS[kind]
        ok, mid, last = plateaus(values, floor)
        rows.append({"series": key, "start": values[0], "middle_mean": mid, "last_mean": last, "plateaus": ok})
    idle = {k: v for k, v in samples[-1].items() if k.startswith("pool.") and k.endswith(".in_use")}
    traffic_ok = result["failed_count"] == 0 and result["exit_code"] == 0 and not any(idle.values())
    ok = traffic_ok and all(r["plateaus"] for r in rows)
    lines = [f"soak of {result['model']}, {result['minutes']:g} min, {result['concurrency']} clients: "
             f"{result['done']} requests done, {result['cancelled']} cancelled, {result['disconnected']} "
             f"disconnected, {result['failed_count']} failed; hkv-launch exited {result['exit_code']}",
             "| series | start | middle third mean | last third mean | plateaus |", "|---|---|---|---|---|"]
    lines += [f"| {r['series']} | {r['start']:.1f} | {r['middle_mean']:.1f} | {r['last_mean']:.1f} | "
              f"{'yes' if r['plateaus'] else 'NO'} |" for r in rows]
    lines.append("in use once the traffic stopped: " + ", ".join(f"{k[5:-7]} {v:g}" for k, v in idle.items()))
    lines.append(f"verdict: {'every curve plateaus' if ok else 'something grows, leaks or failed'}")
    _plot(samples, png)
    return {"ok": ok, "text": "\n".join(lines), "rows": rows}


def _plot(samples: list[dict], png: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # the `bench` extra is not installed: numbers only
        return
    minutes = [s["t"] / 60 for s in samples]
    curves = series(samples)
    panels = (("RSS (MiB)", ("rss_mib.",)), ("open file descriptors", ("fds.",)),
              ("pool entries, radix nodes", ("pool.", "radix.")), ("disk tier (MiB)", ("disk_mib",)))
    fig, axes = plt.subplots(2, 2, figsize=(10, 6.5), dpi=80)
    for ax, (title, prefixes) in zip(axes.flat, panels):
        for key, values in curves.items():
            if key.startswith(prefixes):
                ax.plot(minutes, values, label=key.split(".", 1)[-1] if "." in key else key)
        ax.set_title(title)
        ax.set_xlabel("minutes")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(png)
    plt.close(fig)
