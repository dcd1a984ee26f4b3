"""The synchronous engine: requests in, the step loop, outputs out.

Its parts, in the order of a request's path (vLLM V1's): the builder (`builder.py`: loads,
sizes, picks the executor, warms up, profiles), the input processor (`inputs.py`), the engine
core (`core.py`: scheduler, executor, step loop) and the output processor (`output.py`).
"""

from __future__ import annotations

import dataclasses
import logging

from fastserve.clock import Clock, WallClock
from fastserve.config import EngineConfig
from fastserve.core.cost_model import CostModel
from fastserve.engine.beam_search import BeamSearches
from fastserve.engine.builder import EngineParts, build_parts, with_engine_overhead
from fastserve.engine.core import build_engine_core
from fastserve.engine.group import RequestGroups
from fastserve.engine.inputs import InputProcessor
from fastserve.engine.loras import ServedAdapter
from fastserve.engine.output import OutputProcessor
from fastserve.engine.stats import EngineStats, LoRAStats
from fastserve.model.lora import Adapter
from fastserve.profiling.recorder import CostModelCheck, IterationRecorder
from fastserve.request import FinishReason, Request, RequestOutput, RequestStatus, SamplingParams

logger = logging.getLogger(__name__)


class LLMEngine:
    """Add requests, call `step()`, get `RequestOutput`s. Not thread-safe (AsyncLLM wraps it)."""

    def __init__(self, config: EngineConfig, clock: Clock | None = None) -> None:
        clock = clock or WallClock()
        # NOTE: a profile measured now is completed through a probe engine built from the same
        # parts and dropped: this engine's core is built once, over the final cost model.
        parts = with_engine_overhead(build_parts(config), lambda p: LLMEngine.from_parts(p, clock))
        self._start(parts, clock)

    @classmethod
    def from_parts(cls, parts: EngineParts, clock: Clock | None = None) -> LLMEngine:
        """An engine over parts built already (`build_parts`)."""
        engine = cls.__new__(cls)
        engine._start(parts, clock or WallClock())
        return engine

    def _start(self, parts: EngineParts, clock: Clock) -> None:
        config = self.config = parts.config
        self.clock = clock
        self.model_path, self.arch, self.tokenizer = parts.model_path, parts.arch, parts.tokenizer
        self.eos_token_ids, self.max_model_len = parts.eos_token_ids, parts.max_model_len
        self.dtype_choice, self.runner = parts.dtype_choice, parts.runner
        self.loras, self.grammars, self.cost = parts.loras, parts.grammars, parts.cost
        self.core = build_engine_core(config, self.runner, self.cost, clock, self.runner.num_blocks,
                                      self.runner.num_host_blocks, self.eos_token_ids)
        self.scheduler = self.core.scheduler
        # NOTE: grammars take their tokens inside the step: async scheduling masks the next
        # batch's draw with them there.
        self.core.on_update = self._advance_grammars
        # a structured request's drafts keep to its grammar
        self.scheduler.drafting.vet_with(self.grammars.num_valid)
        self.inputs = InputProcessor(self.tokenizer, self.arch.vocab_size, self.max_model_len,
                                     self.eos_token_ids, self.loras, config.cache.block_size,
                                     self.runner.is_sampler, clock)
        self.outputs = OutputProcessor(self.tokenizer, self._finish)
        self._aborted: list[Request] = []
        # Requests with n, best_of > 1.
        self.groups = RequestGroups(self.scheduler.prefix_hold, self._add_sequence)
        self.beams = BeamSearches(self._add_beam_step, self.tokenizer.decode,  # use_beam_search
                                  self.scheduler.unpark)
        # Batch shape and wall time of recent iterations (`fastserve profile --through-engine`),
        # each also scored against the cost model (`cost_check`, shown in /metrics), which
        # (`calibrate_cost_model`) rescales the model the engine decides with to follow them.
        # NOTE: not under pipeline parallelism: with several batches in flight a recorded
        # cycle is about one stage's time, while the model predicts a batch's whole pass.
        calibrate = config.model.calibrate_cost_model \
            and config.parallel.pipeline_parallel_size == 1
        self.cost_check = CostModelCheck(self.cost, calibrate=calibrate,
                                         on_calibrate=self._recalibrate)
        self.recorder = IterationRecorder(max(1, config.model.record_iterations),
                                          check=self.cost_check)

    @property
    def startup_cost(self) -> CostModel:
        """The start-up profile (or `--profile`): what calibration scales."""
        return self.cost_check.cost

    def _recalibrate(self, cost: CostModel) -> None:
        """Decide with `cost` (the start-up profile, rescaled) from the next iteration on."""
        self.cost = cost
        self.scheduler.recalibrate(cost)

    # -- requests -----------------------------------------------------------------------

    def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        arrival_s: float | None = None,
        oracle_output_len: int | None = None,
        priority: int = 0,
        lora: str | None = None,
        cache_salt: str | None = None,
    ) -> Request:
        """Validate and queue a request. Raises ValueError naming what is wrong. `priority`:
        lower runs first (vLLM's), over the scheduling policy's order. `lora`: the name of a
        LoRA adapter to run with (`lora_modules`). `cache_salt`: the prefix cache finds for it
        only blocks computed for requests of the same salt (vLLM's)."""
        req = self.inputs.process(prompt, params or SamplingParams(), request_id, arrival_s,
                                  oracle_output_len, priority, lora, cache_salt)
        rid, params, text = req.request_id, req.params, prompt if isinstance(prompt, str) else None
        seq_ids = self.groups.sequence_ids(rid, params.num_sequences)
        if rid in self.beams or any(
                sid in self.scheduler.requests or self.groups.is_reserved(sid) for sid in seq_ids):
            raise ValueError(f"request id {rid!r} is already in use")
        if params.use_beam_search:  # its steps are requests of their own (`BeamSearches`)
            self.scheduler.check_fits(req)  # (its last step's: the prompt and max_tokens)
            self.beams.add(req, text, self.eos_token_ids)
            return req
        if params.num_sequences == 1:
            return self._queue(req, text)
        return self.groups.add(rid, params, text, add_leader=lambda p: self._queue(
            dataclasses.replace(req, params=p), text))

    def _queue(self, req: Request, prompt: str | None) -> Request:
        """Queue one sequence: its own grammar matcher (a 400 for a bad spec; it compiles
        while the prompt prefills), its place in the scheduler, its detokenizer."""
        structured = req.params.structured_output
        if structured is not None:
            self.grammars.add(req.request_id, structured)
        try:
            self.scheduler.add_request(req, self.clock.now())  # refuses a job larger than the cache
        except Exception:
            self.grammars.drop(req.request_id)
            raise
        if not self.grammars.is_ready(req.request_id):  # it compiles beside the loop
            self.scheduler.prepare(req.request_id)
        self.outputs.add(req, prompt)
        return req

    def _add_beam_step(self, step_id: str, token_ids: list[int], params: SamplingParams,
                       first: Request, fork_of: str | None) -> None:
        self._queue(self.inputs.beam_step(step_id, token_ids, params, first, fork_of), None)

    def _add_sequence(self, request_id: str, params: SamplingParams, first: Request,
                      prompt: str | None) -> Request:
        return self._queue(self.inputs.sequence(request_id, params, first), prompt)

    def tokenize_texts(self, params: SamplingParams) -> SamplingParams:
        """`InputProcessor.tokenize_texts` (safe on any thread)."""
        return self.inputs.tokenize_texts(params)

    def abort(self, request_id: str) -> None:
        """Stop a request now and free its KV blocks; its final output comes from `step()`.
        A request with several sequences stops them all."""
        seq_ids = (self.groups.abort(request_id) if self.groups.is_group(request_id)
                   else self.beams.step_ids(request_id) if request_id in self.beams
                   else [request_id])
        for sid in seq_ids:
            req = self.scheduler.abort(sid, self.clock.now())
            if req is not None:
                self._aborted.append(req)

    def add_lora(self, adapter: Adapter, path: str, replace: bool = False) -> ServedAdapter:
        """Serve `adapter` (read by `self.loras.read`, on any thread) under its name; requests
        running now keep their adapters' weights. Raises LoRAError naming what is wrong."""
        busy = {r.lora_id for r in self.scheduler.requests.values()}
        served = self.loras.add(adapter, path, busy, replace=replace)
        logger.info("LoRA adapter %r loaded from %s (slot %d)", served.name, path, served.slot)
        return served

    def remove_lora(self, name: str) -> ServedAdapter:
        """Stop serving adapter `name`: new requests naming it are refused, running ones
        finish with it. Raises LoRANotFoundError."""
        served = self.loras.remove(name)
        logger.info("LoRA adapter %r unloaded", name)
        return served

    def check_health(self) -> None:
        """Raise `ExecutorDeadError` once the executor can run no more (a distributed rank
        died or stopped answering)."""
        self.runner.check_health()

    def shutdown(self) -> None:
        """Stop the grammar compile workers, and the executor's workers, if any (safe to call
        more than once)."""
        self.grammars.shutdown()
        self.runner.shutdown()

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished or bool(self._aborted) or self.groups.has_pending

    # -- the loop -------------------------------------------------------------------------

    @property
    def is_waiting_on_preparation(self) -> bool:
        """Whether the last step ran nothing while requests wait for their preparation (a
        grammar compiling): the loop may wait a moment instead of spinning."""
        plan = self.core.last_plan
        return bool(self.scheduler.preparing) and (plan is None or plan.is_empty)

    def step(self) -> list[RequestOutput]:
        start_s = self.recorder.begin()
        if self.scheduler.preparing:
            self._take_prepared()
        touched = self.core.step()
        aborted, self._aborted = self._aborted, []
        self.outputs.detokenize_step(touched, aborted, self.core.last_output)
        touched += aborted
        self.groups.after_step()
        outputs = self.beams.outputs(self.groups.outputs(self.outputs.request_outputs(touched)),
                                     self.clock.now())
        if len(self.grammars):
            for req in touched:
                if req.is_finished:
                    self.grammars.drop(req.request_id)
        self.recorder.end(start_s, self.core.last_plan, self.has_unfinished)
        return outputs

    def _finish(self, req: Request, reason: FinishReason) -> None:
        self.scheduler.finish(req, reason, self.clock.now())

    def _take_prepared(self) -> None:
        """Requests whose grammar has compiled join this step's batch; those whose compile
        failed (over the time limit) fail now, naming their field. NOTE: never waits."""
        ready = [rid for rid in self.scheduler.preparing if self.grammars.is_ready(rid)]
        self.scheduler.prepared(ready)
        for rid in ready:
            failure = self.grammars.failure(rid)
            req = self.scheduler.requests.get(rid)
            if failure is not None and req is not None:
                self.outputs.fail(req, *failure)
                self._aborted.append(req)  # (its output comes with this step's, as an abort's)

    def _advance_grammars(self, touched: list[Request]) -> None:
        """Feed the structured requests' new tokens to their grammars; each stops once its
        grammar ends."""
        if not len(self.grammars):
            return
        for req in touched:
            if req.params.structured_output is None or req.request_id not in self.grammars:
                continue
            try:
                if self.grammars.advance(req) and not req.is_finished:
                    self._finish(req, FinishReason.STOP)
            except Exception as exc:
                logger.exception("the grammar of request %s failed; failing it", req.request_id)
                self.outputs.fail(req, f"structured output failed: {type(exc).__name__}: {exc}")

    # -- what it runs, and how it is doing ------------------------------------------------

    def executor_info(self) -> dict[str, str]:
        """What the executor runs, as chosen at start-up: device, dtype (and why, for
        "auto"), KV cache dtype, attention backend, and the backend's own choices."""
        return {**self.runner.info, "dtype_reason": self.dtype_choice.reason}

    def stats(self) -> EngineStats:
        return EngineStats(
            scheduler=self.scheduler.stats(), executor=self.executor_info(),
            swap_wait_s=self.core.swap_wait_s, num_iterations=self.core.num_iterations,
            cost_model_ratio=self.cost_check.ratio, cost_model_scale=self.cost_check.scale,
            lora=self._lora_stats())

    def _lora_stats(self) -> LoRAStats | None:
        if self.loras.weights is None:
            return None
        requests = self.scheduler.requests.values()
        return LoRAStats(self.loras.max_loras, self.loras.requests_by_adapter(
            (r.lora_id, r.status is RequestStatus.RUNNING) for r in requests))
