# Sourced by the tools/gpu/*.sh device scripts, from the repository root: the environment of a device call
# (OUT, the carried wheels, this tree first on PYTHONPATH), and start/stop of one hkv-launch server
# (which needs MODEL, PORT and LOG; DEVICE defaults to cuda, START_WAIT (half-seconds) to 600), and the helpers
# wants, say, limit, bench_model, served_sweep and served_bench. A script that sets DEADLINE (the $SECONDS it must be done by)
# gets every wait and timeout here cut short at it.

OUT=${OUT:-.out}  # the device tool's folder of files that come back (./.out by hand)
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1; then  # carried wheels (.whl/): fla-core, llguidance, the serving packages
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}

wants() { [[ ,$parts, == *,$1,* ]]; }  # wants PART: the script's $parts (comma-separated) names it
say() { echo "== $(date +%T) $*" | tee -a "$LOG"; }  # a timestamped line, also into $LOG
limit() {  # limit N: N seconds, or what is left before $DEADLINE if less (at least 1: `timeout 0` never ends)
  local left=$(( ${DEADLINE:-$((SECONDS + $1))} - SECONDS ))
  echo $(( $1 < left ? $1 : (left > 1 ? left : 1) ))
}

bench_model() {  # bench_model DIR WHAT [make_bench_model flags...]: write a benchmark model into DIR unless there
  # (a write cut short is removed, so that no later call on the same machine serves half a checkpoint)
  local dir=$1 what=$2; shift 2
  [[ -d $dir ]] && return 0
  say "writing $what"
  timeout "$(limit 400)" python3 -m tools.bench.make_bench_model "$dir" "$@" --no-progress 2>&1 | tail -2 | tee -a "$LOG"
  (( PIPESTATUS[0] == 0 )) && return 0
  say "writing $what failed: $dir removed"; rm -rf "$dir"; return 1
}

served_sweep() {  # served_sweep NAME [flags of the c = 32 run]: hkv-bench at concurrency 1, 32 and 64 against the
  # server on $PORT (random 512 + 128 tokens; 4 prompts at c = 1, 2c else) into $OUT/NAME_c<c>.json; sets `results`.
  # SWEEP_INPUT_LEN replaces the 512 (a CPU dry run of a script: its prefills are most of a CPU's time)
  local name=$1 c; shift
  results=()
  for c in 1 32 64; do
    local extra=(); [[ $c == 32 ]] && extra=("$@")
    served_bench "$OUT/${name}_c$c.json" "c$c" "$c" $((c == 1 ? 4 : 2 * c)) "${extra[@]}"
    results+=("c$c=$OUT/${name}_c$c.json")
  done
}

served_bench() {  # served_bench JSON TAG C N [flags...]: one hkv-bench run against the server on $PORT (random
  # 512 + 128 tokens, N prompts at concurrency C) into JSON, its summary into $LOG with each line tagged [TAG]
  local json=$1 tag=$2 c=$3 n=$4; shift 4
  timeout "$(limit 420)" python3 -m tools.hkv_bench --url "http://127.0.0.1:$PORT" --no-progress \
    --json "$json" --workload random --input-len "${SWEEP_INPUT_LEN:-512}" --range-ratio 1 --output-len 128 \
    --num-prompts "$n" --concurrency "$c" --warmup 2 "$@" 2>&1 | tail -22 | sed "s/^/[$tag] /" | tee -a "$LOG"
}

start() {  # start NAME [flags...]: a server on $PORT, waits for /ready; ROOT=dir serves that tree's hkv
  local name=$1; shift
  # python -c puts the working directory first on sys.path: start it in the tree it serves
  (cd "${ROOT:-.}" && exec env PYTHONPATH="$(pwd)${PYTHONPATH:+:$PYTHONPATH}" python3 -c \
    'from hkv.launcher import main; main()' --model "$MODEL" --device "${DEVICE:-cuda}" --port "$PORT" \
    --name "$name" "$@" >"/tmp/$name.out" 2>"/tmp/$name.err") &
  SERVER_PID=$!
  local t0=$SECONDS
  for _ in $(seq 1 "${START_WAIT:-600}"); do  # a cold GPU compiles and autotunes at start-up
    curl -sf "http://127.0.0.1:$PORT/ready" >/dev/null 2>&1 && { grep -h "KV pool\|CUDA graphs\|prefill graphs\|serving\|loaded" \
      "/tmp/$name.err" "/tmp/$name.out" | cut -c1-220 | tee -a "$LOG"
      echo "== server $name ready in $((SECONDS - t0)) s" | tee -a "$LOG"; return 0; }
    kill -0 "$SERVER_PID" 2>/dev/null || break
    [[ -n ${DEADLINE:-} ]] && (( SECONDS >= DEADLINE )) && break
    sleep 0.5
  done
  say "server $name did not start"; tail -30 "/tmp/$name.err" | tee -a "$LOG"
  kill -KILL "$SERVER_PID" 2>/dev/null; wait "$SERVER_PID" 2>/dev/null; SERVER_PID=; return 1
}

stop() {
  [[ -n $SERVER_PID ]] && kill -TERM "$SERVER_PID" 2>/dev/null && wait "$SERVER_PID" 2>/dev/null
  SERVER_PID=
}
