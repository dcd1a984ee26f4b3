"""First-come-first-served policies: vLLM's default (`fcfs`) and Orca's (`orca`)."""

from __future__ import annotations

from fastserve.core.scheduler import Scheduler
from fastserve.request import Request


class FCFSScheduler(Scheduler):
    """Arrival order, run to completion, blocks allocated on demand.

    When blocks run out the newest started request is dropped and recomputed later (the base
    class's `_make_room`), as vLLM does by default.
    """

    def _order(self, now: float) -> list[Request]:
        return list(self.requests.values())


class OrcaScheduler(FCFSScheduler):
    """Orca: FCFS that admits a job only when blocks for prompt + max_tokens can be reserved.

    The reservation means a running job never runs out of blocks and is never preempted.
    """

    def _admit_tokens(self, req: Request) -> int:
        return req.max_total_tokens
