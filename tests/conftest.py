"""Shared fixtures: the tiny random-weight checkpoint, made once per session."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

torch.set_num_threads(min(2, os.cpu_count() or 1))


@pytest.fixture(scope="session")
def tiny_model_path() -> Path:
    from fastserve.model.make_model import default_model_path

    return default_model_path()


@pytest.fixture
def one_thread() -> Iterator[None]:
    """Run the test on one intra-op thread, then restore the setting."""
    # Two threads on a loaded two-core machine spin against each other: each call ~100x slower.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def cuda_devices() -> list[str]:
    return ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
