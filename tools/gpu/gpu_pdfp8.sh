#!/usr/bin/env bash
# One device call for issue 39 deliverable 4 (FP8 KV pages through PD) on one H100 or H200, ~3-5 minutes:
#   fp8      tests/e2e/test_cuda_pd_fp8.py: an FP8-KV prefill and decode instance on one GPU copy FP8 pages device
#            to device (CUDA IPC) and give one FP8-KV instance's greedy tokens; a model-dtype decode instance on the
#            same GPU refuses them with the line naming both KV dtypes
#   pd       tests/e2e/test_cuda_pd.py: the fp32 device-copy path still taken (the pools document now names the KV
#            dtype and the fingerprint, which the decode side compares before it copies)
#   run: bash tools/gpu/gpu_pdfp8.sh [parts: fp8,pd; default both]
# Results: the log $OUT/gpu_pdfp8.log. Look for: "2 passed" and "1 passed", no skips.
set -uo pipefail
source tools/gpu/common.sh  # OUT, the carried wheels, PYTHONPATH
parts=${1:-fp8,pd}
LOG="$OUT/gpu_pdfp8.log"

nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,memory.used --format=csv | tee -a "$LOG"
if wants fp8; then
  say "FP8 KV pages through PD on one GPU: tests/e2e/test_cuda_pd_fp8.py"
  timeout 400 python3 -m pytest -q -p no:cacheprovider -m gpu -rfEs --timeout=380 tests/e2e/test_cuda_pd_fp8.py \
    2>&1 | grep -v "weights:" | tail -15 | tee -a "$LOG"
fi
if wants pd; then
  say "PD on one GPU, fp32 (the device copy still taken): tests/e2e/test_cuda_pd.py"
  timeout 300 python3 -m pytest -q -p no:cacheprovider -m gpu -rfEs --timeout=280 tests/e2e/test_cuda_pd.py \
    2>&1 | grep -v "weights:" | tail -10 | tee -a "$LOG"
fi
