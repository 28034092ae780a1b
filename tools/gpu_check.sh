#!/usr/bin/env bash
# One device call for issue 6: install fla-core from the carried wheels, run the GPU kernel
# tests and the kernel benchmark; logs land in $OUT (or ./.out when run by hand).
#   run: bash tools/gpu_check.sh [tests|bench|all] [bench sections, e.g. decode,prefill] [pytest -k expression]
set -uo pipefail
OUT=${OUT:-.out}
mkdir -p "$OUT"
what=${1:-all}
sections=${2:-}
select=${3:-}
export PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
{
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,memory.used --format=csv
  python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'
  python3 -c 'import fla; print("fla", fla.__version__)' || echo "fla-core: not importable"
} 2>&1 | tee "$OUT/env.log"
rc=0
if [[ $what == tests || $what == all ]]; then
  timeout 240 python3 -m pytest -q -p no:cacheprovider -m gpu -s -rfE --durations=12 --timeout=200 \
    ${select:+-k "$select"} tests/kernels 2>&1 | tee "$OUT/gpu_tests.log"
  rc=${PIPESTATUS[0]}
fi
if [[ $what == bench || $what == all ]]; then
  args=(--json "$OUT/bench.json")
  [[ -n $sections ]] && args+=(--only "$sections")
  timeout 220 python3 -m tools.bench_kernels "${args[@]}" 2>&1 | tee "$OUT/bench.log"
  brc=${PIPESTATUS[0]}
  [[ $rc == 0 ]] && rc=$brc
fi
exit "$rc"
