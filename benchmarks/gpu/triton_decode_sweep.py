"""Tune the Triton paged-decode kernel for this GPU: every launch config on the decode shapes
that matter, timed side by side, the best per batch size written where the engine reads it.

For each attention shape (Llama-2-7B: 32 heads, MHA; Llama-3-8B: GQA 32/8; head_dim 128) it
times `paged_decode` as a CUDA graph's decode iteration runs it (each decode rotating q and k
and storing its own token) through scattered block tables at batch 32 with 128 and 2048 tokens of context and
batch 128 with 128, for each `DecodeConfig` (keys per tile, warps, pipeline stages,
tensor-core dot or not, a register cap), and prints the KV bytes read per second. Per batch
size it keeps the config whose times are closest to each shape's best (the sum of time / best
over that batch's contexts, so a short context counts as much as a long one): batch 32's as the
entry for batches up to 32, batch 128's for the rest. Both go to
`$FASTSERVE_CACHE/triton/decode-<GPU>.json`, which the CUDA backend reads at start-up (as vLLM
ships fused-MoE configs per device); copy it into `fastserve/executor/backends/configs/` to
ship it.

    python benchmarks/gpu/triton_decode_sweep.py [--dtype bfloat16] [--quick]
    python benchmarks/gpu/triton_decode_sweep.py --kv-cache-dtype fp8   # a float8 E4M3 cache's configs
"""

from __future__ import annotations

import argparse
import itertools
import json
import time
from dataclasses import asdict
from pathlib import Path

import torch

from fastserve.executor.backends import KV_TORCH_DTYPES
from fastserve.executor.backends import triton_ops as ops
from fastserve.executor.backends.triton_configs import (
    PROVENANCE_KEY,
    DecodeConfig,
    tuned_config_dir,
    tuned_config_name,
)

# (batch, context): a decode step's context is the tokens before it plus its own, so these are
# gpu_decode.py's contexts 128 and 2048.
SHAPES = [(32, 129), (32, 2049), (128, 129)]
# The batch sizes configs are chosen for: entries for batches up to 32, and for the rest.
BATCHES = (32, 128)
ATTENTION = {"llama-2-7b": (32, 32), "llama-3-8b": (32, 8)}  # heads, KV heads
HEAD_DIM, BLOCK_SIZE = 128, 16
LAYERS = 4


