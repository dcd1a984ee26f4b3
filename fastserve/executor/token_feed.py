"""Decode inputs still on the device (async scheduling): the previous launch drew them, and
the host has not read them back."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fastserve.executor.staging import to_device


@dataclass(frozen=True)
class TokenFeed:
    """Which of a batch's input ids come from the previous launch's draws."""

    tokens: torch.Tensor  # [num_drawn] long, on the device: the previous launch's draws
    src: list[int]  # place in `tokens` of each fed input; -1: none (its row failed), feed 0
    dst: list[int]  # place of each in the batch's flat input ids

    def write(self, input_ids: torch.Tensor) -> None:
        """Copy the tokens into `input_ids` [num_tokens] on the device, with no host sync."""
        n = self.tokens.shape[0]
        src = [s if s >= 0 else n for s in self.src]
        idx = to_device([src, self.dst], torch.long, input_ids.device)  # [2, num_fed]
        # NOTE: a row drawn alone after a failure holds FAILED_TOKEN: any valid id will do,
        # as that request is failed when its tokens are read.
        tokens = torch.cat([self.tokens.clamp(min=0), self.tokens.new_zeros(1)])  # [n + 1]
        input_ids.index_copy_(0, idx[1], tokens.index_select(0, idx[0]))
