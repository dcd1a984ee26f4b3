"""Weights packed once for oneDNN's matmul on CPU (float32 and bfloat16 models).

A general GEMM (MKL behind `F.linear`) re-packs the weight into its blocked layout on each
call; oneDNN's linear reads a weight packed once at start-up. Measured on 2 cores:
- float32 (AVX2): 1.3-2x faster at 16-64 rows, the 32000-row LM head 2x, and no gain for
  prefills of hundreds of rows, which keep the plain weight (`F32_PACKED_MAX_ROWS`).
- bfloat16 (AVX-512 BF16): oneDNN's bf16 kernels (AVX-512 BF16 dot products, AMX tiles where
  the CPU has them) beat `F.linear`'s at every row count tried, 1 to 4096: 1.2-1.4x at decode
  batches of 16-64 (the LM head 1.4x), a few percent for prefills; so every call takes the
  packed weight. A CPU without bf16 instructions (oneDNN says so) keeps the plain weights.
The packed copies double the weights' memory.
"""

from __future__ import annotations

import logging
import sys

import torch
from torch import Tensor, nn

from fastserve.executor.cpu_kernels import cpu_kernels_enabled
from fastserve.model.layers import LinearBase, PackedWeight, ParallelLMHead

logger = logging.getLogger(__name__)

# Up to this many rows a float32 packed weight wins (decode batches); prefills use the plain one.
F32_PACKED_MAX_ROWS = 64


def onednn_linear(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """x W^T (+ b) with W packed by `pack`."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


def pack(weight: Tensor) -> Tensor:
    """`weight` [out, in] in oneDNN's layout for `onednn_linear`, packed for a decode batch's
    rows (the layout suits larger calls too)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), F32_PACKED_MAX_ROWS // 2)


def _packed_max_rows(dtype: torch.dtype) -> int | None:
    """Up to how many rows a packed weight of this dtype is used; None: do not pack."""
    if dtype == torch.float32:
        return F32_PACKED_MAX_ROWS
    if dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return sys.maxsize
    return None


def pack_weights(model: nn.Module, max_rows: int | None = None) -> int:
    """Give every linear layer of a float32 or bfloat16 CPU model a oneDNN-packed weight,
    used for calls of up to `max_rows` rows (default: per dtype, see the module docstring);
    returns how many layers.

    Does nothing (returns 0) where oneDNN is unavailable or lacks the dtype on this CPU, the
    model is not on CPU, or the CPU kernels are switched off (FASTSERVE_CPU_KERNELS=0, see
    `cpu_kernels`).
    """
    params = list(model.parameters())
    if not cpu_kernels_enabled() or not params or params[0].device.type != "cpu":
        return 0
    default_rows = _packed_max_rows(params[0].dtype)
    if default_rows is None or not torch.backends.mkldnn.is_available():
        return 0
    rows = max_rows or default_rows
    layers = [m for m in model.modules() if isinstance(m, LinearBase | ParallelLMHead)]
    try:
        for m in layers:
            m.packed = PackedWeight(pack(m.weight), onednn_linear, rows)
    except (RuntimeError, AttributeError) as exc:  # an ATen built without the op: plain weights
        logger.warning("oneDNN weight packing unavailable (%s); using plain matmuls", exc)
        for m in layers:
            m.packed = None
        return 0
    return len(layers)
