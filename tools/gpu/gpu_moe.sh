#!/usr/bin/env bash
# One device call for issue 36 (MoE at speed) on one H200: the MoE kernel tests and the MoE CUDA launch test,
# the kernel benchmark (fused MoE against the per-expert loop and torch._grouped_mm, and its tile sweep), the
# in-process decode step of the MoE benchmark model, and its served numbers (tools/bench/make_bench_model.py --moe,
# a real hkv-launch server driven by hkv-bench at concurrency 1, 32 and 64, HF generate at 32, the roofline).
#   run: bash tools/gpu/gpu_moe.sh [parts: tests,launch,bench,sweep,decode,served; default all]
# Results: $OUT/*.json and logs in $OUT/gpu_moe.log; carry .whl (fla-core and the serving wheels). GPU_FRACTION
# (default 0.8) is the server's --gpu-memory-fraction: HF's baseline shares the GPU (0.6 on an 80 GB card).
set -uo pipefail
source tools/gpu/common.sh  # OUT, the carried wheels, PYTHONPATH; start/stop of a server
parts=${1:-tests,launch,bench,sweep,decode,served}
MODEL=${MOE_MODEL:-/tmp/moe_model}
LOG="$OUT/gpu_moe.log"
PORT=8100
SERVER_PID=

nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,memory.used --format=csv | tee -a "$LOG"
python3 -c 'import torch, triton, transformers; print("torch", torch.__version__, "triton", triton.__version__,
  "transformers", transformers.__version__, "grouped_mm", hasattr(torch, "_grouped_mm"))' 2>&1 | tee -a "$LOG"
if wants tests; then
  say "MoE kernel tests (fp32 / bf16 / fp16 against the reference, the routed block against transformers')"
  workers=(); python3 -c 'import xdist' 2>/dev/null && workers=(-n 4)
  timeout 300 python3 -m pytest -q -p no:cacheprovider -m gpu -rfEs "${workers[@]}" --timeout=240 \
    tests/kernels/test_moe.py tests/kernels/test_dispatch.py 2>&1 | tail -15 | tee -a "$LOG"
fi
if wants launch; then
  say "CUDA launch tests: the MoE family in fp32 through graphs, and the dense hybrid's (fp32 parity, bf16 logprobs)"
  timeout 420 python3 -m pytest -q -p no:cacheprovider -m gpu -rfEs -s --timeout=400 tests/e2e/test_cuda_launch.py \
    2>&1 | grep -v "weights:" | tail -12 | tee -a "$LOG"
fi
if wants bench; then
  say "kernel benchmark: fused MoE"
  timeout 300 python3 -m tools.bench.bench_kernels --only moe --json "$OUT/moe_kernels.json" 2>&1 | grep -v Warning \
    | tee -a "$LOG"
fi
if wants sweep; then
  say "kernel benchmark: the grouped GEMMs' tiles at decode shapes"
  timeout 400 python3 -m tools.bench.bench_kernels --only moe_sweep --json "$OUT/moe_sweep.json" 2>&1 | grep -v Warning \
    | tail -40 | tee -a "$LOG"
fi
if wants decode; then
  say "in-process decode step of the MoE benchmark model (random weights on the GPU)"
  timeout 300 python3 -m tools.bench.bench_decode --moe --profile --json "$OUT/moe_decode.json" 2>&1 | grep -v Warning \
    | tee -a "$LOG"
  python3 - "$OUT/moe_decode.json" <<'EOF' 2>&1 | tee -a "$LOG"
import json, sys
for row in json.load(open(sys.argv[1]))["rows"]:
    prof = row.get("profile")
    if prof and row["graphs"]:
        print(f"B{row['batch']}: GPU busy {prof['gpu_busy_ms']:.3f} ms of {prof['wall_ms']:.3f}; top kernels:")
        for name, ms in prof["top"][:8]:
            print(f"   {ms:8.3f} ms  {name}")
EOF
fi

if wants served; then
  bench_model "$MODEL" "the MoE benchmark model (4 layers of Qwen3-Next-80B's shapes)" --moe
  say "server: the MoE benchmark model, bf16, 64 running, 0.8 of the GPU (HF's baseline shares it)"
  start s_moe --max-running-requests 64 --gpu-memory-fraction "${GPU_FRACTION:-0.8}" && {
    served_sweep moe --baseline hf --model-path "$MODEL" --baseline-num-prompts 32  # HF generate at c = 32
    curl -s "http://127.0.0.1:$PORT/metrics" | grep -E "^hkv_engine_graph_steps_total|^hkv_engine_steps_total" \
      | tee -a "$LOG"
    kill -TERM "$SERVER_PID"; wait "$SERVER_PID"; SERVER_PID=
    say "served decode against the roofline (weights but the experts, the touched experts, K/V of 576, states)"
    python3 -m tools.bench.moe_roofline --model "$MODEL" --measure --results "${results[@]}" --json "$OUT/moe_roofline.json" \
      2>&1 | grep -v Warning | tee -a "$LOG"
  }
fi
[[ -n $SERVER_PID ]] && kill -TERM "$SERVER_PID" 2>/dev/null
exit 0
