"""Decode inputs still on the device (async scheduling): the previous launch drew them, and
the host has not read them back."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fastserve.executor.staging import to_device


def drawn_tokens(tokens: torch.Tensor, places: list[int]) -> torch.Tensor:
    """`tokens` [num_drawn] (a launch's draws, on the device) at `places`, where -1 is a row
    whose sampling failed: any valid id (0) will do there, as that request is failed when its
    tokens are read; so will it for a row drawn alone after a failure (FAILED_TOKEN)."""
    n = tokens.shape[0]
    idx = to_device([p if p >= 0 else n for p in places], torch.long, tokens.device)
    return torch.cat([tokens.clamp(min=0), tokens.new_zeros(1)]).index_select(0, idx)


@dataclass(frozen=True)
class TokenFeed:
    """Which of a batch's input ids are tokens still on the device, and those tokens."""

    values: torch.Tensor  # [num_fed] long, on the device
    dst: list[int]  # place of each in the batch's flat input ids

    def write(self, input_ids: torch.Tensor) -> None:
        """Copy the tokens into `input_ids` [num_tokens] on the device, with no host sync."""
        dst = to_device(self.dst, torch.long, input_ids.device)
        input_ids.index_copy_(0, dst, self.values)
