"""Pre-packed weights for the small matmuls of decode on CPU (oneDNN).

A decode iteration multiplies a few dozen rows by every weight of the model. A general GEMM
(MKL behind `F.linear`) re-packs the weight into its blocked layout on each call; oneDNN's
linear reads a weight packed once at start-up. Measured on 2 AVX2 cores (benchmarks in the
commit that added this): 1.3-2x faster at 16-64 rows, the 32000-row LM head 2x, and no gain
for prefills of hundreds of rows, which keep the plain weight. The packed copies double the
weights' memory.
"""

from __future__ import annotations

import logging

import torch
from torch import Tensor, nn

from fastserve.executor.cpu_kernels import cpu_kernels_enabled
from fastserve.model.layers import LinearBase, PackedWeight, ParallelLMHead

logger = logging.getLogger(__name__)

# Up to this many rows the packed weight wins (decode batches); prefills use the plain one.
PACKED_MAX_ROWS = 64


def _onednn_linear(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


def pack_for_small_batches(model: nn.Module, max_rows: int = PACKED_MAX_ROWS) -> int:
    """Give every linear layer of a float32 CPU model a oneDNN-packed weight; returns how many.

    Does nothing (returns 0) where oneDNN is unavailable, the model is not float32 on CPU, or
    the CPU kernels are switched off (FASTSERVE_CPU_KERNELS=0, see `cpu_kernels`).
    """
    params = list(model.parameters())
    if not cpu_kernels_enabled() or not params or params[0].device.type != "cpu" or params[0].dtype != torch.float32:
        return 0
    if not torch.backends.mkldnn.is_available():
        return 0
    layers = [m for m in model.modules() if isinstance(m, LinearBase | ParallelLMHead)]
    try:
        for m in layers:
            packed = torch.ops.mkldnn._reorder_linear_weight(m.weight.detach(), max_rows // 2)
            m.packed = PackedWeight(packed, _onednn_linear, max_rows)
    except (RuntimeError, AttributeError) as exc:  # an ATen built without the op: plain weights
        logger.warning("oneDNN weight packing unavailable (%s); using plain matmuls", exc)
        for m in layers:
            m.packed = None
        return 0
    return len(layers)
