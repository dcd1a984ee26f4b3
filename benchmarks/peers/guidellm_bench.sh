#!/usr/bin/env bash
# guidellm's streaming benchmark against `fastserve serve`, as a user of that tool would run it.
#
# guidellm is a client-side load tool, never a fastserve dependency: it lives in its own
# virtualenv outside the repo (GUIDELLM_VENV, made on first use with the CPU torch build so pip
# does not pull CUDA wheels). The run is bounded (a few concurrent streams, MAX_REQUESTS
# requests) and prints guidellm's own console report: request latency, TTFT, ITL, tokens/s.
#
# usage: benchmarks/peers/guidellm_bench.sh [MODEL_DIR]      (default: the built-in tiny model)
#
# Environment: GUIDELLM_VENV (/work/guidellm-venv), PORT (8731), STREAMS (4), MAX_REQUESTS (40),
# PROMPT_TOKENS (128), OUTPUT_TOKENS (64), FASTSERVE_ARGS (extra `fastserve serve` flags).
set -euo pipefail
case "${1:-}" in  # the header above is the usage text
  -h|--help) sed -n '2,/^$/{/^#/s/^# \{0,1\}//p}' "$0"; exit 0 ;;
esac
cd "$(dirname "$0")/../.."

GUIDELLM_VENV=${GUIDELLM_VENV:-/work/guidellm-venv}
PORT=${PORT:-8731}
STREAMS=${STREAMS:-4}
MAX_REQUESTS=${MAX_REQUESTS:-40}
PROMPT_TOKENS=${PROMPT_TOKENS:-128}
OUTPUT_TOKENS=${OUTPUT_TOKENS:-64}
PY=.venv/bin/python

if [ ! -x "$GUIDELLM_VENV/bin/guidellm" ]; then
    python3 -m venv "$GUIDELLM_VENV"
    "$GUIDELLM_VENV/bin/pip" install --quiet "torch==2.13.0"
    "$GUIDELLM_VENV/bin/pip" install --quiet "guidellm==0.8.1"
fi

MODEL_DIR=${1:-$($PY -c 'from fastserve.model.make_model import default_model_path; print(default_model_path())')}
LOG=$(mktemp /tmp/fastserve-guidellm.XXXXXX.log)
# shellcheck disable=SC2086
$PY -m fastserve.cli serve "$MODEL_DIR" --served-model-name tiny --port "$PORT" --no-access-log \
    ${FASTSERVE_ARGS:-} >"$LOG" 2>&1 &
SERVER=$!
trap 'kill -TERM $SERVER 2>/dev/null; wait $SERVER 2>/dev/null || true' EXIT
for _ in $(seq 600); do
    if curl -sf "http://127.0.0.1:$PORT/health" >/dev/null; then break; fi
    if ! kill -0 $SERVER 2>/dev/null; then cat "$LOG"; exit 1; fi
    sleep 0.5
done

echo "guidellm $("$GUIDELLM_VENV/bin/guidellm" --version | awk '{print $NF}') -> fastserve at" \
     "http://127.0.0.1:$PORT ($STREAMS concurrent streams, $MAX_REQUESTS requests," \
     "$PROMPT_TOKENS prompt / $OUTPUT_TOKENS output tokens)"
OUT=$(mktemp -d /tmp/fastserve-guidellm.XXXXXX)
"$GUIDELLM_VENV/bin/guidellm" run \
    --backend "kind=openai_http,target=http://127.0.0.1:$PORT,model=tiny" \
    --profile "kind=concurrent,streams=$STREAMS" \
    --constraint "kind=max_requests,count=$MAX_REQUESTS" \
    --data "kind=synthetic_text,prompt_tokens=$PROMPT_TOKENS,output_tokens=$OUTPUT_TOKENS" \
    --tokenizer "kind=huggingface_auto,model=$MODEL_DIR" \
    --output "kind=console" --output "kind=json,path=$OUT/benchmarks.json" \
    --disable-console-interactive
echo "guidellm's report: $OUT/benchmarks.json; server log: $LOG"
