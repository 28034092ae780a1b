#!/usr/bin/env bash
# One device call for issue 40 (tensor parallelism) on two GPUs of one host (kind nvidia-h100-x2): the model-layer
# parity test (2 gloo ranks, CPU), then tests/e2e/test_cuda_tp.py: --tp 2 over NCCL with the all-reduces and the
# logits gather captured in the decode, short prefill and verify graphs (fp32 greedy parity with transformers,
# prefix hits, kill -9 of rank 1), then --tp 1 on one GPU for the unchanged path (test_cuda_launch.py).
#   run: bash tools/gpu/gpu_tp.sh [parts: unit,tp,tp1; default all]
# Results: $OUT/gpu_tp.log; carry .whl (fla-core and the serving wheels). About 10 minutes.
set -uo pipefail
source tools/gpu/common.sh  # OUT, the carried wheels, PYTHONPATH
parts=${1:-unit,tp,tp1}
LOG="$OUT/gpu_tp.log"

nvidia-smi --query-gpu=index,name,memory.used --format=csv | tee -a "$LOG"
python3 -c 'import torch; print("torch", torch.__version__, "gpus", torch.cuda.device_count(),
  "nccl", torch.cuda.nccl.version())' 2>&1 | tee -a "$LOG"
if wants unit; then
  say "model layer: 2 gloo ranks give the logits of one on every family"
  timeout 300 python3 -m pytest -q -p no:cacheprovider -rfEs tests/models/test_parallel.py 2>&1 | tail -5 | tee -a "$LOG"
fi
if wants tp; then
  say "--tp 2 over NCCL through CUDA graphs (decode, short prefill, verify with the drafter)"
  timeout 420 python3 -m pytest -q -p no:cacheprovider -m gpu -rfEs -s --timeout=400 tests/e2e/test_cuda_tp.py \
    2>&1 | grep -v "weights:" | tail -20 | tee -a "$LOG"
fi
if wants tp1; then
  say "--tp 1 unchanged: the CUDA launch tests"
  timeout 420 python3 -m pytest -q -p no:cacheprovider -m gpu -rfEs --timeout=400 tests/e2e/test_cuda_launch.py \
    2>&1 | grep -v "weights:" | tail -8 | tee -a "$LOG"
fi
