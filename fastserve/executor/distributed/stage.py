"""One rank's runner: its pipeline stage's layers, its tensor-parallel shard of each, and the KV
cache (device and host) of its own heads and layers.

It is a `ModelRunner` over a rank-local view of the architecture (the stage's layers, this
rank's heads), so batch preparation, the paged KV cache, swaps and sampling are the single-device
ones. What differs is the forward pass: the first stage embeds, the others receive the residual
stream from the previous stage; the last stage computes logits and its tensor-parallel rank 0
samples, the others send the residual stream on. Tensor parallelism is applied by the loader
(each layer holds its shard) and by pointing the layers' collectives at the stage's group.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from datetime import timedelta
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist

from fastserve.config import EngineConfig
from fastserve.core.kv import host_pool_blocks
from fastserve.core.plan import ExecutorOutput, ScheduledRequest, SchedulerOutput
from fastserve.executor.distributed.comm import (
    TAG_ACTIVATIONS,
    TAG_EXTRAS,
    TAG_TOKENS,
    Groups,
    Pending,
    isend_object,
    isend_tensor,
)
from fastserve.executor.distributed.layout import RankLayout, split_layers
from fastserve.executor.distributed.messages import RankStats, SamplerExtras
from fastserve.executor.logprobs import prompt_logprobs
from fastserve.executor.model_runner import (
    TORCH_DTYPES,
    BatchInputs,
    ModelRunner,
    configured_blocks,
    kv_block_bytes,
    kv_cache_dtype,
)
from fastserve.executor.platform import platform_for
from fastserve.model.arch import ArchConfig
from fastserve.model.layers import ParallelLMHead, RowParallelLinear, VocabParallelEmbedding
from fastserve.model.llama import LlamaForCausalLM
from fastserve.model.loader import load_model
from fastserve.model.lora import LoRAWeights
from fastserve.model.mlp import SparseMoeBlock
from fastserve.request import TokenLogprobs


def ships_extras(plan: SchedulerOutput) -> bool:
    """Whether a sampler rank that is not the driver sends `SamplerExtras` after the batch's
    tokens whatever happens: a request asked for sampled or prompt log-probabilities, or
    verifies drafts (it sends them too for a batch where a row's sampling failed)."""
    return any(s.params.logprobs is not None or s.params.prompt_logprobs is not None
               or s.num_draft_tokens for s in plan.scheduled)


def rank_arch(arch: ArchConfig, layers: tuple[int, int], tp_size: int) -> ArchConfig:
    """The architecture as one rank sees it: its stage's layers and its share of the heads.

    NOTE: with fewer KV heads than ranks each rank holds one (replicated) KV head, as
    `QKVParallelLinear` does.
    """
    return dataclasses.replace(
        arch,
        num_hidden_layers=layers[1] - layers[0],
        num_attention_heads=arch.num_attention_heads // tp_size,
        num_key_value_heads=max(1, arch.num_key_value_heads // tp_size),
    )


def check_parallel(arch: ArchConfig, tp_size: int, pp_size: int) -> None:
    """Clear errors for a model that cannot be split this way."""
    for name, value in (
        ("num_attention_heads", arch.num_attention_heads),
        ("intermediate_size", arch.intermediate_size),
        ("moe_intermediate_size", arch.moe_intermediate_size),
    ):
        if value % tp_size:
            raise ValueError(f"tensor_parallel_size={tp_size} must divide the model's {name} ({value})")
    kv = arch.num_key_value_heads
    if kv % tp_size and tp_size % kv:
        raise ValueError(
            f"tensor_parallel_size={tp_size} must divide, or be a multiple of, the model's "
            f"num_key_value_heads ({kv})"
        )
    split_layers(arch.num_hidden_layers, pp_size)


@dataclass(frozen=True)
class PoolSizes:
    """KV pool sizes every rank agrees on (the driver's KV manager hands out these block ids)."""

    num_device_blocks: int
    num_host_blocks: int
    block_bytes: int  # one block's bytes on the rank holding the most (what a swap costs)


def pool_sizes(config: EngineConfig, arch: ArchConfig) -> PoolSizes:
    """Sized for the rank with the largest share (`kv_cache_gib` and `swap_space_gib` are per
    device); every rank computes the same numbers from the same config."""
    p = config.parallel
    cache = config.cache
    device = torch.device(config.model.device)
    dtype = kv_cache_dtype(cache.kv_cache_dtype, TORCH_DTYPES[config.model.dtype], device)
    block_bytes = max(
        kv_block_bytes(rank_arch(arch, layers, p.tensor_parallel_size), cache.block_size, dtype)
        for layers in split_layers(arch.num_hidden_layers, p.pipeline_parallel_size)
    )
    num_device = configured_blocks(cache, block_bytes)
    return PoolSizes(num_device, host_pool_blocks(cache, block_bytes), block_bytes)


def rank_device(device: str, local_rank: int) -> str:
    """CUDA ranks use one GPU each, counted from the configured one; CPU ranks share the CPU."""
    return platform_for(device).rank_device(device, local_rank)


class _StageAttention:
    """The paged attention of a stage, indexed by the model's global layer numbers."""

    def __init__(self, runner: ModelRunner, first_layer: int) -> None:
        self.attn = runner.attn
        self.first_layer = first_layer

    def forward(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return self.attn.forward(layer_idx - self.first_layer, q, k, v)


def _all_reduce(x: torch.Tensor, group: dist.ProcessGroup) -> None:
    dist.all_reduce(x, group=group)


def _all_gather(x: torch.Tensor, group: dist.ProcessGroup) -> list[torch.Tensor]:
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x.contiguous(), group=group)
    return parts


def bind_tp_group(model: LlamaForCausalLM, group: dist.ProcessGroup) -> None:
    """Point the layers' collectives at the stage's tensor-parallel group (they default to the
    default group, which spans every stage under pipeline parallelism)."""
    for m in model.modules():
        if isinstance(m, ParallelLMHead):
            m.all_gather = partial(_all_gather, group=group)
        elif isinstance(m, (RowParallelLinear, VocabParallelEmbedding, SparseMoeBlock)):
            m.all_reduce = partial(_all_reduce, group=group)


class StageRunner(ModelRunner):
    """This rank's share of each iteration; see the module docstring. `ModelRunner.execute`
    runs it, through the hooks below."""

    can_capture_graphs = False  # collectives and point-to-point sends run mid-iteration

    def __init__(
        self,
        layout: RankLayout,
        model: LlamaForCausalLM,
        arch: ArchConfig,
        config: EngineConfig,
        device: str,
        eos_token_ids: list[int],
        groups: Groups,
    ) -> None:
        sizes = pool_sizes(config, arch)
        cache = dataclasses.replace(
            config.cache, num_device_blocks=sizes.num_device_blocks, num_host_blocks=sizes.num_host_blocks
        )
        model_config = dataclasses.replace(config.model, device=device)
        super().__init__(model, rank_arch(arch, layout.layers, layout.tp_size), model_config,
                         cache, eos_token_ids)
        assert self.num_blocks == sizes.num_device_blocks
        self.full_arch = arch
        self.layout = layout
        self.is_sampler = layout.is_sampler
        self.groups = groups
        self.timeout_s = config.parallel.worker_timeout_s
        self._stage_attn = _StageAttention(self, layout.layers[0])
        self._sending = Pending()  # the last activations (or tokens) sent on
        self._stats = _Stats()
        # Between the steps of one `execute`: the posted receive, the stream to send on.
        self._incoming: tuple[dist.Work, torch.Tensor] | None = None
        self._outgoing: torch.Tensor | None = None
        self._ships_extras = False  # the batch's sampler sends `SamplerExtras` (`ships_extras`)
        # This rank's shards of the LoRA adapters served (`load_stage`); None: LoRA is off.
        self.lora: LoRAWeights | None = None
        self._compute_start = 0.0

    def _receive(self, plan: SchedulerOutput) -> None:
        """Post the receive of this batch's residual stream first: its swaps are queued while
        the activations travel."""
        self._incoming = None
        self._ships_extras = ships_extras(plan)
        num_tokens = sum(len(s.token_ids) for s in plan.scheduled)
        if num_tokens and not self.layout.is_first_stage:
            buf = torch.empty(2, num_tokens, self.full_arch.hidden_size, dtype=self.dtype, device=self.device)
            work = dist.irecv(buf, self.layout.prev_rank, tag=TAG_ACTIVATIONS)
            assert work is not None
            self._incoming = (work, buf)

    def _forward(self, batch: BatchInputs, reqs: list[ScheduledRequest]
                 ) -> tuple[torch.Tensor | None, dict[str, tuple[int, list[TokenLogprobs]]]]:
        """This stage's layers: from the embeddings (first stage) or the previous stage's
        residual stream; logits and prompt log-probabilities on the last stage, else the
        stream is kept for `_emit`."""
        if self._incoming is not None:
            self._incoming[0].wait(timedelta(seconds=self.timeout_s))
        self._compute_start = time.perf_counter()
        stage = self.model.model
        x: torch.Tensor
        residual: torch.Tensor | None
        if self._incoming is None:
            assert stage.embed_tokens is not None
            x, residual = stage.embed_tokens(batch.input_ids), None  # [num_tokens, hidden]
        else:
            x, residual = self._incoming[1][0], self._incoming[1][1]  # the previous stage's [2, num_tokens, hidden]
        self._incoming = None
        with self._batch_set(batch, reqs):
            x, residual = stage.forward_layers(x, residual, batch.positions, self._stage_attn)
        if not self.layout.is_last_stage:
            self._outgoing = torch.stack((x, residual))
            return None, {}
        assert stage.norm is not None
        hidden, _ = stage.norm(x, residual)
        # NOTE: every rank of the stage scores the same prompt rows (the lm head gathers).
        return (self.model.compute_logits(hidden[batch.logits_idx]),  # [num_rows, vocab]
                prompt_logprobs(hidden, reqs, self.model.compute_logits))

    def _pending_tokens(self, request_ids: list[str]) -> torch.Tensor:
        """Async scheduling (one stage): the sampling rank looks its draws up and broadcasts
        them to its tensor-parallel peers, which feed the same tokens."""
        if self.layout.pp_size > 1:
            raise RuntimeError("pending tokens under pipeline parallelism: its batches in "
                               "flight are never scheduled ahead")
        if self.is_sampler:
            values = super()._pending_tokens(request_ids)
        else:
            values = torch.empty(len(request_ids), dtype=torch.long, device=self.device)
        if self.groups.tp is not None:
            dist.broadcast(values, src=self.layout.sampler_rank, group=self.groups.tp)
        return values

    def _emit(self, out: ExecutorOutput) -> None:
        lay = self.layout
        self._stats.add(self._compute_start, time.perf_counter())
        if not lay.is_last_stage:
            assert self._outgoing is not None
            self._send(self._outgoing, lay.next_rank, TAG_ACTIVATIONS)
            self._outgoing = None
        elif lay.is_sampler and not lay.is_driver:
            # NOTE: a sampler rank that is not the driver sends the tokens (FAILED_TOKEN stands
            # for a failed row's error) and a flag, then, where the flag says so, the rest:
            # when the plan asked for any, or a row failed (why, the driver cannot know).
            ships = self._ships_extras or bool(out.failed)
            tokens = torch.tensor([*out.sampled_token_ids, int(ships)], dtype=torch.long,
                                  device=self.device)
            self._send(tokens, 0, TAG_TOKENS)
            if ships:
                self._sending.add(isend_object(SamplerExtras.of(out), 0, self.groups.ctrl,
                                               TAG_EXTRAS))

    def stats(self, reset: bool = False) -> RankStats:
        s = self._stats
        out = RankStats(self.layout.rank, self.layout.stage, s.num_batches, s.busy_s,
                        s.last_end_s - s.first_start_s if s.num_batches else 0.0)
        if reset:
            self._stats = _Stats()
        return out

    def close(self) -> None:
        self.swapper.close()

    def _send(self, t: torch.Tensor, dst: int, tag: int) -> None:
        # One send in flight per peer: the previous one has landed once the peer took this
        # batch's predecessor, which bounds the buffers held.
        self._sending.wait(self.timeout_s)
        self._sending = isend_tensor(t, dst, tag)


@dataclass
class _Stats:
    num_batches: int = 0
    busy_s: float = 0.0
    first_start_s: float = 0.0
    last_end_s: float = 0.0

    def add(self, start_s: float, end_s: float) -> None:
        if self.num_batches == 0:
            self.first_start_s = start_s
        self.num_batches += 1
        self.busy_s += end_s - start_s
        self.last_end_s = end_s


def load_stage(
    config: EngineConfig,
    model_path: Path,
    layout: RankLayout,
    local_rank: int,
    eos_token_ids: list[int],
    groups: Groups,
) -> StageRunner:
    """Load this rank's shard of the checkpoint and build its runner."""
    device = rank_device(config.model.device, local_rank)
    platform_for(device).make_current(device)
    model, arch = load_model(model_path, TORCH_DTYPES[config.model.dtype], device,
                             tp_rank=layout.tp_rank, tp_size=layout.tp_size, layers=layout.layers,
                             load_format=config.model.load_format)
    if groups.tp is not None:
        bind_tp_group(model, groups.tp)
    lora = None
    if config.lora.is_enabled:  # NOTE: before the runner, which then captures no graphs
        lora = LoRAWeights(model, arch, config.lora.max_loras + 1)
        model.lora_batch = lora.batch
    stage = StageRunner(layout, model, arch, config, device, eos_token_ids, groups)
    stage.lora = lora
    return stage
