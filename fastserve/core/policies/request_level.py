"""`request-level`: static batching as in FasterTransformer, the baseline before Orca.

Modelled: a batch is formed only when the engine is idle, from the waiting jobs in arrival
order up to max_batch_size (and what the token budget and KV blocks admit), and it runs until
its longest job ends; no job joins a running batch, so slots freed by short jobs stay empty.
Not modelled: FasterTransformer also keeps computing padding for finished sequences and
returns the whole batch at once; here a finished job leaves (and reports) at its own last token.
"""

from __future__ import annotations

from fastserve.config import SchedulerConfig
from fastserve.core.cost_model import CostModel
from fastserve.core.plan import SchedulerOutput
from fastserve.core.scheduling_policy import SchedulingPolicy
from fastserve.request import Request


class RequestLevelPolicy(SchedulingPolicy):
    """Run-to-completion batches: the next batch starts when the last one has finished."""

    def __init__(self, config: SchedulerConfig, cost: CostModel) -> None:
        super().__init__(config, cost)
        # The running batch's unfinished members, in arrival order (a dict as an ordered set).
        self._members: dict[str, None] = {}
        self._is_forming = False  # whether this iteration's plan forms a new batch

    def on_schedule(self, plan: SchedulerOutput) -> None:
        if self._is_forming:
            self._members = dict.fromkeys(s.request_id for s in plan.scheduled)

    def order(self, now: float) -> list[Request]:
        self._is_forming = not self._members
        if self._members:
            # NOTE: members that lost their KV to a recompute stay members and prefill again.
            return [self.requests[rid] for rid in self._members]
        return list(self.requests.values())

    def on_finish(self, req: Request, now: float) -> None:
        self._members.pop(req.request_id, None)
