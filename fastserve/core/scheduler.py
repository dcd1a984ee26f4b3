"""Iteration-level scheduler: the shared mechanism under every policy.

Every iteration the batch is chosen afresh: the policy orders the unfinished requests by
priority (`_order`), and the base class walks that order filling the batch up to the batch size,
the token budget and the KV blocks. A prefill takes what is left of the token budget: a prompt
longer than that is prefilled in chunks over several iterations (chunked prefill), beside the
running decodes, and may be preempted between chunks like any started job. A request that ran last iteration and is not picked now is
preempted between tokens and keeps its KV cache. When a request cannot get its blocks, the
KV policy (`fastserve.core.kv`) may take them from started requests less urgent than it
and outside the batch: their KV is offloaded to host memory or dropped for recompute, so the
engine never deadlocks and never drops a job. A swapped request is uploaded before it runs, and
the KV policy may move KV ahead of need once the batch is chosen; the plan carries the copies.

Pure Python over ints and floats: no torch and no clock; `now` is passed in.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from operator import attrgetter

from fastserve.config import CacheConfig, SchedulerConfig
from fastserve.core.cost_model import CostModel
from fastserve.core.kv import (
    KVCacheManager,
    KVCopies,
    KVPolicy,
    KVSpace,
    PrefixHold,
    check_fits,
    make_kv_policy,
)
from fastserve.core.plan import PENDING_TOKEN, ExecutorOutput, ScheduledRequest, SchedulerOutput
from fastserve.core.replica_stats import ReplicaModel, ReplicaStats
from fastserve.core.speculative import Drafter
from fastserve.core.stats import SchedulerStats
from fastserve.request import FinishReason, Request, RequestStatus


class Scheduler(ABC):
    """Base of all policies. Subclasses supply the priority order and their accounting."""

    # Whether a plan may be scheduled while the previous one runs (`schedule_ahead`): not for
    # a policy that may abandon a job's result after scheduling it again.
    can_schedule_ahead = True

    def __init__(
        self,
        config: SchedulerConfig,
        kv: KVCacheManager,
        cost: CostModel,
        eos_token_ids: Sequence[int] = (),
        kv_policy: KVPolicy | None = None,
    ) -> None:
        self.config = config
        self.cost = cost
        self.eos_token_ids = frozenset(eos_token_ids)
        # Unfinished requests in arrival order (dicts keep insertion order).
        self.requests: dict[str, Request] = {}
        self._finished_ids: list[str] = []  # since the last plan, for the executor
        self._batch_ids: list[str] = []  # last plan's batch
        self.num_preemptions = 0  # times a started request was taken out of the batch
        self._order_now: Sequence[Request] = ()  # this iteration's order, for ENST
        self._now = 0.0
        self._enst: dict[str, float] | None = None  # ENST per request, computed when asked
        # Pipeline parallelism: jobs of batches still in the pipeline are running. They are
        # not scheduled, taken as victims or counted as preempted until their batch is back
        # (`PipelinedEngineCore` keeps this set). With `pipeline_depth` batches in flight, a
        # batch takes at most 1/depth of the unfinished jobs, so that every stage has one.
        self.in_flight: set[str] = set()
        self.pipeline_depth = 1
        # Async scheduling (`schedule_ahead`): jobs of the batch on the device that the next
        # plan may run again before its tokens are back (their KV counts as computed), and of
        # those the ones holding a placeholder token (PENDING_TOKEN) at the end of their outputs.
        self.ahead: set[str] = set()
        self._placeholders: set[str] = set()
        # Jobs whose preparation is not done (a grammar compiling, beside the loop): they may
        # prefill but not sample, so they sit out of the batch at their last prompt token, KV
        # kept, until the engine takes them out of this set. Those past their prompt never wait.
        self.preparing: set[str] = set()
        # The KV blocks: what gives way when they run short is `kv_policy`'s say (default:
        # proactive with no host pool, which acts as `defer`).
        self.kv = KVSpace(kv, kv_policy or make_kv_policy(CacheConfig()), self, self.in_flight,
                          self._on_recompute, self._admit_tokens)
        self._replica_model: ReplicaModel | None = None  # built by `replica_model`
        self._num_prioritized = 0  # unfinished requests whose priority is not 0
        # Speculative decoding: proposes drafted tokens for decodes (None: no request drafts;
        # the step loops that schedule while a batch runs leave it out, see `build_engine_core`),
        # and this iteration's drafts by request id.
        self.drafter: Drafter | None = None
        self._drafts: dict[str, list[int]] = {}
        self.num_draft_tokens = 0  # drafted tokens verified, all time (/metrics)
        self.num_accepted_tokens = 0  # of those, the ones the model kept

    # -- requests in and out ------------------------------------------------------------

    def add_request(self, req: Request, now: float) -> None:
        if req.request_id in self.requests:
            raise ValueError(f"duplicate request id {req.request_id!r}")
        check_fits(req, self.kv)
        req.status = RequestStatus.WAITING
        self.requests[req.request_id] = req
        self._num_prioritized += req.priority != 0
        self._on_add(req, now)

    def abort(self, request_id: str, now: float) -> Request | None:
        req = self.requests.get(request_id)
        if req is not None:
            self.finish(req, FinishReason.ABORT, now)
        return req

    def finish(self, req: Request, reason: FinishReason, now: float) -> None:
        """End a request and free its blocks at once."""
        if req.is_finished:
            return
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        req.finish_s = now
        if req.request_id in self._placeholders:  # its last token never came back
            self._placeholders.discard(req.request_id)
            req.output_token_ids.pop()
        keep = req.keep_kv and reason in (FinishReason.STOP, FinishReason.LENGTH)
        self.kv.free(req.request_id, park=req if keep else None)
        if self.drafter is not None:
            self.drafter.drop(req.request_id)
        self.preparing.discard(req.request_id)
        del self.requests[req.request_id]
        self._num_prioritized -= req.priority != 0
        self._finished_ids.append(req.request_id)
        self._on_finish(req, now)

    def recalibrate(self, cost: CostModel) -> None:
        """Decide with `cost` from the next iteration on: the engine's running check found
        its iterations taking a steady multiple of what the old model predicted
        (`CostModelCheck`). Policies whose settings derive from the cost model rescale them."""
        self.cost = cost

    @property
    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def count(self, status: RequestStatus) -> int:
        return sum(1 for r in self.requests.values() if r.status is status)

    def queue_lengths(self) -> dict[int, int]:
        """Unfinished requests per priority queue (1 = most urgent). One queue by default;
        the MLFQ policies report one entry per level."""
        return {1: len(self.requests)}

    # -- what a fleet router reads ------------------------------------------------------

    def stats(self) -> SchedulerStats:
        kv_stats = self.kv.stats()
        return SchedulerStats(
            kv=kv_stats,
            queue_lengths=self.queue_lengths(),
            num_running=self.count(RequestStatus.RUNNING),
            num_waiting=self.count(RequestStatus.WAITING),
            num_preempted=self.count(RequestStatus.PREEMPTED),
            num_swapped=self.count(RequestStatus.SWAPPED),
            num_preemptions=self.num_preemptions,
            num_offloads=kv_stats.num_offloads,
            num_uploads=kv_stats.num_uploads,
            num_recomputes=kv_stats.num_recomputes,
            num_prefix_query_tokens=kv_stats.num_prefix_query_tokens,
            num_prefix_hit_tokens=kv_stats.num_prefix_hit_tokens,
            num_draft_tokens=self.num_draft_tokens,
            num_accepted_tokens=self.num_accepted_tokens,
        )

    def replica_stats(self, replica_id: str, now: float,
                      max_prefix_hashes: int = 8192) -> ReplicaStats:
        """This replica's snapshot for a fleet router (`fastserve.fleet`): O(jobs + cached
        hashes), changes nothing. The simulator's replicas and the real engine both call it.
        NOTE: it walks the scheduler's dicts: call it between iterations, on the thread that
        steps the engine, not from another thread while one runs."""
        kv_stats = self.kv.stats(max_prefix_hashes)
        return ReplicaStats(
            replica_id=replica_id, time_s=now, num_requests=len(self.requests),
            queued_work_s=tuple(self.queued_work_s()),
            num_free_blocks=kv_stats.num_free_blocks, num_total_blocks=kv_stats.num_total_blocks,
            prefix_hashes=kv_stats.prefix_hashes, model=self.replica_model(),
            is_prefix_truncated=kv_stats.is_prefix_truncated,
            level_reach=tuple(self.level_reach()))

    def replica_model(self) -> ReplicaModel:
        """The static part of `replica_stats`, built once (again after `recalibrate`)."""
        model = self._replica_model
        if model is None or model.cost is not self.cost:
            quanta_s, charge_mode = self._routing_levels()
            model = self._replica_model = ReplicaModel(
                block_size=self.kv.stats().block_size, max_batch_size=self.config.max_batch_size,
                max_num_batched_tokens=self.config.max_num_batched_tokens, quanta_s=quanta_s,
                charge_mode=charge_mode, cost=self.cost, policy=self.config.policy)
        return model

    def _routing_levels(self) -> tuple[tuple[float, ...], str]:
        """(quanta per level, charge mode) for `ReplicaModel`: one unbounded level by default."""
        return (math.inf,), "own"

    def level_reach(self) -> list[float]:
        """`ReplicaStats.level_reach`: one level, which every job reaches."""
        return [1.0]

    def queued_work_s(self) -> list[float]:
        """`ReplicaStats.queued_work_s`: by default one level, every job's rest of its prefill
        (or one full-batch decode step's share, for a decoding job)."""
        b = self.config.max_batch_size
        step_s = self.cost.iteration_s(0, b, 0) / b
        work = 0.0
        for r in self.requests.values():
            left = r.num_tokens - r.num_computed_tokens
            work += self.cost.prefill_s(left, r.num_computed_tokens) if left > 1 else step_s
        return [work]

    # -- one iteration ------------------------------------------------------------------

    def schedule(self, now: float) -> SchedulerOutput:
        """Pick this iteration's batch, and the KV copies it needs."""
        self._enst = None
        self._now = now
        self._drafts = {}
        batch: list[Request] = []
        in_batch: set[str] = set()
        chunks: dict[str, int] = {}  # tokens each batched job runs this iteration
        num_tokens = 0
        budget = self.config.max_num_batched_tokens
        admitting = True  # NOTE: once a new request fails to fit, later new ones wait too
        order = self._order_now = self._not_in_flight(self._by_priority(self._order(now)))
        max_jobs = self._max_jobs()
        # Started jobs the walk may pass without a look once the batch holds one (the KV
        # policy's say), and the other started requests not yet walked past: once new
        # requests stop being admitted and this reaches 0, nothing later in the order can run
        # (a long queue is not walked for nothing).
        # NOTE: an upper bound (victims dropped below were counted), so stopping stays safe.
        passable, num_started_left = self.kv.begin(now)
        for i, req in enumerate(order):
            if len(batch) >= max_jobs:
                break
            if req.request_id in passable:
                if batch:
                    if not admitting and num_started_left <= 0:
                        break
                    continue
                started = True
                reuse = None
            else:
                reuse = self.kv.lookup(req)
                started = reuse.is_started
                num_started_left -= started
            if not started and not admitting:
                if num_started_left <= 0:
                    break
                continue
            if not started and req.request_id in self._placeholders:
                continue  # dropped for recompute while its token is on the device: not yet
            # A job starting (or restarting) with no KV forks the parked KV it continues, or
            # else shares the longest cached prefix.
            done = req.num_computed_tokens + (reuse.num_tokens if reuse is not None else 0)
            num_new = req.num_tokens - done
            if self.preparing and req.request_id in self.preparing:
                num_new -= 1  # NOTE: its last token samples, which waits for its preparation
                if num_new <= 0:
                    continue
            if num_new > 1:  # a prefill: what is left of the budget (a decode always fits)
                num_new = min(num_new, self.cost.prefill_chunk(budget - num_tokens, done))
                if num_new <= 0:
                    admitting = admitting and started
                    continue
            if not self.kv.reserve(req, done + num_new, reuse, i + 1, len(in_batch), now):
                if not started:
                    admitting = False
                continue
            if num_new == 1 and self.drafter is not None and done == req.num_tokens - 1 \
                    and req.request_id not in self._placeholders:  # (its last token is known)
                num_new += self._draft(req, budget - num_tokens - 1)
            batch.append(req)
            in_batch.add(req.request_id)
            chunks[req.request_id] = num_new
            num_tokens += num_new
        return self._plan(batch, chunks, self.kv.end_iteration(batch, now))

    def _draft(self, req: Request, max_tokens: int) -> int:
        """Speculative decoding: draft tokens for a decode of `req` that holds its blocks for
        its next token (at most `max_tokens`, the iteration's token budget left); returns how
        many (kept in `_drafts`). Drafts take a free block when they need one, never room
        made by moving another job's KV: they fit in what is there or are cut short."""
        assert self.drafter is not None
        if not self.drafter.drafts_for(req):
            return 0
        p = req.params
        # NOTE: k drafts give at most k + 1 tokens, and feed positions up to num_tokens - 1 + k.
        limit = min(max_tokens, p.max_tokens - req.num_output_tokens - 1,
                    req.max_model_len - req.num_tokens, self.drafter.num_speculative_tokens)
        draft = self.drafter.propose(req, self._drafts_worth(self.drafter, req, limit))
        if not draft:
            return 0
        rid = req.request_id
        need = req.num_tokens + len(draft)
        if not self.kv.reserve(req, need):
            held = len(self.kv.block_table(rid)) * self.kv.stats().block_size
            draft = draft[: max(0, len(draft) - (need - held))]
        if draft:
            self._drafts[rid] = draft
        return len(draft)

    def _drafts_worth(self, drafter: Drafter, req: Request, limit: int) -> int:
        """How many drafts (at most `limit`) the cost model says pay for themselves: with the
        request's acceptance a, j drafts yield a + a^2 + ... + a^j tokens on average, each
        sparing it a decode step (its share of one: the fixed cost split over the last
        batch's jobs, plus its own decode), for the cost of feeding j more tokens. Where a
        step is weight-bound (a small batch, a GPU) that is cheap and every draft pays; where
        it is compute-bound (a CPU's large batch) only well-kept drafts do."""
        if limit <= 0:
            return 0
        cost = self.cost
        a = drafter.acceptance(req)
        ctx = req.num_tokens
        num_jobs = max(1, len(self._batch_ids))
        share_s = cost.iteration_s(0, num_jobs, num_jobs * ctx) / num_jobs
        decode_s = cost.iteration_s(0, 1, ctx)
        best, best_gain, expected, a_j = 0, 0.0, 0.0, 1.0
        for j in range(1, limit + 1):
            a_j *= a
            expected += a_j
            n = 1 + j  # the last token and j drafts, fed as a chunk after ctx - 1 cached ones
            extra_s = cost.iteration_s(n, 0, 0, n * n + 2 * n * (ctx - 1), ctx - 1) - decode_s
            gain = expected * share_s - extra_s
            if gain > best_gain:
                best, best_gain = j, gain
        if best == 0 and drafter.is_due_probe(req):
            return 1  # a probe: its verdict may show the drafts are worth more
        return best

    def _by_priority(self, order: list[Request]) -> list[Request]:
        """Requests' `priority` over the policy's order: a lower value runs first, whatever
        the policy says; within one value, the policy's order (a stable sort). NOTE: strict,
        as vLLM's priority scheduling: a steady stream of urgent requests starves the others
        (the policy's starvation promotion works within a priority)."""
        if not self._num_prioritized:
            return order
        return sorted(order, key=attrgetter("priority"))

    def _not_in_flight(self, order: Sequence[Request]) -> Sequence[Request]:
        if not self.in_flight:
            return order
        return [r for r in order if r.request_id not in self.in_flight]

    def _max_jobs(self) -> int:
        if self.pipeline_depth == 1:
            return self.config.max_batch_size
        share = -(-len(self.requests) // self.pipeline_depth)
        return max(1, min(self.config.max_batch_size, share))

    def schedule_ahead(self, plan: SchedulerOutput) -> None:
        """Async scheduling: `plan` runs on the device while the next plan is scheduled. Its
        jobs' new tokens count as computed, and each job that samples holds a placeholder
        token (PENDING_TOKEN), which the next plan's decode feeds from the device (a
        grammar's mask, made on the host, waits for it: the executor draws that plan's tokens
        once these are back, `AsyncExecutor.draw`). A job whose next step needs its token on
        the host (a logits processor, a draft, a token that may be its last by length) sits
        the next plan out, as a pipeline's jobs in flight do.
        `update` puts the real tokens in. NOTE: only for a policy that `can_schedule_ahead`."""
        for sched in plan.scheduled:
            rid = sched.request_id
            req = self.requests.get(rid)
            if req is None:
                continue
            if not self._can_go_ahead(req, sched):
                self.in_flight.add(rid)
                continue
            self.ahead.add(rid)
            req.num_computed_tokens = sched.num_context_tokens
            if sched.samples:
                req.output_token_ids.append(PENDING_TOKEN)
                self._placeholders.add(rid)

    def _can_go_ahead(self, req: Request, sched: ScheduledRequest) -> bool:
        if not sched.samples:  # a prefill chunk: the next chunk's tokens are the prompt's
            return True
        p = req.params
        if p.max_tokens == 0:
            return False
        if p.logits_processors:  # NOTE: a processor may keep state from one step to the next
            return False
        if self.drafter is not None and self.drafter.wants_last_token(req):
            return False  # its next step drafts after its last token: it sits one plan out
        num_output = len(req.output_token_ids) + 1  # with the token on the device
        return num_output < p.max_tokens and req.num_prompt_tokens + num_output < req.max_model_len

    def update(self, plan: SchedulerOutput, out: ExecutorOutput, now: float) -> list[Request]:
        """Take the sampled tokens; returns the requests that got a token (finished ones too)."""
        self._on_iteration(plan, out, now)
        touched: list[Request] = []
        ahead, placeholders = self.ahead, self._placeholders  # NOTE: empty in step (no async)
        for sched, token in zip(plan.scheduled, out.sampled_token_ids):
            rid = sched.request_id
            is_ahead = bool(ahead) and rid in ahead
            if is_ahead:
                ahead.discard(rid)
            req = self.requests.get(rid)
            if req is None:  # aborted while the iteration ran
                continue
            if not self._keeps_result(sched):  # the policy abandoned this job's iteration
                continue
            if rid in out.failed or (sched.samples and token < 0):  # its sampling failed
                self.finish(req, FinishReason.ERROR, now)
                req.error = out.failed.get(rid, "sampling failed on the sampler rank")
                touched.append(req)
                continue
            if sched.num_draft_tokens:
                self._take_verified(req, sched, out.verified_token_ids.get(rid, [token]), now)
                touched.append(req)
                continue
            if not is_ahead:  # (ahead: counted when scheduled ahead, or since dropped)
                req.num_computed_tokens = sched.num_context_tokens
            has_placeholder = bool(placeholders) and rid in placeholders
            if has_placeholder:  # NOTE: before the block hashes read the tokens
                placeholders.discard(rid)
                req.output_token_ids[-1] = token
            self.kv.commit(req)
            if not sched.samples:  # a prefill chunk with prompt left: no token yet
                continue
            if req.params.max_tokens == 0:  # a prefill alone (prompt log-probabilities)
                self.finish(req, FinishReason.LENGTH, now)
                touched.append(req)
                continue
            if not has_placeholder:
                req.output_token_ids.append(token)
            if req.first_token_s is None:
                req.first_token_s = now
            reason = self._stop_reason(req, token)
            if reason is not None:
                self._end(req, token, reason, now)
            touched.append(req)
        return touched

    def _take_verified(self, req: Request, sched: ScheduledRequest, tokens: list[int],
                       now: float) -> None:
        """A decode that verified drafts: its tokens (the accepted drafts, then the model's
        next) join the output up to the first that stops it. The KV of the tokens fed up to
        the last accepted draft stays computed; a rejected draft's is overwritten later."""
        num_accepted = len(tokens) - 1
        req.num_draft_tokens += sched.num_draft_tokens
        req.num_accepted_tokens += num_accepted
        self.num_draft_tokens += sched.num_draft_tokens
        self.num_accepted_tokens += num_accepted
        if self.drafter is not None:
            self.drafter.observe(req.request_id, sched.num_draft_tokens, num_accepted)
        reason = None
        num_kept = 0
        for t in tokens:
            req.output_token_ids.append(t)
            num_kept += 1
            reason = self._stop_reason(req, t)
            if reason is not None:
                break
        # NOTE: position start_pos is the last token before the drafts; a stop before the
        # last accepted draft leaves the KV past its tokens uncounted.
        req.num_computed_tokens = sched.start_pos + 1 + min(num_accepted, num_kept)
        self.kv.commit(req)
        if reason is not None:
            self._end(req, req.output_token_ids[-1], reason, now)

    # -- policy hooks ---------------------------------------------------------------------

    @abstractmethod
    def _order(self, now: float) -> list[Request]:
        """Unfinished requests, most urgent first. Requests left out are not run."""

    def _admit_tokens(self, req: Request) -> int:
        """Tokens of KV to reserve when a request (re)starts, beyond what its first iteration
        writes (0: blocks come as its chunks and tokens need them). Orca reserves the maximum."""
        return 0

    def level_of(self, request_id: str) -> int | None:
        """The request's priority queue (0 = the most urgent), or None when it is not here.
        One queue by default; the MLFQ policies have one per level."""
        return 0 if request_id in self.requests else None

    def num_in_top_queues(self, num_queues: int) -> int:
        """Unfinished requests in the `num_queues` most urgent queues."""
        return len(self.requests) if num_queues > 0 else 0

    def estimate_next_run_s(self, order: Sequence[Request], now: float) -> list[float]:
        """Estimated next scheduled time (ENST) of each request of `order`, in seconds from
        `now`: the KV policies offload the largest first and upload the smallest first.

        Default: the request's place in the order times a full batch's per-job decode step,
        which only ranks them (a policy without levels cannot say more). MLFQ overrides it.
        """
        b = self.config.max_batch_size
        step_s = self.cost.iteration_s(0, b, 0) / b
        return [i / b * step_s for i in range(len(order))]

    def _on_add(self, req: Request, now: float) -> None:
        pass

    def _on_finish(self, req: Request, now: float) -> None:
        pass

    def _on_recompute(self, req: Request) -> None:
        """A request's KV was dropped: it has a prefill to redo."""

    def _on_iteration(self, plan: SchedulerOutput, out: ExecutorOutput, now: float) -> None:
        """Accounting after an iteration (MLFQ charges attained service here)."""

    def _keeps_result(self, sched: ScheduledRequest) -> bool:
        """Whether the job keeps this iteration's token (called after `_on_iteration`).

        False leaves the request as if the iteration had not run for it (its time is still
        spent): `mlfq-preempt` abandons iterations that overrun a quantum.
        """
        return True

    # -- shared mechanism -----------------------------------------------------------------

    def admit_tokens(self, req: Request) -> int:
        """Tokens of KV the request needs to start (its prompt, or Orca's reservation)."""
        return max(req.num_tokens, self._admit_tokens(req))

    @property
    def order(self) -> Sequence[Request]:
        """This iteration's order (what `schedule` walks)."""
        return self._order_now

    def next_run_s(self, req: Request) -> float:
        """The request's ENST this iteration (see `estimate_next_run_s`), computed once."""
        if self._enst is None:
            order = self._order_now
            self._enst = dict(
                zip((r.request_id for r in order), self.estimate_next_run_s(order, self._now))
            )
        return self._enst.get(req.request_id, float("inf"))

    # -- prefix cache -------------------------------------------------------------------

    def cached_prefix_tokens(self, req: Request) -> int:
        """Tokens of the request's longest prefix cached on the device, or of the parked KV
        it forks (changes nothing but the request's block hashes): what it would not compute
        if it started now."""
        return self.kv.lookup(req).num_tokens

    def prefix_hold(self) -> PrefixHold | None:
        """A handle that holds a prompt's cached blocks until released, for the sequences of
        an `n` / `best_of` request that share it; None with prefix caching off."""
        return self.kv.prefix_hold()

    def unpark(self, request_ids: Iterable[str]) -> None:
        """Drop the KV kept for these finished requests' forks (beam search's steps)."""
        for rid in request_ids:
            self.kv.free(rid)

    def _plan(self, batch: list[Request], chunks: dict[str, int],
              kv_copies: KVCopies) -> SchedulerOutput:
        preempted: list[str] = []
        for rid in self._batch_ids:
            req = self.requests.get(rid)
            if req is not None and rid not in chunks and rid not in self.in_flight \
                    and rid not in self.preparing:  # (waiting on itself, not preempted)
                if req.status is RequestStatus.RUNNING:
                    req.status = RequestStatus.PREEMPTED
                req.num_preemptions += 1
                self.num_preemptions += 1
                preempted.append(rid)
        scheduled = []
        block_table = self.kv.block_table
        for req in batch:
            req.status = RequestStatus.RUNNING
            rid = req.request_id
            draft = self._drafts.get(rid, ())
            n = chunks[rid] - len(draft)
            start = req.num_computed_tokens
            outputs = req.output_token_ids
            num_tokens = len(req.prompt_token_ids) + len(outputs)
            # Penalties and prompt log-probabilities read the request's tokens (else none).
            history = req.params.needs_token_history
            token_ids = _new_tokens(req, n, num_tokens)
            if draft:
                token_ids = [*token_ids, *draft]
            scheduled.append(
                ScheduledRequest(
                    request_id=rid,
                    token_ids=token_ids,
                    start_pos=start,
                    block_ids=list(block_table(rid)),
                    params=req.params,
                    num_output_tokens=len(outputs),
                    samples=start + n == num_tokens,  # (drafts come after the last token)
                    prompt_token_ids=req.prompt_token_ids if history else (),
                    output_token_ids=outputs if history else (),
                    lora_id=req.lora_id,
                    num_draft_tokens=len(draft),
                )
            )
        # Jobs still in flight ran in an earlier batch: they are checked once they are back.
        self._batch_ids = [r.request_id for r in batch] + [
            rid for rid in self._batch_ids if rid in self.in_flight
        ]
        finished, self._finished_ids = self._finished_ids, []
        return SchedulerOutput(
            scheduled=scheduled,
            finished_ids=finished,
            swap_out=kv_copies.swap_out,
            swap_in=kv_copies.swap_in,
            copies=kv_copies.copies,
            preempted_ids=preempted,
        )

    def _end(self, req: Request, token: int, reason: FinishReason, now: float) -> None:
        """Finish a request whose output `token` ended it (`_stop_reason`)."""
        if reason is FinishReason.STOP:
            if self._is_stop_token(req, token):
                req.stop_token = token
            else:
                req.is_repetitive = True
        self.finish(req, reason, now)

    def _is_stop_token(self, req: Request, token: int) -> bool:
        p = req.params
        return token in p.stop_token_ids or (not p.ignore_eos and token in self.eos_token_ids)

    def _stop_reason(self, req: Request, token: int) -> FinishReason | None:
        p = req.params
        num_output = len(req.output_token_ids)
        if num_output >= p.min_tokens and self._is_stop_token(req, token):
            return FinishReason.STOP
        if num_output >= p.max_tokens or len(req.prompt_token_ids) + num_output >= req.max_model_len:
            return FinishReason.LENGTH
        repetition = p.repetition_detection
        if repetition is not None and num_output >= p.min_tokens and repetition.repeats(
                req.output_token_ids):
            return FinishReason.STOP
        return None


def _new_tokens(req: Request, n: int, num_tokens: int) -> list[int]:
    """The `n` tokens to feed this iteration: the last one for a decode, the next uncached
    ones (the whole rest, or a chunk) otherwise; `num_tokens` is the request's so far."""
    start = req.num_computed_tokens
    if start == num_tokens - 1:
        return [req.output_token_ids[-1] if req.output_token_ids else req.prompt_token_ids[-1]]
    num_prompt = req.num_prompt_tokens
    if start + n <= num_prompt:  # NOTE: no copy of a long prompt for each of its chunks
        return req.prompt_token_ids[start : start + n]
    return req.all_token_ids()[start : start + n]
