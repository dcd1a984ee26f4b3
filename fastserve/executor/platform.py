"""The device-family seam of the executor: what differs between a CPU and a GPU outside the
attention kernels (those are `PagedAttention` backends, `executor/backends/`).

One interface (`Platform`), one class per device family (`CpuPlatform`, `CudaPlatform`), and a
registry that picks one by the device's type (`platform_for`), as vLLM's `current_platform`
does. The generic path (staging, sampling, swaps, the KV pool's size, collectives, threads,
timing) asks its device's platform instead of testing `device.type` itself. A device type
with no class of its own (the meta tensors that compile kernels offline) gets `Platform`:
plain torch ops, nothing asynchronous.

NOTE: a leaf of the executor (torch and the CPU kernels' switch only): the attention
interface, the staging helpers and everything above them may import it without a cycle.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Sequence
from typing import ClassVar

import torch

from fastserve.executor.cpu_kernels import cpu_kernels_enabled


class Platform:
    """A device family's answers; this base class is the portable one (plain torch ops)."""

    # torch.distributed's backend for this device's tensors.
    collective_backend: ClassVar[str] = "gloo"
    # The KV pool is sized by profiling a forward pass against the device's memory (a GPU's
    # is the limit); otherwise a fixed default (`memory_profile.CPU_KV_CACHE_GIB`).
    profiles_kv_pool: ClassVar[bool] = False
    # The sampler draws the rows without a seed in one batched race (measured to pay on a
    # GPU; on a CPU the race's exponentials cost more than an inverse transform per row).
    batched_draw: ClassVar[bool] = False
    # Top-k / top-p sort whole rows (a GPU); elsewhere a sort costs more than the model's
    # step, and selections do instead (`executor/nucleus.py`).
    sorts_rows: ClassVar[bool] = False
    # The cache's blocks move to and from the host on a copy stream of their own.
    has_copy_stream: ClassVar[bool] = False
    # Decode iterations may be captured and replayed as CUDA graphs.
    captures_graphs: ClassVar[bool] = False
    # The device's compute is this machine's cores: torch's thread count, OpenMP's workers
    # and the C++ CPU kernels apply to it.
    runs_on_host_cores: ClassVar[bool] = False

    def to_device(self, values: Sequence[int] | Sequence[float] | Sequence[Sequence[int]],
                  dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """`values` as a tensor on `device` (see `staging.to_device`)."""
        return torch.tensor(values, dtype=dtype, device=device)

    def copy_to_host(self, t: torch.Tensor) -> torch.Tensor:
        """`t` on its way to the host without waiting (read it after `copies_done`'s event);
        `t` itself where it is read as it is."""
        return t

    def copies_done(self) -> torch.cuda.Event | None:
        """An event recorded after the copies `copy_to_host` started (wait on it before
        reading them); None where nothing was started."""
        return None

    def synchronize(self, device: torch.device) -> None:
        """Wait for the work queued on `device` (a timing's start and end)."""

    def total_memory_bytes(self, device: torch.device) -> int | None:
        """All the memory the device has (None where the system does not say)."""
        try:
            return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (ValueError, OSError):  # not a POSIX system that says
            return None

    def rank_device(self, device: str, local_rank: int) -> str:
        """The device of a distributed rank on this machine: by default all ranks share it."""
        return device

    def make_current(self, device: str) -> None:
        """Make `device` the process's current one (before loading onto it)."""

    def grammar_mask_backend(self) -> str | None:
        """xgrammar's kernel for applying a token bitmask to logits on this device; None:
        its host kernel, on the logits and bitmask where they are."""
        return None

    def runs_cpu_kernels(self) -> bool:
        """Whether fastserve's C++ CPU kernels run here (on a CPU, unless switched off)."""
        return False


class CpuPlatform(Platform):
    runs_on_host_cores = True

    def runs_cpu_kernels(self) -> bool:
        return cpu_kernels_enabled()


class CudaPlatform(Platform):
    collective_backend = "nccl"
    profiles_kv_pool = True
    batched_draw = True
    sorts_rows = True
    has_copy_stream = True
    captures_graphs = True

    def to_device(self, values: Sequence[int] | Sequence[float] | Sequence[Sequence[int]],
                  dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        # NOTE: staged in pinned memory and copied with non_blocking: a copy from pageable
        # memory waits for everything queued on the stream.
        return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)

    def copy_to_host(self, t: torch.Tensor) -> torch.Tensor:
        # Into pinned host memory, non_blocking: nothing waits until the event is.
        return torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True)

    def copies_done(self) -> torch.cuda.Event | None:
        copied = torch.cuda.Event()
        copied.record()
        return copied

    def synchronize(self, device: torch.device) -> None:
        torch.cuda.synchronize(device)

    def total_memory_bytes(self, device: torch.device) -> int | None:
        return int(torch.cuda.get_device_properties(device).total_memory)

    def rank_device(self, device: str, local_rank: int) -> str:
        # One GPU a rank, counted from the configured one.
        base = int(device.partition(":")[2] or 0)
        return f"cuda:{base + local_rank}"

    def make_current(self, device: str) -> None:
        torch.cuda.set_device(device)

    def grammar_mask_backend(self) -> str | None:
        return "triton" if importlib.util.find_spec("triton") else "torch_native"


# Device type -> its family's platform.
_PLATFORMS: dict[str, Platform] = {"cpu": CpuPlatform(), "cuda": CudaPlatform()}
_PORTABLE = Platform()


def platform_for(device: torch.device | str) -> Platform:
    """The platform of `device` (a torch.device, or a resolved config string such as "cpu"
    or "cuda:1"); the portable one for a type without its own."""
    return _PLATFORMS.get(torch.device(device).type, _PORTABLE)
