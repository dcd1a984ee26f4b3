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
        pytest.skip("no compiled kernel (no C++ compiler, or FASTSERVE_CPU_KERNELS=0): the PyTorch "
                    "path is covered above")
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


def _causal_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Plain SDPA of a chunk's q [q_len, H, D] over the whole context k, v [ctx, Hkv, D], the
    chunk being the context's last q_len positions (bottom-right causal)."""
    q_len, ctx = q.shape[0], k.shape[0]
    group = q.shape[1] // k.shape[1]
    mask = torch.ones(q_len, ctx, dtype=torch.bool).tril(ctx - q_len)
    o = F.scaled_dot_product_attention(
        q.transpose(0, 1),
        k.repeat_interleave(group, dim=1).transpose(0, 1),
        v.repeat_interleave(group, dim=1).transpose(0, 1),
        attn_mask=mask,
    )
    return o.transpose(0, 1)


@pytest.mark.parametrize("dim,heads,kv_heads,bs", [
    (32, 8, 4, 16),  # the tiny preset's shape
    (64, 8, 2, 4),   # GQA group of 4, blocks shorter than a key step
    (128, 4, 4, 8),  # MHA
    (48, 6, 3, 16),  # head_dim not a multiple of 32: the plain-loop accumulate
])
@pytest.mark.parametrize("start,q_len", [(3, 17), (40, 33), (100, 1), (16, 70), (200, 130)])
def test_cpu_extend_kernel_matches_sdpa(dim: int, heads: int, kv_heads: int, bs: int,
                                        start: int, q_len: int) -> None:
    """A prefill chunk after `start` cached tokens, read through a scattered block table by
    the CPU extend kernel, matches masked SDPA over the gathered context: chunk offsets that
    start and end mid-block, one-token chunks, chunks longer than the cached part."""
    from fastserve.executor.cpu_kernels import decode_attention_kernel

    kernel = decode_attention_kernel()
    if kernel is None:
        pytest.skip("no compiled kernel (no C++ compiler, or FASTSERVE_CPU_KERNELS=0): the PyTorch "
                    "path is covered by the engine tests")
    torch.manual_seed(start * 1000 + q_len)
    ctx = start + q_len
    num_blocks = -(-ctx // bs)
    table = torch.randperm(3 * num_blocks)[:num_blocks]  # scattered, out of order
    k_cache = torch.randn(kv_heads, 3 * num_blocks * bs, dim)
    v_cache = torch.randn(kv_heads, 3 * num_blocks * bs, dim)
    q = torch.randn(q_len, heads, dim)
    out = kernel.extend_attention(q, k_cache, v_cache, table.to(torch.int32), start, bs,
                                  dim**-0.5)
    slots = (table.unsqueeze(1) * bs + torch.arange(bs)).flatten()[:ctx]
    ref = _causal_reference(q, k_cache[:, slots].transpose(0, 1), v_cache[:, slots].transpose(0, 1))
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("use_kernel", [True, False], ids=["kernel", "torch"])
def test_chunk_after_cached_prefix_reads_scattered_blocks(use_kernel: bool) -> None:
    """Through `PagedAttention.forward`: a second chunk whose first chunk sits in scattered
    blocks attends exactly as one causal pass over the whole prompt would."""
    torch.manual_seed(1)
    heads, kv_heads, dim, bs = 8, 4, 32, 16
    attn = PagedAttention(1, kv_heads, dim, num_blocks=16, block_size=bs,
                          dtype=torch.float32, device=torch.device("cpu"))
    if use_kernel and attn.decode_kernel is None:
        pytest.skip("no compiled kernel (no C++ compiler, or FASTSERVE_CPU_KERNELS=0)")
    if not use_kernel:
        attn.decode_kernel = None
    blocks = [9, 2, 14, 5]
    first, second = 37, 20
    ctx = first + second
    q = torch.randn(ctx, heads, dim)
    k = torch.randn(ctx, kv_heads, dim)
    v = torch.randn(ctx, kv_heads, dim)
    slots = attn.block_slots(blocks)[:ctx]
    attn.metadata = AttentionMetadata(slots[:first], [SeqSlice(0, first, True, first, 0, None)])
    attn.forward(0, q[:first], k[:first], v[:first])
    table = torch.tensor(blocks, dtype=torch.int32)
    chunk = SeqSlice(0, second, True, ctx, blocks[0] * bs,
                     None if use_kernel else slots, table if use_kernel else None)
    attn.metadata = AttentionMetadata(slots[first:], [chunk])
    out = attn.forward(0, q[first:], k[first:], v[first:])
    torch.testing.assert_close(out, _causal_reference(q, k, v)[first:], rtol=1e-5, atol=1e-5)
