"""Which decode launch config the CUDA backend takes from a sweep's file, per batch size."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import pytest
import torch

from fastserve.executor.backends.triton_configs import (
    DecodeConfig,
    pick_decode_config,
    tuned_config_name,
    tuned_decode_configs,
)

BF16 = torch.bfloat16
SMALL = DecodeConfig(block_n=32, num_warps=4, num_stages=2, max_registers=64)
MEDIUM = DecodeConfig(block_n=64, num_warps=8, num_stages=3)
LARGE = DecodeConfig(block_n=128, num_warps=8, num_stages=2, use_dot=False)


def test_the_smallest_batch_bound_that_covers_a_batch_wins() -> None:
    key = DecodeConfig.key(1, 128, BF16)
    tuned = {f"{key}-b32": SMALL, f"{key}-b8": MEDIUM, key: LARGE}
    assert pick_decode_config(tuned, 1, 128, BF16, 1) == MEDIUM
    assert pick_decode_config(tuned, 1, 128, BF16, 8) == MEDIUM
    assert pick_decode_config(tuned, 1, 128, BF16, 9) == SMALL
    assert pick_decode_config(tuned, 1, 128, BF16, 32) == SMALL
    assert pick_decode_config(tuned, 1, 128, BF16, 33) == LARGE


def test_other_shapes_and_dtypes_keep_their_own_entries_or_the_default() -> None:
    tuned = {DecodeConfig.key(1, 128, BF16, max_batch=32): SMALL}
    assert pick_decode_config(tuned, 1, 128, BF16, 64) == DecodeConfig()  # past every bound
    assert pick_decode_config(tuned, 4, 128, BF16, 16) == DecodeConfig()  # GQA: another key
    assert pick_decode_config(tuned, 1, 128, torch.float8_e4m3fn, 16) == DecodeConfig()
    assert pick_decode_config(tuned, 1, 64, BF16, 16) == DecodeConfig()


def test_a_sweeps_file_in_the_cache_is_read(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """What `triton_decode_sweep.py` writes (an older file has no register cap) is what the
    backend reads for that GPU model."""
    monkeypatch.setenv("FASTSERVE_CACHE", str(tmp_path))
    device = "Test GPU (configs read from the cache)"
    key = DecodeConfig.key(1, 128, BF16)
    older = {k: v for k, v in asdict(LARGE).items() if k != "max_registers"}
    path = tmp_path / "triton" / tuned_config_name(device)
    path.parent.mkdir()
    path.write_text(json.dumps({f"{key}-b32": asdict(SMALL), key: older}))
    tuned = tuned_decode_configs(device)
    assert pick_decode_config(tuned, 1, 128, BF16, 32) == SMALL
    assert pick_decode_config(tuned, 1, 128, BF16, 128) == LARGE


def test_a_shipped_files_provenance_is_not_a_config(tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """A file as `triton_decode_sweep.py --out` writes it for shipping: its `_provenance`
    (GPU, versions, command, timings) is kept beside the configs and read as none of them."""
    monkeypatch.setenv("FASTSERVE_CACHE", str(tmp_path))
    device = "Test GPU (a shipped file with its provenance)"
    key = DecodeConfig.key(1, 128, BF16)
    path = tmp_path / "triton" / tuned_config_name(device)
    path.parent.mkdir()
    path.write_text(json.dumps({
        f"{key}-b32": asdict(SMALL), key: asdict(MEDIUM),
        "_provenance": {"gpu": device, "triton": "3.6.0", "command": "python benchmarks/..."}}))
    tuned = tuned_decode_configs(device)
    assert set(tuned) == {f"{key}-b32", key}
    assert pick_decode_config(tuned, 1, 128, BF16, 16) == SMALL
    assert pick_decode_config(tuned, 1, 128, BF16, 128) == MEDIUM
