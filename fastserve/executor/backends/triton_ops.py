"""Triton kernels of the CUDA backend: the KV store, paged decode (split-KV) and varlen paged
prefill. Each is one launch per layer for the whole batch.

Cache layout (see `executor/attention.py`): K and V of a layer are each [num_kv_heads,
num_slots, head_dim], slot = block_id * block_size + offset; every kernel takes the strides,
so any layout with a unit head_dim stride works.

The kernels follow well-known designs: the KV store is nano-vllm's `store_kvcache` (one program
per token, a slot of -1 stores nothing: the padding rows of a CUDA-graph batch); decode is
SGLang's / vLLM's grouped split-KV decode (one program per (request, KV head, split) computes
the `group` query heads sharing that KV head with `tl.dot`, padded to 16 rows, and a second
kernel merges the splits by their log-sum-exp, in base 2 as every score here); prefill is a
flash-attention forward over the block table, bottom-right causal, so a chunk after a cached
prefix and a prefill from position 0 are the same case.

They run on CPU tensors under Triton's interpreter (TRITON_INTERPRET=1 set before triton is
imported), which is how `tests/executor/interpreted/` checks them without a GPU.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from fastserve.executor.attention import FP8_MAX, compute_dtype, is_fp8
from fastserve.executor.backends.triton_configs import DecodeConfig, decode_config
from fastserve.executor.backends.triton_layers import FP_FUSION, rotate_half

# Whether these kernels run under Triton's interpreter (read when triton decorates them): then
# they take CPU tensors, which is how the tests run them without a GPU.
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"

# Scores are kept in base-2 units (the softmax scale times log2(e)): `tl.exp2` is the
# hardware's exponential, `tl.exp` a multiply and then it.
LOG2E = 1.4426950408889634

# Rows of a decode program's query tile: `tl.dot` wants at least 16 on a GPU.
_MIN_DOT = 16


def _pow2(n: int) -> int:
    return max(_MIN_DOT, triton.next_power_of_2(n))


def _precision(cache: torch.Tensor, q: torch.Tensor) -> str:
    # float32 dots are exact fp32 ones (tf32 would round q and k to 10-bit mantissas); for
    # half types the option is ignored.
    return "ieee" if compute_dtype(cache.dtype, q.dtype) == torch.float32 else "tf32"


_TL_DTYPES = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}
# The caches these kernels read and write.
CACHE_DTYPES = (*_TL_DTYPES, torch.float8_e4m3fn)


def _dot_dtype(cache: torch.Tensor, q: torch.Tensor) -> tl.dtype:
    """What `tl.dot`'s operands are cast to: the cache's dtype on a GPU. A float8 cache's
    tiles are widened to float16 for a half-precision model: every E4M3 value is exact there,
    and the hardware widens two per instruction (see `_widen`); a float32 model's to float32.
    NOTE: Triton's interpreter (CPU tensors) multiplies bfloat16 as the raw 16-bit integers it
    stores them in, so there bf16 operands are widened to float32 (the products are then
    exact, which the tests' tolerance covers either way)."""
    dtype = compute_dtype(cache.dtype, q.dtype)
    if is_fp8(cache.dtype) and dtype != torch.float32:
        dtype = torch.float16
    if cache.device.type == "cpu" and dtype == torch.bfloat16:
        return tl.float32
    return _TL_DTYPES[dtype]


def _fp8_asm(cache: torch.Tensor, dot_dtype: tl.dtype) -> bool:
    """Whether float8 tiles widen through `_widen`'s inline PTX: compiled for a GPU (CPU
    tensors mean Triton's interpreter, which has no PTX; `benchmarks/gpu/triton_sass.py`
    compiles for a GPU from tensors on the meta device)."""
    return is_fp8(cache.dtype) and dot_dtype == tl.float16 and cache.device.type != "cpu"


# fp16's largest value: a query widened to fp16 (over a float8 cache) saturates there.
_F16_MAX = tl.constexpr(65504.0)


@triton.jit
def _query_as(q, DT: tl.constexpr):
    """The query tile in `tl.dot`'s dtype; saturated where that is fp16 and the model's bf16."""
    if DT == tl.float16:
        q = tl.minimum(tl.maximum(q.to(tl.float32), -_F16_MAX), _F16_MAX)
    return q.to(DT)


@triton.jit
def _widen(x, DT: tl.constexpr, FP8_ASM: tl.constexpr):
    """A cache tile in `tl.dot`'s dtype. A float8 tile on a GPU goes through PTX's pairwise
    E4M3 -> fp16 conversion written out as inline assembly: a plain cast lets Triton move the
    conversion after the shared-memory read of a dot operand, which then reads V one byte per
    instruction (its SASS had 64 LDS.U8 a tile, and float8 decode was no faster than bf16)."""
    if FP8_ASM:
        return tl.inline_asm_elementwise(
            asm="""{
            .reg .b16 lo, hi;
            mov.b32 {lo, hi}, $2;
            cvt.rn.f16x2.e4m3x2 $0, lo;
            cvt.rn.f16x2.e4m3x2 $1, hi;
            }""",
            constraints="=r,=r,r", args=[x], dtype=tl.float16, is_pure=False, pack=4)
    else:
        return x.to(DT)


# --------------------------------------------------------------------------- KV store


@triton.jit
def _to_e4m3_grid(x, FP8_MAX: tl.constexpr):
    """float32 `x` saturated and rounded (to nearest, ties to even) onto float8 E4M3's values,
    so that the cast after it is exact. NOTE: a GPU's cast rounds the same way by itself;
    Triton's interpreter does not (it rounds ties up and drops the carry into the exponent:
    7.99 became 4.0), and the tests run the kernels there."""
    x = tl.minimum(tl.maximum(x, -FP8_MAX), FP8_MAX)
    # Normal values: keep 3 of float32's 23 mantissa bits, rounding on the 20 dropped ones.
    b = x.to(tl.uint32, bitcast=True)
    normal = ((b + 0x7FFFF + ((b >> 20) & 1)) & 0xFFF00000).to(tl.float32, bitcast=True)
    # Subnormal ones (below 2**-6) sit on a grid of 2**-9: float32's own rounding of a sum
    # whose ulp is 2**-9 puts them there. The sign goes back on as a bit, so what rounds to
    # zero keeps it (-0.0): on an H200 `-tiny` of a zero `tiny` stored +0.0.
    tiny = (tl.abs(x) + 24576.0) - 24576.0
    tiny = (tiny.to(tl.uint32, bitcast=True) | (b & 0x80000000)).to(tl.float32, bitcast=True)
    return tl.where(tl.abs(x) < 0.015625, tiny, normal)


@triton.jit
def _as_cached(x, cache_ptr, FP8_MAX: tl.constexpr):
    """`x` as the cache at `cache_ptr` holds it: a float8 cache (FP8_MAX > 0) saturates and
    rounds to nearest even (see attention.FP8_MAX)."""
    if FP8_MAX > 0:
        x = _to_e4m3_grid(x.to(tl.float32), FP8_MAX)
    return x.to(cache_ptr.dtype.element_ty)


def _fp8_max(cache: torch.Tensor) -> float:
    """The kernels' FP8_MAX: where a float8 cache saturates, 0 for any other."""
    return FP8_MAX if is_fp8(cache.dtype) else 0.0


@triton.jit
def _store_kv_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh, stride_ch, stride_cs, num_kv_heads,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_H: tl.constexpr, FP8_MAX: tl.constexpr,
):
    # One program: one token's kv heads [BLOCK_H x head_dim] from head program_id(1) * BLOCK_H.
    t = tl.program_id(0)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot < 0:  # a padding row: stores nothing
        return
    d = tl.arange(0, BLOCK_D)
    m = (heads < num_kv_heads)[:, None] & (d < HEAD_DIM)[None, :]
    h = heads.to(tl.int64)[:, None]
    k = tl.load(k_ptr + t * stride_kt + h * stride_kh + d[None, :], mask=m, other=0.0)
    v = tl.load(v_ptr + t * stride_vt + h * stride_vh + d[None, :], mask=m, other=0.0)
    dst = h * stride_ch + slot * stride_cs + d[None, :]
    tl.store(k_cache_ptr + dst, _as_cached(k, k_cache_ptr, FP8_MAX), mask=m)
    tl.store(v_cache_ptr + dst, _as_cached(v, v_cache_ptr, FP8_MAX), mask=m)


