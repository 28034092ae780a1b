#!/usr/bin/env bash
# Issue 41 on one host of 2 or 4 GPUs (kinds nvidia-h100-x2/-x4, nvidia-h200-x2/-x4): `--tp N` against `--tp 1` on
# the 1.99 B benchmark model (MODELS name `bench`, BENCH_MODEL) and on the model with Qwen3.5-27B's layer shapes
# (`large`, LARGE_MODEL: make_bench_model --preset qwen3.5-27b, 17.3 GB in bf16), each written here unless there.
#   speed:   per N of TPS, `hkv-launch --tp N --max-running-requests 64`, hkv-bench at concurrency 1, 32 and 64
#            (served_sweep: random 512 + 128 tokens) into $OUT/tp_<model>_tp<N>_c<c>.json;
#   profile: per N again, after the timed runs (the profiler synchronizes the device), a server with
#            HKV_PROFILE_STEPS=1,32,64 HKV_PROFILE_DIR=$OUT/prof_<model>_tp<N> given 64, then 32, then 1 request(s)
#            of 512 + 96 tokens at once: each rank writes a window of 16 decode steps of each size (the steps
#            that move a hybrid's rolling checkpoint at a page count as decode steps: the served steady state);
#   parity:  tests/e2e/test_cuda_tp_bench.py at the N above 1 (fp32 greedy through graphs against transformers in
#            fp32) into $OUT/tp_parity_<model>.log;
# then tools/bench/tp_report.py's tables into the log and $OUT/tp_speed_<model>.md (rerun it by hand over the
# files of several calls put together).
#   run: [MODELS=bench,large] [TPS=1,2,4] bash tools/gpu/gpu_tp_speed.sh [parts: speed,profile,parity; default all]
# TPS defaults to those of 1, 2, 4 that the GPUs hold. Results: $OUT/gpu_tp_speed.log and the files above; carry .whl
# (fla-core and the serving wheels). GPU_FRACTION (default 0.8) is the servers' --gpu-memory-fraction, as in the
# one-GPU served runs of docs/benchmarks.md.
#
# Time, estimated from the one-GPU runs in docs/benchmarks.md (no --tp run has been timed yet): writing bench ~0.5
# min, large ~1.5 min; a start with a cold compile cache 1.5-2 min for bench, ~2.5 min for large (every N compiles
# its own shapes), warm 0.5 and ~1 min; the sweep 0.5 and ~1 min; the profile's load ~0.3 min; parity a cold fp32
# start an N and transformers' load (large: 34.6 GB in fp32, ~1.5 min). So with TPS=1,2,4: bench speed ~7 min,
# profile ~2.5; large speed ~11, profile ~5; parity at 2 and 4 ~5 and ~8 min. BUDGET_S (default 570) bounds one
# call: a step that no longer fits is skipped and said so (profile goes from the largest N down, so tp 1's is the
# first dropped), every timeout and start-up wait ends at the budget, and the tables, "not run" where a file is
# missing, come after it. Calls in order of need (the issue's figures first; a machine kept warm between calls keeps
# the models written and the kernels compiled, so later calls start faster):
#   four GPUs: 1. MODELS=bench bash tools/gpu/gpu_tp_speed.sh speed,profile
#              2. MODELS=large bash tools/gpu/gpu_tp_speed.sh speed
#              3. BUDGET_S=300 MODELS=large bash tools/gpu/gpu_tp_speed.sh profile;
#                 BUDGET_S=270 MODELS=bench TPS=2,4 bash tools/gpu/gpu_tp_speed.sh parity
#              4. MODELS=large TPS=2,4 bash tools/gpu/gpu_tp_speed.sh parity
#   two GPUs:  1. MODELS=bench bash tools/gpu/gpu_tp_speed.sh
#              2. MODELS=large bash tools/gpu/gpu_tp_speed.sh speed,profile
#              3. MODELS=large bash tools/gpu/gpu_tp_speed.sh parity
# Two calls cover the speed and profile parts of both models on two GPUs, of bench and large's speed on four.
# Dry run on a CPU (the script's own mistakes, gloo ranks; BENCH_FLAGS are make_bench_model's shrinking flags,
# SWEEP_INPUT_LEN shortens every prompt, whose prefill is most of a CPU's time: 4.5-8 min a --tp at 512 on 2 cores):
#   DEVICE=cpu OUT=/tmp/tpdry BENCH_MODEL=/tmp/tpdry/bench MODELS=bench TPS=1,2 BUDGET_S=3600 SWEEP_INPUT_LEN=64 \
#     BENCH_FLAGS="--layers 4 --hidden-size 256 --intermediate-size 512 --vocab-size 2048" \
#     bash tools/gpu/gpu_tp_speed.sh
set -uo pipefail
source tools/gpu/common.sh  # OUT, the carried wheels, PYTHONPATH; start/stop of a server; limit, served_sweep
parts=${1:-speed,profile,parity}
LOG="$OUT/gpu_tp_speed.log"
PORT=8100
SERVER_PID=
DEVICE=${DEVICE:-cuda}
DEADLINE=$(( ${BUDGET_S:-570} - 20 ))  # $SECONDS by which every step is done; 20 s left for the tables
PROFILE_LEN=96  # tokens a profiled request: 8 skipped + 16 profiled + 1 closing decode steps, twice over and more
OUT_ABS=$(cd "$OUT" && pwd)  # the ranks write their profiles from the server's working directory
if [[ $DEVICE == cuda ]]; then
  MEM=(--gpu-memory-fraction "${GPU_FRACTION:-0.8}")
  gpus=$(python3 -c 'import torch; print(torch.cuda.device_count())')
