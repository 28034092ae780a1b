#!/usr/bin/env bash
# One device call for the served numbers of issues 11, 12 and 13 (and the built-in model's training, issue 18) on the benchmark model
# (tools/bench/make_bench_model.py): real hkv-launch servers on the GPU, one at a time, driven by hkv-bench.
#   run: bash tools/gpu/gpu_bench.sh [parts: train,spec(-test,-bench,-tiny),launch,launch-only,i11,prefix,i12,i13,pd-test,
#        pd-bench,pd2 (two GPUs),decode,sweep,ab (this tree against BASE_TREE: `git archive` of an earlier commit),
#        wave (the shared-prefix wave three times on both trees, request times logged), steps (the wave's prefill
#        steps in-process), rate (shared-prefix waves, steady, and the default workload at each of RATES requests/s,
#        default RATE or 16, with and without the prefix cache; RATE_SERVERS picks them), burst
#        (tools.bench.bench_burst: the wave in one router step, this tree and BASE_TREE's);
#        default launch,i11,i12,i13]
# Results: $OUT/<part>.json (hkv-bench JSON per run, merged), logs in $OUT/gpu_bench.log.
set -uo pipefail
source tools/gpu/common.sh  # OUT, the carried wheels, PYTHONPATH; start/stop of a server
parts=${1:-launch,i11,i12,i13}
MODEL=${BENCH_MODEL:-/tmp/bench_model}  # made here unless it exists
DEVICE=${DEVICE:-cuda}
# SMOKE=1: the same script at toy sizes on a CPU server (checks the script itself, not hkv)
if [[ -n ${SMOKE:-} ]]; then IN=64 GEN=4 LONG=600 LEVELS="1 4" VOCAB=1536 MEM=() TIER_PROMPT=256 TIER_GB=0.05 TIER_TOKENS=2048
  SYS=256 QL=16 WAVE=4 NGROUPS=2; else
  IN=512 GEN=128 LONG=30000 LEVELS="1 32 64" VOCAB=151936 MEM=(--gpu-memory-fraction 0.8) TIER_PROMPT=8192 TIER_GB=16 TIER_TOKENS=24576
  SYS=2048 QL=128 WAVE=32 NGROUPS=64; fi
LOG="$OUT/gpu_bench.log"
PORT=8100
SERVER_PID=
wants spec && parts="$parts,spec-test,spec-bench,spec-tiny"  # spec: all three speculative parts

bench() {  # bench TAG [hkv-bench flags...]
  local tag=$1; shift
  timeout 240 python3 -m tools.hkv_bench --url "http://127.0.0.1:$PORT" --vocab "$VOCAB" --no-progress \
    --json "/tmp/res_$tag.json" "$@" 2>&1 | tail -22 | sed "s/^/[$tag] /" | tee -a "$LOG"
}

merge() {  # merge PART: every /tmp/res_<PART>_*.json into $OUT/<PART>.json
  python3 - "$1" "$OUT" <<'EOF'
import glob, json, os, sys
part, out = sys.argv[1], sys.argv[2]
doc = {os.path.basename(p)[4:-5]: json.load(open(p)) for p in sorted(glob.glob(f"/tmp/res_{part}_*.json"))}
json.dump(doc, open(f"{out}/{part}.json", "w"), indent=1)
EOF
}

nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,memory.used --format=csv | tee -a "$LOG"
if wants train; then  # issue 18: the built-in model, trained here; $OUT/tiny-hybrid.tgz is the folder to commit
  say "train tiny-hybrid on this Python's standard library, then evaluate it"
  rm -rf /tmp/tiny-hybrid
  timeout 470 python3 -m tools.train.train_tiny --out /tmp/tiny-hybrid --max-train-minutes "${TRAIN_MINUTES:-6}" \
    >"$OUT/train.log" 2>&1
  grep -v "^step " "$OUT/train.log" | tail -25 | tee -a "$LOG"
  timeout 150 python3 -m tools.train.train_tiny --eval --model /tmp/tiny-hybrid >"$OUT/eval.log" 2>&1
  tail -15 "$OUT/eval.log" | tee -a "$LOG"
  tar czf "$OUT/tiny-hybrid.tgz" -C /tmp tiny-hybrid && ls -la /tmp/tiny-hybrid | tee -a "$LOG"
