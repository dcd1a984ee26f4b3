"""The MLFQ family: skip-join MLFQ (FastServe; the default policy) and two plain-MLFQ baselines.

Queues Q1..Qn have quanta q1 * ratio^(i-1). After every iteration each batched job is charged
its service (`ChargeModel`); a job that has used up its level's quantum is demoted at least one
level, to the level whose quantum covers its next iteration, down to the lowest level, which it
never leaves by demotion. The order is by level, then by the variant's tie rule
(`MLFQSettings`; robust bounds how many later jobs pass one waiting in the lowest level).
With starvation promotion on, a job that has not run for `starve_limit_s` moves to Q1.

- `skip-join-mlfq`: a new job joins the highest level whose quantum covers its first
  iteration (prefill), skipping the levels above; iteration-level preemption.
- `mlfq`: FastServe's MLFQ without preemption: every job joins Q1; a job that used up its
  quantum finishes its iteration, then is demoted; the batch is chosen by level each iteration.
- `mlfq-keep-batch`: every job joins Q1, and a running job keeps its slot until it finishes:
  new jobs get the slots that free up.
- `mlfq-preempt`: every job joins Q1, with preemption, and an iteration that would overrun the
  job's remaining quantum is abandoned: it runs (its time is spent and charged) but its token is
  dropped and the job is demoted, to redo the iteration later.
"""

from __future__ import annotations

import bisect
import heapq
import math
from collections import OrderedDict, deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace

from fastserve.config import SchedulerConfig
from fastserve.core.cost_model import CostModel
from fastserve.core.plan import ExecutorOutput, ScheduledRequest, SchedulerOutput
from fastserve.core.policies.fcfs_deadline import FCFSDeadlineEstimate
from fastserve.core.policies.finished_lengths import finished_length
from fastserve.core.policies.keyed_order import Key, KeyedOrder
from fastserve.core.policies.mlfq_settings import ChargeModel, MLFQSettings, TailEstimate
from fastserve.core.scheduling_policy import SchedulingPolicy
from fastserve.request import Request, RequestStatus

FINAL_LEVELS_WINDOW = 1024  # finished jobs whose final level `level_reach` counts
# Requests whose latest job's level and service a later job of theirs continues
# (`Request.service_of`): the most recently served this many.
SERVICE_MEMORY = 4096


@dataclass(slots=True)
class _Job:
    """A request's MLFQ state."""

    req: Request
    seq: int  # arrival order: the last, unique element of every priority key
    level: int  # 0 = Q1, the highest priority
    allowance_s: float  # service it may attain in this level (inf in the lowest level)
    attained_s: float = 0.0  # service charged since it entered this level
    last_run_s: float = 0.0  # end of its last iteration, or its arrival (paper's turn-taking)
    starve_clock_s: float = 0.0  # since when it has waited, for starvation promotion
    is_started: bool = False  # has run an iteration (robust: it stays ahead of new jobs)
    # One of the `oldest_slots` oldest, or held back `max_wait_s`: ahead of every level.
    is_oldest: bool = False
    arrived_s: float = 0.0  # when it was added
    ran_s: float = 0.0  # time it spent in iterations (its wait: the rest of its age)
    # (attained_s, last_run_s) as of its last token, what the paper variant ranks by: a job
    # whose prefill runs in chunks keeps its place until the prefill is done, so jobs taking
    # turns in a level take them between tokens. Ranked by its chunks, each job would run one
    # chunk and drop behind, and under memory pressure the next would recompute it away:
    # none would ever finish its prefill.
    turn: tuple[float, float] = (0.0, 0.0)
    # fcfs_deadline / fcfs_p99: the work ahead of it at its arrival and its estimated FCFS
    # time in the system (that plus its expected time alone), None / inf until the first
    # estimate; and the earliest time its entry in `_urgent_due` says it may be urgent.
    fcfs_wait_s: float | None = None
    fcfs_jct_s: float = math.inf
    urgent_due_s: float = math.inf


