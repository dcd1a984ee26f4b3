"""The attention-backend seam of the executor: the paged KV cache and the attention over it.

A backend is one class per device or kernel family (`fastserve.executor.backends` holds them
and the registry that picks one, once, from the device and the cache dtype). Each one:

- owns the KV tensors, in the layout `kv_cache_shape` gives;
- builds its own attention metadata for an iteration from the scheduled requests
  (`build_metadata`): what its kernels read (block tables, lengths, gather indices);
- is the model's `AttentionBackend` (`forward(layer_idx, q, k, v)`): it stores the new
  tokens' K/V at their slots and attends;
- says whether decode iterations may be captured as CUDA graphs, and if so provides the
  static metadata buffers capture and replay use (`init_cuda_graphs`, `graph_metadata`,
  `fill_graph_metadata`).

Cache layout per layer: K and V each [num_kv_heads, num_blocks * block_size, head_dim], all
layers in one tensor (see `kv_cache_shape`). Slot `b * block_size + i` holds position i of
block b. NOTE: the swapper (`executor/swap.py`) moves blocks of every layer in one indexed op
and relies on this layout; a backend wanting another one must bring its own swapper.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar

import torch

from fastserve.core.plan import ScheduledRequest
from fastserve.executor.staging import to_device

# The largest float8 E4M3 value: K/V beyond it are clamped as stored (a plain cast overflows
# to NaN), as vLLM's fp8 cache saturates.
FP8_MAX = torch.finfo(torch.float8_e4m3fn).max


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype.is_floating_point and dtype.itemsize == 1


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """`t`, or for a float8 tensor the same memory as uint8: copies and indexed writes move
    the same bytes, and some (index_copy_) have no float8 kernel."""
    return t.view(torch.uint8) if is_fp8(t.dtype) else t


def to_cache_dtype(x: torch.Tensor, cache_dtype: torch.dtype) -> torch.Tensor:
    """`x` as the cache stores it: float8 saturates at +-FP8_MAX."""
    if is_fp8(cache_dtype):
        x = x.float().clamp(-FP8_MAX, FP8_MAX)
    return x.to(cache_dtype)


def compute_dtype(cache_dtype: torch.dtype, model_dtype: torch.dtype) -> torch.dtype:
    """What attention over the cache computes in: the cache's dtype (it may be wider than the
    model's), except that a float8 cache is read back into the model's."""
    return model_dtype if is_fp8(cache_dtype) else cache_dtype


@dataclass(frozen=True)
class AttentionMetadata:
    """What every backend's metadata carries; each backend subclasses it with its own."""

    slot_mapping: torch.Tensor  # [num_tokens] long: cache slot of each new token (-1: none)


