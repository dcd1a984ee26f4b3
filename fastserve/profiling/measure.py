"""Time the real executor on a small grid of batches: prefills of several sizes, prefill chunks
after long cached contexts, and decode batches of several sizes and context lengths (`fit.py`
turns the timings into a `CostModel`)."""

from __future__ import annotations

import dataclasses
import itertools
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from fastserve.clock import Timer
from fastserve.config import EngineConfig
from fastserve.core.cost_model import CostModel
from fastserve.core.kv import num_blocks_for
from fastserve.core.plan import ScheduledRequest, SchedulerOutput
from fastserve.executor.dtype_choice import resolve_config
from fastserve.executor.model_runner import TORCH_DTYPES, ModelRunner
from fastserve.executor.platform import platform_for
from fastserve.model.loader import load_model
from fastserve.model.make_model import resolve_model_path
from fastserve.profiling.fit import FEATURES, Sample
from fastserve.request import SamplingParams

_PARAMS = SamplingParams(max_tokens=1 << 20, temperature=0.0, ignore_eos=True)


@dataclass(frozen=True)
class ProfileGrid:
    """Which batches to time, most informative first: a time budget cuts the tail.

    The defaults keep the tiny model's profile to a few seconds on two CPU cores.
    """

    # Single-prompt prefill lengths.
    prefill_lens: tuple[int, ...] = (8, 512, 64, 1024, 256, 16)
    # Decode batches as (batch size, context length) pairs.
    decode_batches: tuple[tuple[int, int], ...] = (
        (1, 16), (16, 16), (4, 1024), (16, 256), (1, 1024), (4, 16), (16, 1024), (1, 256),
    )
    decode_steps: int = 2  # timed decode iterations per pair
    # Prefill chunks of `chunk_lens` tokens after each of `chunk_starts` cached tokens (one
    # untimed prefill fills the longest): what a later chunk of a long prompt costs, which
    # fresh prefills cannot show (its attention reads the whole cached context: the pairs
    # and prefill-context terms). Starts beyond the model's context are skipped.
    chunk_starts: tuple[int, ...] = (768, 1536, 3072)
    chunk_lens: tuple[int, ...] = (16, 128)
    # Each batch is timed this many times and the fastest kept: noise from other processes
    # only ever adds time.
    repeats: int = 3
    time_budget_s: float = 8.0  # stop adding batches after this long


def with_copies(cost: CostModel, runner: ModelRunner, clock: Timer = time.perf_counter
                ) -> CostModel:
    """`cost` with the runner's KV copies: their bandwidth, measured now when it has a host
    pool (a few milliseconds), and whether they overlap compute."""
    bandwidth = measure_copies(runner, clock=clock)
    return dataclasses.replace(
        cost, copies_overlap=runner.swapper.overlaps_compute,
        swap_bytes_per_s=cost.swap_bytes_per_s if bandwidth is None else bandwidth)


def measure_copies(runner: ModelRunner, num_blocks: int = 64, repeats: int = 3,
                   clock: Timer = time.perf_counter) -> float | None:
    """Bytes per second of the runner's KV copies: `num_blocks` out to host memory and back
    as one plan each, the fastest of `repeats`; None without a host pool.

    NOTE: the runner must be otherwise idle (it copies device blocks from id 0 up)."""
    n = min(num_blocks, runner.num_blocks, runner.num_host_blocks)
    if n == 0:
        return None
    pairs = [(i, i) for i in range(n)]
    best = float("inf")
    for _ in range(repeats):
        start = clock()
        runner.swapper.submit(pairs, [])
        runner.swapper.synchronize()
        runner.swapper.submit([], pairs)
        runner.swapper.synchronize()
        best = min(best, clock() - start)
    return 2 * n * runner.block_bytes / best if best > 0 else None


def measure(
    runner: ModelRunner, grid: ProfileGrid, clock: Timer = time.perf_counter
) -> list[Sample]:
    """Timed iterations over `grid`, until it is done or its time budget is spent."""
    timer = _Timer(runner, grid.repeats, clock)
    max_len = runner.arch.max_position_embeddings - grid.decode_steps - 1
    deadline = clock() + grid.time_budget_s
    timer.prefill(min(64, max_len))  # first calls pay for allocation; keep them out of the fit
    prefills = [
        n for n in grid.prefill_lens
        if n <= max_len and num_blocks_for(n + 1, runner.block_size) <= runner.num_blocks
    ]
    pairs = [
        (b, c) for b, c in grid.decode_batches
        if c <= max_len and b * num_blocks_for(c + grid.decode_steps, runner.block_size)
        <= runner.num_blocks
    ]
    samples: list[Sample] = []
    chunk_lens = sorted(grid.chunk_lens)
    starts = [
        s for s in sorted(grid.chunk_starts)
        if chunk_lens and s + chunk_lens[-1] <= max_len
        and num_blocks_for(s + chunk_lens[-1], runner.block_size) <= runner.num_blocks
    ]
    if starts:  # first: nothing else bounds a late chunk of a long prompt
        samples += timer.chunks(starts, chunk_lens)
    # Interleave the two kinds so a budget cut still leaves both prefill and decode points.
    for prefill, pair in itertools.zip_longest(prefills, pairs):
        if clock() > deadline and len(samples) >= 2 * len(FEATURES):
            break
        if prefill is not None:
            samples.append(timer.prefill(prefill))
        if pair is not None:
            batch, context = pair
            samples += timer.decode(batch, context, grid.decode_steps)
    return samples


