"""The CUDA backend: Triton kernels (`triton_ops` for attention, `triton_layers` for the small
layers), a fixed number of launches per layer.

Per layer: one KV store for every new token, one paged decode (split-KV, plus its merge) for
all decodes, one varlen paged prefill for all prefills and chunks. An iteration of decodes only
(every CUDA graph's) rotates q and k and stores each new token inside the decode launch
instead: one launch a layer for attention. Metadata is built on the host in pinned memory and
copied once per iteration; nothing in `forward` syncs with the host, so a decode iteration can
be captured as a CUDA graph over the static buffers of `init_cuda_graphs` and replayed at any
batch size up to the captured one (padding rows store nothing and read slot 0 of block 0).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fastserve.core.plan import ScheduledRequest
from fastserve.executor.attention import AttentionMetadata, PagedAttention
from fastserve.executor.backends import triton_layers as layers
from fastserve.executor.backends import triton_ops as ops
from fastserve.model.layers import ApplyRotary, RMSNorm, SiluAndMul


@dataclass(frozen=True)
class DecodeMeta:
    q_rows: torch.Tensor  # [num_decodes] long: the decodes' rows in the flattened batch
    block_table: torch.Tensor  # [num_decodes, >= max blocks] int32
    ctx_lens: torch.Tensor  # [num_decodes] int32, new token included
    num_splits: int  # splits per context (fixed for a captured graph)


@dataclass(frozen=True)
class PrefillMeta:
    q_starts: torch.Tensor  # [num_prefills] long: first row of each in the flattened batch
    q_lens: torch.Tensor  # [num_prefills] int32
    ctx_lens: torch.Tensor  # [num_prefills] int32: cached tokens before it + q_len
    block_table: torch.Tensor  # [num_prefills, max blocks] int32
    max_q_len: int  # sizes the grid


@dataclass(frozen=True)
class TritonMetadata(AttentionMetadata):
    decode: DecodeMeta | None
    prefill: PrefillMeta | None


@dataclass
class _GraphBuffers:
    """The static inputs a captured decode graph reads; replays overwrite them in place."""

    # [2, max_batch_size] long: row 0 each token's cache slot (-1: a padding row, stores
    # nothing), row 1 each context's length (new token included). One buffer, so one replay's
    # rows go over in one copy.
    slots_lens: torch.Tensor
    q_rows: torch.Tensor  # [max_batch_size] long: 0..n-1 (a decode batch is all decodes)
    block_table: torch.Tensor  # [max_batch_size, max_blocks_per_seq] int32
    # Pinned staging for one replay's inputs. NOTE: rewritten each replay without waiting for
    # the last copy out of it: every iteration reads its sampled tokens back first.
    host_slots_lens: torch.Tensor  # [2, max_batch_size] long
    # [max_batch_size * max_blocks_per_seq] int32: a replay's [batch_size, width] block table,
    # contiguous, so that it goes over in one DMA whatever its width.
    host_tables: torch.Tensor


def _table(rows: list[list[int]]) -> list[list[int]]:
    width = max(len(t) for t in rows)
    return [t + [0] * (width - len(t)) for t in rows]


class TritonAttention(PagedAttention):
    """Triton kernels on a CUDA device; see the module docstring."""

    name = "triton"
    supports_cuda_graphs = True

    @classmethod
    def is_supported(cls, device: torch.device, cache_dtype: torch.dtype) -> bool:
        # On CPU only under Triton's interpreter (TRITON_INTERPRET=1): slow, for tests.
        if cache_dtype not in ops.CACHE_DTYPES:
            return False
        if device.type == "cpu":
            return ops.INTERPRETED
        if device.type != "cuda":
            return False
        # Triton converts float8 E4M3 on sm89+ only.
        return cache_dtype != torch.float8_e4m3fn or torch.cuda.get_device_capability(device) >= (8, 9)

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, num_blocks: int,
                 block_size: int, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__(num_layers, num_kv_heads, head_dim, num_blocks, block_size, dtype, device)
        self.num_sms = (torch.cuda.get_device_properties(device).multi_processor_count
                        if device.type == "cuda" else 1)
        self._graph: _GraphBuffers | None = None
        # The rotary embedding's (cos, sin) a layer's `ApplyRotary` left for its `forward` in
        # an iteration of decodes only (see `_rotary`); None: nothing to rotate.
        self._cos_sin: tuple[torch.Tensor, torch.Tensor] | None = None
        # NOTE: the kernels also run on CPU tensors under Triton's interpreter (the tests);
        # only a real GPU gets pinned staging.
        self.pin_memory = device.type == "cuda"

    def _to_device(self, values: list[int] | list[list[int]], dtype: torch.dtype) -> torch.Tensor:
        host = torch.tensor(values, dtype=dtype, pin_memory=self.pin_memory)
        return host.to(self.device, non_blocking=True)

    def build_metadata(
        self, reqs: list[ScheduledRequest], slot_mapping: torch.Tensor
    ) -> TritonMetadata:
        d_rows: list[int] = []
        d_tables: list[list[int]] = []
        d_lens: list[int] = []
        p_starts: list[int] = []
        p_lens: list[int] = []
        p_ctx: list[int] = []
        p_tables: list[list[int]] = []
        q_start = 0
        for r in reqs:
            n = len(r.token_ids)
            if r.is_prefill:
                p_starts.append(q_start)
                p_lens.append(n)
                p_ctx.append(r.num_context_tokens)
                p_tables.append(r.block_ids)
            else:
                d_rows.append(q_start)
                d_tables.append(r.block_ids)
                d_lens.append(r.num_context_tokens)
            q_start += n
        decode = prefill = None
        if d_rows:
            splits = ops.decode_splits(len(d_rows), self.num_kv_heads, max(d_lens), self.num_sms)
            decode = DecodeMeta(self._to_device(d_rows, torch.long),
                                self._to_device(_table(d_tables), torch.int32),
                                self._to_device(d_lens, torch.int32), splits)
        if p_starts:
            prefill = PrefillMeta(self._to_device(p_starts, torch.long),
                                  self._to_device(p_lens, torch.int32),
                                  self._to_device(p_ctx, torch.int32),
                                  self._to_device(_table(p_tables), torch.int32), max(p_lens))
        return TritonMetadata(slot_mapping=slot_mapping, decode=decode, prefill=prefill)

    def forward(
        self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        # q: [num_tokens, num_heads, head_dim]; k, v: [num_tokens, num_kv_heads, head_dim]
        md = self.metadata
        assert isinstance(md, TritonMetadata), "attention metadata must be set before the forward pass"
        k_cache, v_cache = self.k_caches[layer_idx], self.v_caches[layer_idx]
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        if self._decodes_only():
            # All decodes (a CUDA graph's batch too): the decode launch also rotates q and k
            # and stores each new K/V, two launches a layer fewer.
            d = md.decode
            assert d is not None
            rotary, self._cos_sin = self._cos_sin, None
            ops.paged_decode(q, k_cache, v_cache, d.q_rows, d.block_table, d.ctx_lens,
                             self.block_size, self.scale, d.num_splits, out,
                             new_kv=(k, v, md.slot_mapping), rotary=rotary)
            return out
        ops.store_kv(k, v, k_cache, v_cache, md.slot_mapping)
        if md.decode is not None:
            d = md.decode
            ops.paged_decode(q, k_cache, v_cache, d.q_rows, d.block_table, d.ctx_lens,
                             self.block_size, self.scale, d.num_splits, out)
        if md.prefill is not None:
            p = md.prefill
            ops.paged_prefill(q, k_cache, v_cache, p.q_starts, p.q_lens, p.ctx_lens,
                              p.block_table, p.max_q_len, self.block_size, self.scale, out)
        return out

    def _decodes_only(self) -> bool:
        md = self.metadata
        return isinstance(md, TritonMetadata) and md.prefill is None and md.decode is not None

    def _rotary(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """`ApplyRotary`'s kernel. In an iteration of decodes only the decode launch rotates
        q and the new k itself (`forward` takes cos, sin from here): x goes on as it is."""
        if self._decodes_only():
            self._cos_sin = (cos, sin)
            return x
        return layers.rotary(x, cos, sin)

    def prepare_model(self, model: torch.nn.Module) -> None:
        """Fused add+RMSNorm, SiLU-and-mul and rotary kernels (one launch each instead of
        four to a dozen), with the plain layers' roundings."""
        for m in model.modules():
            if isinstance(m, RMSNorm):
                m.fused = layers.rms_norm
            elif isinstance(m, SiluAndMul):
                m.fused = layers.silu_and_mul
            elif isinstance(m, ApplyRotary):
                m.fused = self._rotary

    # -- CUDA graphs ----------------------------------------------------------------------

    def init_cuda_graphs(self, max_batch_size: int, max_blocks_per_seq: int) -> None:
        dev = self.device
        slots_lens = torch.ones((2, max_batch_size), dtype=torch.long, device=dev)
        slots_lens[0] = -1
        self._graph = _GraphBuffers(
            slots_lens=slots_lens,
            q_rows=torch.arange(max_batch_size, dtype=torch.long, device=dev),
            block_table=torch.zeros((max_batch_size, max_blocks_per_seq), dtype=torch.int32,
                                    device=dev),
            host_slots_lens=torch.zeros((2, max_batch_size), dtype=torch.long,
                                        pin_memory=self.pin_memory),
            host_tables=torch.zeros(max_batch_size * max_blocks_per_seq, dtype=torch.int32,
                                    pin_memory=self.pin_memory),
        )

    def graph_metadata(self, batch_size: int) -> TritonMetadata:
        g = self._graph
        assert g is not None, "init_cuda_graphs first"
        max_ctx = g.block_table.shape[1] * self.block_size
        splits = ops.decode_splits(batch_size, self.num_kv_heads, max_ctx, self.num_sms)
        decode = DecodeMeta(g.q_rows[:batch_size], g.block_table[:batch_size],
                            g.slots_lens[1, :batch_size], splits)
        return TritonMetadata(slot_mapping=g.slots_lens[0, :batch_size], decode=decode,
                              prefill=None)

    def fill_graph_metadata(
        self, reqs: list[ScheduledRequest], slots: list[int], batch_size: int
    ) -> None:
        g = self._graph
        assert g is not None, "init_cuda_graphs first"
        n = len(reqs)
        tables = [r.block_ids for r in reqs]
        width = max(map(len, tables))
        # Padding rows: slot -1 (store nothing), a context of one token in block 0.
        host = g.host_slots_lens[:, :batch_size]
        host[:, :n] = torch.tensor([slots, [r.num_context_tokens for r in reqs]])
        if n < batch_size:
            host[0, n:] = -1
            host[1, n:] = 1
        tables_h = g.host_tables[: batch_size * width].view(batch_size, width)
        tables_h[:n] = torch.tensor(_table(tables), dtype=torch.int32)
        if n < batch_size:
            tables_h[n:] = 0
        g.slots_lens[:, :batch_size].copy_(host, non_blocking=True)
        g.block_table[:batch_size, :width].copy_(tables_h, non_blocking=True)
