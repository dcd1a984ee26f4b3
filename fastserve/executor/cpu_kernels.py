"""CPU kernels compiled once per version and machine with torch's C++ extension tooling:
ahead of the first request (`LLMEngine` builds them before it loads the model, `fastserve
build-kernels` and `make install` before anything runs), with a log line saying so.

Optional by design: if no C++ compiler is present, or the CPU kernels are switched off
(`cpu_kernels_enabled`), callers get None and fall back to plain PyTorch ops, which are correct
but slower for decode.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import importlib.util
import logging
import os
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import torch

from fastserve.paths import cache_dir

logger = logging.getLogger(__name__)

# One extension: the paged attention kernels (and its Python bindings), the small layers, the
# bfloat16 matmul and the sampler's top-p test.
_CSRC = Path(__file__).parent / "csrc"
_SOURCES = [_CSRC / name for name in ("decode_attention.cpp", "cpu_layers.cpp", "cpu_gemm.cpp",
                                       "cpu_moe.cpp", "cpu_sampling.cpp", "cpu_attention_amx.cpp")]
_HEADERS = [_CSRC / "vec.h", _CSRC / "aten_api.h"]
# CPU-seconds a cold build takes (six files, most of it parsing torch's headers; measured on a
# Zen 4 EPYC): the estimate the build's progress line gives.
_BUILD_CPU_S = 60.0

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
    matmul, the sampler's top-p test), or None
    (switched off, or no compiler)."""
    return _build_kernel() if cpu_kernels_enabled() else None


def avx2_kernel_variant() -> ModuleType | None:
    """The same kernels built without their AVX-512 BF16 paths (the AVX2 ones that CPUs
    without those instructions take), for checking both on a CPU that has them; None where
    the CPU has no AVX-512 BF16 (the kernels above are that variant already), or no build."""
    if cpu_isa() not in ("amx_bf16", "avx512_bf16") or not cpu_kernels_enabled():
        return None
    return _build_kernel(avx2_only=True)


def is_built() -> bool:
    """Whether this version's kernels are built for this machine (switched off: nothing to
    build). Reads two small files; builds nothing."""
    return not cpu_kernels_enabled() or _is_finished(*_library_paths(_build_folder(False), False))


@functools.cache
def kernel_sources_digest() -> str:
    """A short hash of the kernels' C++ sources: what a build, or a timing of one, is of."""
    return hashlib.sha256(b"".join(p.read_bytes() for p in _SOURCES + _HEADERS)).hexdigest()[:12]


def _cflags(avx2_only: bool) -> list[str]:
    # No implicit multiply-adds: the layer kernels round as the tensor ops do.
    return ["-O3", "-march=native", "-fopenmp", "-ffp-contract=off",
            *(["-DFS_NO_AVX512_BF16"] if avx2_only else [])]


def _build_folder(avx2_only: bool) -> Path:
    """One build folder per source version and build (the flags, torch's version): checkouts
    of different versions sharing a cache (old vs new in a benchmark, worktrees) neither
    rebuild over each other nor load each other's kernel. -march=native: a cache shared by
    machines of other CPUs keeps a build per kind."""
    variant = "-avx2" if avx2_only else ""
    recipe = hashlib.sha256(" ".join([torch.__version__, *_cflags(avx2_only)]).encode()
                            ).hexdigest()[:8]
    return (cache_dir() / "torch_extensions"
            / f"decode_attention-{kernel_sources_digest()}-{recipe}-{cpu_isa()}{variant}")


def _module_name(avx2_only: bool) -> str:
    return "fastserve_decode_attention" + ("_avx2" if avx2_only else "")


def _library_paths(build: Path, avx2_only: bool) -> tuple[Path, Path]:
    """The built library and the stamp written once it is whole."""
    name = _module_name(avx2_only)
    return build / f"{name}.so", build / f"{name}.done"


@functools.cache
def _build_kernel(avx2_only: bool = False) -> ModuleType | None:
    try:
        from torch.utils.cpp_extension import load

        name, build = _module_name(avx2_only), _build_folder(avx2_only)
        build.mkdir(parents=True, exist_ok=True)
        library, done = _library_paths(build, avx2_only)
        with _build_lock(build):
            if _is_finished(library, done):
                return _import(name, library)
            # Not known to be whole (a build was killed, maybe in its link: importing a cut
            # library kills the process): build it again. NOTE: torch's own lock file is left
            # behind by a killed build, and every later start would wait on it for ever;
            # under our lock no build is running.
            for stale in (done, library, build / "lock"):
                stale.unlink(missing_ok=True)
            cores = max(1, min(len(os.sched_getaffinity(0)), len(_SOURCES)))
            logger.info("building the CPU kernels for %s (one time per version and machine, "
                        "about %.0f s on %d cores) in %s", cpu_isa(), _BUILD_CPU_S / cores,
                        cores, build)
            start = time.perf_counter()
            module = load(name=name, sources=[str(p) for p in _SOURCES],
                          extra_cflags=_cflags(avx2_only), extra_ldflags=["-fopenmp"],
                          build_directory=str(build), verbose=False)
            done.write_text(_stamp(library))
            logger.info("built the CPU kernels in %.1f s", time.perf_counter() - start)
            return module
    except Exception as exc:  # no compiler, or a failed build: fall back, loudly
        logger.warning("CPU decode-attention kernel unavailable, using PyTorch ops: %s", exc)
        return None


@contextlib.contextmanager
def _build_lock(build: Path) -> Iterator[None]:
    """One builder per build folder at a time, across processes. NOTE: an OS file lock,
    released when its holder dies (torch's lock file is not: a killed build leaves it)."""
    with (build / ".fastserve-build.lock").open("w") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            logger.info("waiting for another process to finish building the CPU kernels in %s", build)
            fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _stamp(library: Path) -> str:
    stat = library.stat()
    return f"{stat.st_size} {stat.st_mtime_ns}"


def _is_finished(library: Path, done: Path) -> bool:
    """Whether the folder holds a finished build (its stamp, written after the build, matches
    the library): the folder is keyed by the sources, flags and torch, so the build is of these,
    and it is imported without asking ninja (a fresh checkout's newer file times would rebuild
    it)."""
    try:
        return done.read_text() == _stamp(library)
    except OSError:
        return False


def _import(name: str, library: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, library)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
