"""The portable backend: per-request `scaled_dot_product_attention` over the paged cache.

Runs on any device and cache dtype; the reference the kernels are held against, and what runs
where no kernel backend does (a CPU without a compiler, a GPU without Triton, a bf16 cache on
CPU). A request whose blocks run consecutively (the block pool arranges that when it can) reads
its context as a plain view of the cache; otherwise its slots are gathered.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from fastserve.core.kv import is_contiguous
from fastserve.core.plan import ScheduledRequest
from fastserve.executor.attention import AttentionMetadata, PagedAttention, compute_dtype
from fastserve.executor.cpu_linear import pack_weights


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
class TorchMetadata(AttentionMetadata):
    seqs: list[SeqSlice]


class TorchAttention(PagedAttention):
    """Plain torch ops, request by request; see the module docstring."""

    name = "torch"

    @classmethod
    def is_supported(cls, device: torch.device, cache_dtype: torch.dtype) -> bool:
        return True

    def prepare_model(self, model: torch.nn.Module) -> None:
        # On CPU (float32, bfloat16) the matmuls read weights packed once; elsewhere a no-op.
        pack_weights(model)

    def build_metadata(
        self, reqs: list[ScheduledRequest], slot_mapping: torch.Tensor
    ) -> TorchMetadata:
        bs = self.block_size
        seqs: list[SeqSlice] = []
        q_start = 0
        for r in reqs:
            n = len(r.token_ids)
            ctx = r.num_context_tokens
            live = r.block_ids[: -(-ctx // bs)]  # the blocks its context occupies
            # Only requests reading cached tokens (decodes, later chunks) need the gather.
            gathers = r.start_pos > 0 and not is_contiguous(live)
            seqs.append(SeqSlice(
                q_start=q_start, q_len=n, is_prefill=r.is_prefill, ctx_len=ctx,
                slot_start=live[0] * bs,
                slot_index=self.block_slots(live)[:ctx] if gathers else None,
            ))
            q_start += n
        return TorchMetadata(slot_mapping=slot_mapping, seqs=seqs)

    def forward(
        self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        # q: [num_tokens, num_heads, head_dim]; k, v: [num_tokens, num_kv_heads, head_dim]
        md = self.metadata
        assert isinstance(md, TorchMetadata), "attention metadata must be set before the forward pass"
        k_cache, v_cache = self.store_kv(layer_idx, k, v, md.slot_mapping)
        with self._sdpa_backends():
            outs = [
                self._prefill(s, q, k, v, k_cache, v_cache) if s.is_prefill
                else self._decode(s, q, k_cache, v_cache)
                for s in md.seqs
            ]
        return outs[0] if len(outs) == 1 else torch.cat(outs)

    def _sdpa_backends(self) -> AbstractContextManager[object]:
        """Which SDPA implementations may run (all of them here)."""
        return nullcontext()

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
        kc, vc = self._context(s, k_cache, v_cache, q.dtype)  # [num_kv_heads, ctx_len, head_dim]
        start = s.ctx_len - s.q_len
        # Bottom-right causal: query i (position start + i) sees keys 0..start + i. A boolean
        # mask keeps SDPA on its fused CPU kernel (no [heads, q_len, ctx_len] scores in memory).
        keys = torch.arange(s.ctx_len, device=q.device)
        mask = keys.unsqueeze(0) <= (start + torch.arange(s.q_len, device=q.device)).unsqueeze(1)
        o = F.scaled_dot_product_attention(
            q.transpose(0, 1).unsqueeze(0).to(kc.dtype),
            kc.unsqueeze(0),
            vc.unsqueeze(0),
            attn_mask=mask,  # [q_len, ctx_len]
            enable_gqa=q.shape[1] != kc.shape[0],
        )  # [1, num_heads, q_len, head_dim]
        return o[0].transpose(0, 1).to(q.dtype)

    @staticmethod
    def _context(
        s: SeqSlice, k_cache: torch.Tensor, v_cache: torch.Tensor, model_dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The request's cached K and V, [num_kv_heads, ctx_len, head_dim] each: a view when
        its blocks run consecutively, a gather otherwise (a float8 cache's, in the model's
        dtype)."""
        if s.slot_index is None:
            end = s.slot_start + s.ctx_len
            kc, vc = k_cache[:, s.slot_start : end], v_cache[:, s.slot_start : end]
        else:
            kc, vc = k_cache.index_select(1, s.slot_index), v_cache.index_select(1, s.slot_index)
        dt = compute_dtype(k_cache.dtype, model_dtype)
        return kc.to(dt), vc.to(dt)

    def _decode(
        self, s: SeqSlice, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor
    ) -> torch.Tensor:
        """One query token against the cached context, as a view when blocks are contiguous."""
        kc, vc = self._context(s, k_cache, v_cache, q.dtype)
        num_heads = q.shape[1]
        group = num_heads // self.num_kv_heads
        # The `group` query heads sharing a KV head become `group` query rows against it,
        # so GQA needs no expanded K/V.
        o = F.scaled_dot_product_attention(
            q[s.q_start].reshape(1, self.num_kv_heads, group, self.head_dim).to(kc.dtype),
            kc.unsqueeze(0),  # [1, num_kv_heads, ctx_len, head_dim]
            vc.unsqueeze(0),
        )  # [1, num_kv_heads, group, head_dim]
        # NOTE: reshape, not view: SDPA's output need not be contiguous (on CUDA it is not).
        return o.reshape(1, num_heads, self.head_dim).to(q.dtype)


class TorchCudaAttention(TorchAttention):
    """The portable backend on a GPU without Triton: SDPA minus its cuDNN implementation,
    which fails on these one-row bf16 decode shapes."""

    name = "torch"
    _BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]

    @classmethod
    def is_supported(cls, device: torch.device, cache_dtype: torch.dtype) -> bool:
        return device.type == "cuda"

    def prepare_model(self, model: torch.nn.Module) -> None:
        pass  # packed weights are a CPU matter

    def _sdpa_backends(self) -> AbstractContextManager[object]:
        return sdpa_kernel(self._BACKENDS)
