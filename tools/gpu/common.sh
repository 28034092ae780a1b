# Sourced by the tools/gpu/*.sh device scripts, from the repository root: the environment of a device call
# (OUT, the carried wheels, this tree first on PYTHONPATH), and start/stop of one hkv-launch server
# (which needs MODEL, PORT, LOG and say(); DEVICE defaults to cuda, START_WAIT (half-seconds) to 600).

OUT=${OUT:-.out}  # the device tool's folder of files that come back (./.out by hand)
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1; then  # carried wheels (.whl/): fla-core, llguidance, the serving packages
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}

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
    sleep 0.5
  done
  say "server $name did not start"; tail -30 "/tmp/$name.err" | tee -a "$LOG"
  kill -KILL "$SERVER_PID" 2>/dev/null; wait "$SERVER_PID" 2>/dev/null; SERVER_PID=; return 1
}

stop() {
  [[ -n $SERVER_PID ]] && kill -TERM "$SERVER_PID" 2>/dev/null && wait "$SERVER_PID" 2>/dev/null
  SERVER_PID=
}