# Elements per KV-store program at most: all of a token's kv heads up to 32 heads of 128
# (vLLM's reshape_and_cache too takes a token per block).
STORE_BLOCK_ELEMENTS = 4096


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """k, v [num_tokens, num_kv_heads, head_dim] (unit last stride) into the caches at
    `slot_mapping` [num_tokens] (long; -1 = skip)."""
    num_tokens, num_kv_heads, head_dim = k.shape
    assert k.stride(2) == 1 and v.stride(2) == 1 and k_cache.stride(2) == 1
    assert k_cache.stride() == v_cache.stride()
    block_d = triton.next_power_of_2(head_dim)
    block_h = min(triton.next_power_of_2(num_kv_heads), max(1, STORE_BLOCK_ELEMENTS // block_d))
    _store_kv_kernel[(num_tokens, triton.cdiv(num_kv_heads, block_h))](
        k, v, k_cache, v_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1), k_cache.stride(0), k_cache.stride(1),
        num_kv_heads, HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_H=block_h,
        FP8_MAX=_fp8_max(k_cache), enable_fp_fusion=FP_FUSION,
    )


# --------------------------------------------------------------------------- decode


@triton.jit
def _decode_split_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, q_rows_ptr, block_table_ptr, ctx_lens_ptr,
    o_part_ptr, lse_part_ptr, out_ptr, k_new_ptr, v_new_ptr, slot_ptr, cos_ptr, sin_ptr,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_ch, stride_cs, stride_bt,
    stride_kt, stride_kh, stride_vt, stride_vh, stride_cos, stride_sin,
    qk_scale,
    BLOCK_SIZE: tl.constexpr, NUM_HEADS: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr, USE_DOT: tl.constexpr, PRECISION: tl.constexpr,
    DOT_DT: tl.constexpr, FP8_ASM: tl.constexpr, STORE_NEW: tl.constexpr, FP8_MAX: tl.constexpr,
    ROTARY: tl.constexpr,
):
    r = tl.program_id(0)
    kvh = tl.program_id(1)
    sp = tl.program_id(2)
    # NOTE: int32 position arithmetic (a graph's lengths are int64: 64-bit division is slow).
    ctx = tl.load(ctx_lens_ptr + r).to(tl.int32)
    # Splits are fixed in number (a CUDA graph's grid) and sized by this request's context.
    split_len = tl.cdiv(ctx, NUM_SPLITS)
    start = sp * split_len
    end = tl.minimum(start + split_len, ctx)
    row = tl.load(q_rows_ptr + r).to(tl.int64)
    hs = tl.arange(0, BLOCK_H)
    hm = hs < GROUP
    d = tl.arange(0, BLOCK_D)
    dm = d < HEAD_DIM
    heads = kvh * GROUP + hs
    qm = hm[:, None] & dm[None, :]
    q = tl.load(q_ptr + row * stride_qt + heads[:, None] * stride_qh + d[None, :], mask=qm,
                other=0.0)  # [BLOCK_H, BLOCK_D]
    # ROTARY: q and the new k come unrotated; rotated here as the rotary kernel would.
    half = HEAD_DIM // 2
    first = d < half
    partner = tl.where(first, d + half, d - half)  # the dim each rotates with
    if ROTARY:
        cos = tl.load(cos_ptr + row * stride_cos + d % half, mask=dm, other=0.0).to(tl.float32)
        sin = tl.load(sin_ptr + row * stride_sin + d % half, mask=dm, other=0.0).to(tl.float32)
        qp = tl.load(q_ptr + row * stride_qt + heads[:, None] * stride_qh + partner[None, :],
                     mask=qm, other=0.0)
        q = rotate_half(q.to(tl.float32), qp.to(tl.float32), cos[None, :], sin[None, :],
                        first[None, :], q.dtype)
    else:
        cos = d.to(tl.float32)  # unused
        sin = cos
    q = _query_as(q, DOT_DT) if USE_DOT else q.to(tl.float32)
    cache = kvh * stride_ch
    if STORE_NEW:
        # The context's last token (this step's) is not read from the cache: the program
        # whose split ends the context stores it there and starts from it.
        m_i, l_i, acc = _new_token(
            q, k_cache_ptr, v_cache_ptr, k_new_ptr, v_new_ptr, slot_ptr, row, cache + d,
            (start <= ctx - 1) & (ctx - 1 < end), kvh, stride_cs, stride_kt, stride_kh,
            stride_vt, stride_vh, qk_scale, d, dm, FP8_MAX, ROTARY, cos, sin, first, partner)
        cached_end = tl.minimum(end, ctx - 1)
    else:
        m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_H], tl.float32)
        acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
        cached_end = end
    for n0 in range(start, cached_end, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        pm = pos < cached_end
        blk = tl.load(block_table_ptr + r * stride_bt + pos // BLOCK_SIZE, mask=pm, other=0)
        slot = blk.to(tl.int64) * BLOCK_SIZE + pos % BLOCK_SIZE
        kv_off = cache + slot[:, None] * stride_cs + d[None, :]
        kvm = pm[:, None] & dm[None, :]
        k = tl.load(k_cache_ptr + kv_off, mask=kvm, other=0.0)  # [BLOCK_N, BLOCK_D]
        if USE_DOT:  # a GQA group's heads share each K/V tile: tensor cores
            s = tl.dot(q, tl.trans(_widen(k, DOT_DT, FP8_ASM)), input_precision=PRECISION)
        else:  # one head (MHA): a padded dot would waste 15 of its 16 rows
            s = tl.sum(q[:, None, :] * _widen(k, DOT_DT, FP8_ASM).to(tl.float32)[None, :, :], 2)
        s = tl.where(pm[None, :], s * qk_scale, float("-inf"))  # [BLOCK_H, BLOCK_N]
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_cache_ptr + kv_off, mask=kvm, other=0.0)
        if USE_DOT:
            pv = tl.dot(p.to(DOT_DT), _widen(v, DOT_DT, FP8_ASM), input_precision=PRECISION)
        else:
            pv = tl.sum(p[:, :, None] * _widen(v, DOT_DT, FP8_ASM).to(tl.float32)[None, :, :], 1)
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    if NUM_SPLITS == 1:  # the whole context: normalise and write the output, no merge
        o = acc / l_i[:, None]  # NOTE: l_i > 0, a context holds >= 1 token
        tl.store(out_ptr + row * stride_ot + heads[:, None] * stride_oh + d[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=hm[:, None] & dm[None, :])
    else:
        # An empty split (context shorter than the splits) leaves l_i = 0: weight 0 in the merge.
        has = l_i > 0
        o = acc / tl.where(has, l_i, 1.0)[:, None]
        lse = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))
        part = (r * NUM_HEADS + heads) * NUM_SPLITS + sp  # [BLOCK_H]
        tl.store(o_part_ptr + part[:, None] * BLOCK_D + d[None, :], o, mask=hm[:, None])
        tl.store(lse_part_ptr + part, lse, mask=hm)


