"""The Triton kernels and backend against plain torch: on a GPU natively, on a CPU under
Triton's interpreter (TRITON_INTERPRET=1 must be set before triton is imported, so
tests/executor/test_triton_interpreter.py runs this file in a subprocess with it; in a plain
CPU session it skips). Small shapes: the interpreter runs each program in numpy."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")
if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("needs a GPU, or TRITON_INTERPRET=1 (test_triton_interpreter.py sets it)",
                allow_module_level=True)

from fastserve.config import CacheConfig, ModelConfig  # noqa: E402
from fastserve.core.plan import ScheduledRequest, SchedulerOutput  # noqa: E402
from fastserve.executor.attention import PagedAttention  # noqa: E402
from fastserve.executor.backends import triton_layers as layers  # noqa: E402
from fastserve.executor.backends import triton_ops as ops  # noqa: E402
from fastserve.executor.backends.torch_sdpa import TorchAttention  # noqa: E402
from fastserve.executor.backends.triton_attn import TritonAttention  # noqa: E402
from fastserve.executor.backends.triton_configs import DecodeConfig  # noqa: E402
from fastserve.executor.cuda_graphs import capture_sizes, graph_batch_size  # noqa: E402
from fastserve.executor.model_runner import ModelRunner, flatten  # noqa: E402
from fastserve.model.layers import ApplyRotary, RMSNorm, RotaryEmbedding, SiluAndMul  # noqa: E402
from fastserve.model.loader import load_model  # noqa: E402
from fastserve.model.make_model import cached_model_path  # noqa: E402
from fastserve.request import SamplingParams  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
# Half types accumulate in float32 but round q, k, v and the probabilities to 8 (bf16) or 11
# (fp16) mantissa bits.
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prefix: int) -> torch.Tensor:
    """float64 reference: q [n, H, D] are the last n positions of a context k, v [ctx, Hkv, D],
    bottom-right causal (query i sees keys 0..prefix + i)."""
    n, ctx = q.shape[0], k.shape[0]
    group = q.shape[1] // k.shape[1]
    mask = torch.ones(n, ctx, dtype=torch.bool).tril(prefix)
    o = F.scaled_dot_product_attention(
        q.double().transpose(0, 1),
        k.double().repeat_interleave(group, 1).transpose(0, 1),
        v.double().repeat_interleave(group, 1).transpose(0, 1),
        attn_mask=mask.to(q.device),
    )
    return o.transpose(0, 1)


def _slots(table: list[int], n: int, bs: int) -> torch.Tensor:
    return (torch.tensor(table).unsqueeze(1) * bs + torch.arange(bs)).flatten()[:n]


def _padded(tables: list[list[int]]) -> torch.Tensor:
    width = max(map(len, tables))
    return torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32,
                        device=DEVICE)


@pytest.mark.parametrize("kv_heads,dtype", [(2, torch.float32), (3, torch.float32),
                                            (3, torch.float16)], ids=str)
def test_store_kv_writes_slots_and_skips_padding(kv_heads: int, dtype: torch.dtype) -> None:
    """3 KV heads: a token's program masks a fourth head; float16: a Llama-2 checkpoint's
    half type, which `--dtype auto` runs on a GPU (stored bit for bit)."""
    torch.manual_seed(0)
    dim = 24  # head_dim not a power of 2: the masked tail
    qkv = torch.randn(4, 3 * kv_heads, dim, device=DEVICE).to(dtype)
    k, v = qkv[:, :kv_heads], qkv[:, kv_heads : 2 * kv_heads]  # strided views, as the model's
    k_cache = torch.zeros(kv_heads, 32, dim, device=DEVICE, dtype=dtype)
    v_cache = torch.zeros(kv_heads, 32, dim, device=DEVICE, dtype=dtype)
    slots = torch.tensor([5, 17, -1, 30], device=DEVICE)  # -1: a CUDA-graph padding row
    ops.store_kv(k, v, k_cache, v_cache, slots)
    written = [0, 1, 3]
    idx = slots[written]
    assert torch.equal(k_cache[:, idx], k[written].transpose(0, 1))
    assert torch.equal(v_cache[:, idx], v[written].transpose(0, 1))
    assert int((k_cache != 0).any(-1).sum()) == kv_heads * 3  # nothing else touched


@pytest.mark.parametrize("dtype,heads,kv_heads,splits", [
    (torch.float32, 8, 2, 4),
    (torch.float32, 4, 4, 1),
    (torch.float32, 6, 1, 8),
    (torch.bfloat16, 8, 2, 4),
    (torch.float16, 6, 1, 8),
    (torch.bfloat16, 4, 4, 4),
], ids=str)
@pytest.mark.parametrize("use_dot", [True, False], ids=["dot", "sum"])
def test_paged_decode_split_kv_gqa(dtype: torch.dtype, heads: int, kv_heads: int,
                                   splits: int, use_dot: bool) -> None:
    """Ragged contexts through scattered tables (ending mid-block, one of a single token,
    shorter than the number of splits), GQA groups of 4, 1 and 6, at decode rows interleaved
    with other tokens."""
    torch.manual_seed(heads * 10 + splits)
    dim, bs = 32, 4
    k_cache = torch.randn(kv_heads, 48 * bs, dim, device=DEVICE).to(dtype)
    v_cache = torch.randn(kv_heads, 48 * bs, dim, device=DEVICE).to(dtype)
    tables = [[3, 4, 5], [10, 2, 40, 7, 33, 21, 8, 9, 11, 12, 13], [47]]
    lens = [11, 42, 1]
    q = torch.randn(7, heads, dim, device=DEVICE).to(dtype)
    rows = torch.tensor([1, 4, 6], device=DEVICE)
    out = torch.zeros_like(q)
    ops.paged_decode(q, k_cache, v_cache, rows, _padded(tables),
                     torch.tensor(lens, dtype=torch.int32, device=DEVICE), bs, dim**-0.5,
                     splits, out, config=DecodeConfig(block_n=32, use_dot=use_dot))
    for i, (table, n) in enumerate(zip(tables, lens, strict=True)):
        s = _slots(table, n, bs).to(DEVICE)
        row = int(rows[i])
        ref = _attend(q[row : row + 1], k_cache[:, s].transpose(0, 1),
                      v_cache[:, s].transpose(0, 1), n - 1)
        torch.testing.assert_close(out[row : row + 1].double(), ref, rtol=TOL[dtype],
                                   atol=TOL[dtype])
    assert not out[[0, 2, 3, 5]].any()  # rows that are not decodes stay untouched


@pytest.mark.parametrize(("dtype", "cache_dtype", "kv_heads", "splits"), [
    (torch.float32, torch.float32, 2, 1),
    (torch.float32, torch.float32, 4, 4),
    (torch.bfloat16, torch.bfloat16, 1, 8),
    (torch.bfloat16, torch.float8_e4m3fn, 2, 4),
    (torch.float16, torch.float16, 2, 4),
    (torch.float16, torch.float8_e4m3fn, 1, 2),
], ids=str)
@pytest.mark.parametrize("use_dot", [True, False], ids=["dot", "sum"])
def test_decode_stores_its_own_token_as_the_store_kernel_would(
        dtype: torch.dtype, cache_dtype: torch.dtype, kv_heads: int, splits: int,
        use_dot: bool) -> None:
    """`new_kv`: each decode's new K/V go into the cache inside the decode launch (no
    `store_kv` before it): the caches end bit for bit as the store kernel leaves them, the
    outputs as attention over them, a padding row (slot -1) stores nothing, and a context of
    one token (only the new one) and contexts shorter than the splits work."""
    torch.manual_seed(kv_heads * 10 + splits)
    heads, dim, bs = 4, 32, 4
    k_cache = (torch.randn(kv_heads, 48 * bs, dim, device=DEVICE) * 2).to(cache_dtype)
    v_cache = (torch.randn(kv_heads, 48 * bs, dim, device=DEVICE) * 2).to(cache_dtype)
    tables = [[3, 4, 5], [10, 2, 40, 7, 33, 21, 8, 9, 11, 12, 13], [47], [0]]
    lens = [11, 42, 1, 1]
    slots = torch.tensor([_slots(t, n, bs)[-1] for t, n in zip(tables, lens)][:3] + [-1],
                         device=DEVICE)
    q = torch.randn(4, heads, dim, device=DEVICE).to(dtype)
    kv = (torch.randn(4, 2 * kv_heads, dim, device=DEVICE) * 3).to(dtype)
    k, v = kv[:, :kv_heads], kv[:, kv_heads:]  # strided views, as the model's
    args = (q_rows := torch.arange(4, device=DEVICE), _padded(tables),
            torch.tensor(lens, dtype=torch.int32, device=DEVICE), bs, dim**-0.5, splits)
    cfg = DecodeConfig(block_n=32, use_dot=use_dot)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    ops.store_kv(k, v, k_ref, v_ref, slots)
    out_ref = torch.zeros_like(q)
    ops.paged_decode(q, k_ref, v_ref, *args, out_ref, config=cfg)
    out = torch.zeros_like(q)
    ops.paged_decode(q, k_cache, v_cache, *args, out, config=cfg, new_kv=(k, v, slots))
    assert torch.equal(k_cache.view(torch.uint8), k_ref.view(torch.uint8))
    assert torch.equal(v_cache.view(torch.uint8), v_ref.view(torch.uint8))
    tol = TOL[dtype] if cache_dtype == dtype else 2e-2
    torch.testing.assert_close(out[:3], out_ref[:3], rtol=tol, atol=tol)
    assert bool(out.isfinite().all()) and q_rows.numel() == 4


@pytest.mark.parametrize(("dtype", "cache_dtype", "kv_heads", "splits"), [
    (torch.float32, torch.float32, 2, 1),
    (torch.bfloat16, torch.bfloat16, 4, 4),
    (torch.bfloat16, torch.float8_e4m3fn, 1, 2),
    (torch.float16, torch.float16, 2, 2),
], ids=str)
def test_decode_rotates_q_and_k_as_the_rotary_kernel_would(
        dtype: torch.dtype, cache_dtype: torch.dtype, kv_heads: int, splits: int) -> None:
    """`rotary`: unrotated q and k rotated inside the decode launch give, bit for bit, the
    output and cache of the rotary kernel's q and k through the same launch."""
    torch.manual_seed(kv_heads + splits)
    heads, dim, bs = 4, 32, 4
    k_cache = torch.randn(kv_heads, 48 * bs, dim, device=DEVICE).to(cache_dtype)
    v_cache = torch.randn(kv_heads, 48 * bs, dim, device=DEVICE).to(cache_dtype)
    tables = [[3, 4, 5], [10, 2, 40, 7, 33, 21, 8, 9, 11, 12, 13], [47]]
    lens = [11, 42, 1]
    slots = torch.tensor([_slots(t, n, bs)[-1] for t, n in zip(tables, lens)], device=DEVICE)
    qkv = torch.randn(3, heads + 2 * kv_heads, dim, device=DEVICE).to(dtype)
    rope = RotaryEmbedding(dim, 64, 10000.0).to(DEVICE)
    cos, sin = rope.get_cos_sin(torch.tensor(lens, device=DEVICE) - 1, dtype)
    qk = qkv[:, : heads + kv_heads]  # a view, as the model hands it over
    rotated = layers.rotary(qk, cos, sin)
    args = (torch.arange(3, device=DEVICE), _padded(tables),
            torch.tensor(lens, dtype=torch.int32, device=DEVICE), bs, dim**-0.5, splits)
    v = qkv[:, heads + kv_heads :]
    caches, outs = [], []
    for q, k, rot in ((rotated[:, :heads], rotated[:, heads:], None),
                      (qk[:, :heads], qk[:, heads:], (cos, sin))):
        kc, vc = k_cache.clone(), v_cache.clone()
        out = torch.zeros(3, heads, dim, device=DEVICE, dtype=dtype)
        ops.paged_decode(q, kc, vc, *args, out, new_kv=(k, v, slots), rotary=rot)
        caches.append(kc.view(torch.uint8))
        outs.append(out)
    assert torch.equal(caches[0], caches[1])
    assert torch.equal(outs[0], outs[1])
    assert not torch.equal(rotated, qk)  # (it did rotate)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16],
                         ids=lambda d: str(d).removeprefix("torch."))
