"""The attention seam between the model and whoever owns the KV cache.

The model computes q, k, v (rotary already applied) for a flat batch of tokens and
hands them to an `AttentionBackend`, which knows how tokens group into sequences,
where their past keys/values live and which keys each query may see. The paged
KV-cache backend lives in `fastserve.executor`; `DenseCausalAttention` here is the
cache-less reference used by tests.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import Tensor


class AttentionBackend(Protocol):
    """Attention for one forward pass over a flat batch of tokens."""

    def forward(self, layer_idx: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """Attend and return [num_tokens, num_heads, head_dim] in q's dtype.

        q: [num_tokens, num_heads, head_dim]; k, v: [num_tokens, num_kv_heads, head_dim].
        num_heads is a multiple of num_kv_heads (grouped-query attention). The inputs
        may be strided views into one fused qkv buffer. The softmax scale is
        head_dim ** -0.5 for every supported architecture.
        """
        ...


class DenseCausalAttention:
    """Reference backend: causal attention within each packed sequence, no KV cache.

    `seq_lens` gives the length of each sequence in token order; the batch is those
    sequences concatenated (their positions start at 0). Supports GQA and an optional
    Mistral-style sliding window (a query sees keys at distance < sliding_window).
    """

    def __init__(self, seq_lens: Sequence[int], sliding_window: int | None = None) -> None:
        if any(n <= 0 for n in seq_lens):
            raise ValueError(f"sequence lengths must be positive, got {list(seq_lens)}")
        self.seq_lens = list(seq_lens)
        self.sliding_window = sliding_window

    @property
    def cu_seqlens(self) -> list[int]:
        """Cumulative start offsets, [0, n0, n0 + n1, ...]."""
        out = [0]
        for n in self.seq_lens:
            out.append(out[-1] + n)
        return out

    def forward(self, layer_idx: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        num_tokens, num_heads, head_dim = q.shape
        if num_tokens != sum(self.seq_lens):
            raise ValueError(f"got {num_tokens} tokens but seq_lens sum to {sum(self.seq_lens)}")
        is_gqa = k.shape[1] != num_heads
        out = q.new_empty(num_tokens, num_heads, head_dim)
        cu = self.cu_seqlens
        for start, end in zip(cu[:-1], cu[1:], strict=True):
            # [heads, seq_len, head_dim] views: SDPA takes the head axis as a batch axis.
            qs, ks, vs = (t[start:end].transpose(0, 1) for t in (q, k, v))
            mask = self._mask(end - start, q.device)
            o = F.scaled_dot_product_attention(
                qs, ks, vs, attn_mask=mask, is_causal=mask is None, enable_gqa=is_gqa
            )  # [num_heads, seq_len, head_dim]
            out[start:end] = o.transpose(0, 1)
        return out

    def _mask(self, seq_len: int, device: torch.device) -> Tensor | None:
        if self.sliding_window is None or seq_len <= self.sliding_window:
            return None
        i = torch.arange(seq_len, device=device)
        dist = i[:, None] - i[None, :]  # [seq_len, seq_len]: query index - key index
        return (dist >= 0) & (dist < self.sliding_window)
