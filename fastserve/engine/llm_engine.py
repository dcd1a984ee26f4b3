"""The synchronous engine: a model, a tokenizer, the scheduler and the step loop."""

from __future__ import annotations

import dataclasses
import itertools
import json
import logging
from pathlib import Path

import torch

from fastserve.clock import Clock, WallClock
from fastserve.config import EngineConfig
from fastserve.core.cost_model import CostModel
from fastserve.core.kv import num_blocks_for
from fastserve.core.plan import ScheduledRequest, SchedulerOutput
from fastserve.core.scheduler import check_fits
from fastserve.engine.beam_search import BeamSearches
from fastserve.engine.core import build_engine_core
from fastserve.engine.group import RequestGroups
from fastserve.engine.loras import AdapterSlots, LoRAAdapters, ServedAdapter, read_lora
from fastserve.engine.output import OutputProcessor
from fastserve.engine.overhead import measure_engine_overhead
from fastserve.engine.startup_checks import check_cache_writable, check_stop_ids, check_weights_fit
from fastserve.executor.cpu_kernels import decode_attention_kernel
from fastserve.executor.device_choice import choose_device
from fastserve.executor.distributed.executor import DistributedExecutor
from fastserve.executor.distributed.launch import start_executor
from fastserve.executor.distributed.stage import pool_sizes
from fastserve.executor.dtype_choice import resolve_config
from fastserve.executor.grammar import StructuredOutputs
from fastserve.executor.kv_sizing import CPU_KV_CACHE_GIB, check_pool_holds, gpu_max_batch_size
from fastserve.executor.memory_profile import KVPoolPlan, plan_kv_pool
from fastserve.executor.model_runner import TORCH_DTYPES, ModelRunner
from fastserve.logs import startup_step
from fastserve.model.llama import LlamaForCausalLM
from fastserve.model.loader import load_model, read_arch_config
from fastserve.model.lora import Adapter, LoRAWeights
from fastserve.model.make_model import cache_dir, resolve_model_path
from fastserve.model.tokenizer import Tokenizer, check_encodable
from fastserve.profiling.cache import (
    cached_profile_path,
    load_cached,
    profile_cache_key,
    profile_engine,
    save_profile,
)
from fastserve.profiling.recorder import CostModelCheck, IterationRecorder
from fastserve.request import (
    FinishReason,
    InvalidRequestError,
    Request,
    RequestOutput,
    RequestStatus,
    SamplingParams,
)

logger = logging.getLogger(__name__)


def _max_model_len(configured: int | None, max_position_embeddings: int) -> int:
    """The context limit: the configured one, which may not exceed the checkpoint's."""
    if configured is None:
        return max_position_embeddings
    if configured > max_position_embeddings:
        raise ValueError(
            f"max_model_len={configured} exceeds the model's max_position_embeddings="
            f"{max_position_embeddings}"
        )
    return configured


