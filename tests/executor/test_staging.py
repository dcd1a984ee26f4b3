"""Host lists onto the device and rows taken or put by them: what list indexing gives, without
a Python list index (which a GPU copies from pageable memory, waiting for its stream)."""

from __future__ import annotations

import pytest
import torch

from fastserve.executor.staging import put_rows, take_rows, to_device

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)
def test_rows_taken_and_put_as_list_indexing_does(device: str) -> None:
    t = torch.arange(24, dtype=torch.float32, device=device).reshape(6, 4)
    assert take_rows(t, range(6)) is t  # all rows in order: the tensor itself, no copy
    for rows in ([4, 1, 1], [0, 2, 3], [5]):
        assert torch.equal(take_rows(t, rows), t[rows])
        want, got = t.clone(), t.clone()
        values = -torch.ones(len(set(rows)), 4, device=device)
        unique = list(dict.fromkeys(rows))
        want[unique] = values
        put_rows(got, unique, values)
        assert torch.equal(got, want)
    whole = t.clone()
    put_rows(whole, list(range(6)), torch.zeros(6, 4, device=device))
    assert not whole.any()
    ids = to_device([3, 1, 2], torch.long, torch.device(device))
    assert ids.device.type == device and ids.tolist() == [3, 1, 2]
