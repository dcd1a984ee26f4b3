"""Triton kernels of the CUDA backend for the model's small layers: add + RMSNorm, SiLU-and-mul
and rotary embedding, one launch each (instead of four to a dozen), each with the plain
layers' roundings so that the model's outputs do not change with the backend.
`TritonAttention.prepare_model` hands them to the layers (`fused`)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Fused multiply-adds in the kernels: Triton's default until 3.10 turns it off. Every launch
# names it, so the kernels keep the roundings and speed they were checked with whatever the
# Triton version; rotary in float32 turns it off (see rotate_half).
FP_FUSION = True


@triton.jit
def _rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, stride_x, stride_r, hidden, eps,
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    m = cols < hidden
    x = tl.load(x_ptr + row * stride_x + cols, mask=m, other=0.0)
    dt = x.dtype
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_r + cols, mask=m, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(dt)  # the add rounded to the model dtype
        tl.store(res_out_ptr + row * hidden + cols, x, mask=m)
    xf = x.to(tl.float32)
    var = tl.sum(xf * xf, 0) / hidden
    y = (xf * tl.rsqrt(var + eps)).to(dt).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=m, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * hidden + cols, (w * y).to(dt), mask=m)


def rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
             eps: float) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """`RMSNorm.forward` in one launch, with HF's roundings: x [num_tokens, hidden] (and the
    residual add before it, in the model dtype) -> norm(x) (, x + residual)."""
    num_tokens, hidden = x.shape
    assert x.stride(1) == 1 and (residual is None or residual.stride(1) == 1)
    out = torch.empty((num_tokens, hidden), dtype=x.dtype, device=x.device)
    res_out = torch.empty_like(out) if residual is not None else out
    res = residual if residual is not None else x
    _rms_norm_kernel[(num_tokens,)](
        x, res, weight, out, res_out, x.stride(0), res.stride(0), hidden, eps,
        HAS_RESIDUAL=residual is not None, BLOCK=triton.next_power_of_2(hidden),
        enable_fp_fusion=FP_FUSION,
    )
    return out if residual is None else (out, res_out)


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, inter, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = cols < inter
    g = tl.load(x_ptr + row * stride_x + cols, mask=m, other=0.0)
    u = tl.load(x_ptr + row * stride_x + inter + cols, mask=m, other=0.0).to(tl.float32)
    dt = g.dtype
    gf = g.to(tl.float32)
    act = (gf / (1.0 + tl.exp(-gf))).to(dt).to(tl.float32)  # silu, rounded as F.silu's output
    tl.store(out_ptr + row * inter + cols, (act * u).to(dt), mask=m)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """`SiluAndMul.forward` in one launch: x [num_tokens, 2 * inter] = [gate | up] ->
    silu(gate) * up [num_tokens, inter]."""
    num_tokens, two_inter = x.shape
    inter = two_inter // 2
    assert x.stride(1) == 1
    out = torch.empty((num_tokens, inter), dtype=x.dtype, device=x.device)
    block = min(1024, triton.next_power_of_2(inter))
    _silu_and_mul_kernel[(num_tokens, triton.cdiv(inter, block))](
        x, out, x.stride(0), inter, BLOCK=block, enable_fp_fusion=FP_FUSION)
    return out


@triton.jit
def rotate_half(x, partner, cos, sin, first, dt: tl.constexpr):
    """One half of `apply_rotary`'s output: x * cos - partner * sin for the first half (x is
    x1, partner x2), x * cos + partner * sin for the second (x is x2, partner x1), in float32
    with each product and the sum rounded to the model dtype `dt`, as the tensor ops round
    them. `first` may be a mask. NOTE: a float32 caller compiles with enable_fp_fusion=False,
    or a multiply-add would skip a rounding the tensor ops make."""
    a = (x * cos).to(dt).to(tl.float32)
    b = (partner * sin).to(dt).to(tl.float32)
    return tl.where(first, a - b, a + b).to(dt)


@triton.jit
def _rotary_kernel(x_ptr, out_ptr, cos_ptr, sin_ptr, stride_xt, stride_xh, stride_ct,
                   stride_st, num_heads, HALF: tl.constexpr, BLOCK: tl.constexpr,
                   BLOCK_H: tl.constexpr):
    # One program: one token's heads [BLOCK_H x head_dim] from head program_id(1) * BLOCK_H.
    t = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    cols = tl.arange(0, BLOCK)
    mc = cols < HALF
    m = (heads < num_heads)[:, None] & mc[None, :]
    h = heads.to(tl.int64)[:, None]
    src = x_ptr + t * stride_xt + h * stride_xh + cols[None, :]
    x1 = tl.load(src, mask=m, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF, mask=m, other=0.0)
    dt = x2.dtype
    x2 = x2.to(tl.float32)
    cos = tl.load(cos_ptr + t * stride_ct + cols, mask=mc, other=0.0).to(tl.float32)[None, :]
    sin = tl.load(sin_ptr + t * stride_st + cols, mask=mc, other=0.0).to(tl.float32)[None, :]
    dst = out_ptr + (t * num_heads + h) * (2 * HALF) + cols[None, :]
    tl.store(dst, rotate_half(x1, x2, cos, sin, True, dt), mask=m)
    tl.store(dst + HALF, rotate_half(x2, x1, cos, sin, False, dt), mask=m)


# Elements of one half per rotary program at most: all of a token's heads up to 64 heads of
# 128 (vLLM's CUDA kernel too takes a token per block).
ROTARY_BLOCK_ELEMENTS = 4096


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """`apply_rotary` in one launch: x [num_tokens, num_heads, head_dim] (a view of the fused
    qkv output: any token and head strides, dims contiguous) rotated by cos, sin
    [num_tokens, 1, head_dim // 2] (in x's dtype) -> a new contiguous tensor of x's shape.
    Same roundings as the tensor ops: no fused multiply-add (`enable_fp_fusion=False`)."""
    num_tokens, num_heads, head_dim = x.shape
    half = head_dim // 2
    assert x.stride(2) == 1 and cos.stride(2) == 1 and sin.stride(2) == 1
    assert cos.dtype == x.dtype and sin.dtype == x.dtype
    out = torch.empty((num_tokens, num_heads, head_dim), dtype=x.dtype, device=x.device)
    if num_tokens == 0:
        return out
    block = triton.next_power_of_2(half)
    block_h = min(triton.next_power_of_2(num_heads), max(1, ROTARY_BLOCK_ELEMENTS // block))
    _rotary_kernel[(num_tokens, triton.cdiv(num_heads, block_h))](
        x, out, cos, sin, x.stride(0), x.stride(1), cos.stride(0), sin.stride(0), num_heads,
        HALF=half, BLOCK=block, BLOCK_H=block_h, enable_fp_fusion=False,
    )
    return out
