"""What a scheduling policy is: an object the `Scheduler` is given, which orders and charges
jobs. The scheduler owns the requests, the walk that fills the batch, the KV, stop criteria,
drafting and the pipeline's bookkeeping; it tells the policy what happened (a job added,
finished, recomputed, an iteration run) and asks it for the order each iteration.

A policy reads the scheduler through `PolicyView` (given once, `attach`) and writes nothing
of it; it may ask one thing done: `drop_kv` (`mlfq-preempt` gives back the blocks of a first
prefill chunk it abandoned).
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Collection, Mapping, Sequence
from operator import attrgetter
from typing import ClassVar, Protocol

from fastserve.config import SchedulerConfig
from fastserve.core.cost_model import CostModel
from fastserve.core.plan import ExecutorOutput, ScheduledRequest, SchedulerOutput
from fastserve.request import Request


class PolicyView(Protocol):
    """What a scheduling policy may read of its scheduler."""

    @property
    def requests(self) -> Mapping[str, Request]: ...  # unfinished, in arrival order

    @property
    def in_flight(self) -> Collection[str]: ...  # jobs of batches still in the pipeline

    def cached_prefix_tokens(self, req: Request) -> int: ...  # what it would not compute

    def drop_kv(self, request_id: str) -> None: ...  # give back blocks that hold nothing kept


class SchedulingPolicy(ABC):
    """Orders the unfinished jobs each iteration and keeps its own accounting of them.

    The hooks are called by the scheduler in this order: `check` then `on_add` when a job
    arrives; each iteration `order` (inside `schedule`), then `on_schedule` with the plan;
    after the iteration `on_iteration`, `keeps_result` per job, then `on_update` with the
    jobs that got a token; `on_recompute` when a job's KV is dropped and `on_finish` when it
    ends. The rest are questions: what a job needs to start, its queue, ENST, and the numbers
    a fleet router reads.
    """

    # Whether a plan may be scheduled while the previous one runs (`schedule_ahead`): not for
    # a policy that may abandon a job's result after scheduling it again.
    can_schedule_ahead: ClassVar[bool] = True

    def __init__(self, config: SchedulerConfig, cost: CostModel) -> None:
        self.config = config
        self.cost = cost
        self._view: PolicyView | None = None

    def attach(self, view: PolicyView) -> None:
        """The scheduler this policy orders for (once, by the scheduler's constructor)."""
        self._view = view

    @property
    def view(self) -> PolicyView:
        assert self._view is not None, "the policy is not attached to a scheduler"
        return self._view

    @property
    def requests(self) -> Mapping[str, Request]:
        return self.view.requests

    def recalibrate(self, cost: CostModel) -> None:
        """Decide with `cost` from now on (`Scheduler.recalibrate`)."""
        self.cost = cost

    # -- the order and the charges --------------------------------------------------------

    @abstractmethod
    def order(self, now: float) -> list[Request]:
        """Unfinished requests, most urgent first. Requests left out are not run."""

    def admit_tokens(self, req: Request) -> int:
        """Tokens of KV to reserve when a request (re)starts, beyond what its first iteration
        writes (0: blocks come as its chunks and tokens need them). Orca reserves the maximum."""
        return 0

    def check(self, req: Request) -> None:
        """Refuse a request the policy cannot order (raise), before the scheduler files it."""

    def on_add(self, req: Request, now: float) -> None:
        pass

    def on_finish(self, req: Request, now: float) -> None:
        pass

    def on_recompute(self, req: Request) -> None:
        """A request's KV was dropped: it has a prefill to redo."""

    def on_schedule(self, plan: SchedulerOutput) -> None:
        """The plan `schedule` just made."""

    def on_iteration(self, plan: SchedulerOutput, out: ExecutorOutput, now: float) -> None:
        """Accounting after an iteration, before its tokens are taken (MLFQ charges here)."""

    def keeps_result(self, sched: ScheduledRequest) -> bool:
        """Whether the job keeps this iteration's token (called after `on_iteration`).

        False leaves the request as if the iteration had not run for it (its time is still
        spent): `mlfq-preempt` abandons iterations that overrun a quantum.
        """
        return True

    def on_update(self, touched: list[Request]) -> None:
        """The requests that got a token (finished ones too) once the tokens are taken."""

    # -- queues ---------------------------------------------------------------------------

    def level_of(self, request_id: str) -> int | None:
        """The request's priority queue (0 = the most urgent), or None when it is not here.
        One queue by default; the MLFQ policies have one per level."""
        return 0 if request_id in self.requests else None

    def queue_lengths(self) -> dict[int, int]:
        """Unfinished requests per priority queue (1 = most urgent). One queue by default;
        the MLFQ policies report one entry per level."""
        return {1: len(self.requests)}

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

    # -- what a fleet router reads (`fastserve.core.routing_stats`) -------------------------

    def routing_levels(self) -> tuple[tuple[float, ...], str]:
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


def by_priority(order: list[Request], num_prioritized: int) -> list[Request]:
    """Requests' `priority` over a policy's order (`num_prioritized` of them not 0): a lower
    value runs first, whatever the policy says; within one value, the policy's order (a
    stable sort). NOTE: strict, as vLLM's priority scheduling: a steady stream of urgent
    requests starves the others (a policy's starvation promotion works within a priority)."""
    if not num_prioritized:
        return order
    return sorted(order, key=attrgetter("priority"))
