"""Iteration-level scheduler: the shared mechanism under every policy.

Every iteration the batch is chosen afresh: the policy orders the unfinished requests by
priority (`_order`), and the base class walks that order filling the batch up to the batch size,
the token budget and the KV blocks. A request that ran last iteration and is not picked now is
preempted between tokens and keeps its KV cache. When a started request cannot get the block
for its next token, the lowest-priority started request outside the batch gives its blocks up
(`_make_room`); by default its KV is dropped and recomputed later, so the engine never deadlocks
and never drops a job.

Pure Python over ints and floats: no torch and no clock; `now` is passed in.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence

from fastserve.config import SchedulerConfig
from fastserve.core.cost_model import CostModel
from fastserve.core.kv_manager import KVCacheManager
from fastserve.core.plan import ExecutorOutput, ScheduledRequest, SchedulerOutput
from fastserve.request import FinishReason, Request, RequestStatus


class Scheduler(ABC):
    """Base of all policies. Subclasses supply the priority order and their accounting."""

    def __init__(
        self,
        config: SchedulerConfig,
        kv: KVCacheManager,
        cost: CostModel,
        eos_token_ids: Sequence[int] = (),
    ) -> None:
        self.config = config
        self.kv = kv
        self.cost = cost
        self.eos_token_ids = frozenset(eos_token_ids)
        # Unfinished requests in arrival order (dicts keep insertion order).
        self.requests: dict[str, Request] = {}
        self._finished_ids: list[str] = []  # since the last plan, for the executor
        self._batch_ids: list[str] = []  # last plan's batch
        self.num_preemptions = 0  # times a started request was taken out of the batch
        self.num_recomputes = 0  # times a request's KV was dropped for recompute

    # -- requests in and out ------------------------------------------------------------

    def add_request(self, req: Request, now: float) -> None:
        if req.request_id in self.requests:
            raise ValueError(f"duplicate request id {req.request_id!r}")
        req.status = RequestStatus.WAITING
        self.requests[req.request_id] = req
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
        self.kv.free(req.request_id)
        del self.requests[req.request_id]
        self._finished_ids.append(req.request_id)
        self._on_finish(req, now)

    @property
    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def count(self, status: RequestStatus) -> int:
        return sum(1 for r in self.requests.values() if r.status is status)

    def queue_lengths(self) -> dict[int, int]:
        """Unfinished requests per priority queue (1 = most urgent). One queue by default;
        the MLFQ policies report one entry per level."""
        return {1: len(self.requests)}

    # -- one iteration ------------------------------------------------------------------

    def schedule(self, now: float) -> SchedulerOutput:
        """Pick this iteration's batch."""
        batch: list[Request] = []
        in_batch: set[str] = set()
        num_tokens = 0
        admitting = True  # NOTE: once a new request fails to fit, later new ones wait too
        order = self._order(now)
        for i, req in enumerate(order):
            if len(batch) >= self.config.max_batch_size:
                break
            started = self.kv.has_blocks(req.request_id)
            if not started and not admitting:
                continue
            num_new = req.num_tokens - req.num_computed_tokens
            if num_new > 1 and batch and num_tokens + num_new > self.config.max_num_batched_tokens:
                admitting = admitting and started
                continue
            if not self._allocate(req, order[i + 1 :], in_batch, now):
                if not started:
                    admitting = False
                continue
            batch.append(req)
            in_batch.add(req.request_id)
            num_tokens += num_new
        return self._plan(batch, in_batch)

    def update(self, plan: SchedulerOutput, out: ExecutorOutput, now: float) -> list[Request]:
        """Take the sampled tokens; returns the requests that got a token (finished ones too)."""
        self._on_iteration(plan, out, now)
        touched: list[Request] = []
        for sched, token in zip(plan.scheduled, out.sampled_token_ids):
            req = self.requests.get(sched.request_id)
            if req is None:  # aborted while the iteration ran
                continue
            if not self._keeps_result(sched):  # the policy abandoned this job's iteration
                continue
            req.num_computed_tokens = sched.num_context_tokens
            req.output_token_ids.append(token)
            if req.first_token_s is None:
                req.first_token_s = now
            reason = self._stop_reason(req, token)
            if reason is not None:
                self.finish(req, reason, now)
            touched.append(req)
        return touched

    # -- policy hooks ---------------------------------------------------------------------

    @abstractmethod
    def _order(self, now: float) -> list[Request]:
        """Unfinished requests, most urgent first. Requests left out are not run."""

    def _admit_tokens(self, req: Request) -> int:
        """Tokens of KV to allocate when a request (re)starts. Orca reserves the maximum."""
        return req.num_tokens

    def _on_add(self, req: Request, now: float) -> None:
        pass

    def _on_finish(self, req: Request, now: float) -> None:
        pass

    def _on_iteration(self, plan: SchedulerOutput, out: ExecutorOutput, now: float) -> None:
        """Accounting after an iteration (MLFQ charges attained service here)."""

    def _keeps_result(self, sched: ScheduledRequest) -> bool:
        """Whether the job keeps this iteration's token (called after `_on_iteration`).

        False leaves the request as if the iteration had not run for it (its time is still
        spent): `mlfq-preempt` abandons iterations that overrun a quantum.
        """
        return True

    def _make_room(self, victims: list[Request], now: float) -> bool:
        """Free blocks by giving up the KV of the last (least urgent) victim.

        Default: drop it for recompute. Returns False when there is no victim.
        """
        if not victims:
            return False
        self.recompute(victims[-1])
        return True

    # -- shared mechanism -----------------------------------------------------------------

    def recompute(self, req: Request) -> None:
        """Drop a request's KV; it prefills its prompt and generated tokens again later."""
        self.kv.free(req.request_id)
        req.num_computed_tokens = 0
        req.status = RequestStatus.WAITING
        req.num_preemptions += 1
        self.num_recomputes += 1

    def _allocate(
        self, req: Request, rest: Sequence[Request], in_batch: set[str], now: float
    ) -> bool:
        """Find KV blocks for the request's tokens this iteration, making room if it must."""
        started = self.kv.has_blocks(req.request_id)
        num_tokens = req.num_tokens if started else max(req.num_tokens, self._admit_tokens(req))
        while self.kv.allocate(req.request_id, num_tokens) is None:
            if not started:
                return False  # new requests wait for free blocks
            victims = [r for r in rest if self.kv.has_blocks(r.request_id)]
            if not self._make_room(victims, now):
                # Nothing below it holds blocks: give up this request's own KV.
                self.recompute(req)
                return False
        return True

    def _plan(self, batch: list[Request], in_batch: set[str]) -> SchedulerOutput:
        preempted: list[str] = []
        for rid in self._batch_ids:
            req = self.requests.get(rid)
            if req is not None and rid not in in_batch:
                if req.status is RequestStatus.RUNNING:
                    req.status = RequestStatus.PREEMPTED
                req.num_preemptions += 1
                self.num_preemptions += 1
                preempted.append(rid)
        scheduled = []
        for req in batch:
            req.status = RequestStatus.RUNNING
            scheduled.append(
                ScheduledRequest(
                    request_id=req.request_id,
                    token_ids=_new_tokens(req),
                    start_pos=req.num_computed_tokens,
                    block_ids=list(self.kv.block_table(req.request_id)),
                    params=req.params,
                    num_output_tokens=req.num_output_tokens,
                )
            )
        self._batch_ids = [r.request_id for r in batch]
        finished, self._finished_ids = self._finished_ids, []
        return SchedulerOutput(scheduled=scheduled, finished_ids=finished, preempted_ids=preempted)

    def _stop_reason(self, req: Request, token: int) -> FinishReason | None:
        p = req.params
        if req.num_output_tokens >= p.min_tokens and (
            token in p.stop_token_ids or (not p.ignore_eos and token in self.eos_token_ids)
        ):
            return FinishReason.STOP
        if req.num_output_tokens >= p.max_tokens or req.num_tokens >= req.max_model_len:
            return FinishReason.LENGTH
        return None


def _new_tokens(req: Request) -> list[int]:
    """Tokens to feed this iteration: the last one for a decode, all uncached ones otherwise."""
    if req.num_computed_tokens == req.num_tokens - 1:
        return [req.output_token_ids[-1] if req.output_token_ids else req.prompt_token_ids[-1]]
    return req.all_token_ids()[req.num_computed_tokens :]
