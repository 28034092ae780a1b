"""Per-step overhead outside the model forward during a steady single-request decode.

Starts `hkv-launch` (real processes), streams one greedy request, and reads
the router's stats region before and after the decode window:

    overhead per step = (router step wall time - rank forward time) / steps

where the router's step wall time spans scheduling, the plan's trip to the
rank, batch building, the forward, sampling, the result's trip back and
publishing tokens to the api. The client-side time per token is printed too.

--free-forward makes the ranks' model forward free (tools/bench/free_forward/): every
step is then host work only, the path a GPU decode step at concurrency 1 is bound by.

    python -m tools.bench.bench_step_overhead [--model tiny-dense] [--tokens 512] [--free-forward] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

from hkv.ipc import stats
from hkv.ipc.shm import ShmRegion


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


FREE_FORWARD_DIR = Path(__file__).with_name("free_forward")  # its sitecustomize frees the ranks' forward


def start_server(model: str, port: int, name: str, extra: list[str], free_forward: bool = False) -> subprocess.Popen:
    """Start hkv-launch and wait for its ready line (also used by tools.bench.soak); free_forward: the
    ranks' forward costs nothing (FREE_FORWARD_DIR first on the actors' PYTHONPATH)."""
    launch = str(Path(sys.executable).with_name("hkv-launch"))
    env = None
    if free_forward:
        paths = [str(FREE_FORWARD_DIR), *filter(None, [os.environ.get("PYTHONPATH")])]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}
    proc = subprocess.Popen(
        [launch, "--model", model, "--port", str(port), "--name", name, *extra],
        stdout=subprocess.PIPE, text=True, env=env,
    )
    ready = threading.Event()

    def pump():
        for line in proc.stdout:
            if "serving" in line:
                print(line.strip(), file=sys.stderr)
                ready.set()
        ready.set()

    threading.Thread(target=pump, daemon=True).start()
    if not ready.wait(300) or proc.poll() is not None:
        proc.kill()
        raise SystemExit("hkv-launch did not start")
    return proc


def _stream(url: str, tokens: int, on_first, stream: bool = True) -> list[float]:
    """Run one greedy request; returns the arrival time of every chunk (one when not streaming)."""
    body = {"prompt": "Benchmark the decode loop.", "max_tokens": tokens, "temperature": 0,
            "ignore_eos": True, "stream": stream}
    req = urllib.request.Request(f"{url}/v1/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    arrivals = []
    with urllib.request.urlopen(req, timeout=600) as resp:
        if not stream:
            on_first()
            resp.read()
            return [time.perf_counter()]
        for raw in resp:
            if raw.startswith(b"data: {"):
                arrivals.append(time.perf_counter())
                if len(arrivals) == 1:
                    on_first()
    return arrivals


def measure(model: str, tokens: int, extra: list[str], stream: bool = True, free_forward: bool = False) -> dict:
    port, name = free_port(), f"bench{os.getpid()}"
    proc = start_server(model, port, name, extra, free_forward)
    url = f"http://127.0.0.1:{port}"
    try:
        region = ShmRegion.attach(name, stats.REGION, readonly=True)
        router_stats = stats.RouterStats(region.payload)
        _stream(url, 16, lambda: None)  # warm-up
        marks = {}
        if not stream:
            marks["first"] = router_stats.read()
        arrivals = _stream(url, tokens, lambda: marks.setdefault("first", router_stats.read()), stream)
        after = router_stats.read()
        before = marks["first"]
        router_stats.release_views()
        region.close()
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
    steps = after["steps"] - before["steps"]
    wall = (after["step_wall_s"] - before["step_wall_s"]) / steps
    forward = (after["forward_s"] - before["forward_s"]) / steps
    client = (arrivals[-1] - arrivals[0]) / (len(arrivals) - 1) if len(arrivals) > 1 else None
    return {
        "model": model,
        "streamed": stream,
        "free_forward": free_forward,
        "decode_steps": int(steps),
        "step_wall_ms": wall * 1e3,
        "forward_ms": forward * 1e3,
        "overhead_ms": (wall - forward) * 1e3,
        "forward_share": forward / wall,
        "client_ms_per_token": None if client is None else client * 1e3,
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny-dense")
    p.add_argument("--tokens", type=int, default=512)
    p.add_argument("--device", default="cpu")
    p.add_argument("--json", default=None, help="also write the result here")
    p.add_argument("--no-stream", action="store_true", help="one non-streamed response (less api work per token)")
    p.add_argument("--free-forward", action="store_true",
                   help="the ranks' model forward costs nothing: a step is host work only (tools/bench/free_forward/)")
    args = p.parse_args(argv)
    result = measure(args.model, args.tokens, ["--device", args.device], stream=not args.no_stream,
                     free_forward=args.free_forward)
    print(json.dumps(result, indent=2))
    print(
        ("free forward, " if result["free_forward"] else "") + f"{result['model']}: {result['decode_steps']} decode steps, {result['step_wall_ms']:.3f} ms/step, "
        f"forward {result['forward_ms']:.3f} ms ({result['forward_share']:.0%}), "
        f"overhead outside the forward {result['overhead_ms']:.3f} ms/step"
        + ("" if result["client_ms_per_token"] is None else
           f", client sees {result['client_ms_per_token']:.3f} ms/token")
    )
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
