#!/usr/bin/env bash
# The API with curl. Start a server first: python -m tinyserve   (serves the bundled stories260k)
set -euo pipefail
URL=${URL:-http://127.0.0.1:8000}
MODEL=${MODEL:-$(curl -s "$URL/v1/models" | python3 -c 'import json,sys; print(json.load(sys.stdin)["data"][0]["id"])')}

curl -s "$URL/health"; echo
curl -s "$URL/ready"; echo

# Completion (one JSON body)
curl -s "$URL/v1/completions" -H 'Content-Type: application/json' \
  -d "{\"model\": \"$MODEL\", \"prompt\": \"Once upon a time\", \"max_tokens\": 16, \"temperature\": 0}"
echo

# Chat, streamed as Server-Sent Events
curl -sN "$URL/v1/chat/completions" -H 'Content-Type: application/json' \
  -d "{\"model\": \"$MODEL\", \"messages\": [{\"role\": \"user\", \"content\": \"Hi!\"}],
       \"max_tokens\": 16, \"stream\": true, \"stream_options\": {\"include_usage\": true}}"

# A bad request: the OpenAI error envelope
curl -s "$URL/v1/completions" -H 'Content-Type: application/json' -d '{"model": "nope", "prompt": "x"}'
echo

# Prometheus metrics
curl -s "$URL/metrics" | grep -E '^tinyserve:(num_requests|kv_cache_usage|prefix_cache_hits)'
