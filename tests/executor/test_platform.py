"""The device-family seam (`fastserve.executor.platform`): each device type gets its family's
answers, and a type with no class of its own (meta tensors, which compile kernels offline)
the portable ones. The CUDA answers that need no GPU are checked here too."""

from __future__ import annotations

import torch

from fastserve.executor.distributed.comm import data_backend
from fastserve.executor.distributed.stage import rank_device
from fastserve.executor.platform import CpuPlatform, CudaPlatform, Platform, platform_for
from fastserve.executor.sampler import Sampler
from fastserve.executor.staging import to_device


def test_each_device_type_gets_its_familys_platform() -> None:
    assert type(platform_for("cpu")) is CpuPlatform
    assert type(platform_for(torch.device("cpu"))) is CpuPlatform
    assert type(platform_for("cuda:1")) is CudaPlatform
    assert type(platform_for("meta")) is Platform


def test_cpu_ranks_share_the_cpu_and_cuda_ranks_take_a_gpu_each() -> None:
    assert [rank_device("cpu", r) for r in range(3)] == ["cpu"] * 3
    assert [rank_device("cuda", r) for r in range(2)] == ["cuda:0", "cuda:1"]
    assert [rank_device("cuda:2", r) for r in range(2)] == ["cuda:2", "cuda:3"]
    assert data_backend(torch.device("cpu")) == "gloo"
    assert data_backend(torch.device("cuda", 0)) == "nccl"


def test_the_cpu_path_reads_on_the_host_and_samples_row_by_row() -> None:
    cpu = platform_for("cpu")
    assert cpu.runs_on_host_cores and not cpu.profiles_kv_pool and not cpu.has_copy_stream
    t = torch.arange(4)
    assert cpu.copy_to_host(t) is t and cpu.copies_done() is None
    sampler = Sampler([2], 0, torch.device("cpu"))
    assert not sampler.batched_draw and sampler.filters_by_selection


def test_a_device_without_a_family_gets_plain_torch_ops() -> None:
    ids = to_device([3, 1, 2], torch.long, torch.device("meta"))
    assert ids.device.type == "meta" and ids.shape == (3,)
    assert not platform_for("meta").runs_cpu_kernels()
