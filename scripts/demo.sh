#!/usr/bin/env bash
# Serve the embedded default model with the project's launcher and its default sparsity (layer
# 0 full, 1,024 entries in layers 1-29), show one chat completion and its answer, then one long
# request and what the sparse layers hold while it decodes, then serve until Ctrl-C.
# Arguments are passed to the launcher (e.g. `scripts/demo.sh --kvsparse-budget 256`).
set -euo pipefail
cd "$(dirname "$0")/.."
port=${PORT:-30000}
url="http://127.0.0.1:$port"
log=${DEMO_LOG:-/tmp/sglang-kvsparse-demo.log}

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
.venv/bin/python scripts/demo_long_request.py "$url"
echo "[demo] serving at $url (OpenAI API at $url/v1); Ctrl-C to stop"
wait $server