class MLFQBase(SchedulingPolicy):
    """Levels, charges, demotion and starvation promotion shared by the MLFQ policies."""

    def __init__(self, config: SchedulerConfig, cost: CostModel) -> None:
        super().__init__(config, cost)
        self.settings = MLFQSettings.from_config(config, cost)
        self.charge = ChargeModel(cost, self.settings.charge, config.max_batch_size)
        self._quanta_s = self.settings.quanta_s
        shallow = self.settings.shallow_levels or len(self._quanta_s)
        self._lowest = self._shallow_lowest = shallow - 1  # the lowest level in use
        # robust, levels left to it: opens the deeper levels while lengths are heavy-tailed.
        self._tail = None if self.settings.shallow_levels is None else TailEstimate(
            sum(self._quanta_s[: shallow - 1]) / self.charge.step_s)
        self._jobs: dict[str, _Job] = {}
        self._level_counts = [0] * len(self._quanta_s)  # unfinished jobs per level
        self._queue: KeyedOrder[Request] = KeyedOrder()
        # Jobs by starve_clock_s, oldest first (only kept when promotion is on): the scan
        # for starving jobs stops at the first one that is not.
        self._waiting: OrderedDict[str, _Job] = OrderedDict()
        self._num_added = 0
        # (earliest time it may have waited max_wait_s, seq, request id) per job, a min-heap.
        self._wait_due: list[tuple[float, int, str]] = []
        # Levels the latest finished jobs ended in (`level_reach`, for a fleet router).
        self._final_levels: deque[int] = deque(maxlen=FINAL_LEVELS_WINDOW)
        # Request id -> its latest job (live or finished), for the jobs that continue it.
        self._service: OrderedDict[str, _Job] = OrderedDict()
        # fcfs_deadline: the estimate, and (earliest time it may be urgent, seq, request id)
        # per job, a min-heap.
        self._deadline = (FCFSDeadlineEstimate(cost, config.max_batch_size)
                          if self.settings.fcfs_deadline > 0 or self.settings.fcfs_p99 > 0
                          else None)
        self._urgent_due: list[tuple[float, int, str]] = []
        self.num_demotions = 0
        self.num_promotions = 0
        self.num_urgent = 0  # jobs the FCFS deadline or p99 made urgent

    def recalibrate(self, cost: CostModel) -> None:
        # Quanta derived from the decode step keep their length in steps (a quantum set in
        # milliseconds keeps its milliseconds); the jobs' charges so far stand.
        old_step_s = self.charge.step_s
        super().recalibrate(cost)
        if self._deadline is not None:
            self._deadline.recalibrate(cost)
        self.charge = ChargeModel(cost, self.settings.charge, self.config.max_batch_size)
        if self.config.base_quantum_ms <= 0 and old_step_s > 0:
            factor = self.charge.step_s / old_step_s
            self._quanta_s = tuple(q * factor for q in self._quanta_s)
            self.settings = replace(self.settings, quanta_s=self._quanta_s)

    def level_of(self, request_id: str) -> int | None:
        """The request's queue (0 = Q1), or None when it is not here."""
        job = self._jobs.get(request_id)
        return None if job is None else job.level

    def queue_lengths(self) -> dict[int, int]:
        """Jobs per level in use (robust may open more levels, see `_set_lowest`)."""
        return {level + 1: n for level, n in enumerate(self._level_counts[: self._lowest + 1])}

    def num_in_top_queues(self, num_queues: int) -> int:
        return sum(self._level_counts[:num_queues])

    def routing_levels(self) -> tuple[tuple[float, ...], str]:
        return self._quanta_s, self.charge.mode

    def level_reach(self) -> list[float]:
        num_levels = self._lowest + 1
        n = len(self._final_levels)
        if n == 0:
            return []
        ended = [0] * num_levels
        for level in self._final_levels:
            ended[min(level, self._lowest)] += 1
        out, below = [], n
        for j in range(num_levels):
            out.append(below / n)  # ended in level j or deeper
            below -= ended[j]
        return out

    def queued_work_s(self) -> list[float]:
        """Per level j in use: the service the jobs at levels <= j would get before a job
        joining j now has its turn, as `estimate_next_run_s` counts it (the rest of each
        one's quantum, then the quanta of the levels between; the lowest level's quantum
        stands in for its unbounded one, as it does for the router's own count of the jobs
        it sent since). O(jobs + levels^2)."""
        quanta = self._quanta_s
        num_levels = self._lowest + 1
        left = [0.0] * num_levels  # rest of the current quantum, summed per level
        for job in self._jobs.values():
            rest = job.allowance_s - job.attained_s
            left[job.level] += max(0.0, rest) if math.isfinite(rest) else quanta[job.level]
        out = []
        for j in range(num_levels):
            # a job at level l < j also runs through the quanta of levels l+1 .. j-1
            out.append(sum(left[: j + 1]) + sum(
                self._level_counts[lv] * sum(quanta[lv + 1 : j]) for lv in range(j)))
        return out

    def estimate_next_run_s(self, order: Sequence[Request], now: float) -> list[float]:
        """ENST(i) = min(T_promote(i), T_execute(i)), FastServe's estimate (see the base).

        T_promote: time left until starvation promotion lifts job i to Q1 (inf when off).
        T_execute: the service that the jobs ahead of i in the order would use before i's
        turn, each in the levels from its own down to i's (what is left of its current
        quantum, then the full quanta of the levels in between), assuming none finishes
        earlier; a job ahead in i's own level (or, in non-preemptive MLFQ, a lower one)
        counts what is left of its quantum. The lowest level's quantum stands in for its
        unbounded one. Batched jobs run side by side: under the `iteration` charge each of
        them is charged the whole iteration, so the sum is divided by the batch size.
        One pass, O(jobs x levels).
        """
        quanta = self._quanta_s
        num_levels = len(quanta)
        cum = [0.0]  # cum[m] = q_1 + ... + q_m
        for q in quanta:
            cum.append(cum[-1] + q)
        parallel = self.config.max_batch_size if self.charge.mode == "iteration" else 1
        limit_s = self.settings.starve_limit_s
        rem_total = 0.0  # what is left of the current quantum, summed over the jobs seen
        count = [0] * num_levels  # jobs seen per level
        cum_next = [0.0] * num_levels  # sum of cum[level + 1] over the jobs seen per level
        out = []
        for req in order:
            job = self._jobs[req.request_id]
            level = job.level
            n_above = sum(count[:level])
            execute_s = (rem_total + n_above * cum[level] - sum(cum_next[:level])) / parallel
            if limit_s > 0 and level > 0:
                out.append(min(execute_s, max(0.0, limit_s - (now - job.starve_clock_s))))
            else:
                out.append(execute_s)
            left_s = job.allowance_s - job.attained_s
            rem_total += max(0.0, left_s) if math.isfinite(left_s) else quanta[level]
            count[level] += 1
            cum_next[level] += cum[level + 1]
        return out

    # -- policy hooks ---------------------------------------------------------------------

    def _join_level(self, req: Request) -> int:
        """Where a new job starts. Plain MLFQ: Q1."""
        return 0

    def on_add(self, req: Request, now: float) -> None:
        level = self._join_level(req)
        job = _Job(req, self._num_added, level, self._allowance_s(level),
                   last_run_s=now, starve_clock_s=now, turn=(0.0, now), arrived_s=now)
        self._num_added += 1
        if math.isfinite(self.settings.max_wait_s):
            heapq.heappush(self._wait_due, (now + self.settings.max_wait_s, job.seq,
                                            req.request_id))
        self._continue_service(job)
        if self._deadline is not None and self._deadline.is_ready:
            self._set_deadline(job, self._jobs.values(), now)
        self._jobs[req.request_id] = job
        self._level_counts[level] += 1
        if self.settings.starve_limit_s > 0:
            self._waiting[req.request_id] = job
        self._rekey(job)

    def _continue_service(self, job: _Job) -> None:
        """A job of a request already served (a beam step, a later sequence) starts where
        the request's latest job is: at least at its level, with its service in that level
        and its place among started jobs; a request of its own is remembered as its key."""
        key = job.req.service_of or job.req.request_id
        prior = self._service.get(key) if job.req.service_of else None
        if prior is not None and prior.level >= job.level:
            job.level = min(prior.level, self._lowest)
            job.allowance_s = self._allowance_s(job.level)
            job.attained_s = prior.attained_s if job.level == prior.level else 0.0
            job.is_started = prior.is_started
        self._service[key] = job
        self._service.move_to_end(key)
        if len(self._service) > SERVICE_MEMORY:
            self._service.popitem(last=False)

    def on_finish(self, req: Request, now: float) -> None:
        job = self._jobs.pop(req.request_id, None)
        if job is not None:
            self._level_counts[job.level] -= 1
            if finished_length(req) is not None:
                self._final_levels.append(job.level)
        self._queue.remove(req.request_id)
        self._waiting.pop(req.request_id, None)
        length = finished_length(req)
        if self._tail is not None and length is not None and self._tail.add(length):
            self._set_lowest(len(self._quanta_s) - 1 if self._tail.is_heavy
                             else self._shallow_lowest)
        if (self._deadline is not None and job is not None and length is not None
                and self._deadline.add(req, job.fcfs_wait_s)):
            self._renew_deadlines(now)

    def _set_lowest(self, lowest: int) -> None:
        """Use levels 0..`lowest`: jobs below a raised lowest level join it, and the old and
        new lowest levels' jobs get their new allowance (and, in the lowest, rank)."""
        if lowest == self._lowest:
            return
        old, self._lowest = self._lowest, lowest
        for job in self._jobs.values():
            if job.level > lowest:
                self._move(job, lowest)
            elif job.level in (old, lowest):
                job.allowance_s = self._allowance_s(job.level)
            else:
                continue
            self._rekey(job)

    def order(self, now: float) -> list[Request]:
        if self.settings.starve_limit_s > 0:
            self._promote_starved(now)
        if self.settings.oldest_slots > 0:
            self._mark_oldest()
        if self._wait_due:
            self._mark_held_back(now)
        if self._urgent_due:
            self._mark_urgent(now)
        return self._queue.items()

    def _mark_oldest(self) -> None:
        # NOTE: `_jobs` is in arrival order (jobs are added as they arrive and only leave), so
        # its first entries are the oldest; one marked stays marked, as no job can become older.
        for _, job in zip(range(self.settings.oldest_slots), self._jobs.values(), strict=False):
            if not job.is_oldest:
                job.is_oldest = True
                self._rekey(job)

    def _mark_held_back(self, now: float) -> None:
        """Mark the jobs that have waited `max_wait_s` in all (their age less the time they
        spent in iterations) as oldest. `_wait_due` holds for each job the earliest time it
        could have: an entry whose job ran since is pushed back to its new due time."""
        limit_s = self.settings.max_wait_s
        while self._wait_due and self._wait_due[0][0] <= now:
            _, seq, rid = heapq.heappop(self._wait_due)
            job = self._jobs.get(rid)
            if job is None or job.is_oldest:
                continue
            due_s = job.arrived_s + job.ran_s + limit_s
            if due_s <= now:
                job.is_oldest = True
                self._rekey(job)
            else:
                heapq.heappush(self._wait_due, (due_s, seq, rid))

    # -- fcfs_deadline ---------------------------------------------------------------------

    def _set_deadline(self, job: _Job, ahead: Iterable[_Job], now: float) -> None:
        """The job's estimated FCFS time in the system, `ahead` being the unfinished jobs that
        arrived before it (as if it arrived `now`). NOTE: O(unfinished jobs) per arrival,
        which an option measured in the simulator can afford; a serving default would keep
        the sum of their expected work up to date instead."""
        assert self._deadline is not None
        job.fcfs_wait_s = now - job.arrived_s + self._deadline.work_ahead_s(j.req for j in ahead)
        job.fcfs_jct_s = job.fcfs_wait_s + self._deadline.time_alone_s(job.req)
        self._push_urgent(job)

    def _urgent_at_s(self, job: _Job) -> float:
        """When the job's expected finish, were it to start then, passes its bound: its
        arrival plus `fcfs_deadline` x its estimated FCFS time, or plus `fcfs_p99` x the
        estimated p99 of FCFS's times, or (both on) the later of the two; inf while unknown."""
        assert self._deadline is not None
        bound_s = 0.0
        if self.settings.fcfs_deadline > 0:
            bound_s = self.settings.fcfs_deadline * job.fcfs_jct_s
        if self.settings.fcfs_p99 > 0:
            p99_s = self._deadline.fcfs_p99_s
            bound_s = max(bound_s, math.inf if p99_s is None else self.settings.fcfs_p99 * p99_s)
        return job.arrived_s + bound_s - self._deadline.time_alone_s(job.req)

    def _push_urgent(self, job: _Job) -> None:
        """Queue the job's urgency check, if it is due earlier than the one queued."""
        if job.is_oldest:
            return
        due_s = self._urgent_at_s(job)
        if due_s < job.urgent_due_s:
            job.urgent_due_s = due_s
            heapq.heappush(self._urgent_due, (due_s, job.seq, job.req.request_id))

    def _renew_deadlines(self, now: float) -> None:
        """The length estimate changed: jobs that came before the first get their deadline
        (as if they arrived now, behind the jobs older than them), and every job's urgency
        check is moved up where it is now due earlier. O(jobs)."""
        assert self._deadline is not None
        older: list[_Job] = []
        for job in self._jobs.values():  # in arrival order
            if job.fcfs_wait_s is None:
                self._set_deadline(job, older, now)
            older.append(job)
        if self.settings.fcfs_p99 > 0:
            self._deadline.renew_p99((j.fcfs_wait_s, j.req) for j in older
                                     if j.fcfs_wait_s is not None)
        for job in older:
            self._push_urgent(job)

    def _mark_urgent(self, now: float) -> None:
        """Mark the jobs whose expected finish, were they to start now, passes their deadline
        as oldest. An entry is checked against the job's state now: one not yet due is
        queued again at its new time."""
        heap = self._urgent_due
        while heap and heap[0][0] <= now:
            due_s, seq, rid = heapq.heappop(heap)
            job = self._jobs.get(rid)
            if job is None or job.is_oldest or due_s != job.urgent_due_s:
                continue  # gone, already ahead, or a stale entry
            due_s = self._urgent_at_s(job)
            if due_s <= now:
                job.is_oldest = True
                self.num_urgent += 1
                self._rekey(job)
            else:
                job.urgent_due_s = due_s
                heapq.heappush(heap, (due_s, seq, rid))

    def on_iteration(self, plan: SchedulerOutput, out: ExecutorOutput, now: float) -> None:
        charges = self.charge.charges(plan, out.duration_s)
        for sched, charge_s in zip(plan.scheduled, charges, strict=True):
            job = self._jobs.get(sched.request_id)
            if job is not None:  # None: aborted while the iteration ran
                job.ran_s += out.duration_s
                self._charge(job, sched, charge_s, now)
                if self._deadline is not None:
                    self._push_urgent(job)

    # -- accounting -----------------------------------------------------------------------

    def _charge(self, job: _Job, sched: ScheduledRequest, charge_s: float, now: float) -> None:
        self._account(job, charge_s, now)
        if sched.samples:
            job.turn = (job.attained_s, job.last_run_s)
        if job.attained_s >= job.allowance_s:
            # NOTE: demoted before `update` knows whether this token finished the job; a
            # finished job leaves in `on_finish`, so the order is never wrong.
            self._demote(job, self._charge_after_s(job.req, sched))
        self._rekey(job)

    def _charge_after_s(self, req: Request, sched: ScheduledRequest) -> float:
        """Predicted charge of the iteration after `sched`: its prefill's next chunk, or a
        decode step."""
        done = sched.num_context_tokens
        if not sched.samples:
            budget = self.config.max_num_batched_tokens
            chunk = min(self.charge.cost.prefill_chunk(budget, done), req.num_tokens - done)
            return self.charge.prefill_s(chunk, done)
        return self.charge.decode_s(done + 1)

    def _account(self, job: _Job, charge_s: float, now: float) -> None:
        job.attained_s += charge_s
        job.is_started = True
        job.last_run_s = job.starve_clock_s = now
        if self.settings.starve_limit_s > 0:
            self._waiting.move_to_end(job.req.request_id)

    def _demote(self, job: _Job, next_charge_s: float) -> None:
        """At least one level down, to the first level whose quantum covers the next iteration."""
        self._move(job, max(job.level + 1, self._level_for(next_charge_s)))
        self.num_demotions += 1

    def _promote_starved(self, now: float) -> None:
        limit_s = self.settings.starve_limit_s
        while self._waiting:
            job = next(iter(self._waiting.values()))
            if now - job.starve_clock_s <= limit_s:
                break
            # Restart its clock: a job still not run after another limit is looked at again.
            job.starve_clock_s = now
            self._waiting.move_to_end(job.req.request_id)
            if job.level > 0:
                self._promote(job)

    def _promote(self, job: _Job) -> None:
        next_s = self._next_charge_s(job.req)
        self._move(job, 0)
        if next_s > self._quanta_s[0]:
            # An extra quantum the size of its next iteration: without it a job whose next
            # iteration outgrows Q1 would be demoted again by that one iteration (or, under
            # mlfq-preempt, have it abandoned), and the promotion would buy nothing.
            job.allowance_s += next_s
        self.num_promotions += 1
        self._rekey(job)

    # -- levels and keys ------------------------------------------------------------------

    def _level_for(self, charge_s: float) -> int:
        """The highest level whose quantum covers `charge_s` (the lowest when none does)."""
        return min(bisect.bisect_left(self._quanta_s, charge_s), self._lowest)

    def _allowance_s(self, level: int) -> float:
        return math.inf if level >= self._lowest else self._quanta_s[level]

    def _move(self, job: _Job, level: int) -> None:
        self._level_counts[job.level] -= 1
        job.level = min(level, self._lowest)
        self._level_counts[job.level] += 1
        job.attained_s = 0.0
        job.turn = (0.0, job.last_run_s)
        job.allowance_s = self._allowance_s(job.level)

    def _next_charge_s(self, req: Request) -> float:
        """Predicted charge of the request's next iteration, from its current KV state."""
        num_new = req.num_tokens - req.num_computed_tokens
        if req.num_computed_tokens == 0 or num_new > 1:
            done = req.num_computed_tokens
            budget = self.config.max_num_batched_tokens
            chunk = min(num_new, self.charge.cost.prefill_chunk(budget, done))
            return self.charge.prefill_s(chunk, done)
        return self.charge.decode_s(req.num_tokens)

    def _key(self, job: _Job) -> Key:
        if job.is_oldest:
            return (-1, job.seq, 0, job.seq)
        if self.settings.is_arrival_order:
            # Started jobs first, each group in arrival order. A job waiting to start in the
            # lowest level ranks as if it had arrived `max_overtakes` jobs later, so at most
            # that many later arrivals that started pass it (it never leaves that level, so
            # an unbounded started-first rule could make it wait forever).
            if job.is_started:
                rank: float = job.seq
            elif job.level == self._lowest:
                rank = job.seq + self.settings.max_overtakes
            else:
                rank = math.inf
            return (job.level, rank, 0 if job.is_started else 1, job.seq)
        return (job.level, *job.turn, job.seq)

    def _rekey(self, job: _Job) -> None:
        self._queue.put(job.req.request_id, self._key(job), job.req)


