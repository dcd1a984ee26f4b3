"""Checks made at start-up before the model is allocated, each failing with one line that
names the file, field or variable to fix: the cache directory is writable, the weights the
config describes fit the device, the stop tokens are in the vocabulary. (The config's own
limits are `ArchConfig`'s; a checkpoint's files are checked as the loader opens them.)"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import torch

from fastserve.executor.device_choice import choose_device
from fastserve.executor.platform import platform_for
from fastserve.model.arch import ArchConfig
from fastserve.paths import CACHE_ENV, cache_dir

_GIB = 1 << 30


def check_cache_writable() -> Path:
    """The cache directory (CPU kernels, start-up profiles, the built-in model), created if
    missing; a ValueError naming it, and how to move it, if a file cannot be written there."""
    path = cache_dir()
    try:
        path.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".write-check-", dir=path)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        where = f"{CACHE_ENV}={path}" if os.environ.get(CACHE_ENV) else \
            f"the cache directory {path} (set {CACHE_ENV} to move it)"
        raise ValueError(f"{where} is not writable: {exc.strerror or exc}; the cache holds "
                         "the CPU kernels, start-up profiles and the built-in model") from None
    return path


def check_weights_fit(arch: ArchConfig, dtype: torch.dtype, device: str, num_shards: int,
                      config_path: Path) -> None:
    """Refuse, before allocating, a config whose weights (`num_shards` ways split) need more
    memory than the device has in all: what an absurd config would otherwise do slowly."""
    need = arch.num_params * dtype.itemsize / num_shards
    have = _device_memory_bytes(device)
    if have is not None and need > have:
        raise ValueError(
            f"{config_path}: the weights take {need / _GIB:,.1f} GiB in {str(dtype).removeprefix('torch.')} "
            f"(num_hidden_layers {arch.num_hidden_layers}, hidden_size {arch.hidden_size}, "
            f"intermediate_size {arch.intermediate_size}, vocab_size {arch.vocab_size}), "
            f"more than the {have / _GIB:,.1f} GiB of {device}")


def check_stop_ids(eos_token_ids: list[int], vocab_size: int, model_path: Path) -> None:
    """The stop tokens read from tokenizer_config.json, generation_config.json or config.json
    must be ids the model can sample."""
    outside = [i for i in eos_token_ids if not 0 <= i < vocab_size]
    if outside:
        raise ValueError(
            f"{model_path}: eos_token_id {outside[0]} (generation_config.json or config.json) "
            f"is outside the vocabulary (vocab_size {vocab_size}: ids 0 to {vocab_size - 1})")


def _device_memory_bytes(device: str) -> int | None:
    # NOTE: checked before the engine resolves `--device auto`: resolved here as it will be.
    resolved = torch.device(choose_device(device, torch.cuda.is_available()))
    return platform_for(resolved).total_memory_bytes(resolved)
