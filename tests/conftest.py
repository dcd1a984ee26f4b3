"""Shared fixtures: the tiny random-weight checkpoint, made once per session."""

from __future__ import annotations

import ctypes
import functools
import gc
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import torch

if TYPE_CHECKING:
    from tests.greedy import GreedyReference

torch.set_num_threads(min(2, os.cpu_count() or 1))

# The dtype the engine tests run the model in. float32 by default; `make test-variants` runs
# them again in bfloat16 (FASTSERVE_TEST_DTYPE=bfloat16) and with the CPU kernels off
# (FASTSERVE_CPU_KERNELS=0), so that another machine's floating-point path is not the first
# place a failure shows.
TEST_DTYPE = os.environ.get("FASTSERVE_TEST_DTYPE", "float32")
if TEST_DTYPE not in ("float32", "bfloat16", "float16"):
    raise ValueError(f"FASTSERVE_TEST_DTYPE must be float32, bfloat16 or float16, got {TEST_DTYPE!r}")
# Whether greedy tokens are reproducible across batch shapes and kernels. In float32 the few
# ulps two kernels differ by never flip an argmax of the tiny model; in a half type they can
# (one bf16 rounding step is ~0.4% of a logit), so tests compare tokens up to near-ties there.
IS_EXACT_DTYPE = TEST_DTYPE == "float32"


def pytest_sessionstart(session: pytest.Session) -> None:
    """Build the CPU kernels (once per version and machine) before the first test, outside
    every test's timeout: a cold build on a busy 2-core machine takes minutes, and a test that
    happened to be first would time out building them."""
    from fastserve.executor import cpu_kernels

    cold = not cpu_kernels.is_built()
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if cold and reporter is not None:
        reporter.write_line(f"building the CPU kernels for {cpu_kernels.cpu_isa()} "
                            "(one time per version and machine) ...")
    start = time.perf_counter()
    cpu_kernels.decode_attention_kernel()
    cpu_kernels.avx2_kernel_variant()  # the AVX2 path's tests, on a CPU with AVX-512 BF16
    if cold and reporter is not None:
        reporter.write_line(f"built the CPU kernels in {time.perf_counter() - start:.0f} s")


@pytest.fixture(scope="session")
def tiny_model_path() -> Path:
    from fastserve.model.make_model import default_model_path

    return default_model_path()


@pytest.fixture(scope="session")
def greedy_reference(tiny_model_path: Path) -> GreedyReference:
    """Judges greedy outputs in a half-type run (see `tests.greedy`)."""
    from tests.greedy import GreedyReference

    return GreedyReference(tiny_model_path)


def _resident_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.fixture(autouse=True)
def _free_dropped_engines() -> Iterator[None]:
    """Free the engines a test dropped before the next test builds its own.

    An engine hands its own bound methods to its parts (the engine core, the request groups, the
    beam searches), so a dropped engine is a reference cycle that holds its KV pool until the
    cyclic collector runs, and tensors do not count towards the collector's thresholds: a test
    module that builds an engine per test would otherwise hold a pool for each. A full collection
    costs tens of milliseconds, so it runs only after a test that grew the process.
    """
    yield from _collect_if_grown()


@pytest.fixture(scope="module", autouse=True)
def _free_dropped_module_engines() -> Iterator[None]:
    """The same after a module, whose own fixtures may have held an engine for all its tests."""
    yield from _collect_if_grown()


def _collect_if_grown() -> Iterator[None]:
    before = _resident_bytes()
    yield
    if _resident_bytes() - before > 64 << 20:
        gc.collect()
        _LIBC_TRIM()  # the freed heap's pages back to the system, not kept for the next test


def _malloc_trim() -> Callable[[], object]:
    """glibc's `malloc_trim(0)` (a no-op elsewhere): the process's resident memory would
    otherwise creep up by what freed tensors and buffers leave in malloc's arenas."""
    try:
        return functools.partial(ctypes.CDLL("libc.so.6").malloc_trim, 0)
    except (OSError, AttributeError):
        return lambda: None


_LIBC_TRIM = _malloc_trim()


@pytest.fixture
def one_thread() -> Iterator[None]:
    """Run the test on one intra-op thread, then restore the setting."""
    # Two threads on a loaded two-core machine spin against each other: each call ~100x slower.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def cuda_devices() -> list[str]:
    return ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
