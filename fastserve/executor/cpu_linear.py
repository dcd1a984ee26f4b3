"""Weights packed once for the CPU's fastest matmul of their dtype (float32 and bfloat16 models).

A general GEMM (MKL behind `F.linear`) re-packs the weight into its blocked layout on each
call; a weight packed once at start-up is read as is. Measured on 2 cores:
- float32 (AVX2): oneDNN's linear on a packed weight is 1.3-2x faster at 16-64 rows, the
  32000-row LM head 2x, and no gain for prefills of hundreds of rows, which keep the plain
  weight (`F32_PACKED_MAX_ROWS`).
- bfloat16 with AVX-512 BF16 and no AMX: our kernel (`csrc/cpu_gemm.cpp`), every row count.
  On the small preset's matmuls (2-core Zen 4, medians) it is 1.37x faster than oneDNN's
  packed bf16 at 1 row, 1.8x at 10, 1.2x at 16-32, 1.05x at 256: a decode batch's matmuls
  are bound by reading the weights, which the kernel streams near the memory's speed.
- bfloat16 elsewhere oneDNN supports it (AMX tiles, or a build of the kernels without
  AVX-512 BF16): oneDNN's packed bf16, every row count (1.2-1.4x `F.linear` at decode
  batches, a few percent for prefills). A CPU without bf16 instructions keeps the plain weights.
The packed copies double the weights' memory; our kernel's are kept in huge pages
(`cpu_memory`).
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable
from types import ModuleType

import torch
from torch import Tensor, nn

from fastserve.executor.cpu_kernels import cpu_isa, cpu_kernels_enabled, decode_attention_kernel
from fastserve.executor.cpu_memory import to_huge_pages
from fastserve.model.layers import LinearBase, PackedWeight, ParallelLMHead

logger = logging.getLogger(__name__)

KERNEL_LAYOUT = "avx512bf16-kernel"  # the name of `csrc/cpu_gemm.cpp`'s layout

# Up to this many rows a float32 packed weight wins (decode batches); prefills use the plain one.
F32_PACKED_MAX_ROWS = 64


def onednn_linear(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """x W^T (+ b) with W packed by `pack`."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


def pack(weight: Tensor) -> Tensor:
    """`weight` [out, in] in oneDNN's layout for `onednn_linear`, packed for a decode batch's
    rows (the layout suits larger calls too)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), F32_PACKED_MAX_ROWS // 2)


def _bf16_kernel() -> ModuleType | None:
    """The kernels' bfloat16 matmul where it is the one to use: built with AVX-512 BF16, on a
    CPU without AMX (whose tiles oneDNN uses, unmeasured against ours)."""
    kernel = decode_attention_kernel()
    if kernel is None or not hasattr(kernel, "bf16_linear") or cpu_isa() == "amx_bf16":
        return None
    return kernel


def _kernel_matmul(kernel: ModuleType, n: int) -> Callable[[Tensor, Tensor, Tensor | None], Tensor]:
    def matmul(x: Tensor, packed: Tensor, bias: Tensor | None) -> Tensor:
        return kernel.bf16_linear(x, packed, bias, n)
    return matmul


def packed_weight(weight: Tensor, max_rows: int | None = None) -> tuple[PackedWeight, str] | None:
    """`weight` [out, in] packed for this CPU's fastest matmul of its dtype (see the module
    docstring), used for calls of up to `max_rows` rows (default: per dtype), and the layout's
    name; None where the plain weight is what runs (not on CPU, kernels off, no oneDNN or no
    fast path for the dtype)."""
    if not cpu_kernels_enabled() or weight.device.type != "cpu":
        return None
    if weight.dtype == torch.bfloat16 and (kernel := _bf16_kernel()) is not None:
        packed = kernel.bf16_pack_weight(weight.detach())
        return (PackedWeight(packed, _kernel_matmul(kernel, weight.shape[0]), max_rows or sys.maxsize),
                KERNEL_LAYOUT)
    if not torch.backends.mkldnn.is_available():
        return None
    if weight.dtype == torch.float32:
        rows = F32_PACKED_MAX_ROWS
    elif weight.dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported():
        rows = sys.maxsize
    else:
        return None
    name = "onednn-" + str(weight.dtype).removeprefix("torch.")
    return PackedWeight(pack(weight), onednn_linear, max_rows or rows), name


def pack_weights(model: nn.Module, max_rows: int | None = None) -> str:
    """Give every linear layer of a CPU model its weight packed by `packed_weight` (for calls
    of up to `max_rows` rows; default per dtype); returns the layout's name, or "plain" where
    nothing was packed (not on CPU, the CPU kernels switched off: FASTSERVE_CPU_KERNELS=0, no
    oneDNN, or no fast path for the dtype on this CPU)."""
    layers = [m for m in model.modules() if isinstance(m, LinearBase | ParallelLMHead)]
    name = "plain"
    try:
        for m in layers:
            got = packed_weight(m.weight, max_rows)
            m.packed, name = (got[0], got[1]) if got is not None else (None, "plain")
        if name == KERNEL_LAYOUT:  # one region of huge pages for them all (`cpu_memory`)
            packed = [m.packed for m in layers if m.packed is not None]
            for p, moved in zip(packed, to_huge_pages([p.weight for p in packed])):
                p.weight = moved
    except (RuntimeError, AttributeError) as exc:  # an ATen built without the op: plain weights
        logger.warning("weight packing unavailable (%s); using plain matmuls", exc)
        for m in layers:
            m.packed = None
        return "plain"
    return name
