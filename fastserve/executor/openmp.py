"""The OpenMP runtime under torch's CPU ops: a team of worker threads per thread that runs them.

libgomp keeps a team of workers for every thread that has started a parallel region, for as long
as that thread lives. Once a process holds more of them than it has cores, libgomp stops
spinning between regions (a "throttled" count of 100 spins, whatever GOMP_SPINCOUNT says): its
workers sleep after every op, and the next op waits for them to wake. An engine stepped on a
thread other than the one that loaded it (a server's engine thread after loading on the main
thread) ran its decode step 1.5x slower so: 18.5 against 11.9 ms at batch 4 (small preset,
bfloat16, 2 cores).

So the engine runs on the thread that built it (`AsyncLLM`), and a thread done with torch's
parallel ops hands its workers back (`release_thread_team`).
"""

from __future__ import annotations

import ctypes
import functools
import logging
import threading
import weakref

import torch  # noqa: F401  (loads the OpenMP runtime torch was built with, before we look for it)

logger = logging.getLogger(__name__)

_OMP_PAUSE_SOFT = 1  # omp_pause_resource_t: free the threads, keep nothing

# Threads whose team `release_thread_team` ended (`has_released`). NOTE: a thread that runs
# parallel ops again starts a new team and stays listed unless it says so
# (`note_parallel_ops`): the answer is a hint for warnings.
_released: weakref.WeakSet[threading.Thread] = weakref.WeakSet()


@functools.cache
def _libgomp() -> ctypes.CDLL | None:
    """The libgomp torch loaded (a library already loaded is found by its soname), or None
    where torch runs on another OpenMP runtime, or on none."""
    try:
        lib = ctypes.CDLL("libgomp.so.1")
        lib.omp_pause_resource.argtypes = [ctypes.c_int, ctypes.c_int]
        lib.omp_get_initial_device.restype = ctypes.c_int
    except (OSError, AttributeError):
        return None
    return lib


def release_thread_team() -> bool:
    """End the calling thread's OpenMP workers (OpenMP 5's `omp_pause_resource` on the host);
    the thread's next parallel op starts a team again. False where the runtime is not a libgomp
    that has the call, or it refused (the workers then stay)."""
    lib = _libgomp()
    if lib is None:
        return False
    ok = lib.omp_pause_resource(_OMP_PAUSE_SOFT, lib.omp_get_initial_device()) == 0
    if ok:
        _released.add(threading.current_thread())
    else:
        logger.info("OpenMP kept this thread's workers (omp_pause_resource refused)")
    return ok


def has_released(thread: threading.Thread) -> bool:
    """Whether `thread` has handed its OpenMP workers back (`release_thread_team`) since it
    last said it ran parallel ops (`note_parallel_ops`)."""
    return thread in _released


def note_parallel_ops() -> None:
    """The calling thread has run torch's parallel ops (building an engine does): it holds
    a team again, whatever it released before."""
    _released.discard(threading.current_thread())