def test_paged_prefill_varlen_and_chunk_after_cached_prefix(dtype: torch.dtype) -> None:
    """One launch for three prefills: one from position 0, a chunk after 37 cached tokens
    (longer than a query tile), a one-token chunk after 5; scattered tables, GQA."""
    torch.manual_seed(7)
    heads, kv_heads, dim, bs = 4, 2, 32, 8
    k_cache = torch.randn(kv_heads, 32 * bs, dim, device=DEVICE).to(dtype)
    v_cache = torch.randn(kv_heads, 32 * bs, dim, device=DEVICE).to(dtype)
    tables = [[6, 2], [9, 30, 1, 14, 3, 22, 8, 17, 5, 11], [28]]
    prefixes = [0, 37, 5]
    q_lens = [13, 40, 1]
    q = torch.randn(sum(q_lens) + 2, heads, dim, device=DEVICE).to(dtype)
    starts = [1, 14, 55]  # rows 0 and 54: a decode would sit there
    out = torch.zeros_like(q)
    ops.paged_prefill(
        q, k_cache, v_cache, torch.tensor(starts, device=DEVICE),
        torch.tensor(q_lens, dtype=torch.int32, device=DEVICE),
        torch.tensor([p + n for p, n in zip(prefixes, q_lens, strict=True)], dtype=torch.int32,
                     device=DEVICE),
        _padded(tables), max(q_lens), bs, dim**-0.5, out,
    )
    for table, prefix, n, start in zip(tables, prefixes, q_lens, starts, strict=True):
        s = _slots(table, prefix + n, bs).to(DEVICE)
        ref = _attend(q[start : start + n], k_cache[:, s].transpose(0, 1),
                      v_cache[:, s].transpose(0, 1), prefix)
        torch.testing.assert_close(out[start : start + n].double(), ref, rtol=TOL[dtype],
                                   atol=TOL[dtype])
    assert not out[[0, 54]].any()


