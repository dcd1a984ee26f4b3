"""Weights packed once for the CPU's fastest matmul of their dtype (float32 and bfloat16 models).

A general GEMM (MKL behind `F.linear`) re-packs the weight into its blocked layout on each
call; a weight packed once at start-up is read as is. Measured on 2 cores:
- float32 (AVX2): oneDNN's linear on a packed weight is 1.3-2x faster at 16-64 rows, the
  32000-row LM head 2x, and no gain for prefills of hundreds of rows, which keep the plain
  weight (`F32_PACKED_MAX_ROWS`). With AVX-512 BF16 (Zen 4), the packed weight won at every
  row count (`f32_packed_max_rows`).
- bfloat16 with AVX-512 BF16 and no AMX: our kernel (`csrc/cpu_gemm.cpp`), every row count.
  On the small preset's 49 matmuls (2-core Zen 4, medians, `benchmarks/cpu/cpu_matmul.py`) it is
  1.8x oneDNN's packed bf16 at 1-16 rows, 1.35x at 32, 1.2x at 64, 1.07x at 256 and
  0.96-1.0x from 2048 to 8192 rows, where it is 1.01-1.05x `F.linear` on the plain weights: a
  decode batch's matmuls are bound by reading the weights, which the kernel streams near the
  memory's speed, and a prefill's by the `vdpbf16ps` units. One path for every row count also
  rounds a row alike in every batch (a prompt's tokens, alone or beside others).
- bfloat16 with AMX: the same packed layout, read by the kernel's AMX tiles
  (`bf16_linear_amx`), up to 768 rows (`AMX_MAX_ROWS`). On the small preset's 49 matmuls (a
  2-core Xeon with AMX, `benchmarks/cpu/cpu_matmul.py`, medians of two runs' figures) it is
  1.4-1.7x oneDNN's AMX matmul at 1 row, 1.55-1.8x at 16, 1.5-1.6x at 32 (it streams the
  weights at 25-37 GB/s where oneDNN reached 17-21), 1.4x at 64, 1.1-1.2x at 128, 0.8-1.1x
  at 256-512 (oneDNN's own figures move most there), 0.99x at 1024 and 0.7x at 1536; it
  beats `F.linear`, what larger calls take, up to 512 rows at least. A weight whose input
  width is not a multiple of 32 (an A tile's row) takes oneDNN's, every row count: the
  AVX-512 path is compute-bound there past 16 rows, and a row count at which two paths meet
  would make a row's result depend on its batch (they round differently).
- bfloat16 elsewhere oneDNN supports it (a build of the kernels without AVX-512 BF16, or AMX
  refused by the OS): oneDNN's packed bf16, every row count (1.2-1.4x `F.linear` at decode
  batches, a few percent for prefills). A CPU without bf16 instructions keeps the plain weights.
Where a packed copy serves calls of every row count (the kernel without AMX, oneDNN's bfloat16,
float32 with AVX-512 BF16), the plain weight is released once packed, so the weights are held
once; elsewhere (float32 on other CPUs, AMX) the plain copy stays for the larger calls, and the
weights are held twice. Our kernel's packed weights are kept in huge pages (`cpu_memory`).
"""

from __future__ import annotations

import logging
import sys
from collections import Counter
from collections.abc import Callable
from types import ModuleType

import torch
from torch import Tensor, nn

from fastserve.executor.cpu_kernels import cpu_isa, decode_attention_kernel
from fastserve.executor.cpu_memory import huge_page_views
from fastserve.executor.platform import platform_for
from fastserve.model.layers import LinearBase, PackedWeight, ParallelLMHead
from fastserve.model.mlp import SparseMoeBlock

logger = logging.getLogger(__name__)
CPU = torch.device("cpu")

KERNEL_LAYOUT = "avx512bf16-kernel"  # the name of `csrc/cpu_gemm.cpp`'s layout
AMX_LAYOUT = "amx-bf16-kernel"  # the same layout, read by AMX tiles
# The most rows of one expert that `fused_experts` takes in one call (its grouped kernel runs
# a group in one pass over the weight, which slows past this; see csrc/cpu_gemm.cpp); a batch
# with a larger group takes the block's per-expert path, through the same kernel.
FUSED_MOE_MAX_ROWS = 2048
# With AMX: the tiles up to here (where oneDNN's and F.linear's blocking overtakes theirs).
AMX_MAX_ROWS = 768

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
    """The kernels' bfloat16 matmul where it is the one to use: built with AVX-512 BF16, and
    on a CPU with AMX, with the tiles' path, which Linux let this process use."""
    kernel = decode_attention_kernel()
    if kernel is None or not hasattr(kernel, "bf16_linear"):
        return None
    if cpu_isa() == "amx_bf16" and not _has_amx(kernel):
        return None  # oneDNN's AMX matmul beats the AVX-512 path there
    return kernel


