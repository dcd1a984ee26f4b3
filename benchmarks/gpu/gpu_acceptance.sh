#!/usr/bin/env bash
# Issue 24's GPU checks in one time-boxed run, each step's log in one folder, for a machine lent
# for minutes (../shared/gpu/README.md's recipe: `source .gpu/setup.sh` first on the device):
#
# usage: bash benchmarks/gpu/gpu_acceptance.sh [LOG_DIR] [STEPS]
#
# LOG_DIR defaults to $OUT (the device tool's return folder), else ./gpu-logs. STEPS is a
# comma-separated subset of: sweep,decode,sweep8,fp8,tests,kernels,sampling,thr32,thr128,
# thr128-fp8,copy,served,served-in-step,kv,suite
# (thr32 and thr128 run fastserve with and without async scheduling, thr128-fp8 async with a
# float8 KV cache; `served` serves with the default, async on CUDA, `served-in-step` without
# it). Default: all but thr128-fp8, served-in-step and suite, past the device tool's 10
# minutes a call, so run it in two or three calls. On an H200
# decode,fp8,tests,thr32,thr128 took 3.5 minutes, served 1, suite 2 (kv: its limit is 4). With
# 15 device minutes in all, two calls: kernels,sweep,decode,sweep8,fp8,tests (about 8 minutes:
# the decode kernels were changed without a GPU, so `kernels` checks their numbers natively
# first, and the sweeps pick the configs the decode steps then use), then
# thr32,thr128,served,suite (about 5.5); kv,copy when time is left. Each step has its own time limit, so one that hangs or crashes
# does not cost the others; the last lines of every log are printed at the end.
set -u
case "${1:-}" in  # the header above is the usage text
  -h|--help) sed -n '2,/^$/{/^#/s/^# \{0,1\}//p}' "$0"; exit 0 ;;
esac
cd "$(dirname "$0")/../.."
log=${1:-${OUT:-gpu-logs}}
steps=${2:-sweep,decode,sweep8,fp8,tests,kernels,sampling,thr32,thr128,copy,served,kv}
mkdir -p "$log"
export PYTHONUNBUFFERED=1
model=(--preset llama-2-7b)

step() {  # NAME LIMIT_S COMMAND...
  local name=$1 limit=$2
  shift 2
  case ",$steps," in *",$name,"*) ;; *) return ;; esac
  local t0=$SECONDS
  timeout "$limit" "$@" > "$log/$name.log" 2>&1
  echo "$name: rc=$? in $((SECONDS - t0)) s (limit $limit s)" | tee -a "$log/$name.log"
}

# The decode kernel's launch config for this GPU, written where the engine reads it.
step sweep 240 python3 benchmarks/gpu/triton_decode_sweep.py
step decode 90 python3 benchmarks/gpu/gpu_decode.py "${model[@]}" --reps 10 --profile 32:128,128:128
# The same with a float8 KV cache: half the bytes each decode reads (the ctx 2048 line).
step sweep8 120 python3 benchmarks/gpu/triton_decode_sweep.py --kv-cache-dtype fp8 --quick
step fp8 90 python3 benchmarks/gpu/gpu_decode.py "${model[@]}" --reps 10 --batches 32,128 \
  --contexts 128,2048 --engine-arg kv_cache_dtype=fp8
step tests 150 python3 -m pytest -q -n 4 --timeout 120 -p no:cacheprovider \
  tests/executor/test_cuda_engine.py tests/executor/test_attention.py \
  tests/executor/test_cuda_graphs.py tests/executor/test_swap.py tests/test_llm.py \
  tests/model/test_dummy_load.py tests/engine/test_async_scheduling.py \
  -k "cuda or Cuda or replayed or dummy"
# The Triton kernels against torch, natively (CI runs them under Triton's interpreter).
step kernels 120 python3 -m pytest -q --timeout 100 -p no:cacheprovider \
  tests/executor/interpreted/test_triton_kernels.py
# Temperature sampling: the inverse transform against the exponential race (the GPU default).
step sampling 60 python3 benchmarks/engine/sampling_overhead.py --draw-ab --device cuda
# Offline against HF, fastserve with and without async scheduling (one engine at a time).
step thr32 150 python3 benchmarks/engine/engine_throughput.py "${model[@]}" --batch 32 --reps 1 \
  --kv-cache-gib 20
step thr128 170 python3 benchmarks/engine/engine_throughput.py "${model[@]}" --batch 128 --reps 1 \
  --kv-cache-gib 24
# Batch 128 with a float8 KV cache (not in the defaults): at 128/128 the step reads ~13 GB of
# bfloat16 K/V beside 13.5 GB of weights, so on an H100 12,000 tok/s needs the halved bytes.
step thr128-fp8 120 python3 benchmarks/engine/engine_throughput.py "${model[@]}" --batch 128 --reps 1 \
  --kv-cache-gib 24 --async-scheduling on --engine-arg kv_cache_dtype=fp8
step copy 40 python3 benchmarks/gpu/copy_overlap.py
step served 180 python3 benchmarks/serving/http_bench.py "${model[@]}" --device cuda --dtype bfloat16 \
  --load 0.9 --theta 1.2 --cv 4 --max-output-len 512 --max-batch-size 128 --reps 1 \
  --num-requests 150
# The same served run scheduling in step (not in the defaults).
step served-in-step 180 python3 benchmarks/serving/http_bench.py "${model[@]}" --device cuda \
  --dtype bfloat16 --load 0.9 --theta 1.2 --cv 4 --max-output-len 512 --max-batch-size 128 \
  --reps 1 --num-requests 150 --server-arg=--no-async-scheduling
step kv 240 python3 benchmarks/kv/kv_policies.py --part real --real-model llama-2-7b \
  --real-device cuda --real-dtype bfloat16 --variants robust --quick --real-pool-gib 48
# Every test, the CUDA ones included (not in the default steps: several minutes).
step suite 600 python3 -m pytest -q -n 8 --timeout 300 -p no:cacheprovider

for f in "$log"/*.log; do
  echo "==> $f"
  tail -n 6 "$f"
done
