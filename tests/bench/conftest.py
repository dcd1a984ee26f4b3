"""Fixtures shared by the benchmark-tool tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest


@pytest.fixture
def one_thread() -> Iterator[None]:
    """Run the test on one intra-op thread, then restore the setting."""
    # Two threads on a loaded two-core machine spin against each other: each call ~100x slower.
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
