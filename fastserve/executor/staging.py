"""Small host lists onto the device without waiting for the device's queued work."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from fastserve.executor.platform import platform_for


def to_device(values: Sequence[int] | Sequence[float] | Sequence[Sequence[int]],
              dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """`values` as a tensor on `device`. On a GPU it is staged in pinned memory and copied
    with non_blocking: a copy from pageable memory waits for everything queued on the stream,
    which would hold the host behind the batch on the device (async scheduling launches the
    next batch, sampling included, while the previous one runs)."""
    return platform_for(device).to_device(values, dtype, device)


def take_rows(t: torch.Tensor, rows: Sequence[int]) -> torch.Tensor:
    """`t[rows]` without a host sync (indexing with a Python list copies the index from
    pageable memory, which waits for the stream); `t` itself when `rows` are all of its rows
    in order."""
    if _is_every_row(rows, t.shape[0]):
        return t
    return t.index_select(0, to_device(rows, torch.long, t.device))


def put_rows(t: torch.Tensor, rows: Sequence[int], values: torch.Tensor) -> None:
    """`t[rows] = values` without a host sync (see `take_rows`)."""
    if _is_every_row(rows, t.shape[0]):
        t.copy_(values)
    else:
        t.index_copy_(0, to_device(rows, torch.long, t.device), values)


def _is_every_row(rows: Sequence[int], num_rows: int) -> bool:
    return len(rows) == num_rows and all(i == r for i, r in enumerate(rows))
