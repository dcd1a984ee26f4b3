"""The CPU backend: the C++ paged kernels of `executor/cpu_kernels.py`.

The cache is float32, bfloat16 or float16 (`CPU_CACHE_DTYPES`); queries and the kernels' math
are float32 (half-precision K/V rows are widened as they are read).

One kernel call per layer for all decodes (`decode_attention`), and one per prefill chunk after
cached tokens (`extend_attention`); both follow the block tables themselves, so nothing is
gathered. A short chunk after cached tokens (speculative decoding's drafts) joins the decode
call, a row per token. A prefill from position 0 attends over its fresh K/V with SDPA, as the portable
backend does, except in a bfloat16 model with a bfloat16 cache where the kernels have
AVX-512 BF16: there `extend_attention`'s bfloat16 scores beat SDPA at every length on 2 Zen 4
cores (0.5x its time at 128-512 tokens, 0.8x at 2000-4000), and it reads the same values back
from the cache, rounding as a prefix-cache hit's rows do. On an AMX CPU torch's bfloat16 SDPA
is faster from 64 tokens up, and `extend_attention_amx` (cpu_attention_amx.cpp: both products
on the tiles) faster than both up to 1024 tokens and after cached ones (AMX_MIN_QUERIES); it
is opt-in (AMX_PREFILL_ENV: see there why), and then takes fresh prompts up to 1024 tokens and
chunks of 32 or more after cached tokens, longer fresh prompts going to SDPA.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch
import torch.nn.functional as F

from fastserve.core.plan import ScheduledRequest
from fastserve.executor.attention import AttentionMetadata, PagedAttention
from fastserve.executor.cpu_kernels import cpu_isa, decode_attention_kernel
from fastserve.executor.cpu_linear import fused_experts, pack_weights
from fastserve.executor.cpu_memory import huge_page_zeros
from fastserve.model.layers import ApplyRotary, FusedNorm, RMSNorm, SiluAndMul
from fastserve.model.mlp import SparseMoeBlock


@dataclass(frozen=True)
class DecodeBatch:
    """All decoding requests of an iteration, for the one-call decode kernel."""

    token_idx: torch.Tensor  # [num_decodes] long: their rows in the flattened batch
    block_table: torch.Tensor  # [num_decodes, max_blocks] int32
    ctx_lens: torch.Tensor  # [num_decodes] int32


@dataclass(frozen=True)
class PrefillSlice:
    """One prefill (or chunk of one) in the flattened batch."""

    q_start: int
    q_len: int
    start_pos: int  # cached tokens before it: > 0 reads them through `block_table`
    # [num_blocks] int32 when start_pos > 0 or fresh prefills read the cache too; else SDPA
    block_table: torch.Tensor | None


@dataclass(frozen=True)
class CpuMetadata(AttentionMetadata):
    decodes: DecodeBatch | None
    prefills: list[PrefillSlice]


def _fused_norm(kernel: ModuleType) -> FusedNorm:
    def norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
             eps: float) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        outs = kernel.rms_norm(x, residual, weight, eps)
        return outs[0] if residual is None else (outs[0], outs[1])
    return norm


# A chunk of at most this many tokens after cached ones runs as decode rows, one per token
# (`build_metadata`), while its context is at most this long: the decode call then takes a
# batch of speculative decoding's verifications at once instead of a call per request per
# layer, at the cost of reading the context once per row. benchmarks/cpu/verify_attention.py
# (small, float32, 1 + 5 tokens per request, 2-core AVX2 EPYC): at contexts 128 and 512 a
# verification iteration took 0.89-0.94x the per-request calls' time at batch 8 and
# 0.85-0.94x at batch 32 (the same at batch 1); at 2000, 1.10-1.14x (batches 1 and 8).
MAX_QUERY_ROWS = 16
MAX_QUERY_ROWS_CONTEXT = 1024

# Where the CPU has AMX (bfloat16 model and cache), a prefill chunk's attention runs on the
# tiles (`extend_attention_amx`) from this many queries up, except fresh prompts past
# AMX_MAX_FRESH tokens, where torch's SDPA (its flash attention on the tiles, keeping its
# scores in cache) is faster. On 2 Sapphire Rapids cores, 12 heads of 64: fresh 128 / 512 /
# 1024 / 2048 tokens 0.17 / 1.41 / 5.6 / 21.1 ms against SDPA's 0.21 / 2.0 / 6.2 / 18.8 and
# `extend_attention`'s 0.46 / 4.6 / 19.6 / 67.6; after cached tokens, 256 after 1024: 3.6
# against 8.2 ms, 1024 after 3072: 34 against 94, 50 after 1900: 2.7 against 2.8, 16 after
# 1000: 0.77 against 0.71.
# NOTE: opt-in (`FASTSERVE_CPU_AMX_PREFILL=1`). The tiles round P to bfloat16, which the decode
# kernel does not: a prompt's last row then differs between a fresh prefill (here) and a
# prefix-cache hit (its last token a decode row), and greedy tokens can flip at near-ties: the
# same prompt twice would not answer alike. The default keeps every path on the kernels'
# shared arithmetic (`extend_attention`, as the decode kernel's).
AMX_MIN_QUERIES = 32
AMX_MAX_FRESH = 1024
AMX_PREFILL_ENV = "FASTSERVE_CPU_AMX_PREFILL"

# The cache dtypes the C++ kernels read.
CPU_CACHE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class CpuAttention(PagedAttention):
    """The C++ kernels; see the module docstring."""

    name = "cpu"

    @classmethod
    def is_supported(cls, device: torch.device, cache_dtype: torch.dtype) -> bool:
        return (device.type == "cpu" and cache_dtype in CPU_CACHE_DTYPES
                and decode_attention_kernel() is not None)

    @staticmethod
    def new_cache(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """In transparent huge pages where Linux grants them (`cpu_memory`): a decode step's
        reads of scattered blocks then miss no TLB entry per block."""
        return huge_page_zeros(shape, dtype)

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, num_blocks: int,
                 block_size: int, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__(num_layers, num_kv_heads, head_dim, num_blocks, block_size, dtype, device)
        kernel = decode_attention_kernel()
        if kernel is None or dtype not in CPU_CACHE_DTYPES:
            raise ValueError("the cpu attention backend needs its C++ kernels and a float32, "
                             "bfloat16 or float16 cache")
        self.kernel: ModuleType = kernel
        self._info: dict[str, str] = {}  # set by prepare_model (see describe)
        # Fresh prefills through extend_attention too (module docstring); set by prepare_model.
        self._is_prefill_through_cache = False
        # Prefill chunks on AMX tiles (AMX_MIN_QUERIES); set by prepare_model.
        self._is_amx_attention = False

    def prepare_model(self, model: torch.nn.Module) -> None:
        """Weights packed once for this CPU's fastest matmul (`cpu_linear`), and the small
        layers as one C++ call each where they round as the tensor ops do: add + RMSNorm in
        half types (bit for bit in bfloat16, up to a rare last place in float16); SiLU-and-mul
        and rotary in bfloat16 where the kernels have AVX-512 BF16 (bit for bit; elsewhere
        torch's), and rotary in float32 (bit for bit: it sums nothing). A float32 model keeps
        torch's norm and SiLU: a different sum order or exp there moves the last place, which
        could flip a greedy near-tie against HF."""
        dtype = next(model.parameters()).dtype
        is_bf16 = dtype == self.kv_cache.dtype == torch.bfloat16
        self._is_amx_attention = (is_bf16 and self.head_dim % 32 == 0
                                  and os.environ.get(AMX_PREFILL_ENV) == "1"
                                  and hasattr(self.kernel, "extend_attention_amx")
                                  and bool(self.kernel.amx_ready()))
        self._is_prefill_through_cache = self._is_amx_attention or (
            is_bf16 and self.kernel.isa() == "avx512_bf16")
        weights = pack_weights(model)
        fused: dict[type[torch.nn.Module], Callable[..., Any]] = {}
        if dtype in (torch.bfloat16, torch.float16):
            fused[RMSNorm] = _fused_norm(self.kernel)
        if dtype == torch.bfloat16 and hasattr(self.kernel, "rotary"):
            fused[SiluAndMul] = self.kernel.silu_and_mul
            fused[ApplyRotary] = self.kernel.rotary
        if dtype == torch.float32 and hasattr(self.kernel, "rotary_f32"):
            fused[ApplyRotary] = self.kernel.rotary_f32  # products and sums alone: bit for bit
        for m in model.modules():
            if type(m) in fused:
                m.fused = fused[type(m)]  # type: ignore[assignment]
        fused_names = {c.__name__ for c in fused}
        blocks = [m for m in model.modules() if isinstance(m, SparseMoeBlock)]
        for block in blocks:
            block.fused = fused_experts(block)
        if blocks and all(b.fused is not None for b in blocks):
            fused_names.add(SparseMoeBlock.__name__)
        self._info = {"cpu_isa": cpu_isa(), "kernels": self.kernel.isa(),
                      "weights": weights,
                      "fused_layers": ",".join(sorted(fused_names)) or "none",
                      "prefill_attention": ("amx" if self._is_amx_attention else "kernel"
                                            if self._is_prefill_through_cache else "sdpa")}

    def describe(self) -> dict[str, str]:
        """The CPU's best instruction set, the kernels' vector path, the weights' layout
        (`cpu_linear.pack_weights`'s name for it), which layers run as one C++ call, and
        whether fresh prefills' attention is the kernel's or SDPA's."""
        return dict(self._info)

    def build_metadata(self, reqs: list[ScheduledRequest], slot_mapping: torch.Tensor) -> CpuMetadata:
        bs = self.block_size
        idx: list[int] = []
        tables: list[list[int]] = []
        lens: list[int] = []
        prefills: list[PrefillSlice] = []
        q_start = 0
        for r in reqs:
            n = len(r.token_ids)
            if r.is_prefill and r.start_pos > 0 and n <= MAX_QUERY_ROWS \
                    and r.num_context_tokens <= MAX_QUERY_ROWS_CONTEXT:
                # A few tokens after cached ones (drafts being verified, a short last chunk):
                # each is a decode at its own length, in the one decode call.
                live = r.block_ids[: -(-r.num_context_tokens // bs)]
                for j in range(n):
                    idx.append(q_start + j)
                    tables.append(live)
                    lens.append(r.start_pos + j + 1)
            elif r.is_prefill:
                live = r.block_ids[: -(-r.num_context_tokens // bs)]
                through_cache = r.start_pos > 0 or self._is_prefill_through_cache
                table = torch.tensor(live, dtype=torch.int32) if through_cache else None
                prefills.append(PrefillSlice(q_start, n, r.start_pos, table))
            else:
                idx.append(q_start)
                tables.append(r.block_ids)
                lens.append(r.num_context_tokens)
            q_start += n
        decodes = None
        if idx:
            width = max(len(t) for t in tables)
            decodes = DecodeBatch(
                token_idx=torch.tensor(idx, dtype=torch.long),
                block_table=torch.tensor([t + [0] * (width - len(t)) for t in tables],
                                         dtype=torch.int32),
                ctx_lens=torch.tensor(lens, dtype=torch.int32),
            )
        return CpuMetadata(slot_mapping=slot_mapping, decodes=decodes, prefills=prefills)

    def forward(
        self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        # q: [num_tokens, num_heads, head_dim]; k, v: [num_tokens, num_kv_heads, head_dim]
        md = self.metadata
        assert isinstance(md, CpuMetadata), "attention metadata must be set before the forward pass"
        k_cache, v_cache = self.k_caches[layer_idx], self.v_caches[layer_idx]
        self.kernel.store_kv(k, v, k_cache, v_cache, md.slot_mapping)
        dec = md.decodes
        if dec is not None and not md.prefills and dec.token_idx.shape[0] == q.shape[0]:
            # Decodes only: the kernel's output is the whole batch's.
            return self._decode(q.float(), k_cache, v_cache, dec).to(q.dtype)
        if dec is None and len(md.prefills) == 1:
            return self._prefill(md.prefills[0], q, k, v, k_cache, v_cache)
        out = torch.empty(q.shape, dtype=q.dtype)  # [num_tokens, num_heads, head_dim]
        if dec is not None:
            qd = q.index_select(0, dec.token_idx).float()  # [num_decodes, num_heads, head_dim]
            out.index_copy_(0, dec.token_idx, self._decode(qd, k_cache, v_cache, dec).to(q.dtype))
        for p in md.prefills:
            sl = slice(p.q_start, p.q_start + p.q_len)
            out[sl] = self._prefill(p, q[sl], k[sl], v[sl], k_cache, v_cache)
        return out

    def _decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                dec: DecodeBatch) -> torch.Tensor:
        return self.kernel.decode_attention(  # type: ignore[no-any-return]
            q, k_cache, v_cache, dec.block_table, dec.ctx_lens, self.block_size, self.scale
        )

    def _prefill(self, p: PrefillSlice, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        """q: [q_len, num_heads, head_dim] -> the same shape."""
        fresh = p.start_pos == 0
        if self._is_amx_attention and p.block_table is not None and p.q_len >= AMX_MIN_QUERIES \
                and (not fresh or p.q_len <= AMX_MAX_FRESH):
            return self.kernel.extend_attention_amx(  # type: ignore[no-any-return]
                q, k_cache, v_cache, p.block_table, p.start_pos, self.block_size, self.scale)
        if p.block_table is not None and not (fresh and self._is_amx_attention):
            # Block by block through the table: no gathered context, no [q_len, ctx_len] mask.
            return self.kernel.extend_attention(  # type: ignore[no-any-return]
                q.float(), k_cache, v_cache, p.block_table, p.start_pos, self.block_size,
                self.scale,
            ).to(q.dtype)
        o = F.scaled_dot_product_attention(
            q.transpose(0, 1).unsqueeze(0),
            k.transpose(0, 1).unsqueeze(0),
            v.transpose(0, 1).unsqueeze(0),
            is_causal=True,
            enable_gqa=q.shape[1] != k.shape[1],
        )  # [1, num_heads, q_len, head_dim]
        return o[0].transpose(0, 1)
