"""The Triton kernels' machine code for a GPU, read on a machine without one.

Triton compiles for any CUDA target offline (its wheel carries ptxas and cuobjdump), so the
machine code of a kernel can be read where it cannot run: registers and shared memory per
program (its occupancy) and the instructions of its main loop by kind. A decode kernel streams
K/V from HBM, so its loop should spend few instructions per byte, read shared memory in wide
loads and convert nothing it need not. That is how the float8 decode kernel's bottleneck was
found (64 one-byte shared loads per tile) without a GPU, and how
`tests/executor/test_kernel_sass.py` (which imports this file's functions) keeps it from coming
back.

For each decode launch config (the sweep's grid) and cache dtype, and for the prefill kernel,
the script compiles the kernel for a CUDA target (default sm_90: H100/H200) and prints its
registers and shared memory per program, the programs an SM holds by those two, and its main
loop per warp: instructions, instructions per KiB of K/V read, one-byte shared-memory loads,
tensor-core MMAs and conversions. A GPU measures time (`triton_decode_sweep.py`); this shows
why, and works in a session that has no GPU.

    python benchmarks/gpu/triton_sass.py [--arch 90] [--model llama-2-7b|llama-3-8b] [--dtype bfloat16]

The kernels are compiled with exactly the arguments their wrappers (`triton_ops.paged_decode`
and the rest) pass: a wrapper is called on tensors on the meta device with its kernel swapped
for a recorder, and the recorded launch is compiled for the target.

Read with care: instruction counts are static (one pass of the loop), not cycles, and HBM
bandwidth bounds a decode kernel once its instructions per byte are low enough.
"""

from __future__ import annotations

import argparse
import collections
import itertools
import os
import re
import shutil
import subprocess
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from fastserve.executor.backends import triton_ops as ops
from fastserve.executor.backends.triton_configs import DecodeConfig

_PTR_TYPES = {
    torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16",
    torch.float8_e4m3fn: "fp8e4nv", torch.int32: "i32", torch.int64: "i64", torch.uint8: "u8",
}
# Launch keywords that are compile options, not kernel arguments.
_OPTIONS = ("num_warps", "num_stages", "enable_fp_fusion", "maxnreg")


@dataclass(frozen=True)
class Launch:
    """One recorded kernel launch: the kernel, its arguments by name, its compile options."""

    kernel: Any  # a triton.JITFunction
    args: dict[str, Any]
    options: dict[str, Any]


class _Recorder:
    """Stands in for a `@triton.jit` kernel: `kernel[grid](*args, **kwargs)` records the
    launch instead of running it."""

    def __init__(self, kernel: Any) -> None:
        self.kernel = kernel
        self.launches: list[Launch] = []

    def __getitem__(self, grid: object) -> Callable[..., None]:
        def launch(*args: Any, **kwargs: Any) -> None:
            options = {k: kwargs.pop(k) for k in _OPTIONS if k in kwargs}
            named = dict(zip(self.kernel.arg_names, args))
            self.launches.append(Launch(self.kernel, {**named, **kwargs}, options))

        return launch


def record(module: ModuleType, kernel_name: str, call: Callable[[], object]) -> list[Launch]:
    """The launches of `module.<kernel_name>` that `call()` makes (on meta tensors)."""
    kernel = getattr(module, kernel_name)
    recorder = _Recorder(kernel)
    setattr(module, kernel_name, recorder)
    try:
        call()
    finally:
        setattr(module, kernel_name, kernel)
    return recorder.launches