@triton.jit
def _new_token(q, k_cache_ptr, v_cache_ptr, k_new_ptr, v_new_ptr, slot_ptr, row, head_off, own,
               kvh, stride_cs, stride_kt, stride_kh, stride_vt, stride_vh, qk_scale, d, dm,
               FP8_MAX: tl.constexpr, ROTARY: tl.constexpr, cos, sin, first, partner):
    """The decode's own token, stored into the cache and attended to from registers: the KV
    store's work, done by the program whose split ends the context (`own`), so that a decode
    iteration needs no store launch. Returns the online softmax's starting state (m, l, acc):
    that token alone where `own`, else nothing yet. Its K/V are rounded as the cache holds
    them first, so the output is what reading them back would give. NOTE: before the key
    loop, not after it: there its [BLOCK_H, BLOCK_D] temporaries would sit beside `acc` and
    cost registers (118 against 96 a thread, sm_90)."""
    slot = tl.load(slot_ptr + row)
    k_src = k_new_ptr + row * stride_kt + kvh * stride_kh
    kn = tl.load(k_src + d, mask=dm, other=0.0)
    vn = tl.load(v_new_ptr + row * stride_vt + kvh * stride_vh + d, mask=dm, other=0.0)
    if ROTARY:  # k comes unrotated (see the decode kernel)
        kp = tl.load(k_src + partner, mask=dm, other=0.0)
        kn = rotate_half(kn.to(tl.float32), kp.to(tl.float32), cos, sin, first, kn.dtype)
    kn = _as_cached(kn, k_cache_ptr, FP8_MAX)
    vn = _as_cached(vn, v_cache_ptr, FP8_MAX)
    # Slot -1: a CUDA-graph padding row stores nothing. NOTE: the test is on a vector:
    # Triton's interpreter takes no scalar condition into a store's mask.
    slot = tl.where(own, slot, -1)
    keep = dm & ((slot + d * 0) >= 0)
    tl.store(k_cache_ptr + head_off + slot * stride_cs, kn, mask=keep)
    tl.store(v_cache_ptr + head_off + slot * stride_cs, vn, mask=keep)
    # [BLOCK_H]: q's rows (rounded to the dot's dtype, as the tiles' dots see them) times k.
    s = tl.sum(q.to(tl.float32) * kn.to(tl.float32)[None, :], 1) * qk_scale
    m_i = tl.where(own, s, float("-inf"))
    l_i = tl.where(own, 1.0, 0.0) + tl.zeros_like(s)  # p = exp2(s - m) = 1
    acc = tl.where(own, 1.0, 0.0) * vn.to(tl.float32)[None, :] + tl.zeros_like(q.to(tl.float32))
    return m_i, l_i, acc


