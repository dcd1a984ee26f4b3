"""How big the KV pool is, and what it must hold: arithmetic over byte counts, no torch.

On a GPU the pool takes what is left of `gpu_memory_utilization` of the device's memory once
the weights, the peak activations of a profiled forward pass at the largest batch, and the
memory torch did not allocate (the CUDA context, cuBLAS workspaces, NCCL, other processes)
are counted, as vLLM sizes it (`Worker.determine_available_memory`):

    kv_bytes = total * utilization - weights - peak_activations - non_torch

`executor/memory_profile.py` measures those figures on the device; everything here is pure,
so it is tested on a CPU for production shapes on 80 GB and 141 GB devices.
"""

from __future__ import annotations

from dataclasses import dataclass

GIB = 1 << 30
# A CPU's pool when no size is given (`CacheConfig.kv_cache_gib` None): host memory is not
# profiled, and a CPU serves few requests at once.
CPU_KV_CACHE_GIB = 1.0
# The flags that change whether a request of max_model_len fits (named in the refusal).
POOL_FLAGS = ("--max-model-len", "--kv-cache-gib", "--gpu-memory-utilization",
              "--num-device-blocks")


@dataclass(frozen=True)
class MemoryProfile:
    """What one device's memory held around a profiled forward pass at the largest batch
    (bytes); `executor/memory_profile.py` measures it on CUDA."""

    total_bytes: int  # the device's memory
    weights_bytes: int  # torch memory held before the forward: weights and buffers
    peak_activation_bytes: int  # torch's peak during the forward beyond what it held before
    non_torch_bytes: int  # used on the device but not by torch's allocator

    @property
    def non_kv_bytes(self) -> int:
        return self.weights_bytes + self.peak_activation_bytes + self.non_torch_bytes


def kv_pool_bytes(profile: MemoryProfile, gpu_memory_utilization: float) -> int:
    """Bytes left for the KV pool out of `gpu_memory_utilization` of the device (< 0 when
    the model alone needs more)."""
    if not 0 < gpu_memory_utilization <= 1:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}")
    return int(profile.total_bytes * gpu_memory_utilization) - profile.non_kv_bytes


def kv_block_bytes(num_layers: int, num_kv_heads: int, head_dim: int, block_size: int,
                   elem_bytes: int) -> int:
    """Bytes of one KV block over every layer, K and V."""
    return 2 * num_layers * num_kv_heads * head_dim * block_size * elem_bytes


def kv_pool_blocks(pool_bytes: int, block_bytes: int) -> int:
    """Whole blocks in `pool_bytes` (0 when there is no room)."""
    return max(0, pool_bytes) // block_bytes


def blocks_per_request(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


def check_pool_holds(max_model_len: int, block_size: int, num_blocks: int,
                     how_sized: str) -> None:
    """Refuse a pool that cannot hold one request of `max_model_len` tokens: each such
    request would be refused later, one by one (naming the flags that change it)."""
    needed = blocks_per_request(max_model_len, block_size)
    if needed > num_blocks:
        raise ValueError(
            f"the KV cache holds {num_blocks} blocks of {block_size} tokens "
            f"({num_blocks * block_size} tokens; {how_sized}), but one request of "
            f"max_model_len={max_model_len} tokens needs {needed}: lower --max-model-len "
            f"(at most {num_blocks * block_size}), or give the cache more room with "
            f"--kv-cache-gib, --gpu-memory-utilization (a GPU) or --num-device-blocks")


def gpu_max_batch_size(num_blocks: int, cuda_graph_max_batch_size: int) -> int:
    """The scheduler's batch on a GPU when none is given: as many requests as the captured
    graphs replay, and no more than the pool has blocks (each running request holds one at
    least; beyond that the KV policy swaps or preempts)."""
    return max(1, min(cuda_graph_max_batch_size, num_blocks))
