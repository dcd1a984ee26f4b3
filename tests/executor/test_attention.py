"""Paged attention reads the same context whether its blocks are contiguous or scattered."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from fastserve.executor.attention import AttentionMetadata, PagedAttention, SeqSlice

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    # q [1, H, D]; k, v [ctx, Hkv, D]: the last query attends to every key.
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1).transpose(0, 1)
    v = v.repeat_interleave(group, dim=1).transpose(0, 1)
    return F.scaled_dot_product_attention(q.transpose(0, 1), k, v).transpose(0, 1)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("blocks", [[4, 5, 6], [9, 2, 7]], ids=["contiguous", "scattered"])
def test_decode_reads_through_block_table(device: str, blocks: list[int]) -> None:
    torch.manual_seed(0)
    heads, kv_heads, dim, bs = 8, 4, 16, 4
    attn = PagedAttention(1, kv_heads, dim, num_blocks=12, block_size=bs,
                          dtype=torch.float32, device=torch.device(device))
    ctx = 10
    k = torch.randn(ctx, kv_heads, dim, device=device)
    v = torch.randn(ctx, kv_heads, dim, device=device)
    slots = attn.block_slots(blocks)[:ctx]
    # Prefill the first ctx-1 tokens, then decode the last one through the cache.
    attn.metadata = AttentionMetadata(slots[: ctx - 1], [SeqSlice(0, ctx - 1, True, ctx - 1, blocks[0] * bs, None)])
    attn.forward(0, torch.randn(ctx - 1, heads, dim, device=device), k[:-1], v[:-1])
    contiguous = blocks == sorted(blocks) and blocks[-1] - blocks[0] == len(blocks) - 1
    q = torch.randn(1, heads, dim, device=device)
    attn.metadata = AttentionMetadata(
        slots[ctx - 1 :], [SeqSlice(0, 1, False, ctx, blocks[0] * bs, None if contiguous else slots)]
    )
    out = attn.forward(0, q, k[-1:], v[-1:])
    torch.testing.assert_close(out, _reference(q, k, v), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dim,bs", [(32, 4), (64, 4), (64, 16), (128, 8)])
def test_cpu_decode_kernel_matches_reference(dim: int, bs: int) -> None:
    """The one-call CPU kernel reads ragged, scattered contexts exactly like the reference
    (head_dim 64 and 128 take its vectorised path, others the plain loops; contexts end
    mid-block and inside the last four-row group)."""
    from fastserve.executor.cpu_kernels import decode_attention_kernel

    kernel = decode_attention_kernel()
    if kernel is None:
        pytest.skip("no C++ compiler: the PyTorch fallback path is covered above")
    torch.manual_seed(0)
    heads, kv_heads = 8, 2
    k_cache = torch.randn(kv_heads, 64 * bs, dim)
    v_cache = torch.randn(kv_heads, 64 * bs, dim)
    tables = [[3, 4, 5], [10, 2, 40, 7], [60]]
    lens = [11, 14, 1]
    q = torch.randn(3, heads, dim)
    width = max(map(len, tables))
    out = kernel.decode_attention(
        q, k_cache, v_cache,
        torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
        torch.tensor(lens, dtype=torch.int32), bs, dim**-0.5,
    )
    for i, (table, n) in enumerate(zip(tables, lens)):
        slots = (torch.tensor(table).unsqueeze(1) * bs + torch.arange(bs)).flatten()[:n]
        ref = _reference(q[i : i + 1], k_cache[:, slots].transpose(0, 1), v_cache[:, slots].transpose(0, 1))
        torch.testing.assert_close(out[i : i + 1], ref, rtol=1e-5, atol=1e-5)
