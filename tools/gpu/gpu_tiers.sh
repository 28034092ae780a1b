#!/usr/bin/env bash
# One device call for issue 5: the CPU-tier copy benchmark (acceptance 6), the disk tier
# benchmark on the device's disk, and the CUDA tier test; logs land in $OUT (or ./.out).
#   run: bash tools/gpu/gpu_tiers.sh [bench|test|disk|all]   (carry .whl: fla-core and the serving wheels)
set -uo pipefail
source tools/gpu/common.sh  # OUT, the carried wheels, PYTHONPATH; start/stop of a server
what=${1:-all}
rc=0
keep() { [[ $rc == 0 ]] && rc=$1; }
nvidia-smi --query-gpu=name,driver_version,memory.used --format=csv 2>&1 | tee "$OUT/env.log"
if [[ $what == bench || $what == all ]]; then
  timeout 200 python3 -m tools.bench.bench_tiers --json "$OUT/tiers.json" 2>&1 | tee "$OUT/bench_tiers.log"
  keep "${PIPESTATUS[0]}"
fi
if [[ $what == test || $what == all ]]; then
  timeout 240 python3 -m pytest -q -p no:cacheprovider -m gpu -s -rfEs --durations=5 tests/e2e/test_tiers_cuda.py \
    2>&1 | tee "$OUT/tiers_cuda_test.log"
  keep "${PIPESTATUS[0]}"
fi
if [[ $what == disk || $what == all ]]; then
  df -h /tmp | tee -a "$OUT/env.log"
  mkdir -p /tmp/hkv-disk-bench
  timeout 150 python3 -m tools.bench.bench_disk_tier --dir /tmp/hkv-disk-bench --threads 2 --json "$OUT/disk.json" 2>&1 \
    | tee "$OUT/bench_disk.log"
  keep "${PIPESTATUS[0]}"
fi
exit "$rc"