fi
if wants launch || wants launch-only; then
  tests=(tests/e2e/test_cuda_launch.py)
  wants launch && tests+=(tests/kernels/test_chunk_checkpoints.py tests/kernels/test_gdn.py tests/kernels/test_dispatch.py
                         tests/engine/test_prefill_graphs.py tests/engine/test_prefill_graph_steps.py)
  say "CUDA launch test (graphs, planning ahead, fp32 parity and bf16 logprobs against transformers); fla's in-chunk states; short-prefill graphs against eager steps"
  timeout 400 python3 -m pytest -q -p no:cacheprovider -m gpu -rfEs --timeout=300 "${tests[@]}" \
    2>&1 | grep -v "weights:" | tee "$OUT/launch.log" | tail -6 | tee -a "$LOG"
fi
{ wants i11 || wants prefix || wants i12 || wants i13 || wants spec-bench || wants pd-bench || wants pd2 || wants ab || wants wave || wants rate || wants burst; } && [[ ! -d $MODEL ]] && timeout 120 python3 -m tools.bench.make_bench_model "$MODEL" 2>&1 | tail -3 | tee -a "$LOG"
wants i11 && parts+=,prefix  # i11 includes the shared-prefix workloads; "prefix" alone runs only those
if wants i11 || wants i12 || wants prefix; then
  say "server: default flags, 64 running, 0.8 of the GPU (HF's baseline shares it)"
  start s_default --max-running-requests 64 "${MEM[@]}" --log-request-times && {
    if wants i11; then
      for c in $LEVELS; do
        n=$((c == 1 ? 4 : 2 * c))
        extra=(); [[ $c == 64 ]] && extra=(--baseline hf --model-path "$MODEL" --baseline-num-prompts 64)
        bench "i11_c$c" --workload random --input-len "$IN" --range-ratio 1 --output-len "$GEN" --num-prompts $n \
          --concurrency $c --warmup 2 "${extra[@]}"
      done
    fi
    if wants prefix; then
      bench i11_prefix_cache --workload shared-prefix --groups 1 --prompts-per-group 32 --system-len 2048 \
        --question-len 128 --output-len 32 --concurrency 32 --warmup 0
      say "where the shared-prefix requests spent their time (--log-request-times, the last 8)"
      grep -h "router INFO request" /tmp/s_default.err | tail -8 | cut -c25- | tee -a "$LOG"
      bench i11_steady_cache --workload shared-prefix --groups 16 --prompts-per-group 16 --system-len 2048 \
        --question-len 128 --output-len 256 --concurrency 32 --warmup 2
    fi
    wants i12 && bench i12_default --workload random --input-len "$LONG" --range-ratio 1 --output-len 2 \
      --num-prompts 2 --concurrency 1 --warmup 1
    stop
  }
  say "server: --no-prefix-cache"
  start s_nocache --max-running-requests 64 --no-prefix-cache && {
    wants prefix && bench i11_no_prefix_cache --workload shared-prefix --groups 1 --prompts-per-group 32 \
      --system-len 2048 --question-len 128 --output-len 32 --concurrency 32 --warmup 0
    wants prefix && bench i11_steady_nocache --workload shared-prefix --groups 16 --prompts-per-group 16 \
      --system-len 2048 --question-len 128 --output-len 256 --concurrency 32 --warmup 2
    wants i12 && bench i12_nocache --workload random --input-len "$LONG" --range-ratio 1 --output-len 2 \
      --num-prompts 2 --concurrency 1 --warmup 1
    stop
  }
  merge i11
fi
if wants i12; then
  say "server: --checkpoint-interval 32768"
  start s_interval --max-running-requests 64 --checkpoint-interval 32768 && {
    bench i12_interval32768 --workload random --input-len "$LONG" --range-ratio 1 --output-len 2 --num-prompts 2 \
      --concurrency 1 --warmup 1
    stop
  }
  merge i12
