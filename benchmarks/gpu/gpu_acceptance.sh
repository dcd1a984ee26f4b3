#!/usr/bin/env bash
# The GPU acceptance checks in one device call under one deadline (benchmarks/gpu/gpu_acceptance.py
# holds the steps, their priority order and the deadline logic, tested on a CPU):
#
#   bash benchmarks/gpu/gpu_acceptance.sh [--budget-s 450] [--steps a,b] [--out DIR] [--dry-run]
#
# Default steps, in priority order: kernels (the Triton kernel tests, natively), decode (the
# decode step against the weight floor, batch 32/128, context 128/2048), fp8 (the same over a
# float8 KV cache), thr32 (offline batch 32 against HF's static-cache generate), thr128-fp8
# (offline batch 128 over a float8 cache, no HF), tests (the CUDA tests), served (skip-join
# against FCFS behind the HTTP server, its KV pool sized from the GPU's memory). Optional, by
# name: sweep, sweep8 (tune the decode kernel's configs; the JSON lands in the output folder).
# Each step's limit is trimmed to what is left of --budget-s and a step that cannot finish in
# what is left is skipped. The output folder ($OUT on the device) gets summary.txt (a line per
# step as it ends, then each log's tail) and logs.tgz.
#
# Everything travels in one prepared folder, .gpu/ (ignored by git; name it in the device
# tool's `carry`), made on this machine by `bash benchmarks/gpu/gpu_acceptance.sh --prepare`:
# the wheels the device image lacks, ../shared/gpu/setup.sh (installs them into /tmp/site and
# sets PYTHONPATH) and weight_floor.py. Then, on the device, in one call of at most 8 minutes:
#
#   bash benchmarks/gpu/gpu_acceptance.sh --budget-s 450
set -u
cd "$(dirname "$0")/../.."
if [ "${1:-}" = "-h" ] || [ "${1:-}" = "--help" ]; then
  echo "usage: bash benchmarks/gpu/gpu_acceptance.sh --prepare | [--budget-s 450] [--steps a,b] [--out DIR] [--dry-run]"
  echo
  exec python3 benchmarks/gpu/gpu_acceptance.py --help
fi
if [ "${1:-}" = "--prepare" ]; then
  shared=${SHARED_GPU:-../shared/gpu}
  exclude=$(git rev-parse --git-path info/exclude)
  grep -qx '/.gpu/' "$exclude" 2>/dev/null || echo /.gpu/ >> "$exclude"
  mkdir -p .gpu
  bash "$shared/wheels.sh" .gpu/whl && cp "$shared/setup.sh" "$shared/weight_floor.py" .gpu/
  ls .gpu .gpu/whl | head -40
  exit
fi
if [ -f .gpu/setup.sh ]; then
  # shellcheck disable=SC1091
  source .gpu/setup.sh
fi
export PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/triton-cache}
exec python3 benchmarks/gpu/gpu_acceptance.py "$@"
