"""Prefill/decode on one GPU: the transfer's bandwidth against a device copy, and TTFT against one instance.

    python -m tools.bench.bench_pd --model /tmp/bench_model [--prompt-tokens 32768] [--rounds 2] [--json out.json]

Starts, with real hkv-launch processes on one GPU, a prefill, a decode and a
pd-master instance, plus a normal instance; sends the same random prompts
(`--prompt-tokens`, 8 tokens out, greedy) through the master and to the
normal instance, one at a time (each prompt new to every instance), and
reports:

- transfer: the decode rank's `peer copy` log lines (pages plus the
  checkpoint, CUDA-event timed) against `dst.copy_(src)` of the same number
  of bytes between two buffers on the same GPU, timed here in this process;
- TTFT through the master (prefill + transfer + the decode side's first
  token) against the normal instance's, and whether the outputs agree.

The copy baseline is measured twice: back to back (the GPU busy, the ceiling)
and after the GPU idled 50 ms before each copy, as it does before an idle
decode instance's transfer (a waking GPU and the launch run inside the timed
window). `--loaded-rounds` then sends more prompts while `--background`
streams keep the decode instance decoding, as a decode instance in service
is: its copy is queued behind the step before it, like the back-to-back copy.
The streams ask `--background-tokens` each, enough that none ends (and its
next prompt's prefill shares the GPU) during those rounds; the JSON counts
any that did (`background_restarts`).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import torch

from hkv.argtypes import positive_int

MEM = "0.25"  # --gpu-memory-fraction of each of the three model instances
# the decode rank's line per peer copy (hkv/engine/model_runner.py): pages, MiB, ms, how it went
COPY_LINE = re.compile(r"peer copy: (\d+) pages and their state, ([\d.]+) MiB in ([\d.]+) ms \([^;]*; pages "
                       r"[\d.]+ ms, ([^)]*)\)")


def _start(name: str, port: int, args: list[str], log_dir: Path) -> tuple[subprocess.Popen, Path]:
    log = log_dir / f"{name}.err"
    proc = subprocess.Popen([sys.executable, "-c", "from hkv.launcher import main; main()", "--port", str(port),
                             "--name", name, *args], stdout=subprocess.DEVNULL, stderr=open(log, "w"))
    return proc, log


def _wait_ready(port: int, proc: subprocess.Popen, log: Path, timeout: float = 900) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"instance on {port} exited:\n{log.read_text()[-3000:]}")
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/ready", timeout=2)
            return
        except OSError:
            time.sleep(0.5)
    raise SystemExit(f"instance on {port} not ready after {timeout:.0f} s")


def _complete(port: int, prompt: list[int]) -> tuple[float, dict]:
    body = json.dumps({"prompt": prompt, "max_tokens": 8, "temperature": 0, "return_token_ids": True,
                       "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    sent, first, tokens, usage = time.perf_counter(), None, [], None
    with urllib.request.urlopen(req, timeout=600) as resp:
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                raise SystemExit(f"request failed: {event}")
            for choice in event.get("choices", []):
                if choice.get("token_ids"):
                    first = first or time.perf_counter()
                    tokens += choice["token_ids"]
            usage = event.get("usage") or usage
    return first - sent, {"token_ids": tokens, "usage": usage}


def _copy_gbps(nbytes: int, reps: int = 20, idle_s: float = 0.0) -> float:
    """dst.copy_(src) of `nbytes` on this GPU (median of `reps`), each after `idle_s` of an idle GPU."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    dst.copy_(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(reps):
        if idle_s:
            torch.cuda.synchronize()
            time.sleep(idle_s)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    ms = sorted(times)[len(times) // 2]
    return nbytes / ms / 1e6


def _background(port: int, stop: threading.Event, vocab: int, seed: int, tokens: int, done: list) -> None:
    """Keep one decode stream running through the master until `stop` (short prompts, long outputs)."""
    rng = random.Random(seed)
    while not stop.is_set():
        body = json.dumps({"prompt": [rng.randrange(3, vocab) for _ in range(64)], "max_tokens": tokens,
                           "temperature": 0, "ignore_eos": True, "stream": True}).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=600) as resp:
                for _ in resp:
                    if stop.is_set():
                        break  # closing the stream aborts the request on both instances
            done.append(1)
        except OSError as exc:
            done.append(f"{type(exc).__name__}: {exc}")
            return