def _arg_type(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return "*" + _PTR_TYPES[value.dtype]
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i32" if -(2**31) <= value < 2**31 else "i64"
    if isinstance(value, float):
        return "fp32"
    raise TypeError(f"no Triton type for a {type(value).__name__} argument")


def compile_launch(launch: Launch, arch: int = 90) -> Any:
    """`launch` compiled for CUDA compute capability `arch` (90: H100/H200), specialised as
    Triton's launcher would: pointers and integers divisible by 16 marked so."""
    signature: dict[str, str] = {}
    constexprs: dict[tuple[int, ...], Any] = {}
    attrs: dict[tuple[int, ...], list[list[Any]]] = {}
    for i, param in enumerate(launch.kernel.params):
        value = launch.args[param.name]
        if param.is_constexpr:
            signature[param.name] = "constexpr"
            constexprs[(i,)] = value
            continue
        signature[param.name] = _arg_type(value)
        # NOTE: torch's allocations are 16-byte aligned, as the launcher would find them.
        aligned = isinstance(value, torch.Tensor) or (
            isinstance(value, int) and not isinstance(value, bool) and value % 16 == 0)
        if aligned:
            attrs[(i,)] = [["tt.divisibility", 16]]
    source = ASTSource(launch.kernel, signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(source, target=GPUTarget("cuda", arch, 32), options=launch.options)


@dataclass(frozen=True)
class KernelReport:
    """A compiled kernel's resources and its main loop's instructions (one warp, one pass)."""

    registers: int  # per thread
    shared_bytes: int  # per program
    num_warps: int
    loop_instructions: int  # 0: the kernel has no loop
    loop_ops: dict[str, int]  # SASS opcode with its modifiers (LDS.U8, HMMA.16816.F32) -> count

    def count(self, *prefixes: str) -> int:
        """Loop instructions whose opcode starts with any of `prefixes` ("LDS" counts LDSM too)."""
        return sum(n for op, n in self.loop_ops.items() if op.startswith(prefixes))


def nvidia_tool(name: str) -> str:
    """The path of one of Triton's bundled NVIDIA tools (ptxas, cuobjdump), else of PATH's."""
    bundled = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)
    found = bundled if os.path.isfile(bundled) else shutil.which(name)
    if found is None:
        raise FileNotFoundError(f"{name} (Triton's NVIDIA backend ships it)")
    return found


def _cuobjdump(cubin: bytes, flag: str) -> str:
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "kernel.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        return subprocess.run([nvidia_tool("cuobjdump"), flag, path], capture_output=True, text=True,
                              check=True).stdout


_SASS_LINE = re.compile(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);")
_BRANCH = re.compile(r"\bBRA\b[^;]*?(0x[0-9a-f]+)")
_PREDICATE = re.compile(r"^@!?U?P\w+\s+")


def _main_loop(sass: str) -> list[str]:
    """The instructions of the longest loop (a backward branch's range) of a SASS listing."""
    code = [(int(m.group(1), 16), m.group(2)) for m in _SASS_LINE.finditer(sass)]
    best: tuple[int, int] | None = None
    for addr, text in code:
        branch = _BRANCH.search(text)
        if branch:
            target = int(branch.group(1), 16)
            if target < addr and (best is None or addr - target > best[1] - best[0]):
                best = (target, addr)
    if best is None:
        return []
    lo, hi = best
    return [_PREDICATE.sub("", text).split()[0] for addr, text in code if lo <= addr <= hi]


def report(launch: Launch, arch: int = 90) -> KernelReport:
    compiled = compile_launch(launch, arch)
    cubin = compiled.asm["cubin"]
    usage = _cuobjdump(cubin, "-res-usage")
    registers = re.search(r"REG:(\d+)", usage)
    loop = _main_loop(_cuobjdump(cubin, "-sass"))
    return KernelReport(
        registers=int(registers.group(1)) if registers else 0,
        shared_bytes=int(compiled.metadata.shared),
        num_warps=int(launch.options.get("num_warps", 4)),
        loop_instructions=len(loop),
        loop_ops=dict(collections.Counter(loop)),
    )


# --------------------------------------------------------------------------- the kernels