def _case(batch: int, ctx: int, heads: int, kv_heads: int, dtype: torch.dtype,
          cache_dtype: torch.dtype) -> dict:
    per = -(-ctx // BLOCK_SIZE)
    num_blocks = batch * per
    g = torch.Generator().manual_seed(0)
    tables = torch.randperm(num_blocks, generator=g).view(batch, per).to(torch.int32)
    slots = (kv_heads, num_blocks * BLOCK_SIZE, HEAD_DIM)
    last = ctx - 1  # each decode's own token: stored by the launch, as in the engine's graphs
    new_slots = tables[:, last // BLOCK_SIZE].long() * BLOCK_SIZE + last % BLOCK_SIZE
    kv = torch.randn(batch, 2 * kv_heads, HEAD_DIM, device="cuda", dtype=dtype)
    return dict(
        q=torch.randn(batch, heads, HEAD_DIM, device="cuda", dtype=dtype),
        # Several layers' caches, read in turn: a layer's KV is never in L2 from its last read.
        k_caches=[torch.randn(slots, device="cuda").to(cache_dtype) for _ in range(LAYERS)],
        v_caches=[torch.randn(slots, device="cuda").to(cache_dtype) for _ in range(LAYERS)],
        q_rows=torch.arange(batch, device="cuda"),
        block_table=tables.cuda(),
        ctx_lens=torch.full((batch,), ctx, dtype=torch.int32, device="cuda"),
        out=torch.empty(batch, heads, HEAD_DIM, device="cuda", dtype=dtype),
        new_kv=(kv[:, :kv_heads], kv[:, kv_heads:], new_slots.cuda()),
        rotary=torch.randn(batch, 1, HEAD_DIM, device="cuda", dtype=dtype).chunk(2, dim=-1),
        splits=ops.decode_splits(batch, kv_heads, ctx,
                                 torch.cuda.get_device_properties(0).multi_processor_count),
        kv_bytes=2 * batch * ctx * kv_heads * HEAD_DIM * cache_dtype.itemsize,
    )


def _time_ms(case: dict, cfg: DecodeConfig, reps: int) -> float:
    def call(layer: int = 0) -> None:
        ops.paged_decode(case["q"], case["k_caches"][layer], case["v_caches"][layer], case["q_rows"],
                         case["block_table"], case["ctx_lens"], BLOCK_SIZE, HEAD_DIM**-0.5,
                         case["splits"], case["out"], config=cfg, new_kv=case["new_kv"],
                         rotary=case["rotary"])

    call()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for i in range(reps):
        call(i % LAYERS)
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / reps


def _configs(quick: bool, group: int) -> list[DecodeConfig]:
    block_ns, warps, stages = ((32, 64), (4,), (2, 3)) if quick else ((32, 64, 128), (2, 4, 8), (2, 3))
    grid = [DecodeConfig(block_n=n, num_warps=w, num_stages=st, use_dot=dot)
            for n, w, st, dot in itertools.product(block_ns, warps, stages, (False, True))
            if dot or group <= 4]  # a wide group's broadcast product outgrows registers
    # Register caps for more programs an SM (triton_sass.py, sm_90, Triton 3.6): 64 fit 8 programs
    # of 32 keys and 4 warps (ptxas's 72: 7), so batch 32's 1,024 MHA programs run in one wave
    # on 132 SMs; 96 fit 5 of 64 keys over a float8 cache (its 106: 4), as many as bf16's.
    return grid + [DecodeConfig(block_n=32, num_warps=4, num_stages=2, max_registers=64),
                   DecodeConfig(block_n=64, num_warps=4, num_stages=2, max_registers=96)]


def _name(cfg: DecodeConfig) -> str:
    regs = f" r{cfg.max_registers}" if cfg.max_registers else ""
    return (f"n{cfg.block_n} w{cfg.num_warps} s{cfg.num_stages} "
            f"{'dot' if cfg.use_dot else 'sum'}{regs}")


def _provenance(device_name: str, model: str, args: argparse.Namespace,
                best_ms: dict[str, float]) -> dict[str, object]:
    """Where a shipped file's figures come from: the GPU, the versions, the command, when,
    and each shape's fastest time (ms), per attention shape swept."""
    import subprocess

    import triton

    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True, timeout=10).stdout.strip()
    except OSError:
        commit = ""
    return {"gpu": device_name, "torch": torch.__version__, "triton": triton.__version__,
            "commit": commit, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "command": "python benchmarks/triton_decode_sweep.py " + " ".join(
                f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items()
                if k not in ("out", "no_write") and v not in (False, None)),
            f"{model} {args.kv_cache_dtype} cache, fastest ms per (batch, context)": best_ms}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", default="bfloat16", help="the model's (q and the output)")
    ap.add_argument("--kv-cache-dtype", default="auto", choices=["auto", *KV_TORCH_DTYPES],
                    help="the cache's (auto: --dtype)")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--quick", action="store_true", help="fewer configs")
    ap.add_argument("--no-write", action="store_true", help="print only")
    ap.add_argument("--out", default=None, metavar="DIR",
                    help="also write the file into DIR (the device run's output folder), with "
                         "its provenance, to be copied into fastserve/executor/backends/configs/")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("(no CUDA device: nothing to tune)")
        return
    dtype = getattr(torch, args.dtype)
    cache_dtype = dtype if args.kv_cache_dtype == "auto" else KV_TORCH_DTYPES[args.kv_cache_dtype]
    device_name = torch.cuda.get_device_name(0)
    t0 = time.perf_counter()
    for model, (heads, kv_heads) in ATTENTION.items():
        group = heads // kv_heads
        cases = [_case(b, c, heads, kv_heads, dtype, cache_dtype) for b, c in SHAPES]
        print(f"\n{model} attention ({heads} heads, {kv_heads} KV heads, {args.dtype}, "
              f"{str(cache_dtype).removeprefix('torch.')} cache) on "
              f"{device_name}: KV GB/s at (batch, context) {SHAPES}")
        results: list[tuple[DecodeConfig, list[float]]] = []
        for cfg in _configs(args.quick, group):
            try:
                times = [_time_ms(c, cfg, args.reps) for c in cases]
            except Exception as exc:  # e.g. out of shared memory for this tile: skip it
                print(f"  {cfg}: failed ({type(exc).__name__}: {str(exc)[:80]})")
                continue
            results.append((cfg, times))
            rates = "  ".join(f"{c['kv_bytes'] / t / 1e6:7.0f}" for c, t in zip(cases, times))
            print(f"  {_name(cfg):32s} {rates}", flush=True)
        best_t = [min(r[1][i] for r in results) for i in range(len(SHAPES))]
        print("  fastest per shape: " + ", ".join(
            f"{shape} {_name(next(r[0] for r in results if r[1][i] == best_t[i]))} {best_t[i]:.3f} ms"
            for i, shape in enumerate(SHAPES)))
        tuned = {}
        for batch in BATCHES:
            idx = [i for i, (b, _) in enumerate(SHAPES) if b == batch]
            score = {r[0]: sum(r[1][i] / best_t[i] for i in idx) for r in results}
            best = min(score, key=lambda c: score[c])
            base = score.get(DecodeConfig())
            gain = f", the default {base / len(idx):.2f}x" if base else ""
            print(f"  batch {batch}: {_name(best)} (its time / each shape's best: "
                  f"{score[best] / len(idx):.2f}x on average{gain})")
            key = DecodeConfig.key(group, HEAD_DIM, cache_dtype,
                                   max_batch=batch if batch != BATCHES[-1] else None)
            tuned[key] = asdict(best)  # keyed by the cache's dtype, as the backend looks it up
        if not args.no_write:
            path = tuned_config_dir() / tuned_config_name(device_name)
            path.parent.mkdir(parents=True, exist_ok=True)
            old = json.loads(path.read_text()) if path.is_file() else {}
            path.write_text(json.dumps({**old, **tuned}, indent=1, sort_keys=True) + "\n")
            print(f"  wrote {path}")
        if args.out:
            shipped = Path(args.out) / tuned_config_name(device_name)
            old = json.loads(shipped.read_text()) if shipped.is_file() else {}
            provenance = {**old.get(PROVENANCE_KEY, {}), **_provenance(
                device_name, model, args, {str(shape): round(t, 4)
                                           for shape, t in zip(SHAPES, best_t)})}
            shipped.write_text(json.dumps({**old, **tuned, PROVENANCE_KEY: provenance},
                                          indent=1, sort_keys=True) + "\n")
            print(f"  wrote {shipped}")
    print(f"\nswept in {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