FP8 = torch.float8_e4m3fn


def test_store_kv_into_a_float8_cache_rounds_and_saturates() -> None:
    """A float8 cache holds each K/V value bit for bit as torch rounds it to E4M3 (to nearest,
    ties to even, subnormals and -0.0 included), and values past its range as +-448 (a plain
    cast would store NaN); a padding row stores nothing."""
    torch.manual_seed(1)
    dim = 1024  # a token's head holds 1024 of the values: few programs for the interpreter
    x = torch.cat([torch.linspace(-20, 20, 8001), torch.linspace(-0.03, 0.03, 4001),
                   torch.randn(2000) * 100, torch.tensor([448.0, 449.0, 500.0, -1e9, -0.0])])
    x = torch.cat([x, torch.randn(-x.numel() % dim)]).view(-1, 1, dim)  # [tokens, 1, dim]
    tokens = x.shape[0]
    junk = torch.full((1, 1, dim), 3.0)  # one more row, a CUDA graph's padding: stores nothing
    k, v = torch.cat([x, junk]).to(DEVICE), torch.cat([-x, junk]).to(DEVICE)
    k_cache = torch.zeros(1, tokens + 1, dim, device=DEVICE, dtype=FP8)
    v_cache = torch.zeros(1, tokens + 1, dim, device=DEVICE, dtype=FP8)
    slots = torch.tensor([*range(tokens), -1], device=DEVICE)
    ops.store_kv(k, v, k_cache, v_cache, slots)
    for cache, src in ((k_cache, x), (v_cache, -x)):
        expect = src.clamp(-448, 448).to(FP8).transpose(0, 1).view(torch.uint8)
        got = cache[:, :tokens].view(torch.uint8).cpu()
        wrong = (got != expect).nonzero().tolist()[:8]
        assert not wrong, [(src.transpose(0, 1)[tuple(i)].item(), got[tuple(i)].item(),
                            expect[tuple(i)].item()) for i in wrong]
        assert not cache[:, tokens:].view(torch.uint8).any()
    last = k_cache[0, 13, 690:694].float().tolist()  # 448, 449, 500, -1e9
    assert last == [448.0, 448.0, 448.0, -448.0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16],
                         ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("use_dot", [True, False], ids=["dot", "sum"])
