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

from fastserve.executor.cpu_kernels import decode_attention_kernel


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
    # [num_blocks] int32: a prefill after cached tokens read by the CPU extend kernel, which
    # follows the block table itself (no gather index then).
    block_table: torch.Tensor | None = None


@dataclass(frozen=True)
class DecodeBatch:
    """All decoding requests of an iteration, for the one-call CPU kernel."""

    token_idx: torch.Tensor  # [num_decodes] long: their rows in the flattened batch
    block_table: torch.Tensor  # [num_decodes, max_blocks] int32
    ctx_lens: torch.Tensor  # [num_decodes] int32


@dataclass(frozen=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] long: cache slot of each new token
    seqs: list[SeqSlice]
    decodes: DecodeBatch | None = None  # set when the decode kernel will be used


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
        # One tensor, [layers, 2 (K, V), num_kv_heads, num_blocks, block_size, head_dim]: each
        # layer's K or V is a contiguous [num_kv_heads, slots, head_dim] view into it, and a set
        # of blocks across every layer is one index away (the swaps move them in one op).
        self.kv_cache = torch.zeros(
            (num_layers, 2, num_kv_heads, num_blocks, block_size, head_dim), dtype=dtype, device=device
        )
        slots = (num_kv_heads, num_blocks * block_size, head_dim)
        self.k_caches = [self.kv_cache[i, 0].view(slots) for i in range(num_layers)]
        self.v_caches = [self.kv_cache[i, 1].view(slots) for i in range(num_layers)]
        self.block_size = block_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.metadata: AttentionMetadata | None = None
        self.scale = head_dim**-0.5
        # One call per layer for all decodes, and one per later prefill chunk (CPU, float32
        # cache: `cpu_kernels`); None = per-request torch ops.
        self.decode_kernel = (
            decode_attention_kernel() if device.type == "cpu" and dtype == torch.float32 else None
        )

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
        if md.decodes is not None and self.decode_kernel is not None:
            return self._forward_with_kernel(md, md.decodes, q, k, v, k_cache, v_cache)
        outs = [
            self._prefill(s, q, k, v, k_cache, v_cache) if s.is_prefill
            else self._decode(s, q, k_cache, v_cache)
            for s in md.seqs
        ]
        return outs[0] if len(outs) == 1 else torch.cat(outs)

    def _forward_with_kernel(
        self,
        md: AttentionMetadata,
        dec: DecodeBatch,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
    ) -> torch.Tensor:
        assert self.decode_kernel is not None
        out = torch.empty_like(q)  # [num_tokens, num_heads, head_dim]
        qd = q.index_select(0, dec.token_idx).float()  # [num_decodes, num_heads, head_dim]
        od = self.decode_kernel.decode_attention(
            qd, k_cache, v_cache, dec.block_table, dec.ctx_lens, self.block_size, self.scale
        )
        out.index_copy_(0, dec.token_idx, od.to(q.dtype))
        for s in md.seqs:
            if s.is_prefill:
                out[s.q_start : s.q_start + s.q_len] = self._prefill(s, q, k, v, k_cache, v_cache)
        return out

    def _prefill(
        self,
        s: SeqSlice,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
    ) -> torch.Tensor:
        """A prefill from position 0 attends over the fresh K/V, causally; a later chunk (or
        the rest of a prompt whose prefix is cached) over the cache (`_extend`)."""
        sl = slice(s.q_start, s.q_start + s.q_len)
        if s.ctx_len > s.q_len and s.block_table is not None and self.decode_kernel is not None:
            # Block by block through the table: no gathered context, no [q_len, ctx_len] mask.
            return self.decode_kernel.extend_attention(
                q[sl].float(), k_cache, v_cache, s.block_table, s.ctx_len - s.q_len,
                self.block_size, self.scale,
            ).to(q.dtype)  # [q_len, num_heads, head_dim]
        if s.ctx_len > s.q_len:
            return self._extend(s, q[sl], k_cache, v_cache)
        o = F.scaled_dot_product_attention(
            q[sl].transpose(0, 1).unsqueeze(0),
            k[sl].transpose(0, 1).unsqueeze(0),
            v[sl].transpose(0, 1).unsqueeze(0),
            is_causal=True,
            enable_gqa=q.shape[1] != k.shape[1],
        )  # [1, num_heads, q_len, head_dim]
        return o[0].transpose(0, 1)

    def _extend(
        self, s: SeqSlice, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor
    ) -> torch.Tensor:
        """`q_len` new tokens after `ctx_len - q_len` cached ones: each attends to the whole
        cached prefix and causally to the new tokens (their K/V are in the cache already)."""
        # q: [q_len, num_heads, head_dim]
        kc, vc = self._context(s, k_cache, v_cache)  # [num_kv_heads, ctx_len, head_dim]
        start = s.ctx_len - s.q_len
        # Bottom-right causal: query i (position start + i) sees keys 0..start + i. A boolean
        # mask keeps SDPA on its fused CPU kernel (no [heads, q_len, ctx_len] scores in memory).
        keys = torch.arange(s.ctx_len, device=q.device)
        mask = keys.unsqueeze(0) <= (start + torch.arange(s.q_len, device=q.device)).unsqueeze(1)
        o = F.scaled_dot_product_attention(
            q.transpose(0, 1).unsqueeze(0).to(k_cache.dtype),
            kc.unsqueeze(0),
            vc.unsqueeze(0),
            attn_mask=mask,  # [q_len, ctx_len]
            enable_gqa=q.shape[1] != kc.shape[0],
        )  # [1, num_heads, q_len, head_dim]
        return o[0].transpose(0, 1).to(q.dtype)

    @staticmethod
    def _context(
        s: SeqSlice, k_cache: torch.Tensor, v_cache: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The request's cached K and V, [num_kv_heads, ctx_len, head_dim] each: a view when
        its blocks run consecutively, a gather otherwise."""
        if s.slot_index is None:
            end = s.slot_start + s.ctx_len
            return k_cache[:, s.slot_start : end], v_cache[:, s.slot_start : end]
        return k_cache.index_select(1, s.slot_index), v_cache.index_select(1, s.slot_index)

    def _decode(
        self, s: SeqSlice, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor
    ) -> torch.Tensor:
        """One query token against the cached context, as a view when blocks are contiguous."""
        kc, vc = self._context(s, k_cache, v_cache)
        num_heads = q.shape[1]
        group = num_heads // self.num_kv_heads
        # The `group` query heads sharing a KV head become `group` query rows against it,
        # so GQA needs no expanded K/V.
        o = F.scaled_dot_product_attention(
            q[s.q_start].reshape(1, self.num_kv_heads, group, self.head_dim).to(k_cache.dtype),
            kc.unsqueeze(0),  # [1, num_kv_heads, ctx_len, head_dim]
            vc.unsqueeze(0),
        )  # [1, num_kv_heads, group, head_dim]
        return o.view(1, num_heads, self.head_dim).to(q.dtype)

    # -- swaps (block copies between this cache and a host cache of the same layout) --------

    def block_slots(self, block_ids: list[int]) -> torch.Tensor:
        bs = self.block_size
        idx = torch.tensor(block_ids, dtype=torch.long).unsqueeze(1) * bs + torch.arange(bs)
        return idx.flatten().to(self.k_caches[0].device)
