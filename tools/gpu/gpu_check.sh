#!/usr/bin/env bash
# One device call: install the carried wheels (.whl/: fla-core and what the GPU machine lacks to run
# hkv-launch), then any of: the in-process decode-step benchmark (decode), the GPU kernel tests (tests),
# the CUDA launch tests (launch), the kernel benchmark (bench); logs land in $OUT (or ./.out by hand).
#   run: bash tools/gpu/gpu_check.sh [decode,tests,launch,bench|all] [bench sections, e.g. decode,fused] [pytest -k expression]
# TESTS_TIMEOUT_S (240) and LAUNCH_TIMEOUT_S (300) bound the two pytest runs, TEST_TIMEOUT_S (200 / 280)
# one test; PYTEST_WORKERS (4) the xdist workers of the kernel tests.
set -uo pipefail
source tools/gpu/common.sh  # OUT, the carried wheels, PYTHONPATH; start/stop of a server
what=${1:-all}
sections=${2:-}
select=${3:-}
{
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,memory.used --format=csv
  python3 -c 'import torch, triton, transformers; print("torch", torch.__version__, "triton", triton.__version__, "transformers", transformers.__version__)'
  python3 -c 'import fla; print("fla", fla.__version__)' || echo "fla-core: not importable"
  python3 -c 'import msgspec, zmq, posix_ipc, uvloop, aiohttp; print("serving deps: ok")' || echo "serving deps: missing"
} 2>&1 | tee "$OUT/env.log"
rc=0
keep() { [[ $rc == 0 ]] && rc=$1; }
wants() { [[ $what == all || ,$what, == *,$1,* ]]; }
if wants decode; then
  timeout "${DECODE_TIMEOUT_S:-240}" python3 -m tools.bench.bench_decode --profile --json "$OUT/decode.json" \
    ${DECODE_ARGS:-} 2>&1 | tee "$OUT/decode.log"
  keep "${PIPESTATUS[0]}"
fi
if wants tests; then
  # Triton compiles dominate these tests (one kernel variant per shape class and dtype): spread
  # them over PYTEST_WORKERS processes when pytest-xdist is there; -rA shows their printed numbers
  output=(-s -rfEs)
  python3 -c 'import xdist' 2>/dev/null && output=(-n "${PYTEST_WORKERS:-4}" -rA)
  timeout "${TESTS_TIMEOUT_S:-240}" python3 -m pytest -q -p no:cacheprovider -m gpu "${output[@]}" --durations=0 \
    --timeout="${TEST_TIMEOUT_S:-200}" ${select:+-k "$select"} tests/kernels 2>&1 | tee "$OUT/gpu_tests.log"
  keep "${PIPESTATUS[0]}"
fi
if wants launch; then
  # acceptance 6 of issue 6: real hkv-launch processes on CUDA, fp32 and bf16, against transformers
  timeout "${LAUNCH_TIMEOUT_S:-300}" python3 -m pytest -q -p no:cacheprovider -m gpu -s -rfEs --durations=8 \
    --timeout="${TEST_TIMEOUT_S:-280}" tests/e2e/test_cuda_launch.py 2>&1 | tee "$OUT/launch_test.log"
  keep "${PIPESTATUS[0]}"
fi
if wants bench; then
  args=(--json "$OUT/bench.json")
  [[ -n $sections ]] && args+=(--only "$sections")
  timeout 220 python3 -m tools.bench.bench_kernels "${args[@]}" 2>&1 | tee "$OUT/bench.log"
  keep "${PIPESTATUS[0]}"
fi
exit "$rc"
