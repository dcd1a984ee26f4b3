"""Iteration-level scheduler: the shared mechanism under every policy.

Every iteration the batch is chosen afresh: the scheduling policy it is given
(`fastserve.core.scheduling_policy`) orders the unfinished requests by priority, and the
scheduler walks that order filling the batch up to the batch size, the token budget and the KV
blocks. A prefill takes what is left of the token budget: a longer prompt is prefilled in
chunks over several iterations (chunked prefill), beside the running decodes, and may be
preempted between chunks like any started job. A request that ran last iteration and is not
picked now is preempted between tokens and keeps its KV cache. When a request cannot get its
blocks, the
KV policy (`fastserve.core.kv`) may take them from started requests less urgent than it
and outside the batch: their KV is offloaded to host memory or dropped for recompute, so the
engine never deadlocks and never drops a job. A swapped request is uploaded before it runs, and
the KV policy may move KV ahead of need once the batch is chosen; the plan carries the copies.
Stop criteria (`stop`), drafting (`drafting`), the batches in flight (`in_flight`) and the
fleet router's snapshot (`routing_stats`) live in modules of their own.

Pure Python over ints and floats: no torch and no clock; `now` is passed in.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence

from fastserve.config import CacheConfig, SchedulerConfig
from fastserve.core.cost_model import CostModel
from fastserve.core.drafting import Drafting
from fastserve.core.in_flight import InFlight
from fastserve.core.kv import (
    KVCacheManager,
    KVCopies,
    KVPolicy,
    KVSpace,
    PrefixHold,
    check_fits,
    make_kv_policy,
)
from fastserve.core.plan import ExecutorOutput, ScheduledRequest, SchedulerOutput
from fastserve.core.replica_stats import ReplicaStats
from fastserve.core.routing_stats import RoutingStats
from fastserve.core.scheduling_policy import SchedulingPolicy, by_priority
from fastserve.core.speculative import Drafter
from fastserve.core.stats import SchedulerStats
from fastserve.core.stop import mark_stop, stop_reason
from fastserve.request import FinishReason, Request, RequestStatus


class Scheduler:
    """The walk, the requests' lifecycle and the KV moves, under the policy it is given."""

    def __init__(
        self,
        config: SchedulerConfig,
        kv: KVCacheManager,
        cost: CostModel,
        policy: SchedulingPolicy,
        eos_token_ids: Sequence[int] = (),
        kv_policy: KVPolicy | None = None,
    ) -> None:
        self.config = config
        self.cost = cost
        self.policy = policy
        self.eos_token_ids = frozenset(eos_token_ids)
        # Unfinished requests in arrival order (dicts keep insertion order).
        self.requests: dict[str, Request] = {}
        self._finished_ids: list[str] = []  # since the last plan, for the executor
        self._batch_ids: list[str] = []  # last plan's batch
        self.num_preemptions = 0  # times a started request was taken out of the batch
        self.num_draft_tokens = 0  # drafted tokens verified, all time (/metrics)
        self.num_accepted_tokens = 0  # of those, the ones the model kept
        self._order_now: Sequence[Request] = ()  # this iteration's order, for ENST
        self._now = 0.0
        self._enst: dict[str, float] | None = None  # ENST per request, computed when asked
        # Batches still running, as the step loop reports them (see `InFlight`).
        self.flight = InFlight()
        self.in_flight: Collection[str] = self.flight.ids
        self._placeholders = self.flight.placeholders
        # Jobs whose preparation (a grammar compiling) is not done: they may prefill but not
        # sample, so they sit out at their last prompt token, KV kept, until `prepared`.
        self.preparing: set[str] = set()
        # The KV blocks: what gives way when they run short is `kv_policy`'s say (default:
        # proactive with no host pool, which acts as `defer`).
        self.kv = KVSpace(kv, kv_policy or make_kv_policy(CacheConfig()), self, self.in_flight,
                          policy.on_recompute, self._admit_tokens)
        self._routing = RoutingStats()
        self._num_prioritized = 0  # unfinished requests whose priority is not 0
        self.drafting = Drafting(self.kv)  # speculative decoding
        self._drafts = self.drafting.drafts  # this iteration's, by request id
        policy.attach(self)

    # -- requests in and out ------------------------------------------------------------

    def add_request(self, req: Request, now: float) -> None:
        self.policy.check(req)  # NOTE: before anything is filed, so a bad one leaves no trace
        if req.request_id in self.requests:
            raise ValueError(f"duplicate request id {req.request_id!r}")
        self.check_fits(req)
        req.status = RequestStatus.WAITING
        self.requests[req.request_id] = req
        self._num_prioritized += req.priority != 0
        self.policy.on_add(req, now)

    def abort(self, request_id: str, now: float) -> Request | None:
        req = self.requests.get(request_id)
        if req is not None:
            self.finish(req, FinishReason.ABORT, now)
        return req

    def finish(self, req: Request, reason: FinishReason, now: float,
               error: str | None = None) -> None:
        """End a request (failed with `error`, if given) and free its blocks at once."""
        if req.is_finished:
            return
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        req.finish_s = now
        if error is not None:
            req.error = error
        if req.request_id in self._placeholders:  # its last token never came back
            self._placeholders.discard(req.request_id)
            req.output_token_ids.pop()
        keep = req.keep_kv and reason in (FinishReason.STOP, FinishReason.LENGTH)
        self.kv.free(req.request_id, park=req if keep else None)
        self.drafting.drop(req.request_id)
        self.preparing.discard(req.request_id)
        del self.requests[req.request_id]
        self._num_prioritized -= req.priority != 0
        self._finished_ids.append(req.request_id)
        self.policy.on_finish(req, now)

    def prepare(self, request_id: str) -> None:  # (see `preparing`)
        self.preparing.add(request_id)

    def prepared(self, request_ids: Collection[str]) -> None:
        self.preparing.difference_update(request_ids)

    def recalibrate(self, cost: CostModel) -> None:
        """Decide with `cost` from the next iteration on (the engine's `CostModelCheck` found
        the old one off by a steady multiple); the policy rescales what derives from it."""
        self.cost = cost
        self.policy.recalibrate(cost)

    def use_drafter(self, drafter: Drafter | None) -> None:  # (None: no request drafts)
        self.drafting.use(drafter)

    @property
    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def count(self, status: RequestStatus) -> int:
        return sum(1 for r in self.requests.values() if r.status is status)

    def queue_lengths(self) -> dict[int, int]:  # (the policy's queues, 1 = most urgent)
        return self.policy.queue_lengths()

    def level_of(self, request_id: str) -> int | None:  # (0 = the most urgent queue)
        return self.policy.level_of(request_id)

    def num_in_top_queues(self, num_queues: int) -> int:
        return self.policy.num_in_top_queues(num_queues)

    def stats(self) -> SchedulerStats:
        return SchedulerStats(
            kv=self.kv.stats(),
            queue_lengths=self.queue_lengths(),
            num_running=self.count(RequestStatus.RUNNING),
            num_waiting=self.count(RequestStatus.WAITING),
            num_preempted=self.count(RequestStatus.PREEMPTED),
            num_swapped=self.count(RequestStatus.SWAPPED),
            num_preemptions=self.num_preemptions,
            num_draft_tokens=self.num_draft_tokens,
            num_accepted_tokens=self.num_accepted_tokens,
        )

    def replica_stats(self, replica_id: str, now: float,
                      max_prefix_hashes: int = 8192) -> ReplicaStats:
        """This replica's snapshot for a fleet router (`fastserve.fleet`; see `RoutingStats`).
        NOTE: call it between iterations, on the thread that steps the engine."""
        return self._routing.replica_stats(self, replica_id, now, max_prefix_hashes)

    # -- one iteration ------------------------------------------------------------------

    def schedule(self, now: float) -> SchedulerOutput:
        """Pick this iteration's batch, and the KV copies it needs."""
        self._enst = None
        self._now = now
        self.drafting.begin()
        batch: list[Request] = []
        in_batch: set[str] = set()
        chunks: dict[str, int] = {}  # tokens each batched job runs this iteration
        tables: dict[str, list[int]] = {}  # and its device blocks
        num_tokens = 0
        budget = self.config.max_num_batched_tokens
        admitting = True  # NOTE: once a new request fails to fit, later new ones wait too
        order = self._order_now = self.flight.not_in_flight(
            by_priority(self.policy.order(now), self._num_prioritized))
        max_jobs = self.flight.max_jobs(self.config.max_batch_size, len(self.requests))
        drafter = self.drafting.drafter
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
            table = self.kv.reserve(req, done + num_new, reuse, i + 1, len(in_batch), now)
            if table is None:
                if not started:
                    admitting = False
                continue
            if num_new == 1 and drafter is not None and done == req.num_tokens - 1 \
                    and req.request_id not in self._placeholders:  # (its last token is known)
                num_new += self.drafting.draft(req, table, budget - num_tokens - 1, self.cost,
                                               len(self._batch_ids))
            batch.append(req)
            in_batch.add(req.request_id)
            chunks[req.request_id] = num_new
            tables[req.request_id] = table
            num_tokens += num_new
        plan = self._plan(batch, chunks, tables, self.kv.end_iteration(batch, now))
        self.policy.on_schedule(plan)
        return plan

    def schedule_ahead(self, plan: SchedulerOutput) -> None:
        """Async scheduling: `plan` runs on the device while the next is scheduled (see
        `InFlight.schedule_ahead`); `update` puts the real tokens in."""
        self.flight.schedule_ahead(plan, self.requests, self.drafting.drafter)

    def update(self, plan: SchedulerOutput, out: ExecutorOutput, now: float) -> list[Request]:
        """Take the sampled tokens; returns the requests that got a token (finished ones too)."""
        self.policy.on_iteration(plan, out, now)
        touched: list[Request] = []
        keeps_result = self.policy.keeps_result
        ahead, placeholders = self.flight.ahead, self._placeholders  # NOTE: empty in step
        for sched, token in zip(plan.scheduled, out.sampled_token_ids):
            rid = sched.request_id
            is_ahead = bool(ahead) and rid in ahead
            if is_ahead:
                ahead.discard(rid)
            req = self.requests.get(rid)
            if req is None:  # aborted while the iteration ran
                continue
            if not keeps_result(sched):  # the policy abandoned this job's iteration
                continue
            if rid in out.failed or (sched.samples and token < 0):  # its sampling failed
                self.finish(req, FinishReason.ERROR, now,
                            out.failed.get(rid, "sampling failed on the sampler rank"))
                touched.append(req)
                continue
            if sched.num_draft_tokens:
                tokens = out.verified_token_ids.get(rid, [token])
                reason = self.drafting.take_verified(req, sched, tokens, self.eos_token_ids)
                self.num_draft_tokens += sched.num_draft_tokens
                self.num_accepted_tokens += len(tokens) - 1
                self.kv.commit(req)
                if reason is not None:
                    self._end(req, req.output_token_ids[-1], reason, now)
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
            reason = stop_reason(req, token, self.eos_token_ids)
            if reason is not None:
                self._end(req, token, reason, now)
            touched.append(req)
        self.policy.on_update(touched)
        return touched

    def _end(self, req: Request, token: int, reason: FinishReason, now: float) -> None:
        """Finish a request whose output `token` ended it (`stop_reason`)."""
        mark_stop(req, token, reason, self.eos_token_ids)
        self.finish(req, reason, now)

    # -- what the KV policy and the allocation read ---------------------------------------

    def admit_tokens(self, req: Request) -> int:
        """Tokens of KV the request needs to start (its prompt, or Orca's reservation)."""
        return max(req.num_tokens, self.policy.admit_tokens(req))

    def _admit_tokens(self, req: Request) -> int:
        return self.policy.admit_tokens(req)

    @property
    def order(self) -> Sequence[Request]:
        """This iteration's order (what `schedule` walks)."""
        return self._order_now

    def next_run_s(self, req: Request) -> float:
        """The request's ENST this iteration (see `estimate_next_run_s`), computed once."""
        if self._enst is None:
            order = self._order_now
            self._enst = dict(zip((r.request_id for r in order),
                                  self.policy.estimate_next_run_s(order, self._now)))
        return self._enst.get(req.request_id, float("inf"))

    def cached_prefix_tokens(self, req: Request) -> int:
        """Tokens of the request's longest prefix cached on the device, or of the parked KV
        it forks (changes nothing but the request's block hashes): what it would not compute
        if it started now."""
        return self.kv.lookup(req).num_tokens

    def prefix_hold(self) -> PrefixHold | None:
        """A handle that holds a prompt's cached blocks until released, for the sequences of
        an `n` / `best_of` request that share it; None with prefix caching off."""
        return self.kv.prefix_hold()

    def check_fits(self, req: Request) -> None:
        """Raises `InvalidRequestError` (naming `max_tokens`) for a request larger than the
        whole device pool: it could never run. Changes nothing."""
        check_fits(req, self.kv)

    def drop_kv(self, request_id: str) -> None:
        """Give back the job's blocks, which hold nothing it keeps (an abandoned first
        prefill chunk): it starts again from nothing."""
        self.kv.free(request_id)

    def unpark(self, request_ids: Iterable[str]) -> None:
        """Drop the KV kept for these finished requests' forks (beam search's steps)."""
        for rid in request_ids:
            self.kv.free(rid)

    def _plan(self, batch: list[Request], chunks: dict[str, int], tables: dict[str, list[int]],
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
                    block_ids=list(tables[rid]),
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
