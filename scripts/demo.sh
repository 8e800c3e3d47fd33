#!/usr/bin/env bash
# Serve the embedded default model with the project's launcher and sparse layers (layers 0-1 full,
# 2-29 through the project's per-layer pools; the budget keeps every token until decode eviction
# lands), show one chat completion, its answer and the per-layer stats, then serve until Ctrl-C.
# Arguments replace the sparsity options (e.g. `scripts/demo.sh --kvsparse-preset off`).
set -euo pipefail
cd "$(dirname "$0")/.."
port=${PORT:-30000}
url="http://127.0.0.1:$port"
log=${DEMO_LOG:-/tmp/sglang-kvsparse-demo.log}

if [ $# -eq 0 ]; then set -- --kvsparse-full-layers 0,1 --kvsparse-budget 8192; fi
.venv/bin/python -m sglang_kvsparse.launch_server --port "$port" "$@" >"$log" 2>&1 &
server=$!
trap 'kill $server 2>/dev/null; wait $server 2>/dev/null' EXIT INT TERM
echo "[demo] starting the server (about a minute on a CPU); log: $log"
until curl -sf "$url/health" >/dev/null; do
    if ! kill -0 $server 2>/dev/null; then
        echo "[demo] the server exited:"; tail -20 "$log"; exit 1
    fi
    sleep 2
done
grep '^\[sglang-kvsparse\]' "$log" || true

request='{"model": "default", "temperature": 0, "max_tokens": 64,
  "messages": [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]}'
echo "[demo] POST $url/v1/chat/completions"
echo "$request"
curl -s "$url/v1/chat/completions" -H 'Content-Type: application/json' -d "$request" |
    .venv/bin/python -c 'import json,sys; r=json.load(sys.stdin); print("[demo] answer:", r["choices"][0]["message"]["content"])'
echo "[demo] GET $url/kvsparse/stats"
curl -s "$url/kvsparse/stats" | .venv/bin/python -c '
import json, sys
stats = json.load(sys.stdin)
if not stats.get("enabled"):
    print("[demo] sparsity off")
else:
    layers = [l for l in stats["layers"] if l["kind"] == "sparse"]
    pool = stats["pools"][0]
    budget, plans = layers[0]["budget"], stats["forward_plans"]
    free, initial = pool["free_slots"], pool["initial_free_slots"]
    print(f"[demo] {len(layers)} sparse layers (budget {budget}); {plans} forwards through the "
          f"sparse path; after the request: {free}/{initial} slots free")
' || true
echo "[demo] serving at $url (OpenAI API at $url/v1); Ctrl-C to stop"
wait $server