@triton.jit
def _decode_merge_kernel(
    o_part_ptr, lse_part_ptr, q_rows_ptr, out_ptr, stride_ot, stride_oh,
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
):
    r = tl.program_id(0)
    h = tl.program_id(1)
    sps = tl.arange(0, NUM_SPLITS)
    d = tl.arange(0, BLOCK_D)
    part = (r * NUM_HEADS + h) * NUM_SPLITS + sps  # [NUM_SPLITS]
    lse = tl.load(lse_part_ptr + part)
    w = tl.exp2(lse - tl.max(lse, 0))  # split 0 is never empty: the max is finite
    o = tl.load(o_part_ptr + part[:, None] * BLOCK_D + d[None, :])  # [NUM_SPLITS, BLOCK_D]
    o = tl.sum(o * w[:, None], 0) / tl.sum(w, 0)
    row = tl.load(q_rows_ptr + r).to(tl.int64)
    tl.store(out_ptr + row * stride_ot + h * stride_oh + d, o.to(out_ptr.dtype.element_ty),
             mask=d < HEAD_DIM)


def decode_splits(num_decodes: int, num_kv_heads: int, max_ctx_len: int, num_sms: int,
                  block_n: int = 32) -> int:
    """How many splits each decode's context gets: enough programs to fill the GPU's
    multiprocessors twice over, no more than the context has key tiles; a power of 2."""
    want = -(-2 * num_sms // max(1, num_decodes * num_kv_heads))
    tiles = -(-max_ctx_len // block_n)
    return min(16, triton.next_power_of_2(max(1, min(want, tiles))))


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 q_rows: torch.Tensor, block_table: torch.Tensor, ctx_lens: torch.Tensor,
                 block_size: int, scale: float, num_splits: int, out: torch.Tensor,
                 config: DecodeConfig | None = None,
                 new_kv: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
                 rotary: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
    """One query token per decode: q[q_rows[i]] [num_heads, head_dim] against its context of
    ctx_lens[i] (>= 1) tokens through block_table[i] (int32); written to out[q_rows[i]].

    q, out: [num_tokens, num_heads, head_dim] (unit last stride); num_splits a power of 2
    (1: one program per (decode, KV head) writes its output directly, no merge).
    new_kv: (k, v, slot_mapping) of every row, [num_tokens, num_kv_heads, head_dim] and
    [num_tokens]: each decode's own token (its context's last) is stored at its slot (-1:
    nowhere) and attended to from k and v, instead of a `store_kv` launch before this one.
    rotary: (cos, sin) [num_tokens, 1, head_dim // 2] of every row, with new_kv: q and k come
    unrotated and are rotated here, as `triton_layers.rotary` would (one launch fewer).
    """
    num_decodes = q_rows.shape[0]
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k_cache.shape[0]
    group = num_heads // num_kv_heads
    cfg = config or decode_config(k_cache, group, num_decodes)
    use_dot = cfg.use_dot or group > 4  # a wide group's broadcast product outgrows registers
    block_d = triton.next_power_of_2(head_dim)
    assert q.stride(2) == 1 and out.stride(2) == 1 and k_cache.stride(2) == 1
    assert k_cache.stride() == v_cache.stride()
    if num_splits > 1:
        o_part = torch.empty((num_decodes, num_heads, num_splits, block_d), dtype=torch.float32,
                             device=q.device)
        lse_part = torch.empty((num_decodes, num_heads, num_splits), dtype=torch.float32,
                               device=q.device)
    else:  # unused: the kernel writes `out`
        o_part = lse_part = out
    dot_dt = _dot_dtype(k_cache, q)
    k_new, v_new, slots = new_kv if new_kv is not None else (q, q, q_rows)  # unused without
    assert k_new.stride(2) == 1 and v_new.stride(2) == 1
    assert rotary is None or new_kv is not None, "rotary in the decode launch needs new_kv"
    cos, sin = (c.squeeze(1) for c in rotary) if rotary is not None else (q[:, 0], q[:, 0])
    assert cos.stride(-1) == 1 and sin.stride(-1) == 1
    _decode_split_kernel[(num_decodes, num_kv_heads, num_splits)](
        q, k_cache, v_cache, q_rows, block_table, ctx_lens, o_part, lse_part, out,
        k_new, v_new, slots, cos, sin,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), k_cache.stride(0),
        k_cache.stride(1), block_table.stride(0),
        k_new.stride(0), k_new.stride(1), v_new.stride(0), v_new.stride(1), cos.stride(0),
        sin.stride(0), scale * LOG2E,
        BLOCK_SIZE=block_size, NUM_HEADS=num_heads, GROUP=group, HEAD_DIM=head_dim, BLOCK_D=block_d,
        BLOCK_H=_pow2(group) if use_dot else triton.next_power_of_2(group),
        BLOCK_N=cfg.block_n, NUM_SPLITS=num_splits, USE_DOT=use_dot,
        PRECISION=_precision(k_cache, q), DOT_DT=dot_dt, FP8_ASM=_fp8_asm(k_cache, dot_dt),
        STORE_NEW=new_kv is not None, FP8_MAX=_fp8_max(k_cache),
        ROTARY=rotary is not None,
        # float32: a multiply-add would skip a rounding of the rotation (see rotate_half).
        enable_fp_fusion=FP_FUSION and not (rotary is not None and q.dtype == torch.float32),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        **({} if cfg.max_registers is None else {"maxnreg": cfg.max_registers}),
    )
    if num_splits > 1:
        _decode_merge_kernel[(num_decodes, num_heads)](
            o_part, lse_part, q_rows, out, out.stride(0), out.stride(1),
            NUM_HEADS=num_heads, HEAD_DIM=head_dim, BLOCK_D=block_d, NUM_SPLITS=num_splits,
            enable_fp_fusion=FP_FUSION,
        )


# --------------------------------------------------------------------------- prefill


@triton.jit
def _prefill_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, q_starts_ptr, q_lens_ptr, ctx_lens_ptr,
    block_table_ptr,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_ch, stride_cs, stride_bt,
    qk_scale,
    BLOCK_SIZE: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr, DOT_DT: tl.constexpr,
    FP8_ASM: tl.constexpr,
):
    s = tl.program_id(0)
    h = tl.program_id(1)
    mb = tl.program_id(2)
    q_len = tl.load(q_lens_ptr + s)
    if mb * BLOCK_M >= q_len:  # the grid covers the longest prefill
        return
    q_start = tl.load(q_starts_ptr + s).to(tl.int64)
    prefix = tl.load(ctx_lens_ptr + s) - q_len  # cached tokens before this chunk
    kvh = h // GROUP
    ms = mb * BLOCK_M + tl.arange(0, BLOCK_M)
    mm = ms < q_len
    d = tl.arange(0, BLOCK_D)
    dm = d < HEAD_DIM
    q = tl.load(q_ptr + (q_start + ms)[:, None] * stride_qt + h * stride_qh + d[None, :],
                mask=mm[:, None] & dm[None, :], other=0.0)  # [BLOCK_M, BLOCK_D]
    q = _query_as(q, DOT_DT)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    # Bottom-right causal: query i (position prefix + i) sees keys 0..prefix + i.
    end = prefix + tl.minimum(q_len, (mb + 1) * BLOCK_M)
    cache = kvh * stride_ch
    for n0 in range(0, end, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        pm = pos < end
        blk = tl.load(block_table_ptr + s * stride_bt + pos // BLOCK_SIZE, mask=pm, other=0)
        slot = blk.to(tl.int64) * BLOCK_SIZE + pos % BLOCK_SIZE
        kv_off = cache + slot[:, None] * stride_cs + d[None, :]
        kvm = pm[:, None] & dm[None, :]
        k = _widen(tl.load(k_cache_ptr + kv_off, mask=kvm, other=0.0), DOT_DT, FP8_ASM)
        sc = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale  # [BLOCK_M, BLOCK_N]
        visible = (pos[None, :] <= (prefix + ms)[:, None]) & pm[None, :]
        sc = tl.where(visible, sc, float("-inf"))
        # NOTE: key 0 is visible to every row, so m_new is finite from the first tile on.
        m_new = tl.maximum(m_i, tl.max(sc, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(sc - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = _widen(tl.load(v_cache_ptr + kv_off, mask=kvm, other=0.0), DOT_DT, FP8_ASM)
        acc = acc * alpha[:, None] + tl.dot(p.to(DOT_DT), v, input_precision=PRECISION)
        m_i = m_new
    o = acc / l_i[:, None]
    tl.store(out_ptr + (q_start + ms)[:, None] * stride_ot + h * stride_oh + d[None, :],
             o.to(out_ptr.dtype.element_ty), mask=mm[:, None] & dm[None, :])


def paged_prefill(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  q_starts: torch.Tensor, q_lens: torch.Tensor, ctx_lens: torch.Tensor,
                  block_table: torch.Tensor, max_q_len: int, block_size: int, scale: float,
                  out: torch.Tensor) -> None:
    """Every prefill (or chunk) of the batch in one launch: q_lens[i] queries at rows
    q_starts[i].. of q, the last q_lens[i] of a context of ctx_lens[i] tokens whose K/V (the
    chunk's own included) are in the cache through block_table[i] (int32).

    q, out: [num_tokens, num_heads, head_dim] (unit last stride).
    """
    num_prefills = q_starts.shape[0]
    num_heads, head_dim = q.shape[1], q.shape[2]
    group = num_heads // k_cache.shape[0]
    block_d = triton.next_power_of_2(head_dim)
    # Wider tiles for half types; float32 tiles twice the bytes (shared memory).
    block_m = 64 if compute_dtype(k_cache.dtype, q.dtype) != torch.float32 and block_d <= 128 else 32
    assert q.stride(2) == 1 and out.stride(2) == 1 and k_cache.stride(2) == 1
    assert k_cache.stride() == v_cache.stride()
    grid = (num_prefills, num_heads, triton.cdiv(max_q_len, block_m))
    dot_dt = _dot_dtype(k_cache, q)
    _prefill_kernel[grid](
        q, k_cache, v_cache, out, q_starts, q_lens, ctx_lens, block_table,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), k_cache.stride(0),
        k_cache.stride(1), block_table.stride(0), scale * LOG2E,
        BLOCK_SIZE=block_size, GROUP=group, HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_M=block_m, BLOCK_N=32,
        PRECISION=_precision(k_cache, q), DOT_DT=dot_dt, FP8_ASM=_fp8_asm(k_cache, dot_dt),
        enable_fp_fusion=FP_FUSION,
    )
