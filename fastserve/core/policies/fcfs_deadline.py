"""Each job's FCFS finish time, estimated online without its length: robust skip-join MLFQ's
`mlfq_fcfs_deadline` option.

At a job's arrival, FCFS would finish it after every unfinished job that arrived before it
had drained through the engine, plus its own time: `now + work ahead + its time alone`. No
length is known, so both are expected values from the output lengths of the jobs finished so
far (`FinishedLengths`): a job that has produced `a` tokens is expected to need
E[L - a | L > a] more (for a job longer than every finished one: `a` more, the tail's
doubling rule). Its prompt is known. Work is counted in the engine's bottleneck time at full
batch, as `fastserve.bench.workloads.job_work_s` counts capacity (a decode step costs a
job 1/batch of a full batch's stage time); a job's own time alone is its tokens times a full
batch's iteration.

The policy makes a job urgent once its expected finish, if it started only now, would pass
its arrival plus a factor x its estimated FCFS time in the system (`MLFQSettings.fcfs_deadline`)
or x the p99 of the jobs' estimated FCFS times (`MLFQSettings.fcfs_p99`; `renew_p99`).
Measured: docs/results/2026-12-08-fcfs-urgency.md.
"""

from __future__ import annotations

import bisect
import math
from collections import deque
from collections.abc import Iterable
from itertools import accumulate

from fastserve.core.cost_model import CostModel
from fastserve.core.policies.finished_lengths import FinishedLengths
from fastserve.request import Request

DEADLINE_WINDOW = 1024  # the latest finished jobs whose lengths are the distribution
DEADLINE_MIN_SAMPLES = 16  # finished jobs before the first estimate, and between two


class FCFSDeadlineEstimate:
    """Expected remaining work and time of unfinished jobs, from finished jobs' lengths."""

    def __init__(self, cost: CostModel, max_batch_size: int) -> None:
        self.batch = max_batch_size
        self._lengths = FinishedLengths(DEADLINE_WINDOW, DEADLINE_MIN_SAMPLES,
                                        DEADLINE_MIN_SAMPLES)
        self._sorted: list[int] = []
        self._suffix: list[int] = []  # _suffix[i] = sum(_sorted[i:])
        # The finished jobs' FCFS times in the system as estimated: the work ahead of each at
        # its arrival plus its time alone with the length it turned out to have.
        self._fcfs_jcts: deque[float] = deque(maxlen=DEADLINE_WINDOW)
        self.fcfs_p99_s: float | None = None  # `renew_p99`'s
        self._has_jcts = False
        self.recalibrate(cost)

    def recalibrate(self, cost: CostModel) -> None:
        b = self.batch
        self.cost = cost
        # Per decode step: one job's share of the bottleneck, and the job's own latency.
        # Both are linear in the context tokens (attention): the base, then per token.
        self._work_step_s = cost.stage_s(0, b, 0) / b
        self._work_ctx_s = (cost.stage_s(0, b, b) - cost.stage_s(0, b, 0)) / b
        self._latency_step_s = cost.iteration_s(0, b, 0)
        self._latency_ctx_s = (cost.iteration_s(0, b, b) - cost.iteration_s(0, b, 0)) / b

    @property
    def is_ready(self) -> bool:
        """Whether enough jobs have finished for an estimate."""
        return bool(self._sorted)

    def add(self, req: Request, wait_s: float | None) -> bool:
        """Record a finished job's length, and its estimated FCFS time in the system if the
        work ahead of it at its arrival (`wait_s`) was estimated; True when the estimate was
        just renewed."""
        if wait_s is not None:
            self._fcfs_jcts.append(wait_s + self.job_time_alone_s(req))
        # The first FCFS time renews the p99 at once (else it waits for the lengths' next).
        first = not self._has_jcts and bool(self._fcfs_jcts)
        self._has_jcts = bool(self._fcfs_jcts)
        if self._lengths.add(req.num_output_tokens):
            self._sorted = sorted(self._lengths.values)
            self._suffix = list(accumulate(reversed(self._sorted)))[::-1]
        elif not first:
            return False
        return True

    def renew_p99(self, live: Iterable[tuple[float, Request]]) -> None:
        """The p99 of FCFS's times over the finished jobs' and the unfinished jobs' (`live`:
        the work ahead of each at its arrival, and the job), each of the latter with its
        expected length. Without them the p99 lags a burst: its slowest jobs under FCFS
        (long jobs deep in it) are the last the MLFQ finishes."""
        jcts = list(self._fcfs_jcts)
        for wait_s, req in live:
            out = req.num_output_tokens + self.residual_tokens(req.num_output_tokens)
            jcts.append(wait_s + self.job_time_alone_s(req, out))
        if jcts:
            jcts.sort()
            self.fcfs_p99_s = jcts[max(0, math.ceil(0.99 * len(jcts)) - 1)]

    def job_time_alone_s(self, req: Request, num_output_tokens: float | None = None) -> float:
        """A job's whole time alone (its prefill, then its decode steps) with this many
        output tokens (None: those it has, for a finished job)."""
        prompt = req.num_prompt_tokens
        out = req.num_output_tokens if num_output_tokens is None else num_output_tokens
        return (self.cost.prefill_s(prompt) + max(0.0, out - 1)
                * (self._latency_step_s + self._latency_ctx_s * (prompt + out / 2)))

    def residual_tokens(self, attained: int) -> float:
        """Expected output tokens still to come from a job that has produced `attained`."""
        i = bisect.bisect_right(self._sorted, attained)
        n = len(self._sorted) - i
        if n == 0:
            return float(max(attained, 1))
        return self._suffix[i] / n - attained

    def _left(self, req: Request) -> tuple[int, int, float, float]:
        """(prompt tokens still to prefill, its context now, expected tokens to come, mean
        context over them)."""
        prompt = req.num_prompt_tokens
        to_prefill = max(0, prompt - req.num_computed_tokens)
        out = req.num_output_tokens
        tokens = self.residual_tokens(out)
        return to_prefill, prompt + out, tokens, prompt + out + tokens / 2

    def work_s(self, req: Request) -> float:
        """Expected bottleneck time the job still costs the engine at full batch."""
        to_prefill, done, tokens, ctx = self._left(req)
        prefill = (self.cost.stage_s(to_prefill, 0, 0, to_prefill * to_prefill)
                   - self.cost.stage_s(0, 0, 0)) if to_prefill else 0.0
        return prefill + tokens * (self._work_step_s + self._work_ctx_s * ctx)

    def time_alone_s(self, req: Request) -> float:
        """Expected time until the job finishes if it ran every iteration from now on."""
        to_prefill, done, tokens, ctx = self._left(req)
        prefill = self.cost.prefill_s(to_prefill, done - to_prefill) if to_prefill else 0.0
        return prefill + tokens * (self._latency_step_s + self._latency_ctx_s * ctx)

    def work_ahead_s(self, ahead: Iterable[Request]) -> float:
        """Expected bottleneck time the jobs `ahead` still cost: FCFS's wait for a job that
        arrives now behind them."""
        return sum(self.work_s(r) for r in ahead)