def run(args) -> dict:
    log_dir = Path(tempfile.mkdtemp(prefix="bench_pd_"))
    secret = log_dir / "pd.secret"
    secret.write_bytes(os.urandom(32).hex().encode())
    secret.chmod(0o600)
    common = ["--model", args.model, "--device", "cuda", "--gpu-memory-fraction", MEM, "--max-running-requests", "8",
              "--log-request-times"]
    pd_flags = ["--secret-file", str(secret), "--cpu-cache-gb", str(args.cpu_cache_gb)]
    procs = {
        "prefill": _start("bpd_p", 8201, [*common, *pd_flags, "--mode", "prefill"], log_dir),
        "decode": _start("bpd_d", 8202, [*common, *pd_flags, "--mode", "decode"], log_dir),
        "single": _start("bpd_n", 8203, common, log_dir),
    }
    try:
        for name, port in (("prefill", 8201), ("decode", 8202), ("single", 8203)):
            _wait_ready(port, *procs[name])
        procs["master"] = _start("bpd_m", 8200, ["--mode", "pd-master", "--secret-file", str(secret),
                                                 "--prefill-url", "http://127.0.0.1:8201",
                                                 "--decode-url", "http://127.0.0.1:8202"], log_dir)
        _wait_ready(8200, *procs["master"])
        rng = random.Random(args.seed)
        rounds = []
        for r in range(args.rounds + 1):  # the first round warms both paths up (not reported)
            prompt = [rng.randrange(3, args.vocab) for _ in range(args.prompt_tokens)]
            ttft_pd, pd_out = _complete(8200, prompt)
            ttft_one, one_out = _complete(8203, prompt)
            rounds.append({"ttft_pd_s": ttft_pd, "ttft_single_s": ttft_one, "usage_pd": pd_out["usage"],
                           "same_output": pd_out["token_ids"] == one_out["token_ids"]})
            print(f"round {r}: TTFT through the master {ttft_pd * 1e3:.1f} ms, one instance {ttft_one * 1e3:.1f} "
                  f"ms; peer tokens {(pd_out['usage'] or {}).get('cache', {}).get('peer')}; same output "
                  f"{rounds[-1]['same_output']}", flush=True)
        loaded, ended = [], 0
        if args.loaded_rounds:
            stop, done = threading.Event(), []
            streams = [threading.Thread(target=_background, daemon=True,
                                        args=(8200, stop, args.vocab, 1000 + i, args.background_tokens, done))
                       for i in range(args.background)]
            for t in streams:
                t.start()
            time.sleep(3.0)  # every stream past its prefill and transfer, decoding
            settled = done.count(1)
            for r in range(args.loaded_rounds):
                prompt = [rng.randrange(3, args.vocab) for _ in range(args.prompt_tokens)]
                ttft, _ = _complete(8200, prompt)
                loaded.append({"ttft_pd_s": ttft})
                print(f"loaded round {r}: TTFT through the master {ttft * 1e3:.1f} ms beside {args.background} "
                      f"decoding streams", flush=True)
            ended = done.count(1) - settled  # streams that ended (and started again) inside the loaded rounds
            stop.set()
            for t in streams:
                t.join(60)
            errors = [d for d in done if d != 1]
            if errors:
                raise SystemExit(f"a background stream failed: {errors[0]}")
        time.sleep(1.0)
        logs = {name: procs[name][1].read_text() for name in ("prefill", "decode", "single")}
        found = COPY_LINE.findall(logs["decode"])
        copies, how = [(int(p), float(mib), float(ms)) for p, mib, ms, _ in found], [h for *_, h in found]
        # where each long prompt's time went on each instance (--log-request-times), in the order sent
        long_prompt = re.compile(rf"INFO request \d+: ({args.prompt_tokens}|{args.prompt_tokens - 1}) prompt")
        timelines = {name: [line.split("INFO ", 1)[1] for line in text.splitlines() if long_prompt.search(line)]
                     for name, text in logs.items()}
    finally:
        for proc, _ in procs.values():
            proc.send_signal(signal.SIGTERM)
        for proc, _ in procs.values():
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
    # the prompts' copies (the background streams' are a few pages), in the order sent
    largest = max((c[0] for c in copies), default=0)
    big = [c for c in copies if largest and c[0] >= largest // 2]
    if len(big) < 1 + args.rounds + len(loaded):
        raise SystemExit(f"the decode instance logged {len(big)} prompt copies, not {1 + args.rounds + len(loaded)} "
                         "(the device path was not taken)")
    idle_copies, loaded_copies = big[1:1 + args.rounds], big[1 + args.rounds:]  # the first maps the peer's pools
    pages, mib, _ = big[-1]
    nbytes = int(mib * 2**20)
    copy_gbps, idle_copy_gbps = _copy_gbps(nbytes), _copy_gbps(nbytes, reps=9, idle_s=0.05)

    def median_ms(cs):
        return sorted(c[2] for c in cs)[len(cs) // 2]

    doc = {"prompt_tokens": args.prompt_tokens, "pages": pages, "bytes": nbytes, "device_copy_gbps": copy_gbps,
           "device_copy_after_idle_gbps": idle_copy_gbps, "copies": copies, "copied_as": how,
           "timelines": timelines, "rounds": rounds[1:],
           "loaded_rounds": loaded, "background_streams": args.background if loaded else 0,
           "background_restarts": ended}
    for tag, cs, base in (("idle", idle_copies, idle_copy_gbps), ("loaded", loaded_copies, copy_gbps)):
        if not cs:
            continue
        ms = median_ms(cs)
        doc[f"{tag}_peer_copy_ms"], doc[f"{tag}_peer_copy_gbps"] = ms, nbytes / ms / 1e6
        doc[f"{tag}_ratio"] = doc[f"{tag}_peer_copy_gbps"] / base
        doc[f"{tag}_ratio_to_back_to_back"] = doc[f"{tag}_peer_copy_gbps"] / copy_gbps
    print(f"dst.copy_(src) of the same {mib:.1f} MiB: {copy_gbps:.1f} GB/s back to back, {idle_copy_gbps:.1f} GB/s "
          "after 50 ms of an idle GPU")
    print(f"transfer of {args.prompt_tokens} tokens ({pages} pages + checkpoint), idle decode instance: "
          f"{doc['idle_peer_copy_ms']:.3f} ms = {doc['idle_peer_copy_gbps']:.1f} GB/s; ratio to the copy after idle "
          f"{doc['idle_ratio']:.2f}, to the back-to-back copy {doc['idle_ratio_to_back_to_back']:.2f}")
    if loaded_copies:
        print(f"transfer beside {args.background} decoding streams: {doc['loaded_peer_copy_ms']:.3f} ms = "
              f"{doc['loaded_peer_copy_gbps']:.1f} GB/s; ratio to the back-to-back copy {doc['loaded_ratio']:.2f} "
              f"({ended} background streams ended and started again during those rounds)")
    for key in ("ttft_pd_s", "ttft_single_s"):
        doc[f"mean_{key}"] = sum(r[key] for r in rounds[1:]) / max(1, len(rounds) - 1)
    print(f"mean TTFT: through the master {doc['mean_ttft_pd_s'] * 1e3:.1f} ms, one instance "
          f"{doc['mean_ttft_single_s'] * 1e3:.1f} ms")
    for name, lines in timelines.items():  # the last idle round's, on each instance
        if len(lines) > args.rounds:
            print(f"{name}: {lines[args.rounds]}")
    return doc


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="model folder (the benchmark model)")
    p.add_argument("--prompt-tokens", type=int, default=32768, help="tokens per prompt (default: 32768)")
    p.add_argument("--rounds", type=positive_int, default=2, help="measured prompts after one warm-up (default: 2)")
    p.add_argument("--loaded-rounds", type=int, default=2,
                   help="prompts sent while --background streams decode (default: 2; 0: none)")
    p.add_argument("--background", type=int, default=6,
                   help="decoding streams through the master during the loaded rounds (default: 6; the instances run at most 8 requests)")
    p.add_argument("--background-tokens", type=positive_int, default=4096,
                   help="tokens each background stream asks for (default: 4096: long enough that no stream ends, "
                        "and its next prompt's prefill shares the GPU, during the loaded rounds)")
    p.add_argument("--vocab", type=int, default=151936, help="prompt ids are drawn from [3, vocab) (default: 151936)")
    p.add_argument("--cpu-cache-gb", type=float, default=2.0, help="CPU tier of the PD pair (default: 2)")
    p.add_argument("--seed", type=int, default=0, help="prompt seed (default: 0)")
    p.add_argument("--json", default=None, help="write the results here (default: none)")
    return p.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    doc = run(args)
    if args.json:
        Path(args.json).write_text(json.dumps(doc, indent=1))


if __name__ == "__main__":
    main()
