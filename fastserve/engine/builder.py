"""Start-up: what an engine runs on, built once and in order (vLLM V1 builds its engine core's
parts the same way before the loop starts).

`build_parts` checks the model directory, reads the tokenizer, loads the weights, sizes the
KV pool for the device, picks the executor (this process's `ModelRunner`, or the distributed
executor over its ranks), reads the LoRA adapters, wires the grammars to the sampler, warms
up and settles the cost model the scheduler decides with (a given profile, the cached one,
or one measured now). `with_engine_overhead` adds the engine's own work per iteration to a
freshly measured profile, measured through an engine built from the same parts, and caches
it. `LLMEngine` then builds its engine core once, over the final cost model.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch

from fastserve.config import EngineConfig
from fastserve.core.cost_model import CostModel
from fastserve.core.kv import num_blocks_for
from fastserve.core.plan import ScheduledRequest, SchedulerOutput
from fastserve.engine.loras import AdapterSlots, LoRAAdapters, read_lora
from fastserve.engine.overhead import Steppable, measure_engine_overhead
from fastserve.engine.startup_checks import check_cache_writable, check_stop_ids, check_weights_fit
from fastserve.executor.base import Executor
from fastserve.executor.cpu_kernels import decode_attention_kernel
from fastserve.executor.device_choice import choose_device
from fastserve.executor.distributed.launch import start_executor
from fastserve.executor.distributed.stage import pool_sizes
from fastserve.executor.dtype_choice import DtypeChoice, resolve_config
from fastserve.executor.grammar import StructuredOutputs
from fastserve.executor.kv_sizing import CPU_KV_CACHE_GIB, check_pool_holds, gpu_max_batch_size
from fastserve.executor.memory_profile import KVPoolPlan, plan_kv_pool
from fastserve.executor.model_runner import TORCH_DTYPES, ModelRunner
from fastserve.executor.platform import platform_for
from fastserve.logs import startup_step
from fastserve.model.arch import ArchConfig
from fastserve.model.llama import LlamaForCausalLM
from fastserve.model.loader import load_model, read_arch_config
from fastserve.model.lora import LoRAWeights
from fastserve.model.make_model import resolve_model_path
from fastserve.model.tokenizer import Tokenizer
from fastserve.paths import cache_dir
from fastserve.profiling.cache import (
    cached_profile_path,
    load_cached,
    profile_cache_key,
    profile_engine,
    save_profile,
)
from fastserve.request import SamplingParams

logger = logging.getLogger(__name__)


class EngineExecutor(Executor, Protocol):
    """What `LLMEngine` asks of its executor besides running plans: this process's
    `ModelRunner` or the `DistributedExecutor` over several. The engine asks; it never checks
    which one it has."""

    @property
    def num_blocks(self) -> int: ...  # device KV blocks

    @property
    def num_host_blocks(self) -> int: ...

    @property
    def block_bytes(self) -> int: ...  # one block's KV: what a swap copies

    @property
    def is_sampler(self) -> bool:
        """Whether this process samples (a pipeline's last stage samples on another rank):
        logits processors run only where it does."""
        ...

    @property
    def info(self) -> dict[str, str]:
        """What runs, as chosen at start-up (device, dtype, kernels)."""
        ...

    @property
    def copies_overlap_compute(self) -> bool | None:
        """Whether KV copies run beside the compute (None: not known here)."""
        ...

    def use_grammars(self, grammars: StructuredOutputs) -> None: ...

    def check_health(self) -> None:
        """Raise `ExecutorDeadError` once the executor can run no more."""
        ...

    def shutdown(self) -> None:
        """Stop what the executor started (workers); safe to call more than once."""
        ...


@dataclass(frozen=True)
class EngineParts:
    """What `build_parts` made: everything an engine's requests pass through but the
    scheduler and the step loop, which `LLMEngine` builds over `cost`."""

    config: EngineConfig  # "auto" resolved, and the KV pool and batch sized for the device
    model_path: Path
    arch: ArchConfig
    tokenizer: Tokenizer
    eos_token_ids: list[int]
    max_model_len: int  # the context limit: the configured one, or the checkpoint's, or the pool's
    dtype_choice: DtypeChoice  # what "auto" resolved to, and why (shown in /metrics)
    runner: EngineExecutor
    loras: LoRAAdapters  # the adapters served and their slots (0: the base model)
    grammars: StructuredOutputs  # structured output: compiled as requests come, masked by the sampler
    cost: CostModel  # what the scheduler decides with
    # A profile measured at this start-up: where to cache it once the engine's own work per
    # iteration is added (`with_engine_overhead`); None when it came from a file or the cache.
    fresh_profile: Path | None = None


def build_parts(config: EngineConfig) -> EngineParts:
    """Load, size, pick the executor, wire, warm up and profile, in that order. Raises
    ValueError naming what is wrong (a missing tokenizer, a model too large, a bad limit)."""
    check_cache_writable()  # before the slow part: the profile is saved there at its end
    path = resolve_model_path(config.model.model)
    if config.model.device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device {config.model.device!r} requested but CUDA is not available")
    # Read before the weights (and the dtype probe, which runs the model's shapes): a broken
    # config, tokenizer.json or stop token fails in a second, and an absurd size at once.
    arch = read_arch_config(path)  # first: it says what a model argument may be
    try:
        tokenizer = Tokenizer(path, config.model.chat_template)
    except FileNotFoundError as exc:
        raise ValueError(f"cannot load the tokenizer: {exc}") from None
    check_stop_ids(tokenizer.eos_token_ids, arch.vocab_size, path)
    parallel = config.parallel
    num_ranks = parallel.tensor_parallel_size * parallel.pipeline_parallel_size
    check_weights_fit(arch, TORCH_DTYPES.get(config.model.dtype, torch.bfloat16),
                      config.model.device, num_ranks, path / "config.json")
    if platform_for(choose_device(config.model.device, torch.cuda.is_available())
                    ).runs_on_host_cores:
        # Built (once per version and machine) now, with a line saying so, rather than in
        # the middle of the dtype probe or the first request.
        decode_attention_kernel()
    # "auto" becomes a dtype here, before anything (profile cache, workers) reads it.
    config, dtype_choice = resolve_config(config, path)
    if config.model.num_threads:
        torch.set_num_threads(config.model.num_threads)
    lora = config.lora
    model: LlamaForCausalLM | None = None
    weights: AdapterSlots | None = None
    if num_ranks == 1:  # else every rank loads its own shard (start_executor)
        with startup_step(logger, f"loading {path} ({config.model.dtype}, "
                                  f"{config.model.device})"):
            model, arch = load_model(path, TORCH_DTYPES[config.model.dtype], config.model.device,
                                     load_format=config.model.load_format)
        if lora.is_enabled:
            weights = LoRAWeights(model, arch, lora.max_loras + 1)
            model.lora_batch = weights.batch
    # LoRA adapters: a request names one (its slot of `weights`; 0: the base model). Read
    # (and checked) before the workers start.
    loras = LoRAAdapters(weights, arch, lora.max_lora_rank, lora.max_loras)
    startup_adapters = [(read_lora(name, adapter_path, arch, lora.max_lora_rank), adapter_path)
                        for name, adapter_path in lora.adapters]
    eos_token_ids = list(tokenizer.eos_token_ids)
    # The KV pool's blocks (a GPU's from its memory), what one request may hold, and a GPU's
    # batch: all before the runner, which captures graphs up to that batch.
    config, max_model_len = size_for_device(
        config, arch, eos_token_ids, _max_model_len(config.model.max_model_len,
                                                    arch.max_position_embeddings), model)
    runner: EngineExecutor
    local: ModelRunner | None = None  # the runner in this process, which start-up profiles
    if model is None:
        runner = distributed = start_executor(config, path, eos_token_ids)
        if lora.is_enabled:  # every rank holds its shard of each adapter
            loras.weights = distributed
    else:
        runner = local = ModelRunner(model, arch, config.model, config.cache, eos_token_ids)
    for adapter, adapter_path in startup_adapters:
        loras.add(adapter, adapter_path, busy_slots=())
    # Structured output: grammars compile as requests are added; the sampler masks with them.
    grammars = StructuredOutputs(tokenizer, arch.vocab_size, eos_token_ids, config.limits)
    runner.use_grammars(grammars)
    if config.model.warmup:
        with startup_step(logger, "warm-up passes", expect_slow=False):
            warmup(runner, config.cache.block_size, max_model_len)
    cost, fresh = _cost_model(config, path, runner, local)
    return EngineParts(config, path, arch, tokenizer, eos_token_ids, max_model_len, dtype_choice,
                       runner, loras, grammars, cost, fresh)


def with_engine_overhead(parts: EngineParts, probe: Callable[[EngineParts], Steppable]
                         ) -> EngineParts:
    """`parts` with a freshly measured profile's cost model completed and cached: the
    engine's own work per iteration added, measured through `probe(parts)`, an engine that
    is dropped afterwards (its counters moved). Parts whose profile was not measured now come
    back as they are."""
    if parts.fresh_profile is None:
        return parts
    cost = parts.cost
    with startup_step(logger, "measuring the engine's overhead per iteration"):
        overhead = measure_engine_overhead(probe(parts))
    if overhead is not None:
        cost = overhead.apply(cost)
        logger.info("engine overhead per iteration: %.2f ms + %.3f ms per decode",
                    overhead.fixed_s * 1e3, overhead.per_job_s * 1e3)
    save_profile(cost, parts.fresh_profile, method="executor grid + engine overhead")
    return dataclasses.replace(parts, cost=cost, fresh_profile=None)


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


def size_for_device(config: EngineConfig, arch: ArchConfig, eos_token_ids: list[int],
                    max_model_len: int, model: LlamaForCausalLM | None
                    ) -> tuple[EngineConfig, int]:
    """The config with the KV pool's blocks, the context limit and the batch settled for this
    device, and the context limit (`model` None: distributed ranks size their pools from the
    config)."""
    sched, cache = config.scheduler, config.cache
    platform = platform_for(config.model.device)  # resolved: "auto" is settled by now
    if model is None:
        if platform.profiles_kv_pool and cache.kv_cache_gib is None and cache.num_device_blocks is None:
            logger.warning("tensor/pipeline parallel ranks do not profile their memory yet: "
                           "each takes a %g GiB KV pool; give --kv-cache-gib to size it",
                           CPU_KV_CACHE_GIB)
        plan = KVPoolPlan(pool_sizes(config, arch).num_device_blocks, "the configured size")
    else:
        # The profiled batch is the largest the scheduler may run: a GPU's default batch is
        # at most what the graphs capture.
        num_seqs = config.model.cuda_graph_max_batch_size \
            if sched.is_max_batch_size_auto else sched.max_batch_size
        plan = plan_kv_pool(config, model, arch, eos_token_ids, max_model_len, num_seqs)
    bs = cache.block_size
    model_config = config.model
    if cache.num_device_blocks is not None and config.model.max_model_len is None \
            and plan.num_blocks * bs < max_model_len:
        # NOTE: a pool given in blocks and no context limit: the pool sets the limit (as many
        # tests and small benchmarks size them); a limit given is checked below.
        logger.warning("max_model_len %d -> %d: what --num-device-blocks %d of %d tokens "
                       "hold (give --max-model-len to be refused instead)",
                       max_model_len, plan.num_blocks * bs, plan.num_blocks, bs)
        max_model_len = plan.num_blocks * bs
        model_config = dataclasses.replace(model_config, max_model_len=max_model_len)
    check_pool_holds(max_model_len, bs, plan.num_blocks, plan.how_sized)
    logger.info("KV pool: %d blocks of %d tokens (%s); max_model_len %d",
                plan.num_blocks, bs, plan.how_sized, max_model_len)
    if platform.captures_graphs and sched.is_max_batch_size_auto:
        batch = gpu_max_batch_size(plan.num_blocks, model_config.cuda_graph_max_batch_size)
        sched = dataclasses.replace(sched, max_batch_size=batch)
        logger.info("max_batch_size %d: what the KV pool and the captured graphs hold", batch)
    if platform.captures_graphs:  # graphs only up to the batch the scheduler runs
        model_config = dataclasses.replace(model_config, cuda_graph_max_batch_size=min(
            model_config.cuda_graph_max_batch_size, sched.max_batch_size))
    return dataclasses.replace(
        config, model=model_config, scheduler=sched,
        cache=dataclasses.replace(cache, num_device_blocks=plan.num_blocks)), max_model_len


def _cost_model(config: EngineConfig, model_path: Path, runner: EngineExecutor,
                local: ModelRunner | None) -> tuple[CostModel, Path | None]:
    """The given profile, else this machine's own, measured once (through `local`, the
    runner in this process) and cached; and where to cache it when it was measured just now
    (the engine's overhead is still to add)."""
    fresh: Path | None = None
    if config.profile_path:
        cost = CostModel.from_json(config.profile_path)
    elif config.model.startup_profile and local is not None:
        path = cached_profile_path(profile_cache_key(model_path, config), cache_dir() / "profiles")
        cached = load_cached(path)
        if cached is not None:
            cost = cached
        else:
            try:
                with startup_step(logger, "profiling the cost model the scheduler decides "
                                  "with (once per model, dtype and machine; cached in "
                                  f"{path.parent})"):
                    cost, fresh = profile_engine(local), path
            except ValueError as exc:  # e.g. a KV pool too small for the profile's batches
                logger.warning("start-up profile skipped (%s); using the default cost model", exc)
                cost = CostModel()
    else:  # NOTE: distributed executors are not profiled yet; the default model stands in
        cost = CostModel()
    if cost.kv_block_bytes == 0:  # what a swap costs: the proactive KV policy's copy budget
        cost = dataclasses.replace(cost, kv_block_bytes=runner.block_bytes)
    overlap = runner.copies_overlap_compute
    if overlap is not None:
        # Whether copies overlap compute is this executor's, whatever profile was given.
        # NOTE: their bandwidth is the profile's (`fastserve profile` measures it): timed at
        # every start-up on a busy machine it swung 100x and starved the copy budget.
        cost = dataclasses.replace(cost, copies_overlap=overlap)
    return cost, fresh


def warmup(runner: EngineExecutor, block_size: int, max_model_len: int) -> None:
    """Run a few real iterations so the first requests don't pay first-call costs."""
    params = SamplingParams(max_tokens=4, temperature=0.0)
    prompt_len = min(64, max_model_len - 8)
    blocks_per = num_blocks_for(prompt_len + 8, block_size)
    num = max(1, min(4, runner.num_blocks // blocks_per))
    tables = [list(range(i * blocks_per, (i + 1) * blocks_per)) for i in range(num)]
    plans = [
        [ScheduledRequest(f"warmup-{i}", [1] * prompt_len, 0, t, params, 0) for i, t in enumerate(tables)]
    ] + [
        [ScheduledRequest(f"warmup-{i}", [1], prompt_len + k, t, params, k + 1) for i, t in enumerate(tables)]
        for k in range(3)
    ]
    for scheduled in plans:
        runner.execute(SchedulerOutput(scheduled=scheduled))
    runner.execute(SchedulerOutput(scheduled=[], finished_ids=[f"warmup-{i}" for i in range(num)]))
