"""Soak: shared-prefix traffic with cancellations and disconnects for ten minutes; does anything keep growing?

    python -m tools.bench.soak [--minutes 10] [--model tiny-hybrid] [--concurrency 6] [--out soak-out]

Starts `hkv-launch` with a CPU and a disk tier and drives it with
generated-shared-prefix requests from a finite pool (GROUPS system prompts x
QUESTIONS questions, greedy), so every cache level can fill and must then
stop growing. Of the requests, 5% are streamed and cancelled after their
first event and 5% are disconnected mid-request (the socket dropped with a
reset). Every --sample-s seconds it records each actor's RSS and open file
descriptors, the device pools and the CPU tier (read from shared memory, as
hkv-inspect does) and the disk tier's bytes. It writes samples.json, a PNG
of the curves (matplotlib, the `bench` extra) and prints a verdict per curve
(tools/bench/soak_report.py). The radix tree's node count is recorded too.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

from tools.bench.bench_step_overhead import free_port, start_server
from tools.inspect import inspect_instance
from tools.bench.soak_report import report

GROUPS, QUESTIONS = 8, 24
IDLE_WAIT_S = 3.0
WORDS = "cache page token prefix radix state checkpoint tier disk shared memory router rank batch".split()


@dataclass
class Outcomes:
    done: int = 0
    cancelled: int = 0
    disconnected: int = 0
    failed: list[str] = field(default_factory=list)  # status or exception of requests that should have worked


def _text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


def prompt_pool(seed: int) -> list[list[str]]:
    """GROUPS x QUESTIONS prompts: each group shares a ~250-word system prefix."""
    rng = random.Random(seed)
    systems = [f"System {g}: " + _text(rng, 250) for g in range(GROUPS)]
    return [[f"{s}\nQuestion {q}: {_text(rng, 20)}?" for q in range(QUESTIONS)] for s in systems]


def start(model: str, port: int, name: str, disk_dir: str) -> subprocess.Popen:
    return start_server(model, port, name, ["--device", "cpu", "--max-total-tokens", "8192", "--cpu-cache-gb", "0.05",
                                            "--disk-cache-dir", disk_dir, "--disk-cache-gb", "0.2"])


async def _normal(http: aiohttp.ClientSession, url: str, body: dict, stream: bool, out: Outcomes) -> None:
    async with http.post(f"{url}/v1/completions", json={**body, "stream": stream}) as resp:
        data = await resp.read()
        if resp.status != 200 or (stream and not data.rstrip().endswith(b"data: [DONE]")):
            out.failed.append(f"{resp.status} {data[-200:]!r}")
            return
    out.done += 1


async def _cancel(http: aiohttp.ClientSession, url: str, body: dict, out: Outcomes) -> None:
    """Stream, then hang up after the first event."""
    async with http.post(f"{url}/v1/completions", json={**body, "stream": True}) as resp:
        await resp.content.readline()
        resp.close()
    out.cancelled += 1


async def _disconnect(port: int, body: dict, rng: random.Random, out: Outcomes) -> None:
    """Send a non-streamed request on a raw socket and drop it with a reset before the answer."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    payload = json.dumps(body).encode()
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 + f"Content-Length: {len(payload)}\r\n\r\n".encode() + payload)
    await writer.drain()
    await asyncio.sleep(rng.uniform(0.01, 0.3))
    writer.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.close()
    out.disconnected += 1


async def client(url: str, port: int, pool: list[list[str]], seed: int, until: float, out: Outcomes) -> None:
    rng = random.Random(seed)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as http:
        while time.monotonic() < until:
            body = {"prompt": rng.choice(rng.choice(pool)), "max_tokens": 24, "temperature": 0}
            roll = rng.random()
            try:
                if roll < 0.05:
                    await _cancel(http, url, body, out)
                elif roll < 0.10:
                    await _disconnect(port, body, rng, out)
                else:
                    await _normal(http, url, body, roll < 0.55, out)
            except (aiohttp.ClientError, OSError, asyncio.TimeoutError) as exc:
                out.failed.append(repr(exc))


