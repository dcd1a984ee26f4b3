"""fastserve: LLM serving with skip-join MLFQ scheduling (FastServe, Wu et al. 2023)."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

# NOTE: before anything imports torch: OpenMP reads its wait policy once, when it loads. By
# default its idle threads spin on the cores, which is faster only while nothing else wants
# them; the server's HTTP thread (or any other process) does, and then every parallel op waits
# for a spinning thread that lost its core (a 32-row matmul measured 6x slower). Passive
# threads sleep instead. Set OMP_WAIT_POLICY yourself to override.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from fastserve.request import RequestOutput, SamplingParams, StructuredOutputParams

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