class SkipJoinMLFQPolicy(MLFQBase):
    """FastServe's skip-join MLFQ: a job starts in the level that fits its prefill.

    A long prompt's prefill would use up the top quanta at once, so the job skips them and
    cannot delay the short jobs that the top levels are for. A prompt longer than the token
    budget prefills in chunks, one iteration each: the level is the one whose quantum covers
    all of them (after the first chunks it would be demoted there anyway). A prompt whose
    prefix is cached is placed by the prefill of the rest, which is all it will run.
    """

    def _join_level(self, req: Request) -> int:
        chunk = self.config.max_num_batched_tokens
        cached = self.view.cached_prefix_tokens(req)
        return self._level_for(self.charge.prefill_s(req.num_tokens - cached, cached, chunk))


class MLFQPolicy(MLFQBase):
    """FastServe's MLFQ baseline without preemption: every job joins Q1, and a job that used up
    its quantum finishes the iteration it is in, then is demoted (an iteration is never cut
    short). The batch is chosen anew each iteration by level, so a new job takes a slot from
    a demoted one between iterations. Without skip-join a long prompt's prefill spends the top
    quanta at once, and at high rates every job runs down the same levels taking turns: the
    policy drifts toward round-robin, which the paper's scheduler-design figure shows.
    """


class MLFQKeepBatchPolicy(MLFQBase):
    """MLFQ whose running jobs keep their slots: every job joins Q1, and a job in the batch is
    never taken out until it finishes; new jobs get the slots that free up.

    Demotion still happens, so the level decides which waiting job gets a slot that frees up
    (and which started job gives up its KV when blocks run out). With KV to spare it gives
    FCFS's results exactly (no running job is ever preempted).
    """

    def __init__(self, config: SchedulerConfig, cost: CostModel) -> None:
        super().__init__(config, cost)
        # Last plan's batch. Being in it is the first element of the key, so running jobs
        # lead the order; only jobs that join or leave the batch are re-keyed.
        self._running: set[str] = set()

    def on_schedule(self, plan: SchedulerOutput) -> None:
        # Jobs of an earlier batch still in the pipeline keep running too.
        batch = {s.request_id for s in plan.scheduled} | self._running.intersection(
            self.view.in_flight)
        changed = batch ^ self._running
        self._running = batch
        for rid in changed:
            job = self._jobs.get(rid)
            if job is not None:
                self._rekey(job)

    def on_finish(self, req: Request, now: float) -> None:
        self._running.discard(req.request_id)
        super().on_finish(req, now)

    def _key(self, job: _Job) -> Key:
        return (0 if job.req.request_id in self._running else 1, *super()._key(job))


