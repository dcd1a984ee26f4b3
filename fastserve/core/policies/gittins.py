"""`gittins`: the Gittins index over output lengths learned from the jobs already served.

Nobody knows a job's output length, but the engine sees the lengths of the jobs it finishes.
From them it estimates S(x) = P(L > x), the chance a job generates more than x tokens, and
ranks every unfinished job by its Gittins rank: the least, over how much further it might be
served, of the expected time that service costs per unit of probability that the job finishes
within it,

    rank(a, c) = min over b > a of (c S(a) + step (E[min(L, b)] - E[min(L, a + 1)]))
                                    / (S(a) - S(b)),

for a job that has generated a tokens and whose next token costs c (a decode step, or a
prefill of its prompt when it holds no KV). Lowest rank first; ties in arrival order. Among
single-server schedulers that do not know sizes, this order minimises mean response time
(Gittins; Aalto, Ayesta and Righter 2009), and it adapts to the distribution: where long
jobs are rare and their lengths spread (decreasing hazard, heavy tails), a job's rank worsens
as it ages and new jobs pass it (like least-attained-service); where lengths are alike
(increasing hazard) a started job's rank improves and it runs to completion (like FCFS).

Until `MIN_SAMPLES` jobs have finished the order is plain arrival order (FCFS); the estimate
is refitted every `REFIT_EVERY` finishes over the last `WINDOW` lengths. Ages and candidate
horizons b lie on a grid (every age to 16 tokens, then 15% steps), so a job moves in the
order only when its age crosses a grid point; a refit re-ranks every unfinished job (measured: 0.7 ms to
fit 4,096 lengths, 7.6 ms to rank 1,000 new jobs, once per 64 finishes; schedule() itself
47 us at 1,000 waiting, benchmarks/scheduling/sched_overhead.py). A job older than every observed length
keeps the rank of the oldest observed age. NOTE: the lengths are those of finished jobs only (jobs still
running are not counted), which leans the estimate short early in a run.

A reference, not the default. In benchmarks/scheduling/sim_sweep.py's grid (GPU-class cost model, batch
16, ample KV) it is the closest of our policies to `srpt-oracle` on Zipf lengths (worst cell
2.07x the oracle's mean JCT; skip-join-mlfq's worst Zipf cell 2.37x, 3.00x with 4 fixed
levels), but the index starves: a long prompt or a long-running job keeps a poor rank while
short newcomers keep arriving, so p99 JCT reaches 10x FCFS's on the Azure trace at load 1,
and the mean 1.12x FCFS's at load 1.1.
`--mlfq-max-overtakes N` bounds the unfairness: once N jobs that arrived after a job have
finished before it, it goes to the front and runs to completion, oldest first. With N = 64
(4 batches) p99 stays within 2.3x FCFS's but most of the mean gain on Zipf lengths goes
(theta 1.2, CV 8, load 0.95: 0.75x FCFS's mean against 0.25x unbounded). The oldest unfinished
jobs are the most overtaken, so the check walks only the promoted ones and the next.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence
from itertools import accumulate

from fastserve.config import SchedulerConfig
from fastserve.core.cost_model import CostModel
from fastserve.core.policies.finished_lengths import FinishedLengths, finished_length
from fastserve.core.policies.keyed_order import KeyedOrderPolicy
from fastserve.request import Request

MIN_SAMPLES = 32
REFIT_EVERY = 64
WINDOW = 4096
GRID_DENSE = 16
GRID_RATIO = 1.15


def age_grid(max_len: int) -> list[int]:
    """Ages 0..GRID_DENSE, then geometric steps of GRID_RATIO, up to `max_len`."""
    grid = list(range(min(GRID_DENSE, max_len) + 1))
    x = float(GRID_DENSE)
    while grid[-1] < max_len:
        x *= GRID_RATIO
        grid.append(min(max_len, max(grid[-1] + 1, round(x))))
    return grid


class LengthModel:
    """The Gittins ranks of an empirical output-length distribution (see the module doc)."""

    def __init__(self, lengths: Sequence[int], step_s: float) -> None:
        if not lengths:
            raise ValueError("LengthModel needs at least one observed length")
        ls = sorted(lengths)
        n = len(ls)
        prefix = [0, *accumulate(ls)]
        self.grid = age_grid(ls[-1])
        self.step_s = step_s
        # S(x) = P(L > x) and E[min(L, x)] at each grid age (and at age + 1).
        self.surv = [(n - bisect.bisect_right(ls, x)) / n for x in self.grid]
        self.emin = [_mean_min(ls, prefix, x) for x in self.grid]
        self.emin_next = [_mean_min(ls, prefix, x + 1) for x in self.grid]
        self._started = [self._rank(i, step_s) for i in range(len(self.grid))]
        # The oldest age with S > 0: older jobs keep its rank.
        self._last = max((i for i, s in enumerate(self.surv) if s > 0), default=0)

    def slot(self, age: int) -> int:
        """The grid point a job of this age is ranked at."""
        return min(bisect.bisect_right(self.grid, age) - 1, self._last)

    def rank(self, age: int, next_token_s: float | None = None) -> float:
        """Gittins rank (seconds per unit probability of finishing) of a job that has generated
        `age` tokens; `next_token_s`: what its next token costs when not a decode step."""
        i = self.slot(age)
        if next_token_s is None:
            return self._started[i]
        return self._rank(i, next_token_s)

    def _rank(self, i: int, first_s: float) -> float:
        s_a = self.surv[i]
        if s_a <= 0:
            return float("inf")
        base = self.emin_next[i]
        best = float("inf")
        for j in range(i + 1, len(self.grid)):
            done = s_a - self.surv[j]
            if done > 0:
                cost = first_s * s_a + self.step_s * (self.emin[j] - base)
                best = min(best, cost / done)
        return best


def _mean_min(sorted_lengths: list[int], prefix: list[int], x: int) -> float:
    """E[min(L, x)] over the sorted sample."""
    k = bisect.bisect_left(sorted_lengths, x)  # lengths below x count as themselves
    n = len(sorted_lengths)
    return (prefix[k] + (n - k) * x) / n


class GittinsPolicy(KeyedOrderPolicy):
    """Lowest Gittins rank first, re-decided every iteration (preemptive); see the module doc."""

    def __init__(self, config: SchedulerConfig, cost: CostModel) -> None:
        super().__init__(config, cost)
        self._lengths = FinishedLengths(WINDOW, MIN_SAMPLES, REFIT_EVERY)
        self._promoted: set[str] = set()  # overtaken too often: they run first
        self._num_finished = 0
        overtakes = config.mlfq_max_overtakes
        self.max_overtakes = math.inf if overtakes is None else overtakes
        b = config.max_batch_size
        self._step_s = cost.iteration_s(0, b, 0) / b  # one decode step's share of a full batch
        self.model: LengthModel | None = None

    def on_add(self, req: Request, now: float) -> None:
        super().on_add(req, now)
        self._promote_overtaken()  # (with a bound of 0, the oldest job runs first: FCFS)

    def on_finish(self, req: Request, now: float) -> None:
        super().on_finish(req, now)
        self._promoted.discard(req.request_id)
        self._num_finished += 1
        self._promote_overtaken()
        length = finished_length(req)
        if length is not None and self._lengths.add(length):
            self._refit()

    def _promote_overtaken(self) -> None:
        """Send to the front every job that `max_overtakes` later arrivals have finished
        before. A job of arrival number s has been overtaken by (finished - s) jobs
        plus the unfinished ones older than it (every other older job has finished); walking
        from the oldest, those are the jobs just promoted, and the walk stops at the first job
        within the bound by that count (it is checked again at the next finish). A job is
        promoted once `max_overtakes` have passed it, so no more than that many do."""
        for rid, req in self.requests.items():  # unfinished, in arrival order
            if self._num_finished - self._seq[rid] < self.max_overtakes:
                break
            if rid not in self._promoted:
                self._promoted.add(rid)
                self._rekey(req)

    def _refit(self) -> None:
        self.model = LengthModel(list(self._lengths.values), self._step_s)
        for req in list(self.requests.values()):
            self._rekey(req)

    def _priority(self, req: Request) -> float:
        """-inf for a promoted job (ahead of every aged key too); its Gittins rank otherwise
        (0 for all until the first fit). A started job's rank is a table lookup, and an
        unchanged key is not moved."""
        if req.request_id in self._promoted:
            return -math.inf
        if self.model is None:
            return 0.0
        if req.num_computed_tokens == 0:  # its next iteration prefills (new, or recomputed)
            return self.model.rank(req.num_output_tokens, self.cost.prefill_s(req.num_tokens))
        return self.model.rank(req.num_output_tokens)
