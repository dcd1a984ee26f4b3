"""fastserve: LLM serving with skip-join MLFQ scheduling (FastServe, Wu et al. 2023)."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from fastserve.request import RequestOutput, SamplingParams, StructuredOutputParams  # (no torch)

# NOTE: before anything imports torch: OpenMP reads its wait policy once, when it loads. By
# default its idle threads spin on the cores for a long while (300,000 spins), which is faster
# only while nothing else wants them; the server's HTTP thread (or any other process) does,
# and then every parallel op waits for a spinning thread that lost its core (a 32-row matmul
# measured 6x slower). Threads that never spin (OMP_WAIT_POLICY=PASSIVE) sleep between the
# forward pass's ops instead and are woken for each: a bfloat16 batch of 32 on 2 cores ran
# 1.36x slower so. A short spin (GOMP_SPINCOUNT=10000, about half a millisecond) spans the
# gaps between one op and the next, then sleeps; beside 2 and 6 busy processes a 32-row
# matmul took 2.1 and 13.8 ms with it, 3.5 and 13.8 ms passive. Set either yourself to override.
#
# What importing fastserve set in this process's environment (a benchmark gives a peer engine
# it starts its own defaults back: `benchmarks/peers/vs_vllm.py`).
OPENMP_DEFAULTS: dict[str, str] = {}
if "OMP_WAIT_POLICY" not in os.environ and "GOMP_SPINCOUNT" not in os.environ:
    OPENMP_DEFAULTS["GOMP_SPINCOUNT"] = "10000"
    os.environ.update(OPENMP_DEFAULTS)

if TYPE_CHECKING:
    from fastserve.llm import LLM

__all__ = ["LLM", "RequestOutput", "SamplingParams", "StructuredOutputParams"]
__version__ = "0.1.0"


def __getattr__(name: str) -> object:
    # Import torch-backed pieces lazily so `fastserve.core` stays importable without torch.
    if name == "LLM":
        from fastserve.llm import LLM

        return LLM
    raise AttributeError(name)