def test_paged_decode_and_prefill_read_a_float8_cache(dtype: torch.dtype, use_dot: bool) -> None:
    """With a float8 cache the kernels attend over its values widened to the model's dtype:
    the reference is the same attention over the dequantized cache, to the model dtype's
    tolerance (the quantization itself is what `kv_cache_dtype="fp8"` asks for)."""
    torch.manual_seed(4)
    heads, kv_heads, dim, bs = 8, 2, 32, 4
    k_cache = torch.randn(kv_heads, 40 * bs, dim, device=DEVICE).to(FP8)
    v_cache = torch.randn(kv_heads, 40 * bs, dim, device=DEVICE).to(FP8)
    kf, vf = k_cache.float(), v_cache.float()
    tables = [[3, 4, 5, 30], [10, 2, 39, 7, 33, 21]]
    lens = [14, 23]
    q = torch.randn(2, heads, dim, device=DEVICE).to(dtype)
    out = torch.zeros_like(q)
    rows = torch.tensor([0, 1], device=DEVICE)
    ops.paged_decode(q, k_cache, v_cache, rows, _padded(tables),
                     torch.tensor(lens, dtype=torch.int32, device=DEVICE), bs, dim**-0.5, 2,
                     out, config=DecodeConfig(block_n=32, use_dot=use_dot))
    for i, (table, n) in enumerate(zip(tables, lens, strict=True)):
        s = _slots(table, n, bs).to(DEVICE)
        ref = _attend(q[i : i + 1], kf[:, s].transpose(0, 1), vf[:, s].transpose(0, 1), n - 1)
        torch.testing.assert_close(out[i : i + 1].double(), ref, rtol=TOL[dtype], atol=TOL[dtype])
    # A 9-token chunk after 14 cached tokens of request 0, through the same cache.
    qp = torch.randn(9, heads, dim, device=DEVICE).to(dtype)
    outp = torch.zeros_like(qp)
    ops.paged_prefill(qp, k_cache, v_cache, torch.tensor([0], device=DEVICE),
                      torch.tensor([9], dtype=torch.int32, device=DEVICE),
                      torch.tensor([23], dtype=torch.int32, device=DEVICE),
                      _padded([[3, 4, 5, 30, 31, 32]]), 9, bs, dim**-0.5, outp)
    s = _slots([3, 4, 5, 30, 31, 32], 23, bs).to(DEVICE)
    ref = _attend(qp, kf[:, s].transpose(0, 1), vf[:, s].transpose(0, 1), 14)
    torch.testing.assert_close(outp.double(), ref, rtol=TOL[dtype], atol=TOL[dtype])


