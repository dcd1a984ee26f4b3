"""`request-level`: static batching as in FasterTransformer, the baseline before Orca.

Modelled: a batch is formed only when the engine is idle, from the waiting jobs in arrival
order up to max_batch_size (and what the token budget and KV blocks admit), and it runs until
its longest job ends; no job joins a running batch, so slots freed by short jobs stay empty.
Not modelled: FasterTransformer also keeps computing padding for finished sequences and
returns the whole batch at once; here a finished job leaves (and reports) at its own last token.
"""

from __future__ import annotations

from collections.abc import Sequence

from fastserve.config import SchedulerConfig
from fastserve.core.cost_model import CostModel
from fastserve.core.kv import KVCacheManager, KVPolicy
from fastserve.core.plan import SchedulerOutput
from fastserve.core.scheduler import Scheduler
from fastserve.request import Request


class RequestLevelScheduler(Scheduler):
    """Run-to-completion batches: the next batch starts when the last one has finished."""

    def __init__(
        self,
        config: SchedulerConfig,
        kv: KVCacheManager,
        cost: CostModel,
        eos_token_ids: Sequence[int] = (),
        kv_policy: KVPolicy | None = None,
    ) -> None:
        super().__init__(config, kv, cost, eos_token_ids, kv_policy)
        # The running batch's unfinished members, in arrival order (a dict as an ordered set).
        self._members: dict[str, None] = {}

    def schedule(self, now: float) -> SchedulerOutput:
        is_forming = not self._members
        plan = super().schedule(now)
        if is_forming:
            self._members = dict.fromkeys(s.request_id for s in plan.scheduled)
        return plan

    def _order(self, now: float) -> list[Request]:
        if self._members:
            # NOTE: members that lost their KV to a recompute stay members and prefill again.
            return [self.requests[rid] for rid in self._members]
        return list(self.requests.values())

    def _on_finish(self, req: Request, now: float) -> None:
        self._members.pop(req.request_id, None)