def _descendants(pid: int) -> dict[str, int]:
    """Actor name -> pid under the launcher (the api's tokenizer process included)."""
    hkv: dict[int, tuple[int, str]] = {}  # pid -> (parent pid, module)
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rpartition(")")[2].split()[1])
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                args = f.read().split(b"\0")
        except (OSError, ValueError, IndexError):
            continue
        module = next((a.decode() for a in args if a.startswith((b"hkv.actors.", b"hkv.openai.tokenize"))), None)
        if module is not None:
            hkv[int(entry)] = (ppid, module.rsplit(".", 1)[-1])
    found: dict[str, int] = {}
    parents = {pid}
    for child, (ppid, name) in sorted(hkv.items(), key=lambda item: item[1][0] != pid):
        if ppid in parents:
            found[name] = child
            parents.add(child)
    return found


def _proc_figures(pid: int) -> tuple[float, int]:
    with open(f"/proc/{pid}/status") as f:
        rss = next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024
    return rss, len(os.listdir(f"/proc/{pid}/fd"))


def sample(launcher: int, name: str, disk_dir: str, started: float, out: Outcomes) -> dict:
    row: dict = {"t": time.monotonic() - started, "done": out.done, "failed": len(out.failed)}
    for actor, pid in {"launcher": launcher, **_descendants(launcher)}.items():
        try:
            row[f"rss_mib.{actor}"], row[f"fds.{actor}"] = _proc_figures(pid)
        except (OSError, StopIteration):
            continue
    shown = inspect_instance(name)
    pools = shown["pools"]
    row["radix.nodes"] = shown["radix"]["nodes"]
    for pool in ("gpu_pages", "state_slots", "cpu_pages"):
        for figure in ("in_use", "cached", "total"):
            row[f"pool.{pool}.{figure}"] = pools[pool][figure]
    row["disk_mib"] = sum(p.stat().st_size for p in Path(disk_dir).rglob("*") if p.is_file()) / 2**20
    return row


async def soak(args: argparse.Namespace, url: str, port: int, launcher: int, name: str, disk_dir: str) -> dict:
    started = time.monotonic()
    until = started + args.minutes * 60
    out = Outcomes()
    pool = prompt_pool(args.seed)
    clients = [asyncio.create_task(client(url, port, pool, args.seed + i, until, out))
               for i in range(args.concurrency)]
    samples = []
    while time.monotonic() < until:
        samples.append(sample(launcher, name, disk_dir, started, out))
        print(json.dumps({k: round(v, 1) if isinstance(v, float) else v for k, v in samples[-1].items()}),
              file=sys.stderr)
        await asyncio.sleep(max(0.0, min(args.sample_s, until - time.monotonic())))
    await asyncio.gather(*clients)
    await asyncio.sleep(IDLE_WAIT_S)  # the server aborts what the last disconnects left running
    samples.append(sample(launcher, name, disk_dir, started, out))
    return {"samples": samples, "done": out.done, "cancelled": out.cancelled, "disconnected": out.disconnected,
            "failed": out.failed[:20], "failed_count": len(out.failed), "minutes": args.minutes,
            "model": args.model, "concurrency": args.concurrency}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--minutes", type=float, default=10.0, help="how long to drive traffic (default: 10)")
    p.add_argument("--model", default="tiny-hybrid", help="model to serve (default: tiny-hybrid)")
    p.add_argument("--concurrency", type=int, default=6, help="clients at once (default: 6)")
    p.add_argument("--sample-s", type=float, default=10.0, help="seconds between samples (default: 10)")
    p.add_argument("--seed", type=int, default=16, help="seed of the prompt pool and the clients (default: 16)")
    p.add_argument("--out", default="soak-out", help="folder for samples.json and soak.png (default: soak-out)")
    args = p.parse_args(argv)
    port, name = free_port(), f"soak{os.getpid()}"
    with tempfile.TemporaryDirectory(prefix="hkv-soak-disk-") as disk_dir:
        proc = start(args.model, port, name, disk_dir)
        try:
            result = asyncio.run(soak(args, f"http://127.0.0.1:{port}", port, proc.pid, name, disk_dir))
        finally:
            proc.send_signal(signal.SIGTERM)
            result_code = proc.wait(120)
    result["exit_code"] = result_code
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "samples.json").write_text(json.dumps(result, indent=1))
    verdict = report(result, out / "soak.png")
    print(verdict["text"])
    raise SystemExit(0 if verdict["ok"] else 1)


if __name__ == "__main__":
    main()