def _has_amx(kernel: ModuleType) -> bool:
    return hasattr(kernel, "bf16_linear_amx") and bool(kernel.amx_ready())


def _kernel_matmul(kernel: ModuleType, n: int, k: int
                   ) -> tuple[Callable[[Tensor, Tensor, Tensor | None], Tensor], int] | None:
    """The kernel's matmul for an [n, k] weight and the most rows it takes; None where the
    kernel is not the one for it (with AMX, a k that is not a multiple of 32)."""
    if _has_amx(kernel):
        if k % 32:
            return None

        def amx(x: Tensor, packed: Tensor, bias: Tensor | None) -> Tensor:
            return kernel.bf16_linear_amx(x, packed, bias, n)
        return amx, AMX_MAX_ROWS

    def matmul(x: Tensor, packed: Tensor, bias: Tensor | None) -> Tensor:
        return kernel.bf16_linear(x, packed, bias, n)
    return matmul, sys.maxsize


Matmul = Callable[[Tensor, Tensor, Tensor | None], Tensor]  # (x, packed weight, bias) -> y


def _kernel_for(weight: Tensor, device: torch.device | None = None
                ) -> tuple[ModuleType, tuple[Matmul, int]] | None:
    """The kernel and its matmul for `weight` (on `device`, default its own), where
    `packed_weight` packs it in the kernel's layout; else None."""
    if weight_layout(weight.dtype, device or weight.device) not in (KERNEL_LAYOUT, AMX_LAYOUT):
        return None
    kernel = _bf16_kernel()
    if kernel is None:
        return None
    found = _kernel_matmul(kernel, *weight.shape)
    return None if found is None else (kernel, found)


def weight_layout(dtype: torch.dtype, device: torch.device) -> str:
    """Which packed layout weights of this dtype take here (see the module docstring):
    KERNEL_LAYOUT, "onednn-<dtype>", or "plain" (not on CPU, the CPU kernels switched off:
    FASTSERVE_CPU_KERNELS=0, no oneDNN, or no fast path for the dtype on this CPU)."""
    if not platform_for(device).runs_cpu_kernels():
        return "plain"
    kernel = _bf16_kernel() if dtype == torch.bfloat16 else None
    if kernel is not None:
        return AMX_LAYOUT if _has_amx(kernel) else KERNEL_LAYOUT
    if not torch.backends.mkldnn.is_available():
        return "plain"
    if dtype == torch.float32 or (dtype == torch.bfloat16
                                  and torch.ops.mkldnn._is_mkldnn_bf16_supported()):
        return "onednn-" + str(dtype).removeprefix("torch.")
    return "plain"


def packed_weight(weight: Tensor, max_rows: int | None = None,
                  out: Tensor | None = None) -> PackedWeight | None:
    """`weight` [out, in] packed in its `weight_layout` (into `out`, of `packed_shape`, for the
    kernel's layout when given), used for calls of up to `max_rows` rows (default: per dtype);
    None where the plain weight is what runs."""
    layout = weight_layout(weight.dtype, weight.device)
    found = _kernel_for(weight)
    if found is not None:
        kernel, (matmul, kernel_rows) = found
        packed = kernel.bf16_pack_weight(weight.detach(), out)
        return PackedWeight(packed, matmul, min(max_rows or kernel_rows, kernel_rows))
    if layout == "plain":
        return None
    rows = f32_packed_max_rows() if weight.dtype == torch.float32 else sys.maxsize
    return PackedWeight(pack(weight), onednn_linear, max_rows or rows)


def f32_packed_max_rows() -> int:
    """The most rows a float32 call takes the packed weight for here: every row count on an
    AVX-512 BF16 CPU, where oneDNN's packed float32 matmul beat `F.linear` at prefills too
    (small preset's 49 matmuls, 2-core Zen 4, `benchmarks/cpu/cpu_matmul.py --dtype float32`:
    1.64x at 64 rows, 1.21x at 512, 1.14x at 4096); F32_PACKED_MAX_ROWS elsewhere (on AVX2 it
    was 1.26x slower than `F.linear` at 512 rows)."""
    return sys.maxsize if cpu_isa() == "avx512_bf16" else F32_PACKED_MAX_ROWS


def packed_shape(weight: Tensor) -> tuple[int, ...]:
    """The shape of `weight` packed in KERNEL_LAYOUT."""
    kernel = _bf16_kernel()
    assert kernel is not None
    return tuple(kernel.bf16_packed_shape(*weight.shape))