else  # gloo ranks on the CPU; a pool of 64 x (512 + 128) tokens, the CPU default being 32768
  MEM=(--max-total-tokens 65536)
  gpus=
fi

room() {  # room SECONDS WHAT: true when WHAT (about SECONDS long) fits before the deadline, else says it is skipped
  (( DEADLINE - SECONDS >= $1 )) && return 0
  say "skipped: $2 (about $1 s; $((DEADLINE - SECONDS)) s left of BUDGET_S)"; return 1
}

write_model() {  # write_model NAME: MODEL set to its folder, written unless there; WEIGHT to how much slower than
  # bench its steps are (the room they ask for)
  case $1 in
    bench) MODEL=${BENCH_MODEL:-/tmp/bench_model} WEIGHT=1
      [[ -d $MODEL ]] || { room 60 "writing the benchmark model" && bench_model "$MODEL" \
        "the 1.99 B benchmark model${BENCH_FLAGS:+ ($BENCH_FLAGS)}" ${BENCH_FLAGS:-}; } ;;
    large) MODEL=${LARGE_MODEL:-/tmp/large_model} WEIGHT=2
      [[ -d $MODEL ]] || { room 150 "writing the qwen3.5-27b preset" && bench_model "$MODEL" \
        "the qwen3.5-27b preset model (17.3 GB)" --preset qwen3.5-27b; } ;;
    *) say "unknown model $1 (bench or large)"; return 1 ;;
  esac
  [[ -f $MODEL/config.json ]]
}

speed() {  # speed NAME: each N's server timed by hkv-bench
  local n
  for n in "${sizes[@]}"; do
    room $((120 * WEIGHT)) "$1 --tp $n speed" || continue
    say "$1: --tp $n, 64 running, hkv-bench at concurrency 1, 32, 64"
    start "tp_${1}_tp$n" --tp "$n" --max-running-requests 64 "${MEM[@]}" && { served_sweep "tp_${1}_tp$n"; stop; }
  done
}

