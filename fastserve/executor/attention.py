"""Paged attention over the block-table KV cache.

Cache layout per layer: K and V each [num_kv_heads, num_blocks * block_size, head_dim]. A
request whose blocks run consecutively (the block pool arranges that when it can) reads its
context as a plain view of the cache; otherwise its slots are gathered. New tokens' K/V are
written at their slots once per layer for the whole flattened batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class SeqSlice:
    """Where one request's tokens sit in the flattened batch and its context in the cache."""

    q_start: int
    q_len: int
    is_prefill: bool
    ctx_len: int  # tokens of context attended to, the new ones included
    # Contiguous context: first slot of the view; otherwise the gather index.
    slot_start: int
    slot_index: torch.Tensor | None


@dataclass(frozen=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] long: cache slot of each new token
    seqs: list[SeqSlice]


class PagedAttention:
    """The `AttentionBackend` the model calls; owns the per-layer KV tensors."""

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
        num_slots = num_blocks * block_size
        shape = (num_kv_heads, num_slots, head_dim)
        self.k_caches = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v_caches = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.block_size = block_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.metadata: AttentionMetadata | None = None

    def forward(
        self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        # q: [num_tokens, num_heads, head_dim]; k, v: [num_tokens, num_kv_heads, head_dim]
        md = self.metadata
        assert md is not None, "attention metadata must be set before the forward pass"
        k_cache, v_cache = self.k_caches[layer_idx], self.v_caches[layer_idx]
        cdt = k_cache.dtype  # may be wider than the model's (see CacheConfig.kv_cache_dtype)
        k_cache.index_copy_(1, md.slot_mapping, k.transpose(0, 1).to(cdt))
        v_cache.index_copy_(1, md.slot_mapping, v.transpose(0, 1).to(cdt))
        num_heads = q.shape[1]
        group = num_heads // self.num_kv_heads
        outs = []
        for s in md.seqs:
            qs = q[s.q_start : s.q_start + s.q_len]  # [q_len, num_heads, head_dim]
            if s.is_prefill:
                # Prefills start at position 0: attend over the fresh K/V, causally.
                ks = k[s.q_start : s.q_start + s.q_len]
                vs = v[s.q_start : s.q_start + s.q_len]
                o = F.scaled_dot_product_attention(
                    qs.transpose(0, 1).unsqueeze(0),
                    ks.transpose(0, 1).unsqueeze(0),
                    vs.transpose(0, 1).unsqueeze(0),
                    is_causal=True,
                    enable_gqa=group > 1,
                )  # [1, num_heads, q_len, head_dim]
                outs.append(o[0].transpose(0, 1))
            else:
                if s.slot_index is None:
                    kc = k_cache[:, s.slot_start : s.slot_start + s.ctx_len]
                    vc = v_cache[:, s.slot_start : s.slot_start + s.ctx_len]
                else:
                    kc = k_cache.index_select(1, s.slot_index)
                    vc = v_cache.index_select(1, s.slot_index)
                # One query token: the `group` query heads sharing a KV head become `group`
                # query rows against it, so GQA needs no expanded K/V.
                o = F.scaled_dot_product_attention(
                    qs.reshape(1, self.num_kv_heads, group, self.head_dim).to(cdt),
                    kc.unsqueeze(0),  # [1, num_kv_heads, ctx_len, head_dim]
                    vc.unsqueeze(0),
                )  # [1, num_kv_heads, group, head_dim]
                outs.append(o.view(1, num_heads, self.head_dim).to(q.dtype))
        return outs[0] if len(outs) == 1 else torch.cat(outs)

    # -- swaps (block copies between this cache and a host cache of the same layout) --------

    def block_slots(self, block_ids: list[int]) -> torch.Tensor:
        bs = self.block_size
        idx = torch.tensor(block_ids, dtype=torch.long).unsqueeze(1) * bs + torch.arange(bs)
        return idx.flatten().to(self.k_caches[0].device)
