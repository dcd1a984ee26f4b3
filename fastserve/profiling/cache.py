"""The start-up profile: measured once per model, dtype and device, then read from a cache."""

from __future__ import annotations

import hashlib
import os
import tempfile
import time
from pathlib import Path

import torch

from fastserve.clock import Timer
from fastserve.config import EngineConfig
from fastserve.core.cost_model import CostModel
from fastserve.executor.cpu_kernels import kernel_sources_digest
from fastserve.executor.device_choice import choose_device
from fastserve.executor.model_runner import ModelRunner
from fastserve.executor.platform import platform_for
from fastserve.profiling.fit import fit_cost_model
from fastserve.profiling.measure import ProfileGrid, measure


def profile_engine(
    runner: ModelRunner, grid: ProfileGrid | None = None, clock: Timer = time.perf_counter
) -> CostModel:
    """Time the runner on `grid`'s batches and fit a `CostModel` to the timings.

    NOTE: the runner must be otherwise idle: the profile writes KV blocks from id 0 up.
    """
    samples = measure(runner, grid or ProfileGrid(), clock)
    return fit_cost_model(samples, kv_block_bytes=runner.block_bytes)


def load_or_profile(
    runner: ModelRunner,
    cache_key: str,
    cache_dir: str | Path,
    grid: ProfileGrid | None = None,
    clock: Timer = time.perf_counter,
) -> CostModel:
    """The cached profile for `cache_key`, or a fresh one written to the cache.

    A missing or unreadable cache file means "profile again"; the write is atomic, so engines
    starting together never read half a file.
    """
    path = cached_profile_path(cache_key, cache_dir)
    cost = load_cached(path)
    if cost is None:
        cost = profile_engine(runner, grid, clock)
        save_profile(cost, path, cache_key=cache_key)
    return cost


def cached_profile_path(cache_key: str, cache_dir: str | Path) -> Path:
    return Path(cache_dir) / f"profile-{_file_safe(cache_key)}.json"


def load_cached(path: Path) -> CostModel | None:
    """The profile at `path`, or None when it is missing or unreadable (profile again)."""
    if path.is_file():
        try:
            return CostModel.from_json(path)
        except (ValueError, TypeError):
            pass  # corrupt or from an older CostModel
    return None


# Bumped when the fit changes what it would make of the same timings (2: the decode knee;
# 3: knees only with two batch sizes on each side; 4: the engine's own per-iteration work
# added, `fastserve.engine.overhead`; 5: prefill chunks after long cached contexts timed and
# the per-prefill-context-token term fitted), so cached profiles fitted the old way are
# measured again.
FIT_VERSION = 5


def profile_cache_key(model_path: str | Path, config: EngineConfig) -> str:
    """What the timings depend on: the checkpoint, dtypes, device, CPU threads, parallelism
    and KV block size; the fit's version; and on a CPU, which build of its kernels runs (a
    faster kernel makes the old timings stale)."""
    m, c, p = config.model, config.cache, config.parallel
    kernels = ""
    platform = platform_for(choose_device(m.device, torch.cuda.is_available()))  # "auto" too
    if platform.runs_on_host_cores:
        kernels = f"|kernels-{kernel_sources_digest()}" if platform.runs_cpu_kernels() else "|kernels-off"
    return (f"{Path(model_path).resolve()}|{m.dtype}|kv-{c.kv_cache_dtype}|{m.device}"
            f"|threads{m.num_threads}|tp{p.tensor_parallel_size}|pp{p.pipeline_parallel_size}"
            f"|bs{c.block_size}|fit{FIT_VERSION}{kernels}")


def save_profile(cost: CostModel, path: str | Path, **meta: object) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    os.close(fd)
    try:
        cost.to_json(tmp, **meta)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _file_safe(key: str) -> str:
    readable = "".join(c if c.isalnum() or c in "-_." else "_" for c in key)[-60:]
    return f"{readable}-{hashlib.sha256(key.encode()).hexdigest()[:12]}"

