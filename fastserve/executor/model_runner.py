"""The real executor: turns a scheduler plan into tensors, runs the model, samples.

Device-specific work lives behind the attention backend the registry picks once
(`fastserve.executor.backends`): its KV cache, its metadata and, where it supports them,
decode iterations replayed from CUDA graphs (`cuda_graphs.py`). `execute` is one sequence of
steps that a pipeline stage (`distributed/stage.py`) reuses, overriding the hooks where a
stage differs (what it receives, how far its forward pass goes, who samples).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from fastserve.config import CacheConfig, ModelConfig
from fastserve.core.kv import host_pool_blocks
from fastserve.core.plan import PENDING_TOKEN, ExecutorOutput, ScheduledRequest, SchedulerOutput
from fastserve.executor import kv_sizing
from fastserve.executor.attention import AttentionMetadata, PagedAttention
from fastserve.executor.backends import TORCH_DTYPES, attention_backend, kv_cache_dtype
from fastserve.executor.cuda_graphs import DecodeGraphs
from fastserve.executor.grammar import StructuredOutputs
from fastserve.executor.logprobs import prompt_logprobs
from fastserve.executor.sampler import FAILED_TOKEN, SampleDraft, Sampler
from fastserve.executor.speculative import PendingVerdicts, check
from fastserve.executor.staging import take_rows, to_device
from fastserve.executor.swap import make_swapper
from fastserve.executor.token_feed import TokenFeed, drawn_tokens
from fastserve.logs import startup_step
from fastserve.model.arch import ArchConfig
from fastserve.model.llama import LlamaForCausalLM
from fastserve.request import TokenLogprobs

__all__ = ["TORCH_DTYPES", "BatchInputs", "ModelRunner", "kv_block_bytes", "kv_cache_dtype"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class FlatBatch:
    """The scheduled requests' new tokens concatenated, as host lists."""

    input_ids: list[int]
    positions: list[int]
    slots: list[int]  # cache slot of each token
    last_token_idx: list[int]  # where each request's last token is
    # The tokens whose logits are computed: each request's last, and every token of a request
    # verifying drafts (`ScheduledRequest.num_draft_tokens`); and each request's first row
    # among them (None: no drafts, one row per request, `last_token_idx`).
    logits_idx: list[int]
    first_rows: list[int] | None = None


@dataclass(frozen=True)
class Undrawn:
    """A launched plan's logits, to be sampled once the previous plan's tokens are back: a
    grammar's request among its rows is fed its newest token from the device, and its mask
    is made on the host after that token (async scheduling, `ModelRunner.draw`)."""

    logits: torch.Tensor  # [num_reqs, vocab]
    reqs: list[ScheduledRequest]  # the rows to draw for
    fed: torch.Tensor | None  # as `Sampler.draw` takes it


@dataclass(frozen=True)
class Launched:
    """A plan queued on the device (`ModelRunner.launch`), its tokens not read back yet."""

    start_s: float
    swap_wait_s: float
    draft: SampleDraft | None  # None: this runner samples nothing for it
    prompt_logprobs: dict[str, tuple[int, list[TokenLogprobs]]]
    is_empty: bool = False  # no batch: only swaps and finished ids
    verified: PendingVerdicts | None = None  # the requests that verified drafts
    undrawn: Undrawn | None = None  # not sampled yet: `draw` does (then `draft` is set)


@dataclass(frozen=True)
class BatchInputs:
    input_ids: torch.Tensor  # [num_tokens] long
    positions: torch.Tensor  # [num_tokens] long
    last_token_idx: torch.Tensor  # [num_reqs] long: where each request's last token is
    metadata: AttentionMetadata
    # [num_rows] long: the tokens whose logits are computed (`FlatBatch.logits_idx`).
    logits_idx: torch.Tensor


