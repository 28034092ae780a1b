#!/usr/bin/env bash
# One device call for issue 39's FP8 KV cache (--kv-cache-dtype fp8_e4m3) on one H200 (or H100), under ~8 minutes:
#   tests   the @gpu kernel tests: Triton paged attention (prefill, decode, split decode) reading FP8 pages in
#           fp32 / bf16 / fp16 against the reference, the attention prep's FP8 store byte for byte (~1-2 min)
#   serve   tiny-hybrid served with FP8 KV on CUDA (graphs on): a prompt cold, then again as a device prefix hit,
#           with the same greedy tokens, and the start-up line with the KV bytes a token (~1-2 min)
#   decode  acceptance 3's last line: the 1.99 B benchmark model's decode step at concurrency 32 over 32k tokens
#           of context, bf16 KV then FP8 KV in the same run (tools/bench/bench_decode.py, graphs; ~2-3 min)
#   sweep   the split decode attention alone over bf16 and FP8 pages of the benchmark model's attention shapes
#           (B1 / B32 x 32768 keys, B64 x 4096): tiles x split counts, each checked against the reference
#           (tools/bench/bench_decode_fp8kv.py via bench_kernels --only decode_fp8kv; ~1-3 min, mostly compiles)
#           With decode as well, the sweep runs first and its FP8 pick is pasted into the device's copy of
#           DECODE_TILES (tools/bench/paste_decode_tiles.py), so that the decode step runs it in the same call.
#   run: bash tools/gpu/gpu_fp8kv.sh [parts: tests,serve,decode,sweep; default tests,serve,decode]
# Results: $OUT/fp8kv_decode.json, $OUT/fp8kv_sweep.json (every row) with $OUT/fp8kv_sweep.log (the whole
# output), and the log $OUT/gpu_fp8kv.log. Look for: the tests passing, "same tokens: True",
# "FP8 KV speed-up at B32 x 32768: >= 1.3x" (the issue's bar), and the sweep's "DECODE_TILES line for
# fp8_e4m3 pages" (the line to paste into hkv_kernels/paged_attention/triton_paged_attention.py).
set -uo pipefail
source tools/gpu/common.sh  # OUT, the carried wheels, PYTHONPATH; start/stop of a server
parts=${1:-tests,serve,decode}
LOG="$OUT/gpu_fp8kv.log"
PORT=8100
SERVER_PID=

nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,memory.used --format=csv | tee -a "$LOG"
if wants tests; then
  say "FP8 KV kernel tests on the GPU (fp32 / bf16 / fp16 queries over FP8 pages against the reference)"
  timeout 300 python3 -m pytest -q -p no:cacheprovider -m gpu -rfEs --tb=short --timeout=280 \
    tests/kernels/test_fp8_kv.py >/tmp/fp8kv_tests.log 2>&1
  # the first run on an H200 failed 7 of these: keep each failure's assertion lines, not only the summary
  grep -E "^E |^FAILED|^tests/kernels/.*Error|passed|failed" /tmp/fp8kv_tests.log | head -80 | tee -a "$LOG"
fi
if wants serve; then
  say "tiny-hybrid with --kv-cache-dtype fp8_e4m3 on CUDA: cold, then a device prefix hit"
  MODEL=tiny-hybrid start s_fp8kv --kv-cache-dtype fp8_e4m3 --max-total-tokens 16384 && {
    python3 - "$PORT" <<'EOF' 2>&1 | tee -a "$LOG"
import json, random, sys, urllib.request
url = f"http://127.0.0.1:{sys.argv[1]}/v1/completions"
prompt = [random.Random(5).randrange(3, 1000) for _ in range(700)]
def run():
    body = json.dumps({"prompt": prompt, "max_tokens": 32, "temperature": 0, "return_token_ids": True}).encode()
    req = urllib.request.Request(url, body, {"Content-Type": "application/json"})
    return json.load(urllib.request.urlopen(req, timeout=120))
cold, hit = run(), run()
print("cold cached", cold["usage"]["prompt_tokens_details"]["cached_tokens"], "hit cached",
      hit["usage"]["prompt_tokens_details"]["cached_tokens"])
print("same tokens:", cold["choices"][0]["token_ids"] == hit["choices"][0]["token_ids"])
EOF
    stop
  }
fi
if wants sweep; then
  say "decode attention over bf16 and FP8 pages: tiles x split counts (bench_kernels --only decode_fp8kv)"
  timeout 420 python3 -m tools.bench.bench_kernels --only decode_fp8kv --json "$OUT/fp8kv_sweep.json" 2>&1 \
    | grep -v Warning | tee "$OUT/fp8kv_sweep.log" | grep -Ev "^decode_fp8kv .*% of copy" | tee -a "$LOG"
  if wants decode; then
    # the decode part below then runs the sweep's FP8 picks: pasted into this machine's copy of the source only
    say "pasting the sweep's FP8 DECODE_TILES line into this copy of the source for the decode part"
    python3 -m tools.bench.paste_decode_tiles "$OUT/fp8kv_sweep.log" 2>&1 | tee -a "$LOG"
  fi
fi
if wants decode; then
  say "decode step of the 1.99 B benchmark model, B32 x 32768 tokens of context: bf16 KV, then FP8 KV"
  # at most 420 s, and within the call's 600 s where parts ran before it (SECONDS: this script's time so far)
  left=$(( 580 - SECONDS )); left=$(( left > 420 ? 420 : (left < 60 ? 60 : left) ))
  timeout "$left" python3 -m tools.bench.bench_decode --batches 1,32 --context 32768 --iters 20 --graphs-only \
    --kv-cache-dtype bfloat16,fp8_e4m3 --json "$OUT/fp8kv_decode.json" 2>&1 | grep -v Warning | tee -a "$LOG"
  python3 - "$OUT/fp8kv_decode.json" <<'EOF' 2>&1 | tee -a "$LOG"
import json, sys
rows = {(r["kv_dtype"], r["batch"]): r for r in json.load(open(sys.argv[1]))["rows"] if r["graphs"]}
for b in (1, 32):
    if ("bfloat16", b) in rows and ("fp8_e4m3", b) in rows:
        bf16, fp8 = rows["bfloat16", b]["step_ms"], rows["fp8_e4m3", b]["step_ms"]
        print(f"FP8 KV speed-up at B{b} x 32768: {bf16 / fp8:.2f}x ({bf16:.3f} ms bf16 KV, {fp8:.3f} ms FP8 KV)"
              + ("  (the issue's bar: >= 1.3x)" if b == 32 else ""))
EOF
fi
[[ -n $SERVER_PID ]] && kill -TERM "$SERVER_PID" 2>/dev/null
exit 0