class PagedAttention(ABC):
    """An attention backend over the paged KV cache; see the module docstring."""

    name: ClassVar[str]
    # Decode iterations may be captured and replayed as CUDA graphs (`init_cuda_graphs`...).
    supports_cuda_graphs: ClassVar[bool] = False

    @classmethod
    @abstractmethod
    def is_supported(cls, device: torch.device, cache_dtype: torch.dtype) -> bool:
        """Whether this backend runs here (the registry asks, in its order of preference)."""

    @staticmethod
    def kv_cache_shape(
        num_layers: int, num_kv_heads: int, num_blocks: int, block_size: int, head_dim: int
    ) -> tuple[int, ...]:
        # [layers, 2 (K, V), num_kv_heads, num_blocks, block_size, head_dim]: each layer's K
        # or V is a contiguous [num_kv_heads, slots, head_dim] view into it, and a set of
        # blocks across every layer is one index away (the swaps move them in one op).
        return (num_layers, 2, num_kv_heads, num_blocks, block_size, head_dim)

    @staticmethod
    def new_cache(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """The zero-filled KV cache tensor (a backend may place it in memory of its own)."""
        return torch.zeros(shape, dtype=dtype, device=device)

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.kv_cache = self.new_cache(
            self.kv_cache_shape(num_layers, num_kv_heads, num_blocks, block_size, head_dim),
            dtype, device,
        )
        slots = (num_kv_heads, num_blocks * block_size, head_dim)
        self.k_caches = [self.kv_cache[i, 0].view(slots) for i in range(num_layers)]
        self.v_caches = [self.kv_cache[i, 1].view(slots) for i in range(num_layers)]
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.device = device
        self.scale = head_dim**-0.5
        # Host inputs are built in pinned memory and copied with non_blocking (a GPU).
        self.pin_memory = False
        # Set by the runner around each forward pass (`build_metadata`'s result).
        self.metadata: AttentionMetadata | None = None

    @abstractmethod
    def build_metadata(
        self, reqs: list[ScheduledRequest], slot_mapping: torch.Tensor
    ) -> AttentionMetadata:
        """This backend's metadata for one iteration: the scheduled requests' tokens are
        concatenated in order; `slot_mapping` (on the device) says where each one's K/V go."""

    @abstractmethod
    def forward(
        self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        """Store k, v at the metadata's slots and attend: q [num_tokens, num_heads, head_dim],
        k, v [num_tokens, num_kv_heads, head_dim] -> [num_tokens, num_heads, head_dim]."""

    def prepare_model(self, model: torch.nn.Module) -> None:
        """Give the model's layers this device's fused kernels, if the backend has any (the
        runner calls it once, before any forward pass)."""

    def describe(self) -> dict[str, str]:
        """What this backend chose to run, beyond its name (logged at start-up and shown in
        /metrics as `fastserve_executor_info`): e.g. the CPU's vector path."""
        return {}

    # -- CUDA-graph hooks (backends with `supports_cuda_graphs` override them) ------------

    def init_cuda_graphs(self, max_batch_size: int, max_blocks_per_seq: int) -> None:
        """Allocate the static metadata buffers of decode batches up to `max_batch_size`."""
        raise NotImplementedError(f"the {self.name} backend does not capture CUDA graphs")

    def graph_metadata(self, batch_size: int) -> AttentionMetadata:
        """Metadata over the static buffers for a decode batch of `batch_size` (padded) rows:
        what a graph captures, so each replay reads whatever `fill_graph_metadata` wrote."""
        raise NotImplementedError(f"the {self.name} backend does not capture CUDA graphs")

    def fill_graph_metadata(
        self, reqs: list[ScheduledRequest], slots: list[int], batch_size: int
    ) -> None:
        """Write one decode iteration (len(reqs) <= batch_size decodes, their new tokens'
        `slots`) into the static buffers; rows past len(reqs) are padding that stores
        nothing and reads one harmless slot."""
        raise NotImplementedError(f"the {self.name} backend does not capture CUDA graphs")

    # -- swaps (block copies between this cache and a host cache of the same layout) --------

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy whole blocks within this cache, every layer's K and V in one indexed op:
        (source, destination) pairs (a forked request's partial last block, `plan.copies`)."""
        src, dst = (to_device(ids, torch.long, self.device) for ids in zip(*pairs, strict=True))
        kv = as_bytes(self.kv_cache)  # [layers, 2, heads, blocks, block_size, dim]
        kv.index_copy_(3, dst, kv.index_select(3, src))

    def block_slots(self, block_ids: list[int]) -> torch.Tensor:
        """The cache slots of these blocks, in order: [len(block_ids) * block_size] long."""
        bs = self.block_size
        idx = torch.tensor(block_ids, dtype=torch.long).unsqueeze(1) * bs + torch.arange(bs)
        return idx.flatten().to(self.device)

    def store_kv(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor,
                 slot_mapping: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the new tokens' K/V at their slots (plain torch ops); returns the layer's
        K and V caches."""
        k_cache, v_cache = self.k_caches[layer_idx], self.v_caches[layer_idx]
        cdt = k_cache.dtype  # may be wider or narrower than the model's (kv_cache_dtype)
        as_bytes(k_cache).index_copy_(1, slot_mapping, as_bytes(to_cache_dtype(k.transpose(0, 1), cdt)))
        as_bytes(v_cache).index_copy_(1, slot_mapping, as_bytes(to_cache_dtype(v.transpose(0, 1), cdt)))
        return k_cache, v_cache