class _Timer:
    """Builds plans over block ids 0.. and times `runner.execute` on them."""

    def __init__(self, runner: ModelRunner, repeats: int, clock: Timer) -> None:
        self.runner = runner
        self.repeats = repeats
        self.clock = clock
        self._ids = itertools.count()

    def prefill(self, num_tokens: int) -> Sample:
        (req,) = self._requests(1, num_tokens + 1)
        duration = self._time([req(0, num_tokens)])
        self._finish([req])
        return Sample(num_tokens, num_tokens * num_tokens, 0, 0, duration)

    def chunks(self, starts: list[int], lens: list[int]) -> list[Sample]:
        """Fill one request's KV up to the longest start (untimed), then time a prefill chunk
        of each length after each start (a rerun rewrites the same slots)."""
        (req,) = self._requests(1, starts[-1] + lens[-1])
        self.runner.execute(SchedulerOutput(scheduled=[req(0, starts[-1])]))
        samples = []
        for start in starts:
            for n in lens:
                duration = self._time([req(start, n)])
                samples.append(Sample(n, n * n + 2 * n * start, 0, 0, duration, start))
        self._finish([req])
        return samples

    def decode(self, batch: int, context: int, steps: int) -> list[Sample]:
        """Fill `batch` requests' KV with `context` tokens (untimed), then time `steps` decode
        iterations of the whole batch."""
        reqs = self._requests(batch, context + steps)
        for r in reqs:
            self.runner.execute(SchedulerOutput(scheduled=[r(0, context)]))
        samples = []
        for pos in range(context, context + steps):
            duration = self._time([r(pos, 1) for r in reqs])
            samples.append(Sample(0, 0, batch, batch * (pos + 1), duration))
        self._finish(reqs)
        return samples

    def _requests(self, num: int, num_tokens: int) -> list[_PlanFactory]:
        """`num` requests with room for `num_tokens` each, on consecutive blocks from id 0."""
        per = num_blocks_for(num_tokens, self.runner.block_size)
        if num * per > self.runner.num_blocks:
            raise ValueError(f"profile batch needs {num * per} KV blocks, the runner has "
                             f"{self.runner.num_blocks}")
        return [_PlanFactory(f"profile-{next(self._ids)}", list(range(i * per, (i + 1) * per)))
                for i in range(num)]

    def _time(self, scheduled: list[ScheduledRequest]) -> float:
        """Fastest of `repeats` runs (rerunning a step rewrites the same KV slots)."""
        best = float("inf")
        for _ in range(self.repeats):
            self._sync()
            start = self.clock()
            self.runner.execute(SchedulerOutput(scheduled=scheduled))
            self._sync()
            best = min(best, self.clock() - start)
        return best

    def _finish(self, reqs: list[_PlanFactory]) -> None:
        self.runner.execute(SchedulerOutput(scheduled=[], finished_ids=[r.request_id for r in reqs]))

    def _sync(self) -> None:
        platform_for(self.runner.device).synchronize(self.runner.device)


@dataclass(frozen=True)
class _PlanFactory:
    request_id: str
    block_ids: list[int]

    def __call__(self, start_pos: int, num_tokens: int) -> ScheduledRequest:
        # Token 1 everywhere: the timing does not depend on the ids.
        return ScheduledRequest(self.request_id, [1] * num_tokens, start_pos, self.block_ids,
                                _PARAMS, num_output_tokens=0 if start_pos == 0 else 1)


def build_runner(config: EngineConfig) -> tuple[ModelRunner, Path]:
    """The engine's executor alone (no scheduler, no tokenizer), as `LLMEngine` builds it."""
    if config.model.num_threads:
        torch.set_num_threads(config.model.num_threads)  # as the engine will run
    path = resolve_model_path(config.model.model)
    config, _ = resolve_config(config, path)  # dtype "auto" as the engine resolves it
    model, arch = load_model(path, TORCH_DTYPES[config.model.dtype], config.model.device,
                             load_format=config.model.load_format)
    runner = ModelRunner(model, arch, config.model, config.cache, list(arch.eos_token_ids))
    return runner, path
