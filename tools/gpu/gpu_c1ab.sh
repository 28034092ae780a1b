#!/usr/bin/env bash
# Concurrency 1 at this tree against an earlier commit's, on one machine in one call. The MoE benchmark model's
# served c = 1 median ITL was 0.722 ms at 025c52e and 0.93-1.33 ms at d34e70b, each in another device call (and
# machine); on the CPU the per-step host path is the same at both (docs/benchmarks.md, "Per-step overhead outside
# the forward"). Both trees' servers run at once here and hkv-bench alternates between them, so each pair of
# rounds shares the machine, its clocks and whatever else it is doing.
#   prepare: mkdir -p .out/base && git archive 025c52e hkv hkv_kernels tools | tar -x -C .out/base
#   run: BASE_TREE=.out/base bash tools/gpu/gpu_c1ab.sh [parts: host,served,decode,profile; default host,served]
#        (carry .whl, .out/base; `decode` alone fits one device call)
# host: tiny-hybrid with the ranks' forward made free (tools/bench/free_forward/ first on PYTHONPATH): a step is the
#       CUDA host path alone (graph replay, sampling, the step link, router, api), what c = 1 is bound by.
# served: the MoE benchmark model (tools/bench/make_bench_model.py --moe), 0.4 of the GPU for each server.
# decode: no server; the MoE benchmark model's B1 decode step in-process, each tree's own bench_decode
#       (`--moe --batches 1`, random weights, CUDA graphs), then each tree's kernels per step
#       (tools/bench/decode_ab.py kernels) and their diff: is the forward itself slower?
# profile: this tree only (the base has no step profiler): the MoE model served, its one-row decode steps profiled
#       (HKV_PROFILE_STEPS=1, hkv/engine/step_profile.py): wall time a served step against the GPU's busy time in it,
#       i.e. how much of a c = 1 step is outside the kernels (launch gaps, the host). $OUT/c1_profile/*.json.
# ROUNDS (default 4) rounds per tree (hkv-bench at c = 1; bench_decode for decode), base first in odd rounds, this
# tree first in even ones. Results: the per-round figures, the summary and the machine state in $OUT/gpu_c1ab.log,
# decode's kernel tables in $OUT/kernels_{base,head}.json (each round's JSON in /tmp/c1ab on the machine).
set -uo pipefail
source tools/gpu/common.sh  # OUT, the carried wheels, PYTHONPATH; start/stop of a server
parts=${1:-host,served}
BASE=${BASE_TREE:-}
[[ -d $BASE/hkv && -d $BASE/tools ]] \
  || { echo "BASE_TREE must hold an earlier commit's hkv, hkv_kernels and tools (see the header)"; exit 2; }