def test_a_bf16_query_beyond_fp16s_range_over_a_float8_cache_stays_finite() -> None:
    """Over a float8 cache a bf16 model's dots run in fp16 (E4M3 is exact there); a query
    component past fp16's 65504 saturates instead of turning the output into NaN."""
    torch.manual_seed(5)
    heads, dim, bs = 2, 16, 4
    k_cache = torch.randn(heads, 8 * bs, dim, device=DEVICE).to(FP8)
    v_cache = torch.randn(heads, 8 * bs, dim, device=DEVICE).to(FP8)
    q = torch.randn(1, heads, dim, device=DEVICE).to(torch.bfloat16)
    q[0, 0, 3] = 3e5
    out = torch.zeros_like(q)
    ops.paged_decode(q, k_cache, v_cache, torch.tensor([0], device=DEVICE), _padded([[2, 5]]),
                     torch.tensor([7], dtype=torch.int32, device=DEVICE), bs, dim**-0.5, 1, out)
    assert bool(out.isfinite().all())
    s = _slots([2, 5], 7, bs).to(DEVICE)
    ref = _attend(q.clamp(-65504, 65504), k_cache.float()[:, s].transpose(0, 1),
                  v_cache.float()[:, s].transpose(0, 1), 6)
    torch.testing.assert_close(out.double(), ref, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16],
                         ids=lambda d: str(d).removeprefix("torch."))
