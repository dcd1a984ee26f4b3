"""OpenMP's wait policy for a process that runs an engine on a CPU, chosen before torch loads.

libgomp, the OpenMP runtime under torch's CPU ops, reads OMP_WAIT_POLICY and GOMP_SPINCOUNT
once, when it loads: at `import torch`. A value set later changes nothing (libgomp prints what
it read under OMP_DISPLAY_ENV=VERBOSE).

By default its idle threads spin on the cores for a long while (300,000 spins), which is faster
only while nothing else wants them; the server's HTTP thread (or any other process) does, and
then every parallel op waits for a spinning thread that lost its core (a 32-row matmul measured
6x slower). Threads that never spin (OMP_WAIT_POLICY=PASSIVE) sleep between the forward pass's
ops instead and are woken for each: a bfloat16 batch of 32 on 2 cores ran 1.36x slower so. A
short spin (GOMP_SPINCOUNT=10000, about half a millisecond) spans the gaps between one op and
the next, then sleeps; beside 2 and 6 busy processes a 32-row matmul took 2.1 and 13.8 ms with
it, 3.5 and 13.8 ms passive. Set either yourself to override.

So the short spin is written where an engine's process starts, before torch: the `fastserve`
command for its own process (`cli.main`), and the driver of a distributed engine into its
workers' environment (`executor/distributed/launch.py`). `import fastserve` writes nothing. A
program that runs `LLM` on a CPU itself sets GOMP_SPINCOUNT=10000 in its environment before
Python starts, or calls `set_openmp_defaults()` before anything imports torch.

NOTE: a leaf module (standard library only, `.importlinter`'s `leaves`): the CLI calls it before
it imports anything that loads torch.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping

# The variables written where the caller chose neither a wait policy nor a spin count.
OPENMP_DEFAULTS: Mapping[str, str] = {"GOMP_SPINCOUNT": "10000"}


def openmp_defaults(environ: Mapping[str, str]) -> dict[str, str]:
    """What an engine's environment lacks of `OPENMP_DEFAULTS`: nothing where it names
    OMP_WAIT_POLICY or GOMP_SPINCOUNT itself."""
    if "OMP_WAIT_POLICY" in environ or "GOMP_SPINCOUNT" in environ:
        return {}
    return dict(OPENMP_DEFAULTS)


def set_openmp_defaults() -> dict[str, str]:
    """Write `openmp_defaults` into this process's environment, for the libgomp that torch
    loads next; returns what it wrote. Nothing once torch is imported: libgomp has read its
    settings already, and a variable written now would only mislead the processes started
    from this one."""
    if "torch" in sys.modules:
        return {}
    added = openmp_defaults(os.environ)
    os.environ.update(added)
    return added
