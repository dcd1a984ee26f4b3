"""First-come-first-served policies: vLLM's default (`fcfs`) and Orca's (`orca`)."""

from __future__ import annotations

from fastserve.core.scheduling_policy import SchedulingPolicy
from fastserve.request import Request


class FCFSPolicy(SchedulingPolicy):
    """Arrival order, run to completion, blocks allocated on demand.

    When blocks run out the newest started request is dropped and recomputed later (the
    scheduler's `_make_room`), as vLLM does by default.
    """

    def order(self, now: float) -> list[Request]:
        return list(self.requests.values())


class OrcaPolicy(FCFSPolicy):
    """Orca: FCFS that admits a job only when blocks for prompt + max_tokens can be reserved.

    The reservation means a running job never runs out of blocks and is never preempted.
    """

    def admit_tokens(self, req: Request) -> int:
        return req.max_total_tokens
