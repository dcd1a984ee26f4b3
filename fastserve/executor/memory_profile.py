"""The KV pool's size for one device, decided once at start-up, before the real runner.

A block count (`num_device_blocks`) wins, then a size in GiB (`kv_cache_gib`); with neither,
a CUDA device profiles one forward pass at the largest batch and takes what
`gpu_memory_utilization` of its memory leaves (`kv_sizing.kv_pool_bytes`, as vLLM); a CPU
takes 1 GiB.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
from dataclasses import dataclass

import torch

from fastserve.config import EngineConfig
from fastserve.core.plan import ScheduledRequest, SchedulerOutput
from fastserve.executor.backends import TORCH_DTYPES, kv_cache_dtype
from fastserve.executor.kv_sizing import (
    CPU_KV_CACHE_GIB,
    GIB,
    MemoryProfile,
    blocks_per_request,
    kv_pool_blocks,
    kv_pool_bytes,
)
from fastserve.executor.model_runner import ModelRunner, kv_block_bytes
from fastserve.executor.platform import platform_for
from fastserve.model.arch import ArchConfig
from fastserve.model.llama import LlamaForCausalLM
from fastserve.request import SamplingParams

logger = logging.getLogger(__name__)

# The profiled batch samples as the costliest request does: a float32 softmax and a sort of
# every row of the vocabulary (top-k and top-p).
_PROFILE_PARAMS = SamplingParams(max_tokens=1, temperature=1.0, top_p=0.9, top_k=50)


@dataclass(frozen=True)
class KVPoolPlan:
    """How many device blocks the pool has, and how that was decided (logged and named in a
    start-up refusal)."""

    num_blocks: int
    how_sized: str
    profile: MemoryProfile | None = None  # the measurement, where a profile sized the pool


def plan_kv_pool(config: EngineConfig, model: LlamaForCausalLM, arch: ArchConfig,
                 eos_token_ids: list[int], max_model_len: int, num_seqs: int) -> KVPoolPlan:
    """The pool for one process on one device (see the module docstring). `num_seqs`: the
    largest batch the scheduler may run, which the profiled forward pass holds."""
    cache = config.cache
    device = torch.device(config.model.device)
    dtype = kv_cache_dtype(cache.kv_cache_dtype, TORCH_DTYPES[config.model.dtype], device)
    block_bytes = kv_block_bytes(arch, cache.block_size, dtype)
    if cache.num_device_blocks is not None:
        return KVPoolPlan(cache.num_device_blocks, "--num-device-blocks")
    if cache.kv_cache_gib is not None:
        return KVPoolPlan(max(1, int(cache.kv_cache_gib * GIB) // block_bytes),
                          f"--kv-cache-gib {cache.kv_cache_gib:g}")
    if not platform_for(device).profiles_kv_pool:
        return KVPoolPlan(max(1, int(CPU_KV_CACHE_GIB * GIB) // block_bytes),
                          f"{CPU_KV_CACHE_GIB:g} GiB, a CPU's default")
    num_tokens = min(config.scheduler.max_num_batched_tokens, num_seqs * max_model_len)
    profile = profile_memory(config, model, arch, eos_token_ids, num_tokens, num_seqs)
    util = cache.gpu_memory_utilization
    pool = kv_pool_bytes(profile, util)
    num_blocks = kv_pool_blocks(pool, block_bytes)
    logger.info(
        "KV pool: %d blocks (%.2f GiB) = %.0f%% of %.1f GiB - weights %.2f GiB - peak "
        "activations %.2f GiB (a forward pass of %d tokens in %d requests) - non-torch %.2f GiB",
        num_blocks, num_blocks * block_bytes / GIB, util * 100, profile.total_bytes / GIB,
        profile.weights_bytes / GIB, profile.peak_activation_bytes / GIB, num_tokens, num_seqs,
        profile.non_torch_bytes / GIB)
    return KVPoolPlan(num_blocks, f"--gpu-memory-utilization {util:g} of "
                      f"{profile.total_bytes / GIB:.1f} GiB after {profile.non_kv_bytes / GIB:.2f} "
                      "GiB for the model", profile)


@torch.inference_mode()
def profile_memory(config: EngineConfig, model: LlamaForCausalLM, arch: ArchConfig,
                   eos_token_ids: list[int], num_tokens: int, num_seqs: int) -> MemoryProfile:
    """Run one prefill of `num_tokens` tokens over `num_seqs` requests, sampled, through a
    runner with just the blocks it needs, eager, and read the device's memory around it."""
    device = torch.device(config.model.device)
    num_seqs = max(1, min(num_seqs, num_tokens))
    lengths = [num_tokens // num_seqs + (i < num_tokens % num_seqs) for i in range(num_seqs)]
    bs = config.cache.block_size
    tables, first = [], 0
    for n in lengths:
        tables.append(list(range(first, first + blocks_per_request(n, bs))))
        first += len(tables[-1])
    torch.cuda.synchronize(device)
    gc.collect()
    torch.cuda.empty_cache()
    weights = torch.cuda.memory_allocated(device)
    runner = ModelRunner(
        model, arch, dataclasses.replace(config.model, enforce_eager=True),
        dataclasses.replace(config.cache, num_device_blocks=first, num_host_blocks=0),
        eos_token_ids)
    torch.cuda.synchronize(device)
    held = torch.cuda.memory_allocated(device)  # the weights and the profile's few blocks
    torch.cuda.reset_peak_memory_stats(device)
    plan = [ScheduledRequest(f"profile-{i}", [1] * n, 0, t, _PROFILE_PARAMS, 0)
            for i, (n, t) in enumerate(zip(lengths, tables))]
    runner.execute(SchedulerOutput(scheduled=plan))
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - held
    runner.execute(SchedulerOutput(scheduled=[], finished_ids=[r.request_id for r in plan]))
    del runner, plan
    gc.collect()
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    # NOTE: what the device uses beyond torch's own pool: the CUDA context, cuBLAS and NCCL
    # workspaces, and other processes on the same GPU.
    non_torch = (total - free) - torch.cuda.memory_reserved(device)
    return MemoryProfile(total, weights, peak, max(0, non_torch))
