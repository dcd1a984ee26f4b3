"""Measure the real executor's iteration time and fit the scheduler's cost model.

The scheduler (skip-join placement, quanta) and the simulator both read a `CostModel`. This
module times real iterations over a small grid of batches, prefill batches of several sizes
and decode batches of several sizes and context lengths, and fits the model's coefficients
by non-negative weighted least squares. `load_or_profile` caches the fit per model, dtype and
device, so the engine pays for profiling once.

`--through-engine` times whole engine iterations instead (schedule, execute, update,
detokenize, output delivery), recorded by the engine itself (`IterationRecorder`) while it
serves a synthetic load: what the simulator needs to predict the real engine's job times. On a
small model the executor is only about half of an iteration.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import itertools
import os
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from fastserve.core.cost_model import CostModel
from fastserve.core.kv_manager import num_blocks_for
from fastserve.core.plan import ScheduledRequest, SchedulerOutput
from fastserve.request import SamplingParams

if TYPE_CHECKING:
    from fastserve.config import EngineConfig
    from fastserve.executor.model_runner import ModelRunner

# The cost model's terms, in `Sample.features` order.
FEATURES = ("fixed_s", "per_prefill_token_s", "per_prefill_token2_s", "per_decode_s",
            "per_context_token_s")
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
    # Each batch is timed this many times and the fastest kept: noise from other processes
    # only ever adds time.
    repeats: int = 3
    time_budget_s: float = 8.0  # stop adding batches after this long


@dataclass(frozen=True)
class Sample:
    """One timed iteration: what was in the batch and how long it took."""

    num_prefill_tokens: int
    sum_prefill_sq: int
    num_decodes: int
    num_context_tokens: int
    duration_s: float

    @property
    def features(self) -> list[float]:
        return [1.0, self.num_prefill_tokens, self.sum_prefill_sq, self.num_decodes,
                self.num_context_tokens]


Timer = Callable[[], float]


def profile_engine(
    runner: ModelRunner, grid: ProfileGrid | None = None, clock: Timer = time.perf_counter
) -> CostModel:
    """Time the runner on `grid`'s batches and fit a `CostModel` to the timings.

    NOTE: the runner must be otherwise idle: the profile writes KV blocks from id 0 up.
    """
    samples = measure(runner, grid or ProfileGrid(), clock)
    return fit_cost_model(samples, kv_block_bytes=runner.block_bytes)


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
        if self.runner.device.type == "cuda":
            import torch

            torch.cuda.synchronize(self.runner.device)


@dataclass(frozen=True)
class _PlanFactory:
    request_id: str
    block_ids: list[int]

    def __call__(self, start_pos: int, num_tokens: int) -> ScheduledRequest:
        # Token 1 everywhere: the timing does not depend on the ids.
        return ScheduledRequest(self.request_id, [1] * num_tokens, start_pos, self.block_ids,
                                _PARAMS, num_output_tokens=0 if start_pos == 0 else 1)


# Batch sizes tried as the decode cost's knee (0: none; see `CostModel`), and how much better
# (relative squared error) a knee must fit to be taken over a straight line.
DECODE_KNEES = (0, 2, 4, 8)
KNEE_MIN_GAIN = 0.02


def fit_cost_model(
    samples: list[Sample], kv_block_bytes: int = 0, fit_mean: bool = False,
    decode_knees: tuple[int, ...] = DECODE_KNEES,
) -> CostModel:
    """Non-negative least squares on relative error (short decode steps count as much as long
    prefills). A term that would come out negative (noise) is dropped and the rest refitted.

    The per-decode cost is fitted as two slopes, below and beyond a knee, for each knee in
    `decode_knees` (0: one straight line) that has at least two timed batch sizes on each
    side; a knee fit whose slopes are not both positive is dropped. Going through them in
    order, a knee replaces the fit kept so far only if its relative squared error is
    `KNEE_MIN_GAIN` lower.

    `fit_mean`: the samples are single noisy timings (iterations recorded in a running engine)
    and the model should predict their mean, so that simulated iterations add up to the real
    total. Weighting by 1/measured would favour the samples noise made fast and fit below the
    mean; the fit is redone (twice) weighting by 1/predicted instead, which keeps the errors
    relative but no longer depends on the noise.
    """
    if len(samples) < 2:
        raise ValueError(f"need at least 2 timed iterations to fit a cost model, got {len(samples)}")
    if not decode_knees:
        raise ValueError("decode_knees must name at least one knee (0 = none)")
    x = np.array([s.features for s in samples], dtype=np.float64)
    y = np.array([s.duration_s for s in samples], dtype=np.float64)
    counts = np.unique(x[:, 3][x[:, 3] > 0])  # the batch sizes of decodes timed
    fits = []  # (mean squared relative error, knee, coefficients), in `decode_knees` order
    for knee in dict.fromkeys((0, *decode_knees)):  # the straight line always stands
        # NOTE: a slope needs two batch sizes on its side of the knee: the start-up grid
        # times batches of 1, 4 and 16 only, and a knee at 2 there made the first decodes
        # free (the fixed cost took their share), which starved the KV copy budget.
        if knee and ((counts <= knee).sum() < 2 or (counts > knee).sum() < 2):
            continue
        xk = _split_decodes(x, knee)
        coef = _nnls(xk, y, 1.0 / np.maximum(y, 1e-9))
        for _ in range(2 if fit_mean else 0):
            coef = _nnls(xk, y, 1.0 / np.maximum(xk @ coef, 1e-9))
        if knee and not (coef[3] > 0 and coef[5] > 0):
            continue  # every decode costs something on either side
        fits.append((float(np.mean(((xk @ coef - y) / np.maximum(y, 1e-9)) ** 2)), knee, coef))
    best = fits[0]
    for fit in fits[1:]:
        if fit[0] < best[0] * (1 - KNEE_MIN_GAIN):
            best = fit
    _, knee, coef = best
    fixed, prefill, prefill2, decode, context = map(float, coef[:5])  # FEATURES order
    return CostModel(fixed_s=fixed, per_prefill_token_s=prefill, per_prefill_token2_s=prefill2,
                     per_decode_s=decode, per_context_token_s=context,
                     decode_knee=knee, per_decode_beyond_knee_s=float(coef[5]) if knee else 0.0,
                     kv_block_bytes=kv_block_bytes)


def _split_decodes(x: np.ndarray, knee: int) -> np.ndarray:
    """FEATURES, the decodes counted up to `knee` only, then the decodes beyond it (a sixth
    column) when there is a knee."""
    if knee == 0:
        return x
    decodes = x[:, 3]
    out = np.concatenate([x, np.maximum(decodes - knee, 0)[:, None]], axis=1)
    out[:, 3] = np.minimum(decodes, knee)
    return out


def _nnls(x: np.ndarray, y: np.ndarray, w: np.ndarray) -> np.ndarray:
    """Weighted least squares, dropping the most negative term until none is negative."""
    active = [j for j in range(x.shape[1]) if np.any(x[:, j])]
    coef = np.zeros(x.shape[1])
    while active:
        sol, *_ = np.linalg.lstsq(x[:, active] * w[:, None], y * w, rcond=None)
        if (sol >= 0).all():
            coef[active] = sol
            break
        del active[int(np.argmin(sol))]
    return coef


# -- cache --------------------------------------------------------------------------------


def load_or_profile(
    runner: ModelRunner,
    cache_key: str,
    cache_dir: str | Path,
    grid: ProfileGrid | None = None,
    clock: Timer = time.perf_counter,
) -> CostModel:
    """The cached profile for `cache_key`, or a fresh one written to the cache.

    A missing or unreadable cache file means "profile again"; the write is atomic, so engines
    starting together never read half a file.
    """
    path = Path(cache_dir) / f"profile-{_file_safe(cache_key)}.json"
    if path.is_file():
        try:
            return CostModel.from_json(path)
        except (ValueError, TypeError):
            pass  # corrupt or from an older CostModel: profile again
    cost = profile_engine(runner, grid, clock)
    save_profile(cost, path, cache_key=cache_key)
    return cost


# Bumped when the fit changes what it would make of the same timings (2: the decode knee;
# 3: knees only with two batch sizes on each side), so cached profiles fitted the old way are
# measured again.
FIT_VERSION = 3


def profile_cache_key(model_path: str | Path, config: EngineConfig) -> str:
    """What the timings depend on: the checkpoint, dtypes, device, CPU threads, parallelism
    and KV block size; and the fit's version."""
    m, c, p = config.model, config.cache, config.parallel
    return (f"{Path(model_path).resolve()}|{m.dtype}|kv-{c.kv_cache_dtype}|{m.device}"
            f"|threads{m.num_threads}|tp{p.tensor_parallel_size}|pp{p.pipeline_parallel_size}"
            f"|bs{c.block_size}|fit{FIT_VERSION}")