fi
if wants i13; then
  say "servers: --cpu-cache-gb 16 --max-total-tokens 24576 and --no-prefix-cache, side by side"
  start s_tiers --max-running-requests 8 --cpu-cache-gb "$TIER_GB" --max-total-tokens "$TIER_TOKENS" \
    --log-request-times && {
    tiers_pid=$SERVER_PID
    PORT=$((PORT + 1)) start s_nocache2 --max-running-requests 8 --no-prefix-cache --max-total-tokens "$TIER_TOKENS" && {
      timeout 300 python3 -m tools.bench.bench_tier_coverage --url "http://127.0.0.1:$PORT" \
        --baseline-url "http://127.0.0.1:$((PORT + 1))" --prompt-tokens "$TIER_PROMPT" --others 6 30 --tail 64 \
        --vocab "$VOCAB" --json /tmp/res_i13_tiers.json 2>&1 | tail -20 | tee -a "$LOG"
      say "where the tier server's requests spent their time (--log-request-times, the last 12)"
      grep -h "router INFO request" /tmp/s_tiers.err | tail -12 | cut -c25- | tee -a "$LOG"
      stop
    }
    SERVER_PID=$tiers_pid
    stop
  }
  merge i13
fi
# issue 14 (and 18, acceptance 3): speculative decoding on the GPU
if wants spec-test; then
  say "speculative decoding: fp32 parity on CUDA (verify graphs on)"
  timeout 260 python3 -m pytest -q -p no:cacheprovider -m gpu -rfEs --timeout=240 tests/e2e/test_cuda_spec.py \
    2>&1 | grep -v "weights:" | tail -8 | tee -a "$LOG"
fi
if wants spec-bench; then
  # all 16 prompts prefill in one step (8192 tokens) and none hits the cache, so a server computes the same
  # greedy tokens in every run: its first run (the random MTP head, nothing accepted) records them and its
  # second proposes them (the oracle re-reads HKV_SPEC_ORACLE when it changes), every draft right
  SPEC=(--max-running-requests 16 --no-prefix-cache --chunked-prefill-size 8192 "${MEM[@]}")
  sbench() {  # sbench TAG [flags]: 16 random 512-token prompts, 128 out, all at once
    bench "$1" --workload random --input-len "$IN" --range-ratio 1 --output-len "$GEN" --num-prompts 16 \
      --concurrency 16 --warmup 1 "${@:2}"
  }
  say "benchmark model: K = 0; then for K = 1, 2, 3 its random MTP head (recording the outputs), then the oracle"
  start s_spec0 "${SPEC[@]}" && { sbench spec_k0; stop; }
  for k in 1 2 3; do
    rm -f "/tmp/oracle_k$k.json"
    export HKV_SPEC_ORACLE=/tmp/oracle_k$k.json
    start "s_spec$k" "${SPEC[@]}" --spec-tokens "$k" --draft-window 16 && {
      sbench "spec_mtp_k$k" --save-outputs "/tmp/oracle_k$k.json"; sbench "spec_oracle_k$k"; stop; }
    unset HKV_SPEC_ORACLE
  done
  merge spec
fi
if wants spec-tiny; then
  say "trained tiny-hybrid: held-out headers, one stream, K = 0..3"
  for k in 0 1 2 3; do
    flags=(); [[ $k != 0 ]] && flags=(--spec-tokens "$k" --draft-window 16)
    MODEL=tiny-hybrid start "s_tiny$k" --max-running-requests 16 "${flags[@]}" && {
      timeout 100 python3 -m tools.bench.bench_spec_tiny --url "http://127.0.0.1:$PORT" --headers 10 --max-tokens 128 \
        --json "/tmp/res_tiny_k$k.json" 2>&1 | tail -2 | sed "s/^/[tiny k=$k] /" | tee -a "$LOG"
      stop
    }
  done
  merge tiny
fi
if wants pd-test; then  # issue 15: prefill and decode on one GPU, device to device (CUDA IPC), fp32 parity
  say "PD on one GPU: the captured peer copy against eager copies, tests/e2e/test_cuda_pd.py"
  timeout 400 python3 -m pytest -q -p no:cacheprovider -m gpu -rfEs -s --timeout=380 tests/engine/test_peer_copy_graphs.py tests/e2e/test_cuda_pd.py \
    2>&1 | grep -v "weights:" | tail -12 | tee -a "$LOG"
fi
if wants pd-bench; then  # issue 15: a 32k-token prompt's transfer against a device copy; TTFT against one instance
  say "page copies: kernel tests (runs and copy_blocks) and tools/bench/bench_kernels.py --only copy"
  timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu -rfEs --timeout=150 tests/kernels/test_copy_runs.py \
    tests/kernels/test_cache_copy.py 2>&1 | tail -4 | tee -a "$LOG"
  timeout 200 python3 -m tools.bench.bench_kernels --only copy --json "$OUT/copy_kernels.json" 2>&1 | tail -12 | tee -a "$LOG"
  say "PD bench: tools/bench/bench_pd.py on the benchmark model"
  timeout 500 python3 -m tools.bench.bench_pd --model "$MODEL" --prompt-tokens "${PD_TOKENS:-32768}" --rounds "${PD_ROUNDS:-4}" --loaded-rounds 4 \
    --json "$OUT/pd.json" 2>&1 | tail -14 | tee -a "$LOG"