profile() {  # profile NAME: each N's server under HKV_PROFILE_STEPS, given
  # one wave of 64, then 32, then 1 request(s)
  local n c name
  for n in $(printf '%s\n' "${sizes[@]}" | sort -rn); do  # the largest N first: its all-reduces are the question
    room $((60 * WEIGHT)) "$1 --tp $n profile" || continue
    name="prof_${1}_tp$n"
    say "$1: --tp $n, decode steps of 1, 32 and 64 rows profiled into $OUT/$name"
    HKV_PROFILE_STEPS=1,32,64 HKV_PROFILE_DIR="$OUT_ABS/$name" start "$name" --tp "$n" --max-running-requests 64 \
      "${MEM[@]}" || continue
    for c in 64 32 1; do
      timeout "$(limit 150)" python3 -m tools.hkv_bench --url "http://127.0.0.1:$PORT" --no-progress \
        --workload random --input-len "${SWEEP_INPUT_LEN:-512}" --range-ratio 1 --output-len $PROFILE_LEN \
        --num-prompts $c --concurrency $c --warmup 0 2>&1 | grep -E "requests \(failed\)|ITL|hkv-bench" \
        | sed "s/^/[profile c$c] /" | tee -a "$LOG"
    done
    stop
    grep -h "step profile" "/tmp/$name.err" "/tmp/$name.out" | cut -c1-400 | tee -a "$LOG"
  done
}

parity() {  # parity NAME: tests/e2e/test_cuda_tp_bench.py at every N above 1
  local above=() n t
  for n in "${sizes[@]}"; do (( n > 1 )) && above+=("$n"); done
  (( ${#above[@]} )) || { say "$1 parity: no --tp above 1 among ${sizes[*]}"; return 0; }
  room $((200 * WEIGHT)) "$1 parity at --tp ${above[*]}" || return 0
  say "$1: fp32 greedy parity with transformers through graphs, --tp ${above[*]}"
  t=$(limit 560)
  HKV_TP_MODEL=$MODEL HKV_TP_SIZES=$(IFS=,; echo "${above[*]}") timeout "$t" python3 -m pytest -v -s \
    -p no:cacheprovider -m gpu -rfEs --timeout=$((t > 30 ? t - 10 : t)) --timeout-method=thread \
    tests/e2e/test_cuda_tp_bench.py >"$OUT/tp_parity_$1.log" 2>&1
  grep -v "weights:" "$OUT/tp_parity_$1.log" | tail -12 | tee -a "$LOG"
}

[[ $DEVICE == cuda ]] && nvidia-smi --query-gpu=index,name,memory.used --format=csv | tee -a "$LOG"
python3 -c 'import torch; print("torch", torch.__version__, "gpus", torch.cuda.device_count())' 2>&1 | tee -a "$LOG"
IFS=, read -ra models <<<"${MODELS:-bench}"
IFS=, read -ra asked <<<"${TPS:-1,2,4}"
sizes=()
for n in "${asked[@]}"; do
  if [[ -n $gpus ]] && (( n > gpus )); then say "--tp $n left out: $gpus GPUs"; else sizes+=("$n"); fi
done
say "parts $parts; models ${models[*]}; --tp ${sizes[*]} on $DEVICE; budget ${BUDGET_S:-570} s; tree" \
  "$(git rev-parse --short HEAD 2>/dev/null)"
for model in "${models[@]}"; do
  write_model "$model" || { say "$model: no model, nothing run"; continue; }
  wants speed && speed "$model"
  wants profile && profile "$model"
  wants parity && parity "$model"
done
for model in "${models[@]}"; do
  python3 -m tools.bench.tp_report --model-name "$model" --dir "$OUT" --tps "$(IFS=,; echo "${sizes[*]}")" \
    --out "$OUT/tp_speed_$model.md" 2>&1 | tee -a "$LOG"
done
[[ -n $SERVER_PID ]] && kill -TERM "$SERVER_PID" 2>/dev/null
exit 0