def test_fused_norm_and_activation_match_the_layers(dtype: torch.dtype) -> None:
    """The fused kernels the backend gives the model compute what the plain layers do, with
    the same roundings (hidden size not a power of 2: the masked tail)."""
    torch.manual_seed(2)
    hidden, inter = 48, 40
    norm = RMSNorm(hidden, eps=1e-5).to(DEVICE, dtype)
    norm.weight.copy_(torch.randn(hidden))
    act = SiluAndMul()
    x = torch.randn(5, hidden, device=DEVICE).to(dtype)
    res = torch.randn(5, hidden, device=DEVICE).to(dtype)
    gate_up = torch.randn(5, 2 * inter, device=DEVICE).to(dtype)
    plain = norm(x), norm(x, res), act(gate_up)
    TritonAttention(1, 1, 16, 1, 4, torch.float32, DEVICE).prepare_model(
        torch.nn.ModuleList([norm, act]))
    assert norm.fused is not None and act.fused is not None
    fused = norm(x), norm(x, res), act(gate_up)
    # bf16: the variance summed in another order (and the interpreter's rounding, below) can
    # move a rounding of the normalised value by one step, two after the scale.
    tol = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}[dtype]
    torch.testing.assert_close(fused[0], plain[0], rtol=tol, atol=tol)
    torch.testing.assert_close(fused[1][0], plain[1][0], rtol=tol, atol=tol)
    # The residual stream: the same add. NOTE: Triton's interpreter rounds float32 to bf16
    # toward zero (a GPU rounds to nearest, as torch does), one step off at most.
    torch.testing.assert_close(fused[1][1], plain[1][1], rtol=tol, atol=tol)
    if DEVICE.type == "cuda":
        assert torch.equal(fused[1][1], plain[1][1])
    torch.testing.assert_close(fused[2], plain[2], rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16],
                         ids=lambda d: str(d).removeprefix("torch."))
def test_fused_rotary_matches_the_layer(dtype: torch.dtype) -> None:
    """The backend's rotary kernel rotates q and k as `apply_rotary` does, reading them where
    the model has them: a view of the fused qkv output (token stride wider than the heads)."""
    torch.manual_seed(3)
    heads, kv_heads, head_dim, n = 4, 2, 16, 7
    rope = RotaryEmbedding(head_dim, 64, 10000.0).to(DEVICE)
    rope.cos_sin_cache = rope.cos_sin_cache.to(dtype)  # as a model-wide .to(dtype) casts it
    positions = torch.tensor([0, 1, 2, 9, 33, 34, 63], device=DEVICE)
    cos, sin = rope.get_cos_sin(positions, dtype)
    qkv = (torch.randn(n, heads + 2 * kv_heads, head_dim, device=DEVICE) * 3).to(dtype)
    qk = qkv[:, : heads + kv_heads]  # not contiguous: v follows each token's k
    layer = ApplyRotary()
    plain = layer(qk, cos, sin)
    TritonAttention(1, 1, 16, 1, 4, torch.float32, DEVICE).prepare_model(layer)
    assert layer.fused is not None
    fused = layer(qk, cos, sin)
    assert fused.shape == plain.shape and fused.is_contiguous()
    if DEVICE.type == "cuda" or dtype == torch.float32:
        assert torch.equal(fused, plain)  # the same roundings, op for op
    else:  # the interpreter rounds float32 to bf16 toward zero (a GPU: to nearest): one
        # step of a product (|x| < 16: 2**-4 at most) can show in a difference near zero
        torch.testing.assert_close(fused, plain, rtol=2e-2, atol=2**-4)
    assert not torch.equal(fused, qk)  # (it did rotate)


def _req(rid: str, n: int, start: int, blocks: list[int]) -> ScheduledRequest:
    return ScheduledRequest(rid, [1] * n, start, blocks, SamplingParams(), 0)


