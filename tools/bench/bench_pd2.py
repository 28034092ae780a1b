"""Prefill/decode across two GPUs (issue 17): output, transfer bandwidth against NCCL, TTFT and decode speed.

    python -m tools.bench.bench_pd2 --model /tmp/bench_model [--lengths 1024,8192,32768] [--rounds 3] [--json out.json]
    python -m tools.bench.bench_pd2 --model tiny-hybrid-random --device cpu --lengths 200,600 --concurrency 4  (smoke)

With real hkv-launch processes: a prefill instance on GPU 0 and a decode
instance on GPU 1 (each process sees its one GPU: CUDA_VISIBLE_DEVICES), a
pd master in front, and a normal instance on GPU 1 for the comparison. The
decode instance's pools are on another GPU than the prefill's, so prompts
move over the pair group (NCCL; hkv/engine/pd_pairing.py). Reports:

- output: greedy token ids through the master against the normal
  instance's, one prompt of each `--lengths`;
- transfer: the prefill rank's `pair transfer` log lines of the longest
  prompt (`--rounds` of them after a warm-up; CUDA-event timed on the send
  stream, the receive already posted) against `torch.distributed` NCCL
  send/recv of the same bytes between the same two GPUs, as one message and
  as the path's 256 MiB messages, in two processes started here after the
  instances stopped (the same run, the GPUs idle);
- serving: `hkv-bench --workload random` at `--concurrency` through the
  master and against the normal instance: TTFT, TPOT and output tokens/s.

`--device cpu` runs the same over gloo (`--pd-transfer pair`, the baseline
gloo send/recv): a smoke run of this script on a machine without GPUs.
Never unsets NCCL_NVLS_ENABLE or its siblings (the device tool's KINDS.md).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tools.bench.bench_pd import _complete, _wait_ready

# the prefill rank's line per pair transfer (hkv/engine/pair_transfers.py)
SEND_LINE = re.compile(r"pair transfer (\d+) to (\S+): ([\d.]+) MiB in ([\d.]+) ms")
MESSAGE_BYTES = 256 << 20  # hkv/storage/pair_group.py's largest message
PORTS = {"master": 8300, "prefill": 8301, "decode": 8302, "single": 8303}


def _start(name: str, args: list[str], log_dir: Path, gpu: str | None) -> tuple[subprocess.Popen, Path]:
    env = dict(os.environ)
    if gpu is not None:
        env["CUDA_VISIBLE_DEVICES"] = gpu
    log = log_dir / f"{name}.err"
    proc = subprocess.Popen([sys.executable, "-c", "from hkv.launcher import main; main()", "--port",
                             str(PORTS[name]), "--name", f"bpd2_{name}", *args], stdout=subprocess.DEVNULL,
                            stderr=open(log, "w"), env=env)
    return proc, log


def _stop(procs: dict) -> None:
    for proc, _ in procs.values():
        proc.send_signal(signal.SIGTERM)
    for proc, _ in procs.values():
        try:
            proc.wait(90)
        except subprocess.TimeoutExpired:
            proc.kill()


def _serve_bench(name: str, args, log_dir: Path) -> dict:
    """hkv-bench's random workload at --concurrency against one of the instances (the master included)."""
    out = log_dir / f"serve_{name}.json"
    cmd = [sys.executable, "-m", "tools.hkv_bench", "--url", f"http://127.0.0.1:{PORTS[name]}", "--workload",
           "random", "--input-len", str(args.serve_input), "--output-len", str(args.serve_output), "--num-prompts",
           str(2 * args.concurrency), "--concurrency", str(args.concurrency), "--no-flush", "--no-progress",
           "--vocab", str(args.vocab), "--seed", "7", "--json", str(out)]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, timeout=1800)
    report = json.loads(out.read_text())
    if report["requests"]["failed"]:
        raise SystemExit(f"hkv-bench against {name}: {report['requests']['failed']} requests failed, first: "
                         f"{report['requests']['first_error']}")
    keep = {"ttft_ms": report["latency"]["ttft_ms"], "tpot_ms": report["latency"]["tpot_ms"],
            "output_tokens_per_s": report["throughput"]["output_tokens_per_s"]}
    print(f"{name}: c={args.concurrency} mean TTFT {keep['ttft_ms']['mean']:.1f} ms, mean TPOT "
          f"{keep['tpot_ms']['mean']:.2f} ms, {keep['output_tokens_per_s']:.0f} output tokens/s", flush=True)
    return keep


