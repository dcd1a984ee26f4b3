"""fastserve: LLM serving with skip-join MLFQ scheduling (FastServe, Wu et al. 2023)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from fastserve.request import RequestOutput, SamplingParams, StructuredOutputParams  # (no torch)

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