def pack_weights(model: nn.Module, max_rows: int | None = None) -> str:
    """Give every linear layer of a CPU model its weight packed by `packed_weight` (for calls
    of up to `max_rows` rows; default per dtype); returns the `weight_layout` used. The
    kernel's layout is packed straight into one region of huge pages (`cpu_memory`). A plain
    weight that no call reads any more is released (`release_plain_weights`)."""
    layers = [m for m in model.modules() if isinstance(m, LinearBase | ParallelLMHead)]
    if not layers:
        return "plain"
    layout = weight_layout(layers[0].weight.dtype, layers[0].weight.device)
    try:
        outs: list[Tensor | None] = [None] * len(layers)
        mine = [i for i, m in enumerate(layers) if _kernel_for(m.weight) is not None]
        if mine:  # the kernel's weights, in one region of huge pages
            views = huge_page_views([packed_shape(layers[i].weight) for i in mine], torch.bfloat16)
            for i, view in zip(mine, views):
                outs[i] = view
        for m, out in zip(layers, outs):
            m.packed = packed_weight(m.weight, max_rows, out)
    except (RuntimeError, AttributeError) as exc:  # an ATen built without the op: plain weights
        logger.warning("weight packing unavailable (%s); using plain matmuls", exc)
        for m in layers:
            m.packed = None
        return "plain"
    freed = release_plain_weights(model, layers)
    if freed:
        logger.info("weights packed as %s; the plain copies released (%.0f MB): the packed ones "
                    "serve every call", layout, freed / 1e6)
    return layout


def release_plain_weights(model: nn.Module, layers: list[LinearBase | ParallelLMHead]) -> int:
    """Drop the plain copy of each of `layers`' weights whose packed copy serves calls of any
    row count (the kernel's layout without AMX, oneDNN's bfloat16, float32 with AVX-512 BF16),
    so the weights are held once and not twice; a weight another module shares (an LM head
    tied to the embedding) stays. The weight left in its place is a meta tensor, its shape and
    dtype without data: a stray read fails loudly instead of reading garbage. Returns the bytes
    released."""
    refs = Counter(id(p) for _, p in model.named_parameters(remove_duplicate=False))
    freed = 0
    for m in layers:
        if m.packed is None or m.packed.max_rows < sys.maxsize or refs[id(m.weight)] > 1:
            continue
        freed += m.weight.numel() * m.weight.element_size()
        m.weight = nn.Parameter(m.weight.detach().to("meta"), requires_grad=False)
    return freed


def fused_experts(block: SparseMoeBlock) -> Callable[[Tensor], Tensor | None] | None:
    """Where the router's and every expert's weights of `block` are packed in the kernel's
    layout: the block's routed half in one call (`bf16_moe_block`: the router and its choices
    by the block's own ATen ops, then `bf16_moe_experts`: the pairs grouped by expert, a grouped
    matmul for gate/up, SiLU-and-mul, the same for down, on AMX tiles with each group padded to
    their 16 rows, and each token's choices summed) in place of the block's ~25 torch ops from
    Python around one matmul per expert; None elsewhere.

    The choices are the same ops', each row is computed as the expert's own packed matmul
    computes it, and the sums round as the torch ops do, so the outputs are the block's own. A
    batch with more rows than `FUSED_MOE_MAX_ROWS` (or, with AMX, than its tiles take) takes the
    block's per-expert path."""
    kernel = _bf16_kernel()
    if kernel is None or not hasattr(kernel, "bf16_moe_block"):
        return None
    mlps = [block.mlp(i) for i in range(block.num_experts)]
    projections = [block.gate, *(p for e in mlps for p in (e.gate_up_proj, e.down_proj))]
    if block.gate.bias is not None or any(
            p.packed is None or _kernel_for(p.weight, CPU) is None or p.weight.shape[1] % 2
            for p in projections):
        return None
    router = block.gate.packed.weight  # type: ignore[union-attr]
    gate_up = [e.gate_up_proj.packed.weight for e in mlps]  # type: ignore[union-attr]
    down = [e.down_proj.packed.weight for e in mlps]  # type: ignore[union-attr]
    width, hidden = mlps[0].gate_up_proj.output_size, mlps[0].down_proj.output_size
    max_rows = min(FUSED_MOE_MAX_ROWS,
                   *(p.packed.max_rows for p in projections))  # type: ignore[union-attr]
    top_k, norm, amx = block.top_k, block.norm_topk_prob, _has_amx(kernel)

    def run(x: Tensor) -> Tensor | None:
        if x.shape[0] > max_rows:
            return None
        return kernel.bf16_moe_block(x.contiguous(), router, top_k, norm, gate_up, down, width,
                                     hidden, max_rows, amx)
    return run
