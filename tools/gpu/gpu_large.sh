#!/usr/bin/env bash
# One device call for issue 38's large layers on one GPU: the model with Qwen3.5-27B's layer shapes
# (tools/bench/make_bench_model.py --preset qwen3.5-27b: 16 layers, 17.3 GB bf16), in-process decode steps at
# B = 1, 32, 64 with the profiler's top kernels, and its served numbers (a real hkv-launch server driven by
# hkv-bench at concurrency 1, 32 and 64, against the memory roofline measured on the same card).
# Part wave: the same server with --chunked-prefill-size 32768, so that a wave of 64 prompts of 512 tokens is
# prefilled in one step, at concurrency 64 only: TPOT then carries no prefill chunk of the same wave (at the default
# 8192 a request of the wave's first chunk decodes through its three later chunks; docs/benchmarks.md).
#   run: bash tools/gpu/gpu_large.sh [parts: decode,served,wave; default decode,served]   (carry .whl: fla-core,
#   serving wheels)
# Results: $OUT/large_*.json and $OUT/gpu_large.log.
set -uo pipefail
source tools/gpu/common.sh  # OUT, the carried wheels, PYTHONPATH; start/stop of a server
parts=${1:-decode,served}
MODEL=${LARGE_MODEL:-/tmp/large_model}
LOG="$OUT/gpu_large.log"
PORT=8100
SERVER_PID=

nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,memory.used --format=csv | tee -a "$LOG"
if wants decode; then
  say "in-process decode step of the qwen3.5-27b preset (random weights on the GPU), profiled"
  timeout 400 python3 -m tools.bench.bench_decode --preset qwen3.5-27b --profile --iters 30 \
    --json "$OUT/large_decode.json" 2>&1 | grep -v Warning | tee -a "$LOG"
  python3 - "$OUT/large_decode.json" <<'PY' 2>&1 | tee -a "$LOG"
import json, sys
for row in json.load(open(sys.argv[1]))["rows"]:
    prof = row.get("profile")
    if prof and row["graphs"]:
        print(f"B{row['batch']}: GPU busy {prof['gpu_busy_ms']:.3f} ms of {prof['wall_ms']:.3f}; top kernels:")
        for name, ms in prof["top"][:10]:
            print(f"   {ms:8.3f} ms  {name[:150]}")
PY
fi
if wants served; then
  bench_model "$MODEL" "the qwen3.5-27b preset model (17.3 GB)" --preset qwen3.5-27b
  say "server: the qwen3.5-27b preset, bf16, 64 running"
  start s_large --max-running-requests 64 --gpu-memory-fraction "${GPU_FRACTION:-0.8}" && {
    served_sweep large
    stop
    say "served decode against the roofline (every weight, K/V of 576, states read and written)"
    python3 -m tools.bench.moe_roofline --model "$MODEL" --measure --results "${results[@]}" \
      --json "$OUT/large_roofline.json" 2>&1 | grep -v Warning | tee -a "$LOG"
  }
fi
if wants wave; then
  bench_model "$MODEL" "the qwen3.5-27b preset model (17.3 GB)" --preset qwen3.5-27b
  say "server: the qwen3.5-27b preset, bf16, 64 running, a whole wave of 64 x 512 prompt tokens in one step"
  start s_large_wave --max-running-requests 64 --gpu-memory-fraction "${GPU_FRACTION:-0.8}" \
    --chunked-prefill-size 32768 && {
    # twice on the one server: the first round is the first 32,768-token step the server sees (its kernels'
    # compiles and autotuning at that shape land in it), the second is warm
    for round in 1 2; do
      served_bench "$OUT/large_wave_c64_r$round.json" "wave c64 r$round" 64 128
    done
    stop
    # one copy bandwidth for both rounds (measured with the first), so that they compare on one roofline
    bandwidth=(--measure)
    for round in 1 2; do
      python3 -m tools.bench.moe_roofline --model "$MODEL" "${bandwidth[@]}" \
        --results "c64=$OUT/large_wave_c64_r$round.json" --json "$OUT/large_wave_roofline_r$round.json" 2>&1 \
        | grep -v Warning | tee -a "$LOG"
      bandwidth=(--bandwidth-gbs "$(python3 -c 'import json, sys; print(json.load(open(sys.argv[1]))["bandwidth_gbs"])' \
        "$OUT/large_wave_roofline_r1.json")")
    done
  }
fi
[[ -n $SERVER_PID ]] && kill -TERM "$SERVER_PID" 2>/dev/null
exit 0