def kv_block_bytes(arch: ArchConfig, block_size: int, dtype: torch.dtype, tp_size: int = 1) -> int:
    """Bytes of one KV block across all layers (K and V) on one rank."""
    kv_heads = max(1, arch.num_key_value_heads // tp_size)
    elem = torch.empty((), dtype=dtype).element_size()
    return kv_sizing.kv_block_bytes(arch.num_hidden_layers, kv_heads, arch.head_dim, block_size,
                                    elem)


def configured_blocks(cache: CacheConfig, block_bytes: int) -> int:
    """The pool's blocks as the config gives them: a count, else GiB, else a CPU's default
    (`memory_profile.plan_kv_pool` resolves a GPU's before the runner is built)."""
    gib = kv_sizing.CPU_KV_CACHE_GIB if cache.kv_cache_gib is None else cache.kv_cache_gib
    return cache.num_device_blocks or max(1, int(gib * kv_sizing.GIB) // block_bytes)


def _waits_for_grammar(reqs: list[ScheduledRequest]) -> bool:
    """Whether a request with a grammar samples after a token still on the device: its mask
    follows that token (`ModelRunner.draw`)."""
    return any(r.samples and r.params.structured_output is not None
               and r.token_ids[0] == PENDING_TOKEN for r in reqs)


def _counts_pending(reqs: list[ScheduledRequest]) -> bool:
    """Whether a penalty or a bad word reads a request's newest token that is still on the
    device."""
    return any(r.token_ids[0] == PENDING_TOKEN and r.params.reads_output_tokens for r in reqs)


def flatten(reqs: list[ScheduledRequest], block_size: int) -> FlatBatch:
    bs = block_size
    input_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    last: list[int] = []
    for r in reqs:
        input_ids += r.token_ids
        pos = range(r.start_pos, r.start_pos + len(r.token_ids))
        positions += pos
        table = r.block_ids
        slots += [table[p // bs] * bs + p % bs for p in pos]
        last.append(len(input_ids) - 1)
    if not any(r.num_draft_tokens for r in reqs):
        return FlatBatch(input_ids, positions, slots, last, last)
    logits_idx: list[int] = []
    first_rows: list[int] = []
    for r, end in zip(reqs, last):
        first_rows.append(len(logits_idx))
        logits_idx += range(end - r.num_draft_tokens, end + 1)
    return FlatBatch(input_ids, positions, slots, last, logits_idx, first_rows)


class ModelRunner:
    """Owns the model, the KV tensors and the sampler on one device."""

    # A pipeline stage runs collectives mid-forward and never captures graphs.
    can_capture_graphs = True
    # Whether this runner samples (a pipeline's last stage samples on one rank only).
    is_sampler = True

    def __init__(
        self,
        model: LlamaForCausalLM,
        arch: ArchConfig,
        model_config: ModelConfig,
        cache_config: CacheConfig,
        eos_token_ids: list[int],
    ) -> None:
        self.model = model
        self.arch = arch
        self.dtype = TORCH_DTYPES[model_config.dtype]
        # "auto" (a runner built without the engine, which resolves it): where the weights are
        self.device = next(model.parameters()).device if model_config.device == "auto" \
            else torch.device(model_config.device)
        self.block_size = cache_config.block_size
        self.cache_dtype = kv_cache_dtype(cache_config.kv_cache_dtype, self.dtype, self.device)
        self.block_bytes = kv_block_bytes(arch, self.block_size, self.cache_dtype)
        self.num_blocks = configured_blocks(cache_config, self.block_bytes)
        backend = attention_backend(model_config.attention_backend, self.device, self.cache_dtype)
        self.attn: PagedAttention = backend(
            num_layers=arch.num_hidden_layers,
            num_kv_heads=arch.num_key_value_heads,
            head_dim=arch.head_dim,
            num_blocks=self.num_blocks,
            block_size=self.block_size,
            dtype=self.cache_dtype,
            device=self.device,
        )
        self.attn.prepare_model(model)  # e.g. packed CPU weights, fused CUDA kernels
        self.sampler = Sampler(eos_token_ids, model_config.seed, self.device)
        # KV copies to/from host memory, beside the compute (this rank's shards only).
        self.num_host_blocks = host_pool_blocks(cache_config, self.block_bytes)
        self.swapper = make_swapper(self.attn, self.num_host_blocks,
                                    cache_config.cpu_copy_worker)
        self.graphs: DecodeGraphs | None = None
        # NOTE: not with LoRA adapters: which rows take which adapter changes every batch; not
        # with MoE experts, whose grouping reads token counts on the host (`mlp.SparseMoeBlock`).
        if self.attn.supports_cuda_graphs and self.can_capture_graphs and not model_config.enforce_eager \
                and model.lora_batch is None and not arch.num_experts:
            max_len = model_config.max_model_len or arch.max_position_embeddings
            with startup_step(logger, "capturing the decode CUDA graphs"):
                self.graphs = DecodeGraphs(model, self.attn,
                                           model_config.cuda_graph_max_batch_size,
                                           max_blocks_per_seq=-(-max_len // self.block_size))
        self._last_draft: SampleDraft | None = None  # the latest launch's tokens
        self._last_finish_s = 0.0
        # What runs, as chosen at start-up (logged; /metrics shows it as fastserve_executor_info).
        self.info: dict[str, str] = {
            "device": self.device.type, "dtype": model_config.dtype,
            "kv_cache_dtype": str(self.cache_dtype).removeprefix("torch."),
            "attention_backend": self.attn.name, **self.attn.describe()}
        logger.info("executor: %s", ", ".join(f"{k}={v}" for k, v in self.info.items()))

    def execute(self, plan: SchedulerOutput) -> ExecutorOutput:
        return self.finish(self.draw(self.launch(plan)))

    # -- what the engine asks besides plans (`fastserve.engine.builder.EngineExecutor`) ------

    @property
    def copies_overlap_compute(self) -> bool | None:
        """Whether KV copies to and from host memory run beside the compute."""
        return self.swapper.overlaps_compute

    def use_grammars(self, grammars: StructuredOutputs) -> None:
        """Mask structured requests' tokens with `grammars` (the engine's)."""
        self.sampler.grammars = grammars

    def check_health(self) -> None:
        """Nothing to check: the model runs in this process."""

    def shutdown(self) -> None:
        """Nothing to stop: the model and the KV pool go with the runner."""

    @torch.inference_mode()
    def launch(self, plan: SchedulerOutput) -> Launched:
        """Queue the plan's work on the device (on a CPU: run it); `finish` reads the tokens
        back. A decode fed PENDING_TOKEN takes the token the previous launch drew for it; if
        it has a grammar, sampling waits for `draw`."""
        start = time.perf_counter()
        self.sampler.drop(plan.finished_ids)
        self._receive(plan)
        self.swapper.submit(plan.swap_out, plan.swap_in)
        if plan.is_empty:
            return Launched(start, 0.0, None, {}, is_empty=True)
        flat = flatten(plan.scheduled, self.block_size)
        feed = self._feed(plan.scheduled, flat)
        graph_size = self.graphs.batch_size_for(plan.scheduled) if self.graphs else None
        batch = None if graph_size is not None else self._prepare(plan.scheduled, flat)
        # Only the copies into or out of this batch's blocks hold it up; the rest overlap.
        swap_wait_s = self.swapper.wait_for(s.block_ids for s in plan.scheduled)
        if plan.copies:  # NOTE: once the copies out of their destinations are done
            self.attn.copy_blocks(plan.copies)
        prompt_lps: dict[str, tuple[int, list[TokenLogprobs]]] = {}
        fed = None  # [num_reqs]: each row's last input, where sampling reads a pending one
        if batch is None:
            assert self.graphs is not None and graph_size is not None
            logits: torch.Tensor | None = self.graphs.replay(
                plan.scheduled, flat.input_ids, flat.positions, flat.slots, graph_size, feed)
            if feed is not None and _counts_pending(plan.scheduled):
                fed = self.graphs.input_ids[: len(plan.scheduled)]
        else:
            if feed is not None:
                feed.write(batch.input_ids)
                if _counts_pending(plan.scheduled):
                    fed = batch.input_ids[batch.last_token_idx]
            # Echo's prompt log-probabilities: the logits of every prompt position fed.
            logits, prompt_lps = self._forward(batch, plan.scheduled)  # [num_reqs, vocab]
        draft = verified = None
        if logits is not None and self.is_sampler:
            to_draw = plan.scheduled
            if flat.first_rows is not None:
                logits, to_draw, verified = self._verify(logits, plan.scheduled, flat.first_rows)
            if _waits_for_grammar(to_draw):
                return Launched(start, swap_wait_s, None, prompt_lps, verified=verified,
                                undrawn=Undrawn(logits, to_draw, fed))
            draft = self._last_draft = self.sampler.draw(logits, to_draw, fed)
        return Launched(start, swap_wait_s, draft, prompt_lps, verified=verified)

    @torch.inference_mode()
    def draw(self, launched: Launched) -> Launched:
        """Sample a launched plan that `launch` left undrawn, now that the tokens it was fed
        from the device are back and its grammars have taken them."""
        u = launched.undrawn
        if u is None:
            return launched
        draft = self._last_draft = self.sampler.draw(u.logits, u.reqs, u.fed)
        return dataclasses.replace(launched, draft=draft, undrawn=None)

    @torch.inference_mode()
    def finish(self, launched: Launched) -> ExecutorOutput:
        """Wait for a launched plan's tokens (the iteration's one host sync)."""
        if launched.is_empty:
            return ExecutorOutput(sampled_token_ids=[], duration_s=0.0)
        tokens: list[int] = []
        failed: dict[str, str] = {}
        sample_lps: dict[str, TokenLogprobs] = {}
        if launched.draft is not None:
            sampled = self.sampler.read(launched.draft)
            tokens, failed, sample_lps = sampled.token_ids, sampled.errors, sampled.logprobs
        verified = None if launched.verified is None else launched.verified.read()
        if verified is not None:
            failed = {**failed, **verified.errors}
            for i, r in enumerate(launched.draft.reqs if launched.draft else ()):
                if r.num_draft_tokens:
                    got = verified.token_ids.get(r.request_id)
                    tokens[i] = got[0] if got else FAILED_TOKEN
        end = time.perf_counter()
        # NOTE: from the later of its launch and the previous finish: with async scheduling
        # iterations overlap, and each counts the time since the one before it came back.
        duration_s = end - max(launched.start_s, self._last_finish_s)
        self._last_finish_s = end
        out = ExecutorOutput(
            sampled_token_ids=tokens,
            duration_s=duration_s,
            swap_wait_s=launched.swap_wait_s,
            failed=failed,
            sample_logprobs=sample_lps,
            prompt_logprobs=launched.prompt_logprobs,
            verified_token_ids=verified.token_ids if verified is not None else {},
            verified_logprobs=verified.logprobs if verified is not None else {},
        )
        self._emit(out)
        return out

    def _feed(self, reqs: list[ScheduledRequest], flat: FlatBatch) -> TokenFeed | None:
        """Where this batch's PENDING_TOKEN inputs come from: the previous launch's draws."""
        places = [i for i, r in enumerate(reqs) if r.token_ids[0] == PENDING_TOKEN]
        if not places:
            return None
        dst = [flat.last_token_idx[i] for i in places]
        for i in dst:
            flat.input_ids[i] = 0  # NOTE: the host copy holds a valid id until the feed lands
        return TokenFeed(self._pending_tokens([reqs[i].request_id for i in places]), dst)

    # -- the steps a pipeline stage overrides ---------------------------------------------

    def _receive(self, plan: SchedulerOutput) -> None:
        """Before the swaps are queued: a later pipeline stage posts its receive here."""

    def _forward(self, batch: BatchInputs, reqs: list[ScheduledRequest]
                 ) -> tuple[torch.Tensor | None, dict[str, tuple[int, list[TokenLogprobs]]]]:
        """The forward pass: logits [num_reqs, vocab] (None on a stage that computes none),
        and the prompt log-probabilities of the requests that asked for them (echo)."""
        with self._batch_set(batch, reqs):
            hidden = self.model(batch.input_ids, batch.positions, self.attn)  # [num_tokens, hidden]
            logits = self.model.compute_logits(hidden[batch.logits_idx])  # [num_rows, vocab]
        return logits, prompt_logprobs(hidden, reqs, self.model.compute_logits)

    @contextmanager
    def _batch_set(self, batch: BatchInputs, reqs: list[ScheduledRequest]) -> Iterator[None]:
        """For the layers' forward pass: the batch's attention metadata, and which of its
        tokens run with which LoRA adapter."""
        self.attn.metadata = batch.metadata
        lora = self.model.lora_batch
        if lora is not None:
            lora.set([r.lora_id for r in reqs], [len(r.token_ids) for r in reqs], self.device)
        try:
            yield
        finally:
            self.attn.metadata = None
            if lora is not None:
                lora.clear()

    def _verify(self, logits: torch.Tensor, reqs: list[ScheduledRequest], first_rows: list[int]
                ) -> tuple[torch.Tensor, list[ScheduledRequest], PendingVerdicts]:
        """Speculative decoding: check the drafts of the requests that sent some (`logits`
        has all their rows); returns each request's last row for the sampler, the requests
        it draws for (not those: their tokens are verified here), and the verdicts on their
        way back."""
        spec = [i for i, r in enumerate(reqs) if r.num_draft_tokens]
        verified = check(self.sampler, logits, [reqs[i] for i in spec], [first_rows[i] for i in spec])
        last_rows = [f + r.num_draft_tokens for f, r in zip(first_rows, reqs)]
        to_draw = [dataclasses.replace(r, samples=False) if r.num_draft_tokens else r for r in reqs]
        return take_rows(logits, last_rows), to_draw, verified

    def _emit(self, out: ExecutorOutput) -> None:
        """After sampling: a pipeline stage sends its activations, or its tokens and
        log-probabilities, on here."""

    def _pending_tokens(self, request_ids: list[str]) -> torch.Tensor:
        """[len(request_ids)] long, on the device: the tokens the previous launch drew for
        these requests (async scheduling); a tensor-parallel rank that samples none gets them
        from the one that does."""
        draft = self._last_draft
        if draft is None:
            raise RuntimeError("a decode's token is pending but no batch was launched before")
        launched = {r.request_id for r in draft.reqs}
        missing = [rid for rid in request_ids if rid not in launched]
        if missing:
            raise RuntimeError(f"pending tokens of requests not in the previous batch: {missing}")
        row_of = draft.row_of()  # NOTE: a row whose sampling failed before its draw has none
        return drawn_tokens(draft.tokens, [row_of.get(rid, -1) for rid in request_ids])

    def _prepare(self, reqs: list[ScheduledRequest], flat: FlatBatch | None = None) -> BatchInputs:
        flat = flat or flatten(reqs, self.block_size)
        long, dev = torch.long, self.device
        slot_mapping = to_device(flat.slots, long, dev)
        last_idx = to_device(flat.last_token_idx, long, dev)
        return BatchInputs(
            input_ids=to_device(flat.input_ids, long, dev),
            positions=to_device(flat.positions, long, dev),
            last_token_idx=last_idx,
            metadata=self.attn.build_metadata(reqs, slot_mapping),
            logits_idx=last_idx if flat.first_rows is None else to_device(flat.logits_idx, long, dev),
        )