def _layer(attn: PagedAttention, reqs: list[ScheduledRequest], q: torch.Tensor,
           k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    slots = torch.tensor(flatten(reqs, attn.block_size).slots, device=DEVICE)
    attn.metadata = attn.build_metadata(reqs, slots)
    try:
        return attn.forward(0, q, k, v)
    finally:
        attn.metadata = None


def test_backend_mixed_batch_matches_torch_backend() -> None:
    """Through `TritonAttention`'s own metadata: cached prefixes first, then one iteration of
    decodes, a fresh prefill and a chunk, interleaved; the portable backend computes the same."""
    torch.manual_seed(11)
    heads, kv_heads, dim, bs = 8, 2, 32, 4
    args = (1, kv_heads, dim, 40, bs, torch.float32, DEVICE)
    backends = [TritonAttention(*args), TorchAttention(*args)]
    tables = {"d1": [7, 3, 30], "p": [11, 12], "c": [20, 1, 25, 2, 9], "d2": [5]}
    ctx = {"d1": 11, "p": 6, "c": 19, "d2": 3}
    new = {"d1": 1, "p": 6, "c": 12, "d2": 1}
    cached = [_req(r, ctx[r] - new[r], 0, tables[r]) for r in ctx if ctx[r] > new[r]]
    order = ["d1", "p", "c", "d2"]
    step = [_req(r, new[r], ctx[r] - new[r], tables[r]) for r in order]
    outs = []
    for attn in backends:
        torch.manual_seed(12)  # the same q, k, v for both
        for reqs in (cached, step):
            num = sum(len(r.token_ids) for r in reqs)
            qkv = torch.randn(num, heads + 2 * kv_heads, dim, device=DEVICE)
            out = _layer(attn, reqs, qkv[:, :heads], qkv[:, heads : heads + kv_heads],
                         qkv[:, heads + kv_heads :])
        outs.append(out)
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=1e-5)


