"""Profiling through the whole engine: `measure_through_engine` serves a synthetic load
through a real `AsyncLLM` and returns the iterations its `IterationRecorder` kept, which
`fastserve profile --through-engine` fits into the cost model. Unlike the executor-only
profile (`fastserve.profiling.measure`), these times include scheduling, sampling, detokenization and output
delivery: what the simulator must advance its clock by to predict the real engine's job
completion times.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import time
from dataclasses import dataclass

import numpy as np

from fastserve.clock import Timer
from fastserve.config import EngineConfig
from fastserve.engine.async_llm import AsyncLLM
from fastserve.profiling.fit import Sample
from fastserve.request import SamplingParams


@dataclass(frozen=True)
class EngineLoad:
    """The synthetic load `measure_through_engine` serves, in rounds.

    A round keeps `batch` jobs in the engine: `batch` clients, each sending `jobs_per_client`
    jobs one after another (so new prompts join running decodes and the batch stays near its
    size), starting together (batched prefills) or `stagger_s` apart. Prompt and output
    lengths are log-uniform, most short and a few long, reaching the long decode contexts of
    heavy-tailed workloads.
    """

    batch_sizes: tuple[int, ...] = (16, 1, 8, 2, 12, 4)
    stagger_s: tuple[float, ...] = (0.0, 0.01)
    jobs_per_client: int = 3
    max_prompt_len: int = 512
    max_output_len: int = 1024
    time_budget_s: float = 30.0  # no new round after this long
    seed: int = 0


def measure_through_engine(
    config: EngineConfig, load: EngineLoad | None = None, clock: Timer = time.perf_counter
) -> tuple[list[Sample], int]:
    """Serve `load` with a real `AsyncLLM` (FCFS); returns its recorded iterations and the
    engine's KV block bytes (for the cost model's swap term).

    Unlike `measure`, each sample is a whole engine iteration as the server runs it: schedule,
    execute, update, detokenize and output delivery, with the asyncio side streaming tokens.
    Fit them with `fit_cost_model(..., fit_mean=True)`.
    """
    load = load or EngineLoad()
    model = dataclasses.replace(config.model, startup_profile=False,
                                record_iterations=max(config.model.record_iterations, 1 << 17))
    cfg = dataclasses.replace(config, model=model,
                              scheduler=dataclasses.replace(config.scheduler, policy="fcfs"))
    return asyncio.run(_serve_load(cfg, load, clock))


async def _serve_load(
    config: EngineConfig, load: EngineLoad, clock: Timer
) -> tuple[list[Sample], int]:
    llm = AsyncLLM(config)
    engine = llm.engine
    assert engine.recorder is not None
    rng = np.random.default_rng(load.seed)
    max_prompt = min(load.max_prompt_len, config.scheduler.max_num_batched_tokens,
                     engine.max_model_len - 2)
    vocab = engine.arch.vocab_size

    async def client(delay_s: float, room: int) -> None:
        await asyncio.sleep(delay_s)
        for _ in range(load.jobs_per_client):
            (prompt_len,) = _log_uniform(rng, 4, max_prompt, 1)
            (output_len,) = _log_uniform(rng, 1, load.max_output_len, 1)
            # Within the job's share of the KV pool, so no job waits for memory.
            output_len = max(1, min(output_len, engine.max_model_len - prompt_len,
                                    room - prompt_len))
            prompt = rng.integers(min(16, vocab - 1), vocab, size=prompt_len).tolist()
            params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
            async for _ in llm.generate(prompt, params):
                pass

    try:
        deadline = clock() + load.time_budget_s
        for r in itertools.count():
            if clock() > deadline:
                break
            batch = load.batch_sizes[r % len(load.batch_sizes)]
            stagger = load.stagger_s[r // len(load.batch_sizes) % len(load.stagger_s)]
            kv = engine.scheduler.stats().kv
            room = kv.num_total_blocks * kv.block_size // batch
            await asyncio.gather(*(client(i * stagger, room) for i in range(batch)))
    finally:
        await llm.shutdown()
    return engine.recorder.samples(), engine.runner.block_bytes


def _log_uniform(rng: np.random.Generator, low: int, high: int, size: int) -> list[int]:
    return [int(x) for x in np.exp(rng.uniform(np.log(low), np.log(high + 1), size))]
