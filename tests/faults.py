"""Faults injected into one request, for the tests that check it fails alone."""

from __future__ import annotations

from collections.abc import Callable

import torch

LogitsProcessor = Callable[[int, torch.Tensor], torch.Tensor]


def fails_at(step: int, how: str) -> LogitsProcessor:
    """A logits processor that breaks its own request at output token `step`: it raises
    (`how="raise"`), or makes the row NaN so that the draw itself fails (`how="nan"`)."""

    def proc(num_output_tokens: int, logits: torch.Tensor) -> torch.Tensor:
        if num_output_tokens < step:
            return logits
        if how == "raise":
            raise RuntimeError("injected fault")
        return torch.full_like(logits, float("nan"))

    return proc