def _baseline(nbytes: int, device: str, reps: int) -> dict:
    """send/recv of `nbytes` between two processes (NCCL between GPU 0 and GPU 1, or gloo): GB/s, median."""
    port = 29600 + random.randrange(300)
    procs = []
    for rank in (0, 1):
        env = dict(os.environ)
        if device == "cuda":
            env["CUDA_VISIBLE_DEVICES"] = str(rank)
        procs.append(subprocess.Popen([sys.executable, "-m", "tools.bench.bench_pd2", "--baseline-worker", str(rank),
                                       "--baseline-port", str(port), "--baseline-bytes", str(nbytes),
                                       "--baseline-reps", str(reps), "--device", device],
                                      stdout=subprocess.PIPE, text=True, env=env))
    outs = [p.communicate(timeout=600)[0] for p in procs]
    if any(p.returncode for p in procs):
        raise SystemExit(f"the send/recv baseline failed: {outs}")
    return json.loads(outs[0].strip().splitlines()[-1])


def _baseline_worker(args) -> None:
    """One side of the baseline: rank 0 sends, rank 1 receives; rank 0 prints the figures as one JSON line."""
    import torch
    import torch.distributed as dist

    rank, nbytes, cuda = args.baseline_worker, args.baseline_bytes, args.device == "cuda"
    store = dist.TCPStore("127.0.0.1", args.baseline_port, 2, rank == 0, datetime.timedelta(seconds=120))
    group = (dist.ProcessGroupNCCL(store, rank, 2) if cuda else dist.ProcessGroupGloo(store, rank, 2))
    dev = "cuda" if cuda else "cpu"
    figures = {}
    for label, size in (("one_message", nbytes), ("messages_of_256MiB", min(nbytes, MESSAGE_BYTES))):
        buf = torch.empty(size, dtype=torch.uint8, device=dev)
        times = []
        for rep in range(args.baseline_reps + 1):  # the first forms the communicator
            group.barrier().wait()
            if cuda:
                torch.cuda.synchronize()
            start = time.perf_counter()
            for offset in range(0, nbytes, size):
                part = buf[: min(size, nbytes - offset)]
                (group.send if rank == 0 else group.recv)([part], 1 - rank, 0).wait()
            if cuda:
                torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
        t = sorted(times[1:])[len(times[1:]) // 2]
        figures[label] = nbytes / t / 1e9
    if rank == 0:
        print(json.dumps(figures), flush=True)


def run(args) -> dict:
    cuda = args.device == "cuda"
    log_dir = Path(tempfile.mkdtemp(prefix="bench_pd2_"))
    secret = log_dir / "pd.secret"
    secret.write_bytes(os.urandom(32).hex().encode())
    secret.chmod(0o600)
    common = ["--model", args.model, "--device", args.device, "--max-running-requests", str(args.concurrency)]
    if cuda:
        common += ["--gpu-memory-fraction", "0.4"]  # the decode and the normal instance share GPU 1
    pd = ["--secret-file", str(secret), "--cpu-cache-gb", str(args.cpu_cache_gb), "--pd-transfer", "pair"]
    procs = {"prefill": _start("prefill", [*common, *pd, "--mode", "prefill"], log_dir, "0" if cuda else None),
             "decode": _start("decode", [*common, *pd, "--mode", "decode"], log_dir, "1" if cuda else None),
             "single": _start("single", common, log_dir, "1" if cuda else None)}
    doc: dict = {"device": args.device, "lengths": args.lengths, "outputs": [], "transfers": []}
    try:
        for name in ("prefill", "decode", "single"):
            _wait_ready(PORTS[name], *procs[name])
        procs["master"] = _start("master", ["--mode", "pd-master", "--secret-file", str(secret), "--prefill-url",
                                            f"http://127.0.0.1:{PORTS['prefill']}", "--decode-url",
                                            f"http://127.0.0.1:{PORTS['decode']}"], log_dir, None)
        _wait_ready(PORTS["master"], *procs["master"])
        rng = random.Random(args.seed)
        longest = max(args.lengths)
        plan = [longest] + args.lengths + [longest] * (args.rounds - 1)  # a warm-up, each length, more rounds
        for i, n in enumerate(plan):
            prompt = [rng.randrange(3, args.vocab) for _ in range(n)]
            ttft_pd, via = _complete(PORTS["master"], prompt)
            ttft_one, one = _complete(PORTS["single"], prompt)
            row = {"tokens": n, "ttft_pd_s": ttft_pd, "ttft_single_s": ttft_one,
                   "peer_tokens": (via.get("usage") or {}).get("cache", {}).get("peer"),
                   "same_output": via["token_ids"] == one["token_ids"], "warm_up": i == 0}
            doc["outputs"].append(row)
            print(f"{n} tokens: same output {row['same_output']}, peer tokens {row['peer_tokens']}, TTFT through "
                  f"the master {ttft_pd * 1e3:.1f} ms, one instance {ttft_one * 1e3:.1f} ms", flush=True)
        doc["serving"] = {name: _serve_bench(name, args, log_dir) for name in ("master", "single")}
        time.sleep(1.0)
        sends = [(int(t), float(mib), float(ms)) for t, _, mib, ms in SEND_LINE.findall(procs["prefill"][1].read_text())]
    finally:
        _stop(procs)
    if not sends:
        raise SystemExit(f"the prefill instance logged no pair transfer (logs in {log_dir})")
    largest = max(mib for _, mib, _ in sends)
    big = [s for s in sends if s[1] == largest][1:]  # the first formed the group
    if not big:
        raise SystemExit("only the warm-up transfer of the longest prompt was logged")
    ms = sorted(s[2] for s in big)[len(big) // 2]
    nbytes = int(largest * 2**20)
    doc["transfer"] = {"bytes": nbytes, "median_ms": ms, "gbps": nbytes / ms / 1e6, "sends_ms": [s[2] for s in big]}
    doc["baseline_gbps"] = _baseline(nbytes, args.device, args.baseline_reps)
    for label, gbps in doc["baseline_gbps"].items():
        doc["transfer"][f"ratio_to_{label}"] = doc["transfer"]["gbps"] / gbps
    backend = "NCCL" if cuda else "gloo"
    print(f"transfer of the {longest}-token prompt ({largest:.1f} MiB): {ms:.2f} ms = {doc['transfer']['gbps']:.1f} "
          f"GB/s; {backend} send/recv of the same bytes: " + ", ".join(
              f"{label} {gbps:.1f} GB/s (ratio {doc['transfer'][f'ratio_to_{label}']:.2f})"
              for label, gbps in doc["baseline_gbps"].items()), flush=True)
    serving = doc["serving"]
    print(f"c={args.concurrency}: TTFT {serving['master']['ttft_ms']['mean']:.1f} ms disaggregated vs "
          f"{serving['single']['ttft_ms']['mean']:.1f} ms one instance; output tokens/s "
          f"{serving['master']['output_tokens_per_s']:.0f} vs {serving['single']['output_tokens_per_s']:.0f}")
    doc["logs"] = str(log_dir)
    return doc


def _lengths(text: str) -> list[int]:
    try:
        out = [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"want comma-separated token counts, got {text!r}") from None
    if not out or min(out) < 2:
        raise argparse.ArgumentTypeError("every length must be at least 2 tokens")
    return out


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="model folder or built-in name (required unless a baseline worker)")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                   help="cuda: two GPUs, NCCL; cpu: the same over gloo, a smoke run (default: cuda)")
    p.add_argument("--lengths", type=_lengths, default=[1024, 8192, 32768],
                   help="prompt lengths whose output is compared, comma-separated (default: 1024,8192,32768)")
    p.add_argument("--rounds", type=int, default=3, help="timed transfers of the longest prompt (default: 3)")
    p.add_argument("--concurrency", type=int, default=32, help="the serving comparison's concurrency (default: 32)")
    p.add_argument("--serve-input", type=int, default=1024, help="its longest random prompt (default: 1024)")
    p.add_argument("--serve-output", type=int, default=128, help="its tokens out per request (default: 128)")
    p.add_argument("--vocab", type=int, default=151936, help="prompt ids are drawn from [3, vocab) (default: 151936)")
    p.add_argument("--cpu-cache-gb", type=float, default=2.0, help="CPU tier of the PD pair (default: 2)")
    p.add_argument("--baseline-reps", type=int, default=9, help="timed send/recv repeats (default: 9)")
    p.add_argument("--seed", type=int, default=0, help="prompt seed (default: 0)")
    p.add_argument("--json", default=None, help="write the results here (default: none)")
    for flag, kind in (("--baseline-worker", int), ("--baseline-port", int), ("--baseline-bytes", int)):
        p.add_argument(flag, type=kind, default=None, help=argparse.SUPPRESS)  # the baseline's own processes
    args = p.parse_args(argv)
    if args.baseline_worker is None and args.model is None:
        p.error("--model is required")
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.baseline_worker is not None:
        _baseline_worker(args)
        return
    doc = run(args)
    if args.json:
        Path(args.json).write_text(json.dumps(doc, indent=1))


if __name__ == "__main__":
    main()
