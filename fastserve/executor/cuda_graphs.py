"""Decode iterations replayed from CUDA graphs (as nano-vllm and vLLM do).

A decode iteration launches a few kernels per layer for a handful of rows: on a GPU its time
goes to launching them. At start-up the runner captures the whole decode forward pass (model
and LM head) once per batch size in `capture_sizes`, over static input buffers (token ids,
positions, and the backend's metadata buffers: `PagedAttention.graph_metadata`). An iteration
whose requests are all decodes is padded to the next captured size: its inputs are written to
pinned host buffers, copied into the static ones, and the graph is replayed; the padding rows
store no K/V and their logits are dropped. Anything else (a prefill, a batch larger than the
largest captured size) runs eagerly, as does everything under `enforce_eager`.
"""

from __future__ import annotations

import bisect
import logging

import torch

from fastserve.core.plan import ScheduledRequest
from fastserve.executor.attention import PagedAttention
from fastserve.executor.platform import platform_for
from fastserve.executor.token_feed import TokenFeed
from fastserve.model.llama import LlamaForCausalLM

logger = logging.getLogger(__name__)


def capture_sizes(max_batch_size: int) -> list[int]:
    """The batch sizes captured: 1, 2, 4, 8, then every multiple of 16, and the maximum
    itself, so a batch is padded by less than 16 rows (at most doubled below 16)."""
    sizes = [s for s in (1, 2, 4, 8) if s <= max_batch_size]
    sizes += range(16, max_batch_size + 1, 16)
    if sizes[-1] != max_batch_size:
        sizes.append(max_batch_size)
    return sizes


def graph_batch_size(reqs: list[ScheduledRequest], sizes: list[int],
                     max_blocks_per_seq: int) -> int | None:
    """The captured size this iteration replays at, or None to run it eagerly: only a batch
    of decodes fits a decode graph, and only one whose block tables fit its static table."""
    if not reqs or any(r.is_prefill for r in reqs):
        return None
    if any(len(r.block_ids) > max_blocks_per_seq for r in reqs):
        return None
    i = bisect.bisect_left(sizes, len(reqs))
    return sizes[i] if i < len(sizes) else None


class DecodeGraphs:
    """The captured decode graphs of one runner and their static inputs."""

    def __init__(self, model: LlamaForCausalLM, attn: PagedAttention, max_batch_size: int,
                 max_blocks_per_seq: int) -> None:
        assert attn.supports_cuda_graphs and platform_for(attn.device).captures_graphs
        self.model = model
        self.attn = attn
        self.sizes = capture_sizes(max_batch_size)
        self.max_blocks_per_seq = max_blocks_per_seq
        top = self.sizes[-1]
        dev = attn.device
        attn.init_cuda_graphs(top, max_blocks_per_seq)
        # [2, top]: token ids, positions; one buffer, so one replay's inputs are one copy.
        self.ids_positions = torch.zeros((2, top), dtype=torch.long, device=dev)
        self.input_ids, self.positions = self.ids_positions[0], self.ids_positions[1]
        # NOTE: rewritten each replay, once the previous replay's copies out of it have
        # landed (`_staged`).
        self.host = torch.zeros((2, top), dtype=torch.long, pin_memory=True)
        self._staged: torch.cuda.Event | None = None
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._capture()

    def batch_size_for(self, reqs: list[ScheduledRequest]) -> int | None:
        return graph_batch_size(reqs, self.sizes, self.max_blocks_per_seq)

    def _forward(self, batch_size: int) -> torch.Tensor:
        self.attn.metadata = self.attn.graph_metadata(batch_size)
        try:
            hidden = self.model(self.input_ids[:batch_size], self.positions[:batch_size],
                                self.attn)  # [batch_size, hidden]
            return self.model.compute_logits(hidden)  # [batch_size, vocab]
        finally:
            self.attn.metadata = None

    @torch.inference_mode()
    def _capture(self) -> None:
        pool = None
        # Largest first: the smaller graphs fit in the memory pool the largest one made.
        for bs in reversed(self.sizes):
            self._forward(bs)  # eager warm-up: compiles the kernels, sizes the allocator
            torch.cuda.synchronize(self.attn.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                logits = self._forward(bs)
            pool = graph.pool()
            self.graphs[bs] = (graph, logits)
        torch.cuda.synchronize(self.attn.device)
        logger.info("captured decode CUDA graphs for batch sizes %s", self.sizes)

    def replay(self, reqs: list[ScheduledRequest], input_ids: list[int], positions: list[int],
               slots: list[int], batch_size: int, feed: TokenFeed | None = None) -> torch.Tensor:
        """Logits [len(reqs), vocab] of a decode batch padded to `batch_size`; `feed`: inputs
        the previous launch drew on the device."""
        n = len(reqs)
        if self._staged is not None:
            # NOTE: async scheduling launches before the previous replay is read back: its
            # copies out of the pinned staging buffers must have landed before they change.
            self._staged.synchronize()
        self.host[:, :n] = torch.tensor([input_ids, positions])
        self.ids_positions[:, :n].copy_(self.host[:, :n], non_blocking=True)
        self.attn.fill_graph_metadata(reqs, slots, batch_size)
        self._staged = torch.cuda.Event()
        self._staged.record()
        if feed is not None:
            feed.write(self.input_ids)
        graph, logits = self.graphs[batch_size]
        graph.replay()
        return logits[:n]