class LLMEngine:
    """Add requests, call `step()`, get `RequestOutput`s. Not thread-safe (AsyncLLM wraps it)."""

    def __init__(self, config: EngineConfig, clock: Clock | None = None) -> None:
        self.clock = clock or WallClock()
        check_cache_writable()  # before the slow part: the profile is saved there at its end
        path = resolve_model_path(config.model.model)
        if config.model.device.startswith("cuda") and not torch.cuda.is_available():
            raise ValueError(f"device {config.model.device!r} requested but CUDA is not available")
        # Read before the weights (and the dtype probe, which runs the model's shapes): a broken
        # config, tokenizer.json or stop token fails in a second, and an absurd size at once.
        self.arch = read_arch_config(path)  # first: it says what a model argument may be
        try:
            self.tokenizer = Tokenizer(path, config.model.chat_template)
        except FileNotFoundError as exc:
            raise ValueError(f"cannot load the tokenizer: {exc}") from None
        check_stop_ids(self.tokenizer.eos_token_ids, self.arch.vocab_size, path)
        parallel = config.parallel
        check_weights_fit(self.arch, TORCH_DTYPES.get(config.model.dtype, torch.bfloat16),
                          config.model.device,
                          parallel.tensor_parallel_size * parallel.pipeline_parallel_size,
                          path / "config.json")
        if choose_device(config.model.device, torch.cuda.is_available()) == "cpu":
            # Built (once per version and machine) now, with a line saying so, rather than in
            # the middle of the dtype probe or the first request.
            decode_attention_kernel()
        # "auto" becomes a dtype here, before anything (profile cache, workers) reads it.
        config, self.dtype_choice = resolve_config(config, path)
        self.config = config
        self.model_path = path
        if config.model.num_threads:
            torch.set_num_threads(config.model.num_threads)
        dtype = TORCH_DTYPES[config.model.dtype]
        is_distributed = parallel.tensor_parallel_size * parallel.pipeline_parallel_size > 1
        lora = config.lora
        weights: AdapterSlots | None = None
        if not is_distributed:  # else every rank loads its own shard (start_executor)
            with startup_step(logger, f"loading {path} ({config.model.dtype}, "
                                      f"{config.model.device})"):
                model, self.arch = load_model(path, dtype, config.model.device,
                                              load_format=config.model.load_format)
            if lora.is_enabled:
                weights = LoRAWeights(model, self.arch, lora.max_loras + 1)
                model.lora_batch = weights.batch
        # LoRA adapters: a request names one (its slot of `weights`; 0: the base model). Read
        # (and checked) before the workers start.
        self.loras = LoRAAdapters(weights, self.arch, lora.max_lora_rank, lora.max_loras)
        startup_adapters = [(read_lora(name, adapter_path, self.arch, lora.max_lora_rank), adapter_path)
                            for name, adapter_path in lora.adapters]
        self.max_model_len = _max_model_len(config.model.max_model_len,
                                            self.arch.max_position_embeddings)
        self.eos_token_ids = list(self.tokenizer.eos_token_ids)
        # The KV pool's blocks (a GPU's from its memory), what one request may hold, and a
        # GPU's batch: all before the runner, which captures graphs up to that batch.
        config = self.config = self._size_for_device(config, None if is_distributed else model)
        self.runner: ModelRunner | DistributedExecutor
        if is_distributed:
            self.runner = start_executor(config, path, self.eos_token_ids)
            if lora.is_enabled:  # every rank holds its shard of each adapter
                self.loras.weights = self.runner
        else:
            self.runner = ModelRunner(model, self.arch, config.model, config.cache, self.eos_token_ids)
        for adapter, adapter_path in startup_adapters:
            self.loras.add(adapter, adapter_path, busy_slots=())
        # Structured output: grammars compile as requests are added; the sampler masks with them.
        self.grammars = StructuredOutputs(self.tokenizer, self.arch.vocab_size, self.eos_token_ids,
                                          config.limits)
        # The sampler in this process, if any: not a pipeline's (its last stage's rank samples).
        local = self.runner if isinstance(self.runner, ModelRunner) else self.runner.stage
        self._samples_here = local.is_sampler
        if local.is_sampler:
            local.sampler.grammars = self.grammars
        else:  # a pipeline's driver fills the masks for the rank that samples
            assert isinstance(self.runner, DistributedExecutor)
            self.runner.grammars = self.grammars
        if config.model.warmup:
            with startup_step(logger, "warm-up passes", expect_slow=False):
                self._warmup()
        cost, profile_path = self._cost_model()
        self._build_core(cost)
        if profile_path is not None:
            # A fresh executor profile: add the engine's own work per iteration, measured
            # through this engine, so that the cached model predicts whole iterations.
            with startup_step(logger, "measuring the engine's overhead per iteration"):
                overhead = measure_engine_overhead(self)
            if overhead is not None:
                cost = overhead.apply(cost)
                logger.info("engine overhead per iteration: %.2f ms + %.3f ms per decode",
                            overhead.fixed_s * 1e3, overhead.per_job_s * 1e3)
            save_profile(cost, profile_path, method="executor grid + engine overhead")
            self._build_core(cost)

    def _size_for_device(self, config: EngineConfig, model: LlamaForCausalLM | None
                         ) -> EngineConfig:
        """The config with the KV pool's blocks, the context limit and the batch settled for
        this device (`model` None: distributed ranks size their pools from the config)."""
        sched, cache = config.scheduler, config.cache
        is_cuda = config.model.device.startswith("cuda")
        if model is None:
            if is_cuda and cache.kv_cache_gib is None and cache.num_device_blocks is None:
                logger.warning("tensor/pipeline parallel ranks do not profile their memory yet: "
                               "each takes a %g GiB KV pool; give --kv-cache-gib to size it",
                               CPU_KV_CACHE_GIB)
            plan = KVPoolPlan(pool_sizes(config, self.arch).num_device_blocks, "the configured size")
        else:
            # The profiled batch is the largest the scheduler may run: a GPU's default batch
            # is at most what the graphs capture.
            num_seqs = config.model.cuda_graph_max_batch_size \
                if sched.is_max_batch_size_auto else sched.max_batch_size
            plan = plan_kv_pool(config, model, self.arch, self.eos_token_ids,
                                self.max_model_len, num_seqs)
        bs = cache.block_size
        model_config = config.model
        if cache.num_device_blocks is not None and config.model.max_model_len is None \
                and plan.num_blocks * bs < self.max_model_len:
            # NOTE: a pool given in blocks and no context limit: the pool sets the limit (as
            # many tests and small benchmarks size them); a limit given is checked below.
            logger.warning("max_model_len %d -> %d: what --num-device-blocks %d of %d tokens "
                           "hold (give --max-model-len to be refused instead)",
                           self.max_model_len, plan.num_blocks * bs, plan.num_blocks, bs)
            self.max_model_len = plan.num_blocks * bs
            model_config = dataclasses.replace(model_config, max_model_len=self.max_model_len)
        check_pool_holds(self.max_model_len, bs, plan.num_blocks, plan.how_sized)
        logger.info("KV pool: %d blocks of %d tokens (%s); max_model_len %d",
                    plan.num_blocks, bs, plan.how_sized, self.max_model_len)
        if is_cuda and sched.is_max_batch_size_auto:
            batch = gpu_max_batch_size(plan.num_blocks, model_config.cuda_graph_max_batch_size)
            sched = dataclasses.replace(sched, max_batch_size=batch)
            logger.info("max_batch_size %d: what the KV pool and the captured graphs hold", batch)
        if is_cuda:  # graphs only up to the batch the scheduler runs
            model_config = dataclasses.replace(model_config, cuda_graph_max_batch_size=min(
                model_config.cuda_graph_max_batch_size, sched.max_batch_size))
        return dataclasses.replace(
            config, model=model_config, scheduler=sched,
            cache=dataclasses.replace(cache, num_device_blocks=plan.num_blocks))

    def _build_core(self, cost: CostModel) -> None:
        """The scheduler, KV manager and step loop over `cost`, all fresh."""
        config = self.config
        self.cost = cost
        self.core = build_engine_core(config, self.runner, self.cost, self.clock,
                                      self.runner.num_blocks, self.runner.num_host_blocks,
                                      self.eos_token_ids)
        self.scheduler = self.core.scheduler
        # NOTE: grammars take their tokens inside the step: async scheduling masks the next
        # batch's draw with them there.
        self.core.on_update = self._advance_grammars
        if self.scheduler.drafter is not None:  # a structured request's drafts keep to its grammar
            self.scheduler.drafter.vet = self.grammars.num_valid
        self.kv = self.scheduler.kv
        self.outputs = OutputProcessor(self.tokenizer)
        self._ids = itertools.count()
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
        self.cost_check = CostModelCheck(cost, calibrate=calibrate,
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
        params = self.tokenize_texts(params or SamplingParams()).for_vocab(self.arch.vocab_size)
        params.check_allows_a_token(self.eos_token_ids)
        adapter = None
        if lora is not None:
            adapter = self.loras.get(lora)
            if adapter is None:
                served = ", ".join(self.loras.paths) or "none"
                raise InvalidRequestError(f"lora: no adapter named {lora!r} (served: {served})", "model")
        if params.logits_processors and not self._samples_here:
            raise InvalidRequestError(
                "logits_processors run in the sampling process, a worker under pipeline "
                "parallelism: not with pipeline parallelism", "logits_processors")
        token_ids = self._tokenize(prompt)
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        num_seqs = params.num_sequences
        seq_ids = self.groups.sequence_ids(request_id, num_seqs)
        if request_id in self.beams or any(
                sid in self.scheduler.requests or self.groups.is_reserved(sid) for sid in seq_ids):
            raise ValueError(f"request id {request_id!r} is already in use")
        req = Request(
            request_id=request_id,
            prompt_token_ids=token_ids,
            params=params,
            arrival_s=self.clock.now() if arrival_s is None else arrival_s,
            oracle_output_len=oracle_output_len,
            max_model_len=self.max_model_len,
            priority=priority,
            lora_id=adapter.slot if adapter else 0,
            cache_salt=_salt(adapter.cache_salt if adapter else None, cache_salt),
        )
        text = prompt if isinstance(prompt, str) else None
        if params.use_beam_search:  # its steps are requests of their own (`BeamSearches`)
            check_fits(req, self.kv)  # (its last step's: the prompt and max_tokens)
            self.beams.add(req, text, self.eos_token_ids)
            return req
        if num_seqs == 1:
            return self._queue(req, text)
        return self.groups.add(request_id, params, text, add_leader=lambda p: self._queue(
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
            self.scheduler.preparing.add(req.request_id)
        self.outputs.add(req, prompt)
        return req

    def _add_beam_step(self, step_id: str, token_ids: list[int], params: SamplingParams,
                       first: Request, fork_of: str | None) -> None:
        """One step of a beam of `first`, a beam-search request (`BeamSearches`): a request of
        its own, with the request's arrival, priority, adapter and scheduler service, that
        parks its KV and forks its parent's."""
        self._queue(Request(request_id=step_id, prompt_token_ids=token_ids, params=params,
                            arrival_s=first.arrival_s, max_model_len=first.max_model_len,
                            priority=first.priority, lora_id=first.lora_id,
                            cache_salt=first.cache_salt, keep_kv=True, fork_of=fork_of,
                            service_of=first.service_of or first.request_id), None)

    def _add_sequence(self, request_id: str, params: SamplingParams, first: Request,
                      prompt: str | None) -> Request:
        """A later sequence of `first`'s request: the same prompt (and its block hashes, so
        it finds the cached blocks), arrival, limits and scheduler service."""
        req = Request(request_id=request_id, prompt_token_ids=first.prompt_token_ids,
                      params=params, arrival_s=first.arrival_s,
                      oracle_output_len=first.oracle_output_len,
                      max_model_len=first.max_model_len, cache_salt=first.cache_salt,
                      priority=first.priority, lora_id=first.lora_id,
                      service_of=first.service_of or first.request_id,
                      block_hashes=list(first.block_hashes[: first.num_prompt_tokens
                                                            // self.config.cache.block_size]))
        return self._queue(req, prompt)

    def tokenize_texts(self, params: SamplingParams) -> SamplingParams:
        """`params.bad_words` as token sequences, beside any given as ids (vLLM tokenizes them
        as a request is added), and `params.prediction` as the draft's token ids; the texts
        are taken out, so that tokenizing again does nothing. Safe on any thread (`AsyncLLM`
        runs it on a worker thread: a long prediction would stall the engine loop)."""
        if params.bad_words:
            ids = self.tokenizer.bad_words_token_ids(params.bad_words)
            params = dataclasses.replace(
                params, bad_words=(), bad_words_token_ids=(*params.bad_words_token_ids, *ids))
        if params.prediction:
            predicted = check_encodable(params.prediction, "prediction")
            params = dataclasses.replace(params, prediction=None, prediction_token_ids=(
                *params.prediction_token_ids,
                *self.tokenizer.encode(predicted, add_special_tokens=False)))
        return params

    def _tokenize(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequestError("prompt is empty: give at least one character or token", "prompt")
            token_ids = self.tokenizer.encode(check_encodable(prompt, "prompt"))
        else:
            token_ids = list(prompt)
            vocab = self.arch.vocab_size
            bad = [t for t in token_ids if not isinstance(t, int) or not 0 <= t < vocab]
            if bad:
                raise InvalidRequestError(
                    f"prompt token ids must be integers in [0, {vocab}); got {bad[:5]}", "prompt")
        if not token_ids:
            raise InvalidRequestError("prompt is empty: give at least one character or token", "prompt")
        if len(token_ids) >= self.max_model_len:
            raise InvalidRequestError(
                f"prompt has {len(token_ids)} tokens but the model's maximum context length is "
                f"{self.max_model_len} (the prompt must leave room for at least one new token)",
                "prompt",
            )
        return token_ids

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

    # -- LoRA adapters while serving ----------------------------------------------------

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
        if isinstance(self.runner, DistributedExecutor):
            self.runner.check_health()

    def shutdown(self) -> None:
        """Stop the grammar compile workers, and the distributed workers, if any (safe to
        call more than once)."""
        self.grammars.shutdown()
        if isinstance(self.runner, DistributedExecutor):
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
        if self.core.last_output is not None:
            self.outputs.take_logprobs(touched, self.core.last_output)
        for req in touched:
            if req.is_finished or not req.params.final_only or req.params.stop:
                self._detokenize(req)
        for req in self._aborted:
            if req.params.final_only:  # its text was not kept up as it grew
                self._detokenize(req)
        touched += self._aborted
        self._aborted = []
        self.groups.after_step()
        outputs = self.beams.outputs(self.groups.outputs(
            [self._output(r) for r in touched if r.is_finished or not r.params.final_only]),
            self.clock.now())
        if len(self.grammars):
            for req in touched:
                if req.is_finished:
                    self.grammars.drop(req.request_id)
        self.recorder.end(start_s, self.core.last_plan, self.has_unfinished)
        return outputs

    def _take_prepared(self) -> None:
        """Requests whose grammar has compiled join this step's batch; those whose compile
        failed (over the time limit) fail now, naming their field. NOTE: never waits."""
        ready = [rid for rid in self.scheduler.preparing if self.grammars.is_ready(rid)]
        self.scheduler.preparing.difference_update(ready)
        for rid in ready:
            failure = self.grammars.failure(rid)
            req = self.scheduler.requests.get(rid)
            if failure is not None and req is not None:
                self._fail(req, *failure)
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
                    self.scheduler.finish(req, FinishReason.STOP, self.clock.now())
            except Exception as exc:
                logger.exception("the grammar of request %s failed; failing it", req.request_id)
                self._fail(req, f"structured output failed: {type(exc).__name__}: {exc}")

    def _detokenize(self, req: Request) -> None:
        """Take the request's new tokens into its text and check its stop strings.

        NOTE: a failure here fails this request alone; the batch's others keep their tokens.
        """
        try:
            if self.outputs.detokenize(req):
                if not req.is_finished:
                    self.scheduler.finish(req, FinishReason.STOP, self.clock.now())
                elif req.finish_reason is FinishReason.LENGTH:
                    req.finish_reason = FinishReason.STOP  # its text ends at the stop string
        except Exception as exc:
            logger.exception("detokenizing request %s failed; failing it", req.request_id)
            self._fail(req, f"detokenization failed: {type(exc).__name__}: {exc}")

    def _output(self, req: Request) -> RequestOutput:
        try:
            return self.outputs.output(req)
        except Exception as exc:
            logger.exception("the output of request %s failed; failing it", req.request_id)
            self._fail(req, f"output failed: {type(exc).__name__}: {exc}")
            self.outputs.discard(req.request_id)
            return RequestOutput(
                request_id=req.request_id, prompt=None, prompt_token_ids=req.prompt_token_ids,
                token_ids=list(req.output_token_ids), text="", finished=True,
                finish_reason=FinishReason.ERROR.value, arrival_s=req.arrival_s,
                first_token_s=req.first_token_s, finish_s=req.finish_s, error=req.error,
            )

    def _fail(self, req: Request, error: str, param: str | None = None) -> None:
        if not req.is_finished:
            self.scheduler.finish(req, FinishReason.ERROR, self.clock.now())
        req.finish_reason = FinishReason.ERROR  # NOTE: also when it had just finished by length
        req.error = error
        req.error_param = param

    def executor_info(self) -> dict[str, str]:
        """What the executor runs, as chosen at start-up: device, dtype (and why, for
        "auto"), KV cache dtype, attention backend, and the backend's own choices."""
        base = self.runner.info if isinstance(self.runner, ModelRunner) else {
            "device": self.config.model.device.split(":")[0], "dtype": self.config.model.dtype}
        return {**base, "dtype_reason": self.dtype_choice.reason}

    def stats(self) -> dict[str, object]:
        s = self.scheduler
        st = s.stats()
        kv = st.kv
        return {
            "executor": self.executor_info(),
            "queue_lengths": s.queue_lengths(),
            "num_running": s.count(RequestStatus.RUNNING),
            "num_waiting": s.count(RequestStatus.WAITING),
            "num_preempted": s.count(RequestStatus.PREEMPTED),
            "num_swapped": s.count(RequestStatus.SWAPPED),
            "kv_blocks_free": kv.num_free_blocks,
            "kv_blocks_total": kv.num_total_blocks,
            "host_kv_blocks_free": kv.num_free_host_blocks,
            "host_kv_blocks_total": kv.num_total_host_blocks,
            "peak_kv_blocks": kv.peak_used_blocks,
            "swap_out_blocks": kv.num_swap_out_blocks,
            "swap_in_blocks": kv.num_swap_in_blocks,
            "swap_wait_s": self.core.swap_wait_s,
            "num_offloads": st.num_offloads,
            "num_uploads": st.num_uploads,
            "num_preemptions": s.num_preemptions,
            "num_recomputes": st.num_recomputes,
            "num_iterations": self.core.num_iterations,
            # Recent predicted (start-up profile) / measured iteration time, and the scale
            # the engine's cost model puts on the profile (`CostModelCheck`).
            "cost_model_ratio": self.cost_check.ratio,
            "cost_model_scale": self.cost_check.scale,
            "prefix_cache_query_tokens": st.num_prefix_query_tokens,
            "prefix_cache_hit_tokens": st.num_prefix_hit_tokens,
            "prefix_cache_device_blocks": kv.num_cached_blocks,
            "prefix_cache_host_blocks": kv.num_cached_host_blocks,
            "prefix_cache_host_hit_tokens": kv.num_host_hit_tokens,
            "prefix_cache_prefetched_tokens": kv.num_prefetched_tokens,
            "spec_decode_draft_tokens": s.num_draft_tokens,
            "spec_decode_accepted_tokens": s.num_accepted_tokens,
            **self._lora_stats(),
        }

    def _lora_stats(self) -> dict[str, object]:
        if self.loras.weights is None:
            return {}
        requests = self.scheduler.requests.values()
        return {"max_loras": self.loras.max_loras,
                "lora_requests": self.loras.requests_by_adapter(
                    (r.lora_id, r.status is RequestStatus.RUNNING) for r in requests)}

    # -- start-up -------------------------------------------------------------------------

    def _cost_model(self) -> tuple[CostModel, Path | None]:
        """The given profile, else this machine's own, measured once and cached; and where
        to cache it when it was measured just now (the engine's overhead is still to add)."""
        fresh: Path | None = None
        if self.config.profile_path:
            cost = CostModel.from_json(self.config.profile_path)
        elif self.config.model.startup_profile and isinstance(self.runner, ModelRunner):
            path = cached_profile_path(profile_cache_key(self.model_path, self.config),
                                       cache_dir() / "profiles")
            cached = load_cached(path)
            if cached is not None:
                cost = cached
            else:
                try:
                    with startup_step(logger, "profiling the cost model the scheduler decides "
                                      "with (once per model, dtype and machine; cached in "
                                      f"{path.parent})"):
                        cost, fresh = profile_engine(self.runner), path
                except ValueError as exc:  # e.g. a KV pool too small for the profile's batches
                    logger.warning("start-up profile skipped (%s); using the default cost model",
                                   exc)
                    cost = CostModel()
        else:  # NOTE: distributed executors are not profiled yet; the default model stands in
            cost = CostModel()
        if cost.kv_block_bytes == 0:  # what a swap costs: the proactive KV policy's copy budget
            cost = dataclasses.replace(cost, kv_block_bytes=self.runner.block_bytes)
        if isinstance(self.runner, ModelRunner):
            # Whether copies overlap compute is this executor's, whatever profile was given.
            # NOTE: their bandwidth is the profile's (`fastserve profile` measures it): timed
            # at every start-up on a busy machine it swung 100x and starved the copy budget.
            cost = dataclasses.replace(cost,
                                       copies_overlap=self.runner.swapper.overlaps_compute)
        return cost, fresh

    def _warmup(self) -> None:
        """Run a few real iterations so the first requests don't pay first-call costs."""
        bs = self.config.cache.block_size
        params = SamplingParams(max_tokens=4, temperature=0.0)
        prompt_len = min(64, self.max_model_len - 8)
        blocks_per = num_blocks_for(prompt_len + 8, bs)
        num = max(1, min(4, self.runner.num_blocks // blocks_per))
        tables = [list(range(i * blocks_per, (i + 1) * blocks_per)) for i in range(num)]
        plans = [
            [ScheduledRequest(f"warmup-{i}", [1] * prompt_len, 0, t, params, 0) for i, t in enumerate(tables)]
        ] + [
            [ScheduledRequest(f"warmup-{i}", [1], prompt_len + k, t, params, k + 1) for i, t in enumerate(tables)]
            for k in range(3)
        ]
        for scheduled in plans:
            self.runner.execute(SchedulerOutput(scheduled=scheduled))
        self.runner.execute(SchedulerOutput(scheduled=[], finished_ids=[f"warmup-{i}" for i in range(num)]))


def _salt(adapter_salt: str | None, cache_salt: str | None) -> str | None:
    """A request's prefix-cache salt: its adapter's and its own. NOTE: as JSON, so no own salt
    reads as an adapter's (whose blocks hold other weights' KV)."""
    if cache_salt is None:
        return adapter_salt
    if not cache_salt:
        raise InvalidRequestError("cache_salt: must be a non-empty string", "cache_salt")
    return json.dumps([adapter_salt, cache_salt])
