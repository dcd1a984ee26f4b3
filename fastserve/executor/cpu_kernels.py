"""CPU kernels compiled on first use with torch's C++ extension tooling.

Optional by design: if no C++ compiler is present, or the CPU kernels are switched off
(`cpu_kernels_enabled`), callers get None and fall back to plain PyTorch ops, which are correct
but slower for decode.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
from pathlib import Path
from types import ModuleType

import torch

from fastserve.model.make_model import cache_dir

logger = logging.getLogger(__name__)

# One extension: the paged attention kernels (and its Python bindings), the small layers and
# the bfloat16 matmul.
_CSRC = Path(__file__).parent / "csrc"
_SOURCES = [_CSRC / name for name in ("decode_attention.cpp", "cpu_layers.cpp", "cpu_gemm.cpp")]
_HEADERS = [_CSRC / "vec.h"]

# "0" switches off every CPU-specific fast path: the compiled attention kernels (built with
# -march=native) and the oneDNN-packed weights (`cpu_linear`). What is left is the plain-torch
# path any machine runs; `make test-variants` runs the tests on it, so that a machine whose
# kernels differ (AVX-512, no compiler) is not the first place a failure on that path shows.
CPU_KERNELS_ENV = "FASTSERVE_CPU_KERNELS"


def cpu_kernels_enabled() -> bool:
    """Whether the CPU kernels and packed weights may be used (read at each model start-up).
    FASTSERVE_NO_CPU_KERNELS=1, the older spelling, switches them off too."""
    return (os.environ.get(CPU_KERNELS_ENV, "1") != "0"
            and os.environ.get("FASTSERVE_NO_CPU_KERNELS") != "1")


# Instruction sets that matter to the kernels and to oneDNN's bfloat16 matmuls, best first.
_ISAS = ("amx_bf16", "avx512_bf16", "avx512f", "avx2")


@functools.cache
def cpu_isa() -> str:
    """The best of `_ISAS` this CPU has (from /proc/cpuinfo's flags), else "generic"."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:  # not Linux: what torch's own dispatch found
        return torch.backends.cpu.get_cpu_capability().lower()
    flags = next((line.split(":", 1)[1].split() for line in text.splitlines()
                  if line.startswith("flags")), [])
    return next((isa for isa in _ISAS if isa in flags), "generic")


def decode_attention_kernel() -> ModuleType | None:
    """The compiled CPU kernels (paged attention, KV store, the small layers, the bfloat16
    matmul), or None
    (switched off, or no compiler)."""
    return _build_kernel() if cpu_kernels_enabled() else None


def avx2_kernel_variant() -> ModuleType | None:
    """The same kernels built without their AVX-512 BF16 paths (the AVX2 ones that CPUs
    without those instructions take), for checking both on a CPU that has them; None where
    the CPU has no AVX-512 BF16 (the kernels above are that variant already), or no build."""
    if cpu_isa() not in ("amx_bf16", "avx512_bf16") or not cpu_kernels_enabled():
        return None
    return _build_kernel(avx2_only=True)


@functools.cache
def kernel_sources_digest() -> str:
    """A short hash of the kernels' C++ sources: what a build, or a timing of one, is of."""
    return hashlib.sha256(b"".join(p.read_bytes() for p in _SOURCES + _HEADERS)).hexdigest()[:12]


@functools.cache
def _build_kernel(avx2_only: bool = False) -> ModuleType | None:
    try:
        from torch.utils.cpp_extension import load

        # One build folder per source version: checkouts of different versions sharing a
        # cache (old vs new in a benchmark, worktrees) neither rebuild over each other nor
        # load each other's kernel.
        digest = kernel_sources_digest()
        # -march=native: a cache shared by machines of other CPUs keeps a build per kind.
        variant = "-avx2" if avx2_only else ""
        build = cache_dir() / "torch_extensions" / f"decode_attention-{digest}-{cpu_isa()}{variant}"
        build.mkdir(parents=True, exist_ok=True)
        return load(
            name="fastserve_decode_attention" + variant.replace("-", "_"),
            sources=[str(p) for p in _SOURCES],
            # No implicit multiply-adds: the layer kernels round as the tensor ops do.
            extra_cflags=["-O3", "-march=native", "-fopenmp", "-ffp-contract=off",
                          *(["-DFS_NO_AVX512_BF16"] if avx2_only else [])],
            extra_ldflags=["-fopenmp"],
            build_directory=str(build),
            verbose=False,
        )
    except Exception as exc:  # no compiler, or a failed build: fall back, loudly
        logger.warning("CPU decode-attention kernel unavailable, using PyTorch ops: %s", exc)
        return None