def save_profile(cost: CostModel, path: str | Path, **meta: object) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    os.close(fd)
    try:
        cost.to_json(tmp, **meta)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _file_safe(key: str) -> str:
    readable = "".join(c if c.isalnum() or c in "-_." else "_" for c in key)[-60:]
    return f"{readable}-{hashlib.sha256(key.encode()).hexdigest()[:12]}"


# -- CLI ----------------------------------------------------------------------------------


def add_profile_parser(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    from fastserve.args import add_engine_args

    p = subparsers.add_parser(
        "profile",
        help="time the real executor and fit the cost model (JSON for --profile)",
        description=__doc__,
    )
    p.add_argument("--out", required=True, help="profile JSON to write")
    p.add_argument("--time-budget-s", type=float, default=30.0,
                   help="stop adding grid points (or load rounds) after this long (default 30)")
    p.add_argument("--through-engine", action="store_true",
                   help="time whole engine iterations (schedule, execute, update, detokenize, "
                        "output delivery) under a synthetic load through AsyncLLM, instead of "
                        "the executor alone on a grid; what the simulator should use to "
                        "predict the real engine's job completion times")
    add_engine_args(p, skip=("warmup",))
    p.set_defaults(func=run_profile)


def run_profile(args: argparse.Namespace) -> int:
    from fastserve.args import engine_config_from_args

    config = engine_config_from_args(args)
    start = time.perf_counter()
    if args.through_engine:
        from fastserve.engine_profile import EngineLoad, measure_through_engine
        from fastserve.llm_engine import resolve_model_path

        samples, block_bytes = measure_through_engine(
            config, dataclasses.replace(EngineLoad(), time_budget_s=args.time_budget_s,
                                        seed=config.model.seed))
        model_path = resolve_model_path(config.model.model)
    else:
        runner, model_path = build_runner(config)
        samples = measure(runner, dataclasses.replace(ProfileGrid(),
                                                      time_budget_s=args.time_budget_s))
        block_bytes = runner.block_bytes
    cost = fit_cost_model(samples, kv_block_bytes=block_bytes, fit_mean=args.through_engine)
    save_profile(cost, args.out, model=str(model_path), dtype=config.model.dtype,
                 device=config.model.device, block_size=config.cache.block_size,
                 num_threads=config.model.num_threads,
                 method="through-engine" if args.through_engine else "executor",
                 num_samples=len(samples), fit_error=fit_error(cost, samples))
    print(f"timed {len(samples)} iterations in {time.perf_counter() - start:.1f} s; "
          f"median relative error of the fit {fit_error(cost, samples):.1%}, "
          f"total predicted / measured {total_ratio(cost, samples):.3f}")
    for name in FEATURES:
        print(f"  {name:22s} {getattr(cost, name):.3e}")
    if cost.decode_knee:
        print(f"  per decode beyond {cost.decode_knee:2d} decodes {cost.per_decode_beyond_knee_s:.3e}")
    print(f"wrote {args.out}")
    return 0


def fit_error(cost: CostModel, samples: list[Sample]) -> float:
    """Median |predicted - measured| / measured over the samples."""
    rel = [abs(predict(cost, s) - s.duration_s) / s.duration_s for s in samples]
    return float(np.median(rel))


def total_ratio(cost: CostModel, samples: list[Sample]) -> float:
    """Predicted over measured time of all the samples: what a simulated run's busy time is
    off by (at high load, job completion times are off by a multiple of it)."""
    return sum(predict(cost, s) for s in samples) / sum(s.duration_s for s in samples)


def predict(cost: CostModel, sample: Sample) -> float:
    s = sample
    return cost.iteration_s(s.num_prefill_tokens, s.num_decodes, s.num_context_tokens,
                            s.sum_prefill_sq)


def build_runner(config: EngineConfig) -> tuple[ModelRunner, Path]:
    """The engine's executor alone (no scheduler, no tokenizer), as `LLMEngine` builds it."""
    from fastserve.executor.model_runner import TORCH_DTYPES, ModelRunner
    from fastserve.llm_engine import resolve_model_path
    from fastserve.model.loader import load_model

    if config.model.num_threads:
        import torch

        torch.set_num_threads(config.model.num_threads)  # as the engine will run
    path = resolve_model_path(config.model.model)
    model, arch = load_model(path, TORCH_DTYPES[config.model.dtype], config.model.device)
    runner = ModelRunner(model, arch, config.model, config.cache, list(arch.eos_token_ids))
    return runner, path