fi
if wants pd2; then  # issue 17 (nvidia-h200-x2): prefill on GPU 0, decode on GPU 1 over NCCL, against one instance
  say "PD across two GPUs: tests/e2e/test_cuda_pd2.py (fp32 parity over NCCL), $(nvidia-smi -L | wc -l) GPUs"
  timeout 300 python3 -m pytest -q -p no:cacheprovider -m gpu -rfEs --timeout=280 tests/e2e/test_cuda_pd2.py \
    2>&1 | grep -v "weights:" | tail -8 | tee -a "$LOG"
  say "PD across two GPUs: tools/bench/bench_pd2.py on the benchmark model"
  timeout 580 python3 -m tools.bench.bench_pd2 --model "$MODEL" --rounds "${PD_ROUNDS:-3}" --concurrency 32 \
    --json "$OUT/pd2.json" 2>&1 | grep -v Warning | tail -14 | tee -a "$LOG"
fi
if wants ab; then  # served A/B: this tree's server, then BASE_TREE's, same flags and workloads, one after the other
  [[ -d ${BASE_TREE:-} ]] || say "ab needs BASE_TREE: mkdir -p .out/base && git archive BASE hkv hkv_kernels | tar -x -C .out/base"
  for tree in new base; do
    [[ $tree == base && ! -d ${BASE_TREE:-} ]] && continue
    root=.; [[ $tree == base ]] && root=$BASE_TREE
    say "server $tree ($root)"
    ROOT=$root start "s_ab_$tree" --max-running-requests 64 "${MEM[@]}" && {
      for c in 32 64; do
        bench "ab_${tree}_c$c" --workload random --input-len "$IN" --range-ratio 1 --output-len "$GEN" \
          --num-prompts $((2 * c)) --concurrency $c --warmup 2
      done
      bench "ab_${tree}_prefix1" --workload shared-prefix --groups 1 --prompts-per-group 32 --system-len 2048 \
        --question-len 128 --output-len 32 --concurrency 32 --warmup 0
      bench "ab_${tree}_steady" --workload shared-prefix --groups 16 --prompts-per-group 16 --system-len 2048 \
        --question-len 128 --output-len "$((GEN * 2))" --concurrency 32 --warmup 2
      curl -s "http://127.0.0.1:$PORT/metrics" | grep -E "^hkv_engine_graph_steps_total|^hkv_engine_steps_total" \
        | tee -a "$LOG"
      grep -h "prefill graphs:" "/tmp/s_ab_$tree.err" | cut -c25- | tee -a "$LOG"
      stop
    }
  done
  say "server new, --no-prefix-cache (the shared-prefix ratio's baseline, same run)"
  start s_ab_nocache --max-running-requests 64 --no-prefix-cache "${MEM[@]}" && {
    bench ab_nocache_prefix1 --workload shared-prefix --groups 1 --prompts-per-group 32 --system-len 2048 \
      --question-len 128 --output-len 32 --concurrency 32 --warmup 0
    bench ab_nocache_steady --workload shared-prefix --groups 16 --prompts-per-group 16 --system-len 2048 \
      --question-len 128 --output-len "$((GEN * 2))" --concurrency 32 --warmup 2
    curl -s "http://127.0.0.1:$PORT/metrics" | grep -E "^hkv_engine_graph_steps_total" | tee -a "$LOG"
    stop
  }
  merge ab
