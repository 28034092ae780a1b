#!/usr/bin/env bash
# One device call for issue 37's acceptance 4 on one GPU: the 1.99 B benchmark model with a 151k-token
# tokenizer (so structured output's masks cost what they cost on Qwen's vocabulary), served by hkv-launch
# with 64 running, and tools/bench/bench_structured: 64 streams, then 32 of them with a JSON schema.
#   run: bash tools/gpu/gpu_structured.sh   (carry .whl: fla-core, llguidance and the serving wheels; .bench: the
#        tokenizer, written by `python -m tools.bench.bench_grammar --train-vocab 151000` or any tokenizer.json)
# A second constrained round on the same server uses the schema without maxLength (--schema unbounded); both print
# the ranks' mask figures (mean fill ms and live rows a step with grammar rows, late wait ms). DEVICE_WAIT=1 then
# runs the device wait's GPU tests and restarts with HKV_GRAMMAR_DEVICE_WAIT=1 (masks filled off the rank's main
# thread, the device waits for them: hkv/engine/mask_wait.py, experimental) for the bounded schema again, on the
# default threads: $OUT/structured_device_wait.json. Warm restarts (the first is issue 38's second-start time)
# then run the bounded schema with --grammar-threads 1, 2 and 8, one restart each (THREADS="1 2 8"; RESTART=0
# skips them; their lines are in the log). About 7 minutes with DEVICE_WAIT=1 on a fresh machine; DEVICE_WAIT=tests runs
# only the device wait's GPU tests. The mask cache is on by default (HKV_GRAMMAR_MASK_CACHE); MASK_CACHE=1 adds restarts
# with HKV_GRAMMAR_MASK_CACHE=0 (the bounded schema without it, and under DEVICE_WAIT=1 also with the device wait):
# $OUT/structured_mask_cache_off_wait{0,1}.json. WAIT_TESTS=0 skips
# the device wait's tests under DEVICE_WAIT=1 (a call after the one that ran them), UNBOUNDED=0 the unbounded round:
#   MASK_CACHE=1 DEVICE_WAIT=1 WAIT_TESTS=0 UNBOUNDED=0 RESTART=0 bash tools/gpu/gpu_structured.sh   (about 6 minutes)
# Results: $OUT/structured.json, $OUT/structured_unbounded.json, $OUT/startup_*.log and $OUT/gpu_structured.log
# (with DEVICE_WAIT=1 also $OUT/structured_device_wait.json and $OUT/device_wait_tests.log).
set -uo pipefail
source tools/gpu/common.sh  # OUT, the carried wheels, PYTHONPATH; start/stop of a server
MODEL=${STRUCTURED_MODEL:-/tmp/bench_model_151k}
TOKENIZER=${TOKENIZER:-.bench/tokenizer-151k.json}
LOG="$OUT/gpu_structured.log"
PORT=8100
SERVER_PID=

device_wait_tests() {  # the device wait's GPU tests: the flag primitive, the same greedy tokens with and without it
  say "the device wait's GPU tests: the flag primitive, and the same greedy tokens with and without it"
  # -v and a file: a test killed by `timeout` still leaves the lines it printed (the 2026-12-05 call printed none);
  # the thread method dumps every thread's stack at a test's timeout even when the main thread is in a CUDA call;
  # 330 s a test: the e2e test starts two fp32 servers, the first compiling its kernels cold on a fresh machine
  timeout 420 python3 -m pytest -v -p no:cacheprovider -m gpu -rfEs --timeout=330 --timeout-method=thread \
    --durations=5 tests/engine/test_host_flag.py tests/e2e/test_cuda_grammar_wait.py > "$OUT/device_wait_tests.log" 2>&1
  echo "device wait tests: exit $?" >> "$OUT/device_wait_tests.log"
  grep -v "warnings.warn\|Warning" "$OUT/device_wait_tests.log" | tail -40 | tee -a "$LOG"
}

nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,memory.used --format=csv | tee -a "$LOG"
if [[ ${DEVICE_WAIT:-0} == tests ]]; then device_wait_tests; exit 0; fi  # those tests alone (about 3 minutes)
bench_model "$MODEL" "the 1.99 B benchmark model with $TOKENIZER" --tokenizer "$TOKENIZER"
say "server: the benchmark model, bf16, 64 running"
start s_structured --max-running-requests 64 && {
  timeout 400 python3 -m tools.bench.bench_structured --url "http://127.0.0.1:$PORT" --streams 64 --constrained 32 \
    --json "$OUT/structured.json" 2>&1 | tee -a "$LOG"
  if [[ ${UNBOUNDED:-1} == 1 ]]; then
    say "the same server, the schema without maxLength (llguidance's cheap case: is the bounded string the cost?)"
    timeout 200 python3 -m tools.bench.bench_structured --url "http://127.0.0.1:$PORT" --streams 64 --constrained 32 \
      --schema unbounded --json "$OUT/structured_unbounded.json" 2>&1 | tee -a "$LOG"
  fi
  say "mask figures since start (hkv_engine_grammar_*: steps, fill seconds, live rows, late wait seconds)"
  curl -s "http://127.0.0.1:$PORT/metrics" | grep -E "^hkv_engine_(grammar_|steps_total|step_seconds_total|graph_steps_total)" \
    | tee -a "$LOG"
  grep -h "structured output\|grammar\|without drafts" /tmp/s_structured.err | head -5 | tee -a "$LOG"
  stop
  grep -h "done in\|ready in" /tmp/s_structured.err /tmp/s_structured.out | tee "$OUT/startup_first.log" >/dev/null
  if [[ ${DEVICE_WAIT:-0} == 1 ]]; then  # before the thread restarts: what the next call most needs
    [[ ${WAIT_TESTS:-1} == 1 ]] && device_wait_tests
    say "start again with HKV_GRAMMAR_DEVICE_WAIT=1: the bounded schema, masks filled off the rank's main thread"
    export HKV_GRAMMAR_DEVICE_WAIT=1  # the launcher's config reads it; the ranks get it in their config
    start s_structured --max-running-requests 64 && {
      # the rank says whether the wait is on, or why the driver cannot wait (then this round is the late path again)
      grep -h "HKV_GRAMMAR_DEVICE_WAIT\|the device waits for them" /tmp/s_structured.err | head -3 | tee -a "$LOG"
      timeout 400 python3 -m tools.bench.bench_structured --url "http://127.0.0.1:$PORT" --streams 64 --constrained 32 \
        --json "$OUT/structured_device_wait.json" 2>&1 | tee -a "$LOG"
      say "mask figures with the device wait (wait seconds: from a step's forward queued to its fill starting)"
      curl -s "http://127.0.0.1:$PORT/metrics" | grep -E "^hkv_engine_(grammar_|steps_total|step_seconds_total)" \
        | tee -a "$LOG"
      stop
    }
    unset HKV_GRAMMAR_DEVICE_WAIT
  fi
  if [[ ${MASK_CACHE:-0} == 1 ]]; then  # HKV_GRAMMAR_MASK_CACHE=0 (hkv/engine/mask_cache.py), alone and with the wait
    waits="0"; [[ ${DEVICE_WAIT:-0} == 1 ]] && waits="0 1"
    for wait in $waits; do
      say "start again with HKV_GRAMMAR_MASK_CACHE=0 (no mask cache) and HKV_GRAMMAR_DEVICE_WAIT=$wait: the bounded schema"
      HKV_GRAMMAR_MASK_CACHE=0 HKV_GRAMMAR_DEVICE_WAIT=$wait start s_structured --max-running-requests 64 && {
        timeout 300 python3 -m tools.bench.bench_structured --url "http://127.0.0.1:$PORT" --streams 64 \
          --constrained 32 --json "$OUT/structured_mask_cache_off_wait$wait.json" 2>&1 | tee -a "$LOG"
        stop
      }
    done
  fi
  # restarts with other mask thread counts (THREADS, default "1 2 8", beside the default 4 of a 16-CPU box);
  # the first is issue 38's second-start time
  for threads in $([[ ${RESTART:-1} == 0 ]] || echo "${THREADS:-1 2 8}"); do
    say "start again (warm compile cache), masks on $threads threads"
    start s_structured --max-running-requests 64 --grammar-threads "$threads" && {
      [[ -f $OUT/startup_second.log ]] || grep -h "done in\|ready in" /tmp/s_structured.err /tmp/s_structured.out \
        | tee "$OUT/startup_second.log" >/dev/null
      timeout 200 python3 -m tools.bench.bench_structured --url "http://127.0.0.1:$PORT" --streams 64 --constrained 32 \
        --json "/tmp/structured_${threads}threads.json" 2>&1 | grep -E "step|masks" | tee -a "$LOG"
      stop
    }
  done
}
exit 0
