"""Robust skip-join-mlfq opens two more levels while the finished jobs' output lengths are
heavy-tailed, and closes them when they no longer are. Runs through the real scheduler on a
virtual clock (batch 1, 1 ms per token): what changes is who finishes first."""

from __future__ import annotations

import pytest

from fastserve.config import SchedulerConfig
from fastserve.core.cost_model import CostModel
from fastserve.core.policies.mlfq_settings import (
    DEEP_TAIL_RATIO,
    ROBUST_DEEP_LEVELS,
    ROBUST_LEVELS,
    SHALLOW_TAIL_RATIO,
    TAIL_MIN_SAMPLES,
    TAIL_WINDOW,
    MLFQSettings,
    TailEstimate,
)
from fastserve.request import Request
from tests.core.factories import UNIT_COST, make_requests, make_scheduler, serve

HEAVY_TAIL = ([2] * 9 + [400]) * 7  # 70 jobs: most end at once, a few run long
ALIKE = [100] * 130


def test_tail_estimate_needs_samples_and_tells_heavy_from_alike() -> None:
    tail = TailEstimate(age=28)
    for n in HEAVY_TAIL[: TAIL_MIN_SAMPLES - 1]:
        assert not tail.add(n)
    assert tail.ratio is None and not tail.is_heavy
    assert tail.add(HEAVY_TAIL[TAIL_MIN_SAMPLES - 1])  # renewed at the 64th
    assert tail.ratio is not None and tail.ratio > DEEP_TAIL_RATIO and tail.is_heavy
    alike = TailEstimate(age=28)
    for n in ALIKE[:TAIL_MIN_SAMPLES]:
        alike.add(n)
    assert alike.ratio == pytest.approx(0.72) and not alike.is_heavy
    short = TailEstimate(age=28)  # nobody outlived the age: nothing says a tail exists
    for _ in range(TAIL_MIN_SAMPLES):
        short.add(10)
    assert short.ratio == 0.0 and not short.is_heavy


def test_tail_estimate_opens_and_closes_at_different_ratios() -> None:
    # Lengths 1 and x, half each, a = 28: E[L - a | L > a] / E[L] = 2 (x - 28) / (x + 1).
    def estimate(tail: TailEstimate, x: int) -> TailEstimate:
        for i in range(TAIL_WINDOW):
            tail.add(1 if i % 2 else x)
        return tail

    between = 76  # ratio 1.25: between the two thresholds
    assert SHALLOW_TAIL_RATIO < 2 * (between - 28) / (between + 1) < DEEP_TAIL_RATIO
    assert not estimate(TailEstimate(age=28), between).is_heavy  # not enough to open
    opened = estimate(TailEstimate(age=28), 400)
    assert opened.is_heavy
    assert estimate(opened, between).is_heavy  # ... nor to close
    assert not estimate(opened, 60).is_heavy  # ratio 1.05: closes


def test_robust_levels_are_left_to_the_lengths_unless_set() -> None:
    robust = MLFQSettings.from_config(SchedulerConfig(), CostModel())
    assert (robust.shallow_levels, robust.num_levels) == (ROBUST_LEVELS, ROBUST_DEEP_LEVELS)
    fixed = MLFQSettings.from_config(SchedulerConfig(mlfq_levels=4), CostModel())
    assert (fixed.shallow_levels, fixed.num_levels) == (None, 4)
    paper = MLFQSettings.from_config(SchedulerConfig(mlfq_variant="paper"), CostModel())
    assert paper.shallow_levels is None


def _probe_after(history: list[tuple[float, list[int]]], **config: object
                 ) -> tuple[Request, Request, list[int]]:
    """Serve the history (groups of output lengths, each arriving at its time), then a long
    job A at t = 20 s and a 50-token job B 40 ms later. A has then had 40 tokens of service:
    it is in the fourth level (from 28 tokens on), the lowest of four levels; of six, it
    leaves it at 60 tokens for the fifth, while B (50 tokens) ends within the fourth."""
    reqs = []
    for i, (t, outputs) in enumerate(history):
        reqs += make_requests([1] * len(outputs), outputs, [t] * len(outputs), prefix=f"h{i}-")
    a, b = make_requests([1, 1], [1000, 50], [20.0, 20.04], prefix="p")
    sched = make_scheduler("skip-join-mlfq", cost=UNIT_COST, max_batch_size=1, **config)
    levels: list[int] = []

    def watch() -> None:  # the lowest level in use, as the server's queue gauge shows it
        levels.append(max((lv for lv, n in sched.queue_lengths().items() if n), default=0))

    run = serve(sched, [*reqs, a, b], on_step=watch)
    assert len(run.finished) == len(reqs) + 2
    assert a.finish_s is not None and b.finish_s is not None
    return a, b, levels


def test_heavy_tailed_lengths_open_deeper_levels_so_a_newcomer_passes_an_old_long_job() -> None:
    a, b, levels = _probe_after([(0.0, HEAVY_TAIL)])
    # B preempts A on arrival; in the fourth level A runs first until its quantum is used up
    # and it goes down, then B, still in it, preempts it again and finishes first.
    assert b.finish_s < 20.2 < a.finish_s and a.num_preemptions == 2
    assert max(levels) == ROBUST_DEEP_LEVELS


def test_alike_lengths_keep_four_levels_and_the_started_job_runs_on() -> None:
    a, b, levels = _probe_after([(0.0, ALIKE)])
    # Both end up in the lowest (fourth) level, where the started job runs to completion.
    assert a.finish_s < b.finish_s and a.num_preemptions == 1
    assert max(levels) == ROBUST_LEVELS


def test_the_deeper_levels_close_again_when_lengths_stop_being_heavy_tailed() -> None:
    a, b, levels = _probe_after([(0.0, HEAVY_TAIL), (3.5, ALIKE)])
    assert max(levels) == ROBUST_DEEP_LEVELS  # opened during the heavy-tailed part
    assert a.finish_s < b.finish_s  # closed again: A, in the lowest level, runs on


def test_a_fixed_number_of_levels_does_not_adapt() -> None:
    a, b, levels = _probe_after([(0.0, HEAVY_TAIL)], mlfq_levels=4)
    assert a.finish_s < b.finish_s and max(levels) == 4