fi
if wants wave; then  # the shared-prefix wave (cold cache each run), repeated, on this tree and BASE_TREE's
  for tree in new base; do
    [[ $tree == base && ! -d ${BASE_TREE:-} ]] && continue
    root=.; [[ $tree == base ]] && root=$BASE_TREE
    say "server $tree ($root), --log-request-times"
    ROOT=$root start "s_wave_$tree" --max-running-requests 64 "${MEM[@]}" --log-request-times && {
      for r in 1 2 3; do
        bench "wave_${tree}_$r" --workload shared-prefix --groups 1 --prompts-per-group 32 --system-len 2048 \
          --question-len 128 --output-len 32 --concurrency 32 --warmup 0 | grep -E "TTFT|step /"
        grep -h "router INFO request" "/tmp/s_wave_$tree.err" | tail -32 | cut -c25- | sed -n '1p;2p;32p' | tee -a "$LOG"
      done
      curl -s "http://127.0.0.1:$PORT/metrics" | grep -E "^hkv_engine_graph_steps_total" | tee -a "$LOG"
      stop
    }
  done
  merge wave
fi
if wants burst; then  # the wave landing in one router step (tools/bench/bench_burst.py), on this tree and BASE_TREE's
  for tree in new base; do
    [[ $tree == base && ! -d ${BASE_TREE:-} ]] && continue
    root=.; [[ $tree == base ]] && root=$BASE_TREE
    say "server $tree ($root): a burst of $WAVE requests in one step"
    ROOT=$root start "s_burst_$tree" --max-running-requests 64 "${MEM[@]}" && {
      timeout 300 python3 -m tools.bench.bench_burst --url "http://127.0.0.1:$PORT" --name "s_burst_$tree" --requests "$WAVE" \
        --shared "$SYS" --own "$QL" --vocab "$VOCAB" --rounds 3 --json "$OUT/burst_$tree.json" 2>&1 | tee -a "$LOG"
      stop
    }
  done
fi
if wants steps; then  # the wave's prefill steps in-process: the prefill graphs' rounds, forced and as picked, against eager
  say "in-process prefill steps (tools/bench/bench_prefill.py)"
  timeout "${STEPS_TIMEOUT_S:-300}" python3 -m tools.bench.bench_prefill --json "$OUT/prefill_steps.json" 2>&1 \
    | grep -v Warning | tee -a "$LOG"
fi
if wants rate; then  # the default shared-prefix workload (64 groups x 16) at request rates, with and without the cache
  # one server at a time: two starting together on one GPU skew each other's capture-time replay timings, which the
  # prefill cost model uses (a 2,048-token replay read 40 ms instead of 18)
  for tag in ${RATE_SERVERS:-cache nocache}; do
    flags=; [[ $tag == nocache ]] && flags=--no-prefix-cache
    say "server $tag: shared-prefix waves, steady and at ${RATES:-${RATE:-16}} requests/s"
    start "s_rate_$tag" --max-running-requests 64 "${MEM[@]}" $flags && {
      for r in $(seq 1 "${WAVES:-3}"); do
        bench "rate_wave_${tag}_$r" --workload shared-prefix --groups 1 --prompts-per-group "$WAVE" --system-len "$SYS" \
          --question-len "$QL" --output-len 32 --concurrency "$WAVE" --warmup 0 | grep -E "TTFT|hit"
      done
      [[ -z ${NO_STEADY:-} ]] && bench "rate_steady_$tag" --workload shared-prefix --groups $((NGROUPS > 4 ? NGROUPS / 4 : 1)) --prompts-per-group 16 --system-len "$SYS" \
        --question-len "$QL" --output-len "$((GEN * 2))" --concurrency "$WAVE" --warmup 2
      for rate in ${RATES:-${RATE:-16}}; do
        bench "rate_r${rate}_$tag" --workload shared-prefix --groups "$NGROUPS" --system-len "$SYS" \
          --question-len "$QL" --output-len "$((GEN * 2))" --request-rate "$rate" --warmup 2
      done
      curl -s "http://127.0.0.1:$PORT/metrics" | grep -E "^hkv_engine_graph_steps_total|^hkv_engine_steps_total" \
        | tee -a "$LOG"
      grep -h "prefill graphs:" "/tmp/s_rate_$tag.err" | cut -c25- | tee -a "$LOG"
      stop
    }
  done
  merge rate
fi
if wants decode; then
  say "in-process decode step"
  timeout 300 python3 -m tools.bench.bench_decode --profile --mixed --json "$OUT/decode.json" 2>&1 | grep -v Warning \
    | tee -a "$LOG"
fi
if wants sweep; then
  say "kernel tile sweeps"
  timeout 200 python3 -m tools.bench.bench_kernels --only sweep --json "$OUT/sweep.json" 2>&1 | grep -v Warning | tail -60 \
    | tee -a "$LOG"
fi
stop
exit 0
