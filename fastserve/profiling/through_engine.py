"""The running engine's own iterations: recording them, and profiling through the engine.

`IterationRecorder` keeps the batch shape and wall time of an engine's recent iterations
(`--record-iterations N`); `measure_through_engine` serves a synthetic load through a real
`AsyncLLM` and returns those records, which `fastserve profile --through-engine` fits into
the cost model. Unlike the executor-only profile (`fastserve.profiler.measure`), these times
include scheduling, sampling, detokenization and output delivery: what the simulator must
advance its clock by to predict the real engine's job completion times.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from fastserve.core.plan import SchedulerOutput
from fastserve.profiler import Sample, Timer
from fastserve.request import SamplingParams
from fastserve.sim.executor import batch_shape

if TYPE_CHECKING:
    from fastserve.config import EngineConfig


# -- per-iteration records of the running engine --------------------------------------------


class IterationRecorder:
    """The engine's last `capacity` iterations: batch shape and wall time, in a ring buffer.

    An iteration's time is its *cycle*: from the start of `LLMEngine.step()` to the start of
    the next one when the engine went straight on (it still had work), which also counts what
    the serving loop does between steps (handing outputs over, taking new requests); else the
    step alone. That is what the simulator's clock must advance by per iteration. Steps that
    ran no batch are not recorded.

    NOTE: a caller that holds work back between steps inflates the cycles; the engine's own
    loops (`AsyncLLM`, `LLM.generate`) step again at once.
    """

    def __init__(self, capacity: int, clock: Timer = time.perf_counter) -> None:
        if capacity < 1:
            raise ValueError(f"record capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self.clock = clock
        # (prefill tokens, sum of squared prefill lengths, decodes, decode context tokens,
        #  step_s, cycle_s); preallocated so recording allocates one tuple per iteration.
        self._rows: list[tuple[int, int, int, int, float, float] | None] = [None] * capacity
        self._num_recorded = 0
        self._open: tuple[int, int, int, int, float, float] | None = None  # cycle not closed yet

    @property
    def num_recorded(self) -> int:
        """Iterations recorded since the start (the buffer keeps the last `capacity`)."""
        return self._num_recorded + (self._open is not None)

    def begin(self) -> float:
        """Called first thing in a step: closes the previous iteration's cycle."""
        now = self.clock()
        if self._open is not None:
            a, b, c, d, start_s, step_s = self._open
            self._push((a, b, c, d, step_s, now - start_s))
            self._open = None
        return now

    def end(self, start_s: float, plan: SchedulerOutput | None, is_busy: bool) -> None:
        """Called last thing in a step; `is_busy`: work is left, so the next step follows."""
        if plan is None or plan.is_empty:
            return
        num_prefill, num_decodes, num_context, sum_sq = batch_shape(plan)
        step_s = self.clock() - start_s
        if is_busy:  # cycle closes at the next begin(); start_s kept in the cycle slot
            self._open = (num_prefill, sum_sq, num_decodes, num_context, start_s, step_s)
        else:
            self._push((num_prefill, sum_sq, num_decodes, num_context, step_s, step_s))

    def samples(self, cycle: bool = True) -> list[Sample]:
        """The buffered iterations, oldest first, timed by cycle (default) or by step alone."""
        n, cap = self._num_recorded, self.capacity
        rows = [self._rows[i % cap] for i in range(max(0, n - cap), n)]
        if self._open is not None:  # the last step: no next step to close its cycle
            a, b, c, d, _start_s, step_s = self._open
            rows.append((a, b, c, d, step_s, step_s))
        return [Sample(a, b, c, d, cyc if cycle else step)
                for a, b, c, d, step, cyc in (r for r in rows if r is not None)]

    def clear(self) -> None:
        self._rows = [None] * self.capacity
        self._num_recorded = 0
        self._open = None

    def _push(self, row: tuple[int, int, int, int, float, float]) -> None:
        self._rows[self._num_recorded % self.capacity] = row
        self._num_recorded += 1



# -- through the whole engine ---------------------------------------------------------------


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
    import asyncio

    load = load or EngineLoad()
    model = dataclasses.replace(config.model, startup_profile=False,
                                record_iterations=max(config.model.record_iterations, 1 << 17))
    cfg = dataclasses.replace(config, model=model,
                              scheduler=dataclasses.replace(config.scheduler, policy="fcfs"))
    return asyncio.run(_serve_load(cfg, load, clock))


async def _serve_load(
    config: EngineConfig, load: EngineLoad, clock: Timer
) -> tuple[list[Sample], int]:
    import asyncio

    from fastserve.async_engine import AsyncLLM

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
            room = engine.kv.num_total_blocks * engine.kv.block_size // batch
            await asyncio.gather(*(client(i * stagger, room) for i in range(batch)))
    finally:
        await llm.shutdown()
    return engine.recorder.samples(), engine.runner.block_bytes


def _log_uniform(rng: np.random.Generator, low: int, high: int, size: int) -> list[int]:
    return [int(x) for x in np.exp(rng.uniform(np.log(low), np.log(high + 1), size))]
