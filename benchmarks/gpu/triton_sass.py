"""The Triton kernels' machine code for a GPU, read on a machine without one.

For each decode launch config (the sweep's grid) and cache dtype, and for the prefill kernel,
compiles the kernel for a CUDA target (default sm_90: H100/H200) and prints its registers and
shared memory per program, the programs an SM holds by those two, and its main loop per warp:
instructions, instructions per KiB of K/V read, one-byte shared-memory loads, tensor-core
MMAs and conversions. A GPU measures time (`triton_decode_sweep.py`); this shows why, and
works in a session that has no GPU.

    python benchmarks/gpu/triton_sass.py [--arch 90] [--model llama-2-7b|llama-3-8b] [--dtype bfloat16]

Read with care: instruction counts are static (one pass of the loop), not cycles, and HBM
bandwidth bounds a decode kernel once its instructions per byte are low enough.
"""

from __future__ import annotations

import argparse
import itertools
import time
import warnings

import torch

from fastserve.executor.backends import kernel_sass as ks
from fastserve.executor.backends.triton_configs import DecodeConfig

ATTENTION = {"llama-2-7b": (32, 32), "llama-3-8b": (32, 8)}  # heads, KV heads
HEAD_DIM = 128
# Registers and shared memory per SM (sm_80: A100, sm_89: L4/L40, sm_90: H100/H200), and
# resident warps (sm_89: 48).
PER_SM = {80: (65536, 164 * 1024, 64), 89: (65536, 100 * 1024, 48), 90: (65536, 228 * 1024, 64)}


def _programs_per_sm(r: ks.KernelReport, arch: int) -> int:
    regs, smem, warps = PER_SM[arch]
    by_regs = regs // max(1, r.registers * 32 * r.num_warps)
    by_smem = smem // max(1, r.shared_bytes + 1024)  # + the 1 KiB the driver reserves
    return max(0, min(by_regs, by_smem, warps // r.num_warps))


def _row(tag: str, launch: ks.Launch, arch: int) -> None:
    r = ks.report(launch, arch)
    kib = ks.kv_bytes_per_pass(launch) / 1024
    per_kib = r.loop_instructions * r.num_warps / kib
    print(f"  {tag:34s} {r.registers:4d} {r.shared_bytes // 1024:5d} KiB {_programs_per_sm(r, arch):4d}"
          f" {r.loop_instructions:6d} {per_kib:8.1f} {r.count('LDS.U8', 'LDS.S8'):5d}"
          f" {r.count('HMMA', 'HGMMA'):5d} {r.count('F2F'):5d}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", type=int, default=90, choices=sorted(PER_SM))
    ap.add_argument("--model", default="llama-2-7b", choices=sorted(ATTENTION))
    ap.add_argument("--dtype", default="bfloat16", help="the model's (q and the output)")
    args = ap.parse_args()
    warnings.filterwarnings("ignore", module="triton")
    heads, kv_heads = ATTENTION[args.model]
    dtype = getattr(torch, args.dtype)
    caches = [dtype] + ([torch.float8_e4m3fn] if args.arch >= 89 and dtype != torch.float32 else [])
    t0 = time.perf_counter()
    print(f"{args.model} ({heads} heads, {kv_heads} KV heads, head_dim {HEAD_DIM}), {args.dtype}"
          f" model, sm_{args.arch}, one warp's main loop:")
    print(f"  {'kernel / config':34s} {'regs':>4s} {'smem':>9s} {'/SM':>4s} {'instr':>6s}"
          f" {'per KiB':>8s} {'LDS8':>5s} {'MMA':>5s} {'F2F':>5s}")
    for cache in caches:
        name = str(cache).removeprefix("torch.")
        for block_n, warps, stages, dot in itertools.product((32, 64, 128), (4, 8), (2, 3),
                                                              (True, False)):
            if not dot and heads // kv_heads > 4:
                continue
            cfg = DecodeConfig(block_n=block_n, num_warps=warps, num_stages=stages,
                                   use_dot=dot)
            tag = f"decode {name} n{block_n} w{warps} s{stages} {'dot' if dot else 'sum'}"
            _row(tag, ks.decode_launch(heads, kv_heads, HEAD_DIM, dtype, cache, cfg), args.arch)
        _row(f"prefill {name}", ks.prefill_launch(heads, kv_heads, HEAD_DIM, dtype, cache),
             args.arch)
    print(f"\ncompiled in {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
