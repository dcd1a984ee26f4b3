"""Small host lists onto the device without waiting for the device's queued work."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def to_device(values: Sequence[int] | Sequence[float] | Sequence[Sequence[int]],
              dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """`values` as a tensor on `device`. On a GPU it is staged in pinned memory and copied
    with non_blocking: a copy from pageable memory waits for everything queued on the stream,
    which would hold the host behind the batch on the device (async scheduling launches the
    next batch, sampling included, while the previous one runs)."""
    if device.type != "cuda":
        return torch.tensor(values, dtype=dtype, device=device)
    return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)
