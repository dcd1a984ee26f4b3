"""`proactive`, FastServe's KV policy: a free reserve kept, KV moved ahead of need so that the
copies overlap compute (see `fastserve.core.kv.policy` for the others and the shared rules).

Pure Python over ints and floats, like the rest of `fastserve.core`; `now` is passed in.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence

from fastserve.core.kv.manager import num_blocks_for
from fastserve.core.kv.policy import (
    ReactivePolicy,
    SchedulerView,
    latest,
)
from fastserve.core.kv.prefix_cache import extend_block_hashes
from fastserve.core.plan import BatchShape
from fastserve.request import Request

# Proactive exchanges (offloading a resident job to upload a swapped one) are made only for a
# job due within this many iterations, against jobs due at least that much later.
HORIZON_ITERATIONS = 2.0
# Copies inline (no idle core): the most a new or swapped job's moves may add to an
# iteration, as a share of its predicted compute. Measured in the simulator
# (benchmarks/kv/kv_defaults.py cells with this machine's profile, copies at ~8 us and ~630 us a
# block): 0.1 stays within 5% of `defer` where copies are dear and near `reactive` where they
# are cheap; 0.25 let dear copies cost up to 9% over `defer`.
INLINE_COPY_SHARE = 0.1
# `proactive`'s default reserve K: this share of the device pool, rounded up (vLLM keeps a
# similar watermark of 1% free). Measured in the simulator (benchmarks/kv/kv_policies.py, parts 1
# and 2, robust variant): shares from 2% to 15% beat no reserve in most cells; 5% did in all
# 14, by 2-18% on average JCT.
DEFAULT_RESERVE_FRACTION = 0.05
# The burst prediction keeps room for at most this share of the device pool (beyond the
# batch's own growth). On a pool about the size of one large job, room for a batch of
# predicted arrivals was most of the device: jobs a few tokens from done were offloaded for
# arrivals and waited on the host behind them (benchmarks/kv/kv_defaults.py, A100 profile, Zipf
# 1.5, CV 1, a 32-block pool: 1.082x defer; capped at half, 1.028x; larger pools unchanged).
BURST_MAX_SHARE = 0.5


class ProactivePolicy(ReactivePolicy):
    """FastServe: keep a free reserve, offload the latest jobs and upload the next ones early.

    After the batch is chosen (`plan_ahead`):

    1. Keep at least max(K, burst) device blocks free, K = `reserve_blocks`. The burst
       prediction is the blocks needed by the non-resident jobs of the top `burst_queues`
       queues, and by the jobs whose turn came this iteration while their KV was not on the
       device (see `defer_turn`), at most a batch of them. Victims: resident jobs outside the
       batch, largest ENST first, each later than the earliest job it makes room for.
    2. Upload swapped jobs, smallest ENST first, whenever the reserve allows, offloading
       resident jobs with a larger ENST to make room if need be.

    A job whose turn comes while its KV is on the host, or while the blocks it needs are not
    free, does not stall the batch (`defer_turn`): its room is made and its upload queued now, and
    it runs from the next iteration, once the copies have landed by the cost model's estimate
    (`is_landing`); the batch is filled from the resident jobs after it meanwhile. Only the
    first job of a batch may make it wait, when no resident job could run instead. A started
    job takes room only from beyond the jobs that fill the batch's other slots (evicting one
    about to run for another would only churn); a new job may take any later job's room.

    Moves are limited to what the copy engine can finish while the iteration computes (the
    cost model's swap bandwidth and iteration time), so they stay hidden behind compute; the
    backlog of copies still in flight is tracked across iterations (`_CopyBudget`). Blocks
    offloaded by this policy serve no computation before the next iteration
    (`release_now=False`), so nothing waits for them to be copied out.

    When copies cannot overlap compute (`CostModel.copies_overlap` false) all of the above
    that moves KV ahead of need is off (no reserve, no uploads ahead, no deferral: each would
    charge the iteration what the same move costs when it is needed, and might be wasted),
    and the policy starts from what `defer` does, moving KV only where the move is cheaper:
    a started job that must grow takes its victim's blocks by offloading it when copying it
    out and back costs less than recomputing it (`_copy_pays`), else by recompute; a new or
    swapped job waits for free blocks unless its moves add at most `INLINE_COPY_SHARE` of the
    iteration's predicted compute. The copies' time is in the iteration the MLFQ charges.
    """

    name = "proactive"

    def __init__(self, reserve_blocks: int | None = None, burst_queues: int = 2) -> None:
        self._reserve_setting = reserve_blocks  # None: DEFAULT_RESERVE_FRACTION of the pool
        self.reserve_blocks = reserve_blocks or 0
        self.burst_queues = burst_queues
        self._deferred: list[Request] = []  # this iteration's jobs waiting for room / upload
        self._now = 0.0
        # Uploads still in flight, by the cost model: request -> when the copy lands.
        self._landing_s: dict[str, float] = {}
        self._wanted_now: set[str] | None = None  # see `_wanted`
        self._wanted_order: list[Request] = []  # the same jobs, in ENST order
        self._budget = _CopyBudget()

    def begin(self, sched: SchedulerView, now: float) -> None:
        self._now = now
        if self._reserve_setting is None:  # the first iteration: the pool's size is known
            self.reserve_blocks = math.ceil(DEFAULT_RESERVE_FRACTION * sched.kv.num_total_blocks)
            self._reserve_setting = self.reserve_blocks
        self._budget.begin(now, sched.cost.swap_s(1))
        self._deferred = []
        self._wanted_now = None
        # Forget uploads that landed, and those of jobs that left the device since (a job
        # uploaded again gets a new landing time).
        has_blocks = sched.kv.has_blocks
        self._landing_s = {k: t for k, t in self._landing_s.items() if t > now and has_blocks(k)}

    def defer_turn(self, sched: SchedulerView, req: Request, batch_size: int,
                   start: int) -> bool:
        kv = sched.kv
        if kv.num_total_host_blocks == 0 or not sched.cost.copies_overlap:
            # Nothing can move ahead (copies inline: see `make_room`); act as `defer` does.
            return False
        is_new = kv.where(req.request_id) is None
        keep = None
        if batch_size == 0:
            # NOTE: a batch is never left empty while a job could run (and two jobs never
            # take turns evicting each other while nothing runs): a resident job that needs
            # no new block is kept back from eviction, and runs; without one, this job runs
            # now, waiting for its copies. So does a new job: it must not wait behind the
            # resident jobs it is more urgent than (the head-of-line blocking MLFQ avoids).
            keep = None if is_new else self._first_ready(sched, start)
            if keep is None:
                return False
        if req.request_id not in self._wanted(sched):
            return True  # the jobs ahead of it fill the device: its turn has not come
        self._deferred.append(req)
        budget = self._budget
        if not budget.fits(1):
            return True  # no more room is made this iteration: it waits
        need = _need(sched, req)
        sched.moves.reclaim_parked(need)
        if kv.num_free_soon < need:
            # A started job takes its room from beyond the jobs that fill this batch's other
            # slots: evicting a job about to run for another started one would only churn.
            slots = 0 if is_new else max(0, sched.config.max_batch_size - batch_size - 1)
            victims = [r for r in self._resident_after(sched, start, slots)
                       if r is not keep and sched.moves.can_offload(r)]
            room = kv.num_free_soon + sum(len(kv.block_table(r.request_id)) for r in victims)
            if room < need:
                return True  # it waits; nothing is evicted for nothing
            # Make its room now, so that the copies overlap this iteration's compute; it
            # runs from the next iteration.
            while kv.num_free_soon < need:
                victim = latest(sched, victims)
                if victim is None or not self._offload(sched, victim, budget):
                    return True
                victims.remove(victim)
        if kv.is_swapped(req.request_id):
            self._upload(sched, req, budget)
        return True

    def make_room(
        self, sched: SchedulerView, requester: Request, victims: Sequence[Request], now: float
    ) -> bool:
        if sched.cost.copies_overlap:
            return super().make_room(sched, requester, victims, now)
        victim = latest(sched, victims)
        if victim is None:
            return False
        kv = sched.kv
        rid = requester.request_id
        if kv.has_blocks(rid):
            # A started job must grow (as under `defer`): the victim's KV moves to host memory
            # when that costs less than recomputing it.
            if not (_copy_pays(sched, victim) and sched.moves.offload(victim)):
                sched.moves.recompute(victim)
            return True
        # A new or swapped job: it waits for free blocks, as under `defer`, unless moving its
        # room out (and its KV in) adds no more than INLINE_COPY_SHARE to this iteration.
        shortfall = max(1, _need(sched, requester) - kv.num_free_blocks)
        upload = len(kv.host_table(rid)) if kv.is_swapped(rid) else 0
        copy_s = sched.cost.swap_s((len(sched.moves.swap_out) + len(sched.moves.swap_in)) + shortfall + upload)
        if copy_s > INLINE_COPY_SHARE * self._budget.compute_s:
            return False
        return sched.moves.offload(victim)

    def give_up(self, sched: SchedulerView, req: Request) -> None:
        if sched.cost.copies_overlap or _copy_pays(sched, req):
            super().give_up(sched, req)
        else:
            sched.moves.recompute(req)

    def passable(self, sched: SchedulerView) -> Collection[str]:
        # NOTE: with a job in the batch, a swapped job the device should not hold is only
        # deferred (see `defer_turn`). Under pressure most of a long queue is such jobs, and
        # looking at each one cost more than the rest of the walk.
        # With inline copies nothing is uploaded ahead, so a swapped job comes back only
        # when its turn comes (as under `reactive`): passing those the device "should not
        # hold" left them waiting behind a reserve and an ENST order made for uploads ahead
        # (the real CPU engine and the simulator both: 4-13% on average JCT behind reactive).
        kv = sched.kv
        if kv.num_total_host_blocks == 0 or kv.num_swapped == 0 or not sched.cost.copies_overlap:
            return ()
        wanted = self._wanted(sched)
        return {rid for rid in kv.swapped_ids() if rid not in wanted}

    def is_landing(self, sched: SchedulerView, req: Request, batch_size: int,
                   start: int) -> bool:
        landing_s = self._landing_s.get(req.request_id, 0.0)
        if landing_s <= self._now or not sched.kv.has_blocks(req.request_id):
            return False
        return batch_size > 0 or self._first_ready(sched, start) is not None

    def _wanted(self, sched: SchedulerView) -> set[str]:
        """The jobs the device should hold: taken in ENST order, each whose blocks for its
        next iteration still fit in the device pool less the reserve (a job too large for
        what is left is passed over for smaller later ones). Only these are uploaded ahead,
        and only these make room when their turn comes: the order is stable from one
        iteration to the next, so jobs behind a full device are not moved back and forth."""
        if self._wanted_now is None:
            kv = sched.kv
            room = kv.num_total_blocks - self.reserve_blocks
            wanted: set[str] = set()
            self._wanted_order = []
            for req in sorted(sched.order, key=sched.next_run_s):
                if room <= 0:
                    break  # every job needs at least one block
                rid = req.request_id
                if kv.has_blocks(rid):
                    n = len(kv.block_table(rid)) + kv.num_new_blocks(rid, req.num_tokens + 1)
                else:
                    n = _need(sched, req)
                if n > room:
                    continue  # a smaller job later may still fit
                room -= n
                wanted.add(rid)
                self._wanted_order.append(req)
            self._wanted_now = wanted
        return self._wanted_now

    def _resident_after(self, sched: SchedulerView, start: int, slots: int) -> list[Request]:
        """The resident jobs from place `start` on, after the first `slots` of them."""
        kv = sched.kv
        out = []
        for i, r in sched.resident():
            if i < start or not kv.has_blocks(r.request_id):
                continue
            if slots > 0:
                slots -= 1
            else:
                out.append(r)
        return out

    def _first_ready(self, sched: SchedulerView, start: int) -> Request | None:
        """The first resident job from place `start` on that can run now without new blocks
        or waiting for its upload."""
        kv = sched.kv
        for i, r in sched.resident():
            rid = r.request_id
            if i >= start and kv.has_blocks(rid) and kv.num_new_blocks(rid, r.num_tokens) == 0 \
                    and self._landing_s.get(rid, 0.0) <= self._now:
                return r
        return None

    def plan_ahead(self, sched: SchedulerView, order: Sequence[Request], batch: Sequence[Request],
                   now: float) -> None:
        self._budget.compute_s = _predict_compute_s(sched, batch)
        deferred, self._deferred = self._deferred, []
        if not sched.cost.copies_overlap:
            # NOTE: inline copies add their time to the iteration whenever they are made: a
            # move ahead of need (a job's KV, or a host-tier prefix, which is uploaded when its
            # job starts anyway) costs what the same move costs when needed, and may be wasted.
            # The prefetch walk alone, fetching nothing, cost 70 us an iteration on the real
            # CPU engine (a third of the scheduler's time; benchmarks/kv/kv_policies.py --part real).
            return
        self._move_jobs(sched, order, batch, deferred)
        # 3. Then the prefix cache's host tier, with what room and copy time are left.
        if sched.kv.num_cached_host_blocks:
            self._prefetch(sched, self._budget)

    def _move_jobs(self, sched: SchedulerView, order: Sequence[Request],
                   batch: Sequence[Request], deferred: Sequence[Request]) -> None:
        kv = sched.kv
        budget = self._budget
        if kv.num_total_host_blocks == 0:
            return
        burst = self._burst(sched, order, batch, deferred)
        if kv.num_free_soon >= max(self.reserve_blocks, burst.total) and sched.kv.num_swapped == 0:
            return
        in_batch = {r.request_id for r in batch}
        # Resident started jobs outside the batch, latest first.
        victims = [r for _, r in sched.resident()
                   if r.request_id not in in_batch and sched.moves.can_offload(r)]
        victims.sort(key=sched.next_run_s, reverse=True)
        v = 0
        # 1. Keep the reserve: parked KV goes first, then the latest jobs.
        sched.moves.reclaim_parked(max(self.reserve_blocks, burst.total))
        while kv.num_free_soon < max(self.reserve_blocks, burst.total) and v < len(victims):
            if kv.num_free_soon >= self.reserve_blocks \
                    and sched.next_run_s(victims[v]) <= burst.earliest_s:
                break  # every job the burst needs room for runs after this one
            if not self._offload(sched, victims[v], budget):
                break  # no copy time left this iteration, or host memory full
            v += 1
        # 2. Upload the next jobs, earliest first, making room from later ones if need be.
        if sched.kv.num_swapped == 0:
            return
        # Only jobs the device should hold (see `_wanted`): uploading a job that the ones
        # ahead of it will push out again only churns.
        self._wanted(sched)
        swapped = [r for r in self._wanted_order if sched.moves.can_upload(r)]  # in ENST order
        horizon_s = HORIZON_ITERATIONS * budget.compute_s
        for req in swapped:
            need = len(kv.host_table(req.request_id))
            keep = max(self.reserve_blocks, burst.total - burst.of(req.request_id))
            enst = sched.next_run_s(req)
            # Exchanges only for jobs due soon, against jobs due clearly later: no churn.
            while kv.num_free_soon - need < keep and v < len(victims) and enst <= horizon_s \
                    and sched.next_run_s(victims[v]) > enst + horizon_s:
                if not self._offload(sched, victims[v], budget):
                    break
                v += 1
            if kv.num_free_soon - need < keep or not self._upload(sched, req, budget):
                break  # strictly in ENST order: a later job does not jump this one

    def _prefetch(self, sched: SchedulerView, budget: _CopyBudget) -> None:
        """Prefixes on the host tier: for the jobs the device should hold that have not
        started, in ENST order, upload them ahead into blocks free beyond the reserve and the
        burst, treating them like swapped jobs' KV; at its turn the job shares them on the
        device instead of waiting for the copy (or recomputing)."""
        kv = sched.kv
        self._wanted(sched)
        for req in self._wanted_order:
            room = kv.num_free_blocks - self.reserve_blocks
            if room <= 0:
                return
            if kv.where(req.request_id) is not None:
                continue
            hashes = extend_block_hashes(req, kv.block_size)
            limit = (req.num_tokens - 1) // kv.block_size
            n = min(room, limit)
            if n <= 0 or not budget.fits(1):
                continue
            got = sched.moves.prefetch_prefix(hashes, limit, n)
            budget.spend(got)

    @staticmethod
    def _offload(sched: SchedulerView, victim: Request, budget: _CopyBudget) -> bool:
        n = num_blocks_for(victim.num_computed_tokens, sched.kv.block_size)
        if not budget.fits(n) or not sched.moves.offload(victim, release_now=False):
            return False
        budget.spend(n)
        return True

    def _upload(self, sched: SchedulerView, req: Request, budget: _CopyBudget) -> bool:
        n = len(sched.kv.host_table(req.request_id))
        if not budget.fits(n) or not sched.moves.upload(req):
            return False
        budget.spend(n)
        if budget.block_s > 0:  # when the copy engine will be done with it, by the cost model
            self._landing_s[req.request_id] = self._now + budget.backlog_s
        return True

    def _burst(self, sched: SchedulerView, order: Sequence[Request], batch: Sequence[Request],
               deferred: Sequence[Request]) -> _Burst:
        """The blocks to keep free: for the batch's growth next iteration, for the jobs
        deferred this iteration, then for the non-resident jobs of the top `burst_queues`
        queues, at most a batch of jobs (more cannot start next iteration) and at most
        `BURST_MAX_SHARE` of the device pool beyond the batch's growth."""
        kv = sched.kv
        burst = _Burst()
        for r in batch:  # NOTE: this iteration's token is not appended yet: + 1
            burst.extra += kv.num_new_blocks(r.request_id, r.num_tokens + 1)
        burst.total = burst.extra
        limit = sched.config.max_batch_size
        for req in deferred:
            self._add(sched, burst, req)
        if self.burst_queues == 0:
            return burst
        # NOTE: counted down, so the scan ends with the last top-queue job rather than walking
        # a long queue of lower-level jobs every iteration.
        left = sched.num_in_top_queues(self.burst_queues)
        for req in order:
            if len(burst.needs) >= limit or left <= 0:
                break
            level = sched.level_of(req.request_id)
            if level is not None and level < self.burst_queues:
                left -= 1
                self._add(sched, burst, req)
        burst.total = min(burst.total, burst.extra + int(BURST_MAX_SHARE * kv.num_total_blocks))
        return burst

    @staticmethod
    def _add(sched: SchedulerView, burst: _Burst, req: Request) -> None:
        if req.request_id not in burst.needs and (n := _need(sched, req)) > 0:
            burst.add(req.request_id, n, sched.next_run_s(req))


def _copy_pays(sched: SchedulerView, req: Request) -> bool:
    """Whether offloading the job's KV and uploading it again costs less time than
    recomputing it (its prefill's share of a batch: the iteration's fixed cost aside). Asked
    when copies hold up the iteration (`CostModel.copies_overlap` false); where they overlap
    compute they cost the batch nothing."""
    cost = sched.cost
    n = req.num_computed_tokens
    recompute_s = cost.iteration_s(n, 0, 0, n * n) - cost.iteration_s(0, 0, 0)
    return 2 * cost.swap_s(num_blocks_for(n, sched.kv.block_size)) < recompute_s


def _need(sched: SchedulerView, req: Request) -> int:
    """Device blocks the job lacks to run its next iteration."""
    kv = sched.kv
    rid = req.request_id
    if kv.is_swapped(rid):
        return max(len(kv.host_table(rid)), num_blocks_for(req.num_tokens, kv.block_size))
    if kv.has_blocks(rid):
        return kv.num_new_blocks(rid, req.num_tokens)
    return num_blocks_for(sched.admit_tokens(req), kv.block_size)


class _Burst:
    """The burst prediction: blocks per non-resident job to keep room for."""

    def __init__(self) -> None:
        self.needs: dict[str, int] = {}
        self.extra = 0  # for the batch's growth
        self.total = 0
        self.earliest_s = float("inf")  # the smallest ENST among them

    def add(self, request_id: str, n: int, enst_s: float) -> None:
        self.needs[request_id] = n
        self.total += n
        self.earliest_s = min(self.earliest_s, enst_s)

    def of(self, request_id: str) -> int:
        return self.needs.get(request_id, 0)


class _CopyBudget:
    """Whether more blocks may start copying this iteration and still finish during it.

    The copy engine's backlog drains by the time passed since the last plan (`now` is the
    engine's clock); this iteration may add copies while the backlog is shorter than its
    predicted compute time (the last iteration's, until this batch is known). Moves the
    scheduler had to make anyway (victims of failed allocations) count too.
    """

    def __init__(self) -> None:
        self.block_s = 0.0  # one block's copy, by the cost model (0: copies take no time)
        self.backlog_s = 0.0  # copies queued but (by the cost model) not finished yet
        self.compute_s = 0.0  # this iteration's predicted compute (the last one's, until set)
        self._last_s: float | None = None

    def begin(self, now: float, block_s: float) -> None:
        self.block_s = block_s
        elapsed = 0.0 if self._last_s is None else max(0.0, now - self._last_s)
        self._last_s = now
        self.backlog_s = max(0.0, self.backlog_s - elapsed)

    def fits(self, num_blocks: int) -> bool:
        """Whether copying `num_blocks` more would end within this iteration's compute (a
        move longer than that is allowed when the copy engine is idle)."""
        return (
            self.block_s == 0
            or self.backlog_s == 0
            or self.backlog_s + self.block_s * num_blocks <= self.compute_s
        )

    def spend(self, num_blocks: int) -> None:
        self.backlog_s += self.block_s * num_blocks


def _predict_compute_s(sched: SchedulerView, batch: Sequence[Request]) -> float:
    shape = BatchShape.of((r.num_computed_tokens, r.num_tokens - r.num_computed_tokens)
                          for r in batch)
    return sched.cost.iteration_s(*shape)
