#!/usr/bin/env bash
# A newcomer's first start, timed: this commit (HEAD, as a fresh clone has it) in a new folder,
# `make serve` (venv, install, kernel build, model, cost profile) until the first completion
# answers; then, installed, `fastserve serve` again until its first answer. Prints seconds.
# A cold kernel cache and model cache (a fresh FASTSERVE_CACHE); pip's own cache is kept, as
# a machine that installed anything before has it. Run it alone on the machine:
#   bash benchmarks/engine/first_start.sh
set -euo pipefail
if [[ ${1:-} == -h || ${1:-} == --help ]]; then
    echo "usage: bash benchmarks/engine/first_start.sh   (no options; prints the seconds to the first answers)"
    exit 0
fi
repo=$(cd "$(dirname "$0")/../.." && pwd)
work=$(mktemp -d "${TMPDIR:-/tmp}/fastserve-first.XXXXXX")
export FASTSERVE_CACHE="$work/cache"
pid=
cleanup() {
    if [[ -n $pid ]]; then kill -- -"$pid" 2>/dev/null || kill "$pid" 2>/dev/null || true; fi
    rm -rf "$work"
}
trap cleanup EXIT
mkdir "$work/clone"
git -C "$repo" archive --format=tar HEAD | tar -x -C "$work/clone"
cd "$work/clone"

# Seconds from `start` until a completion answers on `port`, or until the server dies.
first_answer() {
    local start=$1 port=$2 log=$3
    until curl -sf "http://127.0.0.1:$port/v1/completions" -H 'Content-Type: application/json' \
            -d '{"model": "tiny", "prompt": "Hello", "max_tokens": 8}' > /dev/null 2>&1; do
        kill -0 "$pid" 2>/dev/null || { cat "$log"; echo "first_start: the server died" >&2; exit 1; }
        sleep 0.25
    done
    echo $(( $(date +%s%N) / 1000000 - start ))
}

port=$(( 18000 + RANDOM % 2000 ))
start=$(( $(date +%s%N) / 1000000 ))
setsid make serve PORT="$port" > "$work/make.log" 2>&1 &
pid=$!
ms=$(first_answer "$start" "$port" "$work/make.log")
echo "first_start: make serve, fresh clone, cold caches: first answer after $((ms / 1000)).$((ms % 1000 / 100)) s"
grep -E "installing|CPU kernels|done in|serving" "$work/make.log" | sed 's/^/first_start:   /'
kill -- -"$pid"; wait "$pid" 2>/dev/null || true

port=$(( 18000 + RANDOM % 2000 ))
start=$(( $(date +%s%N) / 1000000 ))
setsid .venv/bin/fastserve serve --port "$port" > "$work/serve.log" 2>&1 &
pid=$!
ms=$(first_answer "$start" "$port" "$work/serve.log")
echo "first_start: installed fastserve serve: first answer after $((ms / 1000)).$((ms % 1000 / 100)) s"
grep -E "done in|serving" "$work/serve.log" | sed 's/^/first_start:   /'
kill -- -"$pid"; wait "$pid" 2>/dev/null || true
pid=