def decode_launch(num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                  cache_dtype: torch.dtype, config: DecodeConfig, block_size: int = 16,
                  num_splits: int = 1, store_new: bool = True) -> Launch:
    """The paged-decode kernel as `paged_decode` launches it for these shapes and dtypes;
    `store_new` as in an iteration of decodes only (every CUDA graph's), which stores each
    decode's own K/V and applies the rotary embedding in the same launch."""
    meta = torch.device("meta")
    num_slots = 1024 * block_size
    q = torch.empty(32, num_heads, head_dim, dtype=dtype, device=meta)
    k_cache = torch.empty(num_kv_heads, num_slots, head_dim, dtype=cache_dtype, device=meta)
    v_cache = torch.empty_like(k_cache)
    rows = torch.empty(32, dtype=torch.long, device=meta)
    table = torch.empty(32, 64, dtype=torch.int32, device=meta)
    lens = torch.empty(32, dtype=torch.int32, device=meta)
    # The model's k and v: strided views of its fused qkv output.
    qkv = torch.empty(32, num_heads + 2 * num_kv_heads, head_dim, dtype=dtype, device=meta)
    new_kv = (qkv[:, num_heads:num_heads + num_kv_heads], qkv[:, num_heads + num_kv_heads:],
              rows) if store_new else None
    cos_sin = torch.empty(32, 1, head_dim, dtype=dtype, device=meta).chunk(2, dim=-1)
    (launch,) = record(ops, "_decode_split_kernel", lambda: ops.paged_decode(
        q, k_cache, v_cache, rows, table, lens, block_size, head_dim**-0.5, num_splits,
        torch.empty_like(q), config=config, new_kv=new_kv,
        rotary=(cos_sin[0], cos_sin[1]) if store_new else None))
    return launch


def prefill_launch(num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                   cache_dtype: torch.dtype, block_size: int = 16) -> Launch:
    """The varlen paged-prefill kernel as `paged_prefill` launches it."""
    meta = torch.device("meta")
    num_slots = 1024 * block_size
    q = torch.empty(512, num_heads, head_dim, dtype=dtype, device=meta)
    k_cache = torch.empty(num_kv_heads, num_slots, head_dim, dtype=cache_dtype, device=meta)
    starts = torch.empty(4, dtype=torch.long, device=meta)
    lens = torch.empty(4, dtype=torch.int32, device=meta)
    table = torch.empty(4, 64, dtype=torch.int32, device=meta)
    (launch,) = record(ops, "_prefill_kernel", lambda: ops.paged_prefill(
        q, k_cache, torch.empty_like(k_cache), starts, lens, lens, table, 128, block_size,
        head_dim**-0.5, torch.empty_like(q)))
    return launch


def kv_bytes_per_pass(launch: Launch) -> int:
    """K and V bytes one pass of a decode or prefill loop reads: BLOCK_N keys of one head."""
    a = launch.args
    itemsize = a["k_cache_ptr"].dtype.itemsize
    return 2 * int(a["BLOCK_N"]) * int(a["HEAD_DIM"]) * itemsize


# --------------------------------------------------------------------------- the report

ATTENTION = {"llama-2-7b": (32, 32), "llama-3-8b": (32, 8)}  # heads, KV heads
HEAD_DIM = 128
# Registers and shared memory per SM (sm_80: A100, sm_89: L4/L40, sm_90: H100/H200), and
# resident warps (sm_89: 48).
PER_SM = {80: (65536, 164 * 1024, 64), 89: (65536, 100 * 1024, 48), 90: (65536, 228 * 1024, 64)}


def _programs_per_sm(r: KernelReport, arch: int) -> int:
    regs, smem, warps = PER_SM[arch]
    by_regs = regs // max(1, r.registers * 32 * r.num_warps)
    by_smem = smem // max(1, r.shared_bytes + 1024)  # + the 1 KiB the driver reserves
    return max(0, min(by_regs, by_smem, warps // r.num_warps))


def _row(tag: str, launch: Launch, arch: int) -> None:
    r = report(launch, arch)
    kib = kv_bytes_per_pass(launch) / 1024
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
            _row(tag, decode_launch(heads, kv_heads, HEAD_DIM, dtype, cache, cfg), args.arch)
        _row(f"prefill {name}", prefill_launch(heads, kv_heads, HEAD_DIM, dtype, cache),
             args.arch)
    print(f"\ncompiled in {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