def test_graph_metadata_replays_a_padded_decode_batch() -> None:
    """What a captured decode graph runs, run eagerly: three decodes written into the static
    buffers of a batch padded to 4 give the eager metadata's answer, and the padding row
    stores nothing."""
    torch.manual_seed(5)
    heads, kv_heads, dim, bs = 4, 2, 16, 4
    attn = TritonAttention(1, kv_heads, dim, 24, bs, torch.float32, DEVICE)
    attn.k_caches[0].normal_()
    attn.v_caches[0].normal_()
    reqs = [_req("a", 1, 6, [3, 9]), _req("b", 1, 12, [1, 2, 20, 4])]
    q = torch.randn(2, heads, dim, device=DEVICE)
    k, v = torch.randn(2, 2, kv_heads, dim, device=DEVICE)
    eager = _layer(attn, reqs, q, k, v)
    sizes = capture_sizes(8)
    assert graph_batch_size(reqs + [_req("p", 5, 0, [6, 8])], sizes, 16) is None
    assert graph_batch_size(reqs + [_req("c", 1, 2, [7])], sizes, 16) == 4
    size = 4  # this batch of 2, padded as if a third decode had come and gone
    before = attn.kv_cache.clone()
    attn.init_cuda_graphs(max_batch_size=8, max_blocks_per_seq=16)
    md = attn.graph_metadata(size)
    attn.fill_graph_metadata(reqs, flatten(reqs, bs).slots, size)
    attn.metadata = md
    qp = torch.cat([q, torch.randn(size - 2, heads, dim, device=DEVICE)])
    kp = torch.cat([k, torch.randn(size - 2, kv_heads, dim, device=DEVICE)])
    vp = torch.cat([v, torch.randn(size - 2, kv_heads, dim, device=DEVICE)])
    padded = attn.forward(0, qp, kp, vp)
    attn.metadata = None
    torch.testing.assert_close(padded[:2], eager, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(attn.kv_cache, before)  # the same K/V again, padding nowhere


# Three iterations through the whole model: A (19 prompt tokens) and B (26, in two chunks)
# prefill, then A decodes beside B's second chunk, then both decode.
_A, _B = [3, 4, 5], [9, 1, 17, 12]
_MIXED_STEPS = [
    [_req("A", 19, 0, _A), _req("B", 10, 0, _B)],
    [_req("A", 1, 19, _A), _req("B", 16, 10, _B)],
    [_req("A", 1, 20, _A), _req("B", 1, 26, _B)],
]


def _triton_and_torch_runners(path: Path, cache: CacheConfig,
                              dtype: torch.dtype = torch.float32) -> list[ModelRunner]:
    runners = []
    for name in ("triton", "torch"):  # a model each: the triton backend fuses its layers
        model, arch = load_model(path, dtype, str(DEVICE))
        config = ModelConfig(device=str(DEVICE), dtype=str(dtype).removeprefix("torch."),
                             attention_backend=name, enforce_eager=True)
        runners.append(ModelRunner(model, arch, config, cache, [2]))
    # (on a GPU the portable backend is its CUDA subclass)
    assert isinstance(runners[0].attn, TritonAttention)
    assert isinstance(runners[1].attn, TorchAttention)
    return runners


def _mixed_step_logits(runners: list[ModelRunner]) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Each of `_MIXED_STEPS`' logits from both runners, then a sampled step on the first."""
    for reqs in _MIXED_STEPS:
        reqs = [dataclasses.replace(r, token_ids=[(7 * i + 3) % 50 + 4 for i in
                                                  range(len(r.token_ids))]) for r in reqs]
        with torch.inference_mode():
            logits = [r._forward(r._prepare(reqs), reqs)[0] for r in runners]
        assert logits[0] is not None and logits[1] is not None
        yield logits[0], logits[1]
    out = runners[0].execute(SchedulerOutput(scheduled=_MIXED_STEPS[-1]))
    assert len(out.sampled_token_ids) == 2 and not out.failed


@pytest.mark.parametrize("preset", ["tiny", "tiny-qwen3", "tiny-qwen3-moe"])
def test_runner_with_triton_backend_matches_torch_backend(preset: str) -> None:
    """The whole model through `ModelRunner` (the tiny preset, as a Qwen3: its q/k norms
    before the rotation the decode launch does, and as a Qwen3-MoE: experts beside the fused
    kernels; float32): chunked and whole prefills, then
    decodes mixed with a chunk, then decodes only; the Triton backend's logits are the
    portable backend's, and `execute` samples one token per request."""
    cache = CacheConfig(block_size=8, num_device_blocks=24, num_host_blocks=4)
    runners = _triton_and_torch_runners(cached_model_path(preset), cache)
    assert runners[0].model.model.norm.fused is not None  # type: ignore[union-attr]
    assert runners[1].model.model.norm.fused is None  # type: ignore[union-attr]
    for triton_logits, torch_logits in _mixed_step_logits(runners):
        torch.testing.assert_close(triton_logits, torch_logits, rtol=1e-4, atol=1e-4)


def test_runner_in_float16_on_triton_tracks_the_portable_backend(tiny_model_path: Path) -> None:
    """The whole model in float16 (what `--dtype auto` runs for a float16 checkpoint, and on
    a GPU without bfloat16): every fused kernel (norm, activation, rotary, store, prefill,
    decode) in float16 against the portable backend, to float16's rounding of the logits."""
    # A float16 cache by name: "auto" keeps a float32 one on a CPU without the C++ kernels.
    cache = CacheConfig(block_size=8, num_device_blocks=24, num_host_blocks=4,
                        kv_cache_dtype="float16")
    runners = _triton_and_torch_runners(tiny_model_path, cache, torch.float16)
    assert [r.attn.kv_cache.dtype for r in runners] == [torch.float16, torch.float16]
    assert runners[0].model.model.norm.weight.dtype == torch.float16  # type: ignore[union-attr]
    for triton_logits, torch_logits in _mixed_step_logits(runners):
        assert torch.isfinite(triton_logits).all()
        # float16 rounds each layer's output to 11 bits in both, in different orders: a few
        # hundredths on logits of a few units; a broken kernel moves them by the whole spread.
        spread = (torch_logits - torch_logits.mean(-1, keepdim=True)).norm(dim=-1)
        error = float(((triton_logits - torch_logits).norm(dim=-1) / spread).max())
        assert error < 5e-3
        torch.testing.assert_close(triton_logits, torch_logits, rtol=0, atol=0.1)


def test_runner_with_an_fp8_cache_on_triton_tracks_the_portable_backend(
    tiny_model_path: Path,
) -> None:
    """The whole model over a float8 cache, Triton backend against the portable one (both
    store the same E4M3 values; the Triton prefill attends over them where the portable one
    uses the fresh K/V, so the logits agree to the quantization's few percent, not 1e-4)."""
    cache = CacheConfig(block_size=8, num_device_blocks=24, num_host_blocks=4,
                        kv_cache_dtype="fp8")
    runners = _triton_and_torch_runners(tiny_model_path, cache)
    assert [r.attn.kv_cache.dtype for r in runners] == [FP8, FP8]
    for triton_logits, torch_logits in _mixed_step_logits(runners):
        assert torch.isfinite(triton_logits).all()
        spread = (torch_logits - torch_logits.mean(-1, keepdim=True)).norm(dim=-1)
        assert float(((triton_logits - torch_logits).norm(dim=-1) / spread).max()) < 0.2