class MLFQPreemptPolicy(MLFQBase):
    """MLFQ with preemption and no skip-join: every job joins Q1.

    An iteration cannot be stopped halfway, so an iteration that the cost model predicts would
    overrun the job's remaining quantum is abandoned: the job still runs in the batch (the
    time is spent and charged to it), its token is discarded before it is appended
    (`keeps_result`), and it is demoted to the level whose quantum covers that iteration, at
    least one down. Its KV blocks and `num_computed_tokens` are left as they were, so it redoes
    exactly the same iteration later; an abandoned prefill computed nothing worth keeping, so
    its blocks are freed at once. The lowest level has no quantum, so every job finishes.
    """

    can_schedule_ahead = False  # it decides to abandon when it schedules

    def __init__(self, config: SchedulerConfig, cost: CostModel) -> None:
        super().__init__(config, cost)
        # This iteration's abandoned jobs -> the predicted charge of the iteration to redo.
        self._abandoned: dict[str, float] = {}
        self.num_abandoned = 0

    def on_schedule(self, plan: SchedulerOutput) -> None:
        # Batches still in the pipeline are charged when they are back: keep their entries.
        in_flight = self.view.in_flight
        self._abandoned = {r: s for r, s in self._abandoned.items() if r in in_flight}
        for sched, predicted_s in zip(plan.scheduled, self.charge.predict(plan), strict=True):
            job = self._jobs[sched.request_id]
            if job.attained_s + predicted_s > job.allowance_s:
                self._abandoned[sched.request_id] = predicted_s

    def _charge(self, job: _Job, sched: ScheduledRequest, charge_s: float, now: float) -> None:
        redo_s = self._abandoned.get(sched.request_id)
        if redo_s is None:
            super()._charge(job, sched, charge_s, now)
            return
        self._account(job, charge_s, now)  # paid and lost
        if sched.start_pos == 0:
            # Nothing it computed is kept, so its blocks would hold no KV: give them back.
            # (A later chunk keeps its blocks: they hold the earlier chunks.)
            self.view.drop_kv(sched.request_id)
            job.req.status = RequestStatus.WAITING
        self._demote(job, redo_s)
        self.num_abandoned += 1
        self._rekey(job)

    def keeps_result(self, sched: ScheduledRequest) -> bool:
        return sched.request_id not in self._abandoned