BASE=$(cd "$BASE" && pwd)  # the decode part runs in each tree's root
SITE=${PYTHONPATH#"$PWD"}; SITE=${SITE#:}  # PYTHONPATH without this tree: the carried wheels
MODEL=${MOE_MODEL:-/tmp/moe_model}
LOG="$OUT/gpu_c1ab.log"
ROUNDS=${ROUNDS:-4}
RUNS=/tmp/c1ab  # the per-round JSON stays here: a device call returns at most 8 files
mkdir -p "$RUNS"
FREE=$PWD/tools/bench/free_forward
SERVER_PID=
declare -A PIDS=()

nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,memory.used --format=csv | tee -a "$LOG"
lscpu | grep -E "^Model name|^CPU\(s\)|MHz" | tee -a "$LOG"

machine() {  # what else the host is doing: load, dirty pages still being written back
  say "load $(cut -d' ' -f1-3 /proc/loadavg); $(grep -E '^(Dirty|Writeback):' /proc/meminfo | tr -s ' ' | tr '\n' ' ')"
}

both() {  # both NAME MODEL [flags...]: the base tree's server on 8101, this tree's on 8102 (PIDS by tree)
  local name=$1 model=$2; shift 2
  sync; machine  # a model just written is still being flushed: let it land before timing anything
  PORT=8101 ROOT=$BASE MODEL=$model start "${name}_base" "$@" && PIDS[base]=$SERVER_PID
  PORT=8102 ROOT=. MODEL=$model start "${name}_head" "$@" && PIDS[head]=$SERVER_PID
  [[ -n ${PIDS[base]:-} && -n ${PIDS[head]:-} ]]
}

stop_both() {
  local tree
  for tree in base head; do
    [[ -n ${PIDS[$tree]:-} ]] && kill -TERM "${PIDS[$tree]}" 2>/dev/null && wait "${PIDS[$tree]}" 2>/dev/null
    PIDS[$tree]=
  done
  SERVER_PID=
}

rounds() {  # rounds PART: ROUNDS x (base, head) of hkv-bench at c = 1, alternating which goes first
  local part=$1 r tree port order
  for r in $(seq 1 "$ROUNDS"); do
    order="base head"; ((r % 2 == 0)) && order="head base"
    machine
    for tree in $order; do
      port=8101; [[ $tree == head ]] && port=8102
      timeout 300 python3 -m tools.hkv_bench --url "http://127.0.0.1:$port" --no-progress \
        --json "$RUNS/c1ab_${part}_${tree}_$r.json" --workload random --input-len 512 --range-ratio 1 \
        --output-len 128 --num-prompts 8 --concurrency 1 --warmup 2 2>&1 | grep -E "ITL|TTFT|step /" \
        | sed "s/^/[$part $tree $r] /" | tee -a "$LOG"
    done
  done
  python3 - "$RUNS" "$part" <<'PY' 2>&1 | tee -a "$LOG"
import glob, json, statistics, sys
out, part = sys.argv[1], sys.argv[2]
for tree in ("base", "head"):
    runs = [json.load(open(p)) for p in sorted(glob.glob(f"{out}/c1ab_{part}_{tree}_*.json"))]
    itl = [r["latency"]["itl_ms"]["median"] for r in runs]
    step = [r["server"]["step_seconds_mean"] * 1e3 for r in runs if r.get("server")]
    if itl:
        print(f"{part} {tree}: median ITL per round {' '.join(f'{x:.3f}' for x in itl)} ms (median "
              f"{statistics.median(itl):.3f}); server step {' '.join(f'{x:.3f}' for x in step)} ms")
PY
}

in_tree() {  # in_tree TREE CMD...: CMD in that tree's root, only it (and the carried wheels) on PYTHONPATH
  local root=$PWD; [[ $1 == base ]] && root=$BASE; shift
  (cd "$root" && PYTHONPATH="$root${SITE:+:$SITE}" "$@")
}

decode_round() {  # decode_round TREE ROUND: the tree's own bench_decode at B1 (graphs only where it has the flag)
  local tree=$1 r=$2 root=$PWD mod=tools.bench.bench_decode
  [[ $tree == base ]] && root=$BASE
  [[ -f $root/tools/bench/bench_decode.py ]] || mod=tools.bench_decode  # before tools/ was split into folders
  local flags=(--moe --batches 1 --iters 200 --json "$RUNS/decode_${tree}_$r.json")
  grep -q -- "--graphs-only" "$root/${mod//.//}.py" && flags+=(--graphs-only)  # 025c52e's times eager steps too
  in_tree "$tree" timeout 300 python3 -m "$mod" "${flags[@]}" 2>&1 | grep -E "B1 |captured|Error" \
    | sed "s/^/[decode $tree $r] /" | tee -a "$LOG"
}

decode() {  # ROUNDS x (base, head) of decode_round, alternating which goes first; then the kernels of each
  local r tree order
  rm -f "$RUNS"/decode_*.json "$RUNS"/kernels_*.json  # a warm machine keeps an earlier call's
  for r in $(seq 1 "$ROUNDS"); do
    order="base head"; ((r % 2 == 0)) && order="head base"
    machine
    for tree in $order; do decode_round "$tree" "$r"; done
  done
  for tree in base head; do  # fed on stdin: the base tree has no decode_ab.py, and its imports resolve in the tree
    in_tree "$tree" timeout 300 python3 - kernels "$RUNS/kernels_$tree.json" <tools/bench/decode_ab.py 2>&1 \
      | tail -3 | sed "s/^/[kernels $tree] /" | tee -a "$LOG"
    cp "$RUNS/kernels_$tree.json" "$OUT/" 2>/dev/null
  done
  python3 -m tools.bench.decode_ab summary "$RUNS" 2>&1 | tee -a "$LOG"
}

if wants host; then
  say "host path: tiny-hybrid on ${DEVICE:-cuda}, the ranks' forward free (tools/bench/free_forward/), both trees up"
  PYTHONPATH="$FREE:$PYTHONPATH" both s_c1host tiny-hybrid --gpu-memory-fraction 0.2 && rounds host
  stop_both
fi
if wants served; then
  bench_model "$MODEL" "the MoE benchmark model (4 layers of Qwen3-Next-80B's shapes)" --moe
  say "served: the MoE benchmark model, bf16, 64 running, 0.4 of the GPU each, both trees up"
  both s_c1moe "$MODEL" --max-running-requests 64 --gpu-memory-fraction 0.4 && rounds served
  stop_both
fi
if wants decode; then
  say "decode: the MoE benchmark model's B1 decode step in-process, each tree's own bench_decode, $ROUNDS rounds"
  decode
fi
if wants profile; then
  bench_model "$MODEL" "the MoE benchmark model (4 layers of Qwen3-Next-80B's shapes)" --moe
  say "profile: this tree's served one-row decode steps (wall against GPU busy), the MoE benchmark model"
  PORT=8102 HKV_PROFILE_STEPS=1 HKV_PROFILE_DIR="$(cd "$OUT" && pwd)/c1_profile" start s_c1prof \
    --max-running-requests 64 --gpu-memory-fraction 0.4 && {
    PORT=8102 timeout 200 python3 -m tools.hkv_bench --url "http://127.0.0.1:8102" --no-progress --workload random \
      --input-len 512 --range-ratio 1 --output-len 64 --num-prompts 1 --concurrency 1 --warmup 0 2>&1 \
      | grep -E "ITL|TPOT" | sed "s/^/[profile] /" | tee -a "$LOG"
    grep -h "step profile" /tmp/s_c1prof.err | cut -c1-400 | tee -a "$LOG"
    stop
  }
fi
exit 0
