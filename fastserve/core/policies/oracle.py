"""`srpt-oracle`: shortest remaining processing time, told each job's true output length.

Not deployable (nobody knows output lengths in advance): it is the benchmark's lower bound on
mean JCT, and the only policy allowed to read `Request.oracle_output_len`.
"""

from __future__ import annotations

from collections.abc import Sequence

from fastserve.config import SchedulerConfig
from fastserve.core.cost_model import CostModel
from fastserve.core.kv_manager import KVCacheManager
from fastserve.core.plan import ExecutorOutput, SchedulerOutput
from fastserve.core.policies.keyed_order import KeyedOrder
from fastserve.core.scheduler import Scheduler
from fastserve.request import Request


class SRPTOracleScheduler(Scheduler):
    """Least predicted remaining time first, re-decided every iteration (preemptive).

    Remaining time = remaining tokens x one decode step at the current context, plus a prefill
    of every token when the job holds no KV (new, or dropped for recompute); ties go to the
    earlier arrival.
    """

    def __init__(
        self,
        config: SchedulerConfig,
        kv: KVCacheManager,
        cost: CostModel,
        eos_token_ids: Sequence[int] = (),
    ) -> None:
        super().__init__(config, kv, cost, eos_token_ids)
        self._queue: KeyedOrder[Request] = KeyedOrder()
        self._seq: dict[str, int] = {}
        self._num_added = 0

    def add_request(self, req: Request, now: float) -> None:
        # Checked before the base class files the request, so a bad one leaves no trace.
        n = req.oracle_output_len
        if n is None or isinstance(n, bool) or not isinstance(n, int) or n <= 0:
            raise ValueError(
                f"policy 'srpt-oracle' needs Request.oracle_output_len (the true output length, "
                f"a positive int) for request {req.request_id!r}, got {n!r}"
            )
        super().add_request(req, now)

    def update(self, plan: SchedulerOutput, out: ExecutorOutput, now: float) -> list[Request]:
        touched = super().update(plan, out, now)
        for req in touched:
            if not req.is_finished:
                self._rekey(req)
        return touched

    def recompute(self, req: Request) -> None:
        super().recompute(req)
        self._rekey(req)  # it has a prefill to redo now

    def _on_add(self, req: Request, now: float) -> None:
        self._seq[req.request_id] = self._num_added
        self._num_added += 1
        self._rekey(req)

    def _on_finish(self, req: Request, now: float) -> None:
        self._queue.remove(req.request_id)
        self._seq.pop(req.request_id, None)

    def _order(self, now: float) -> list[Request]:
        return self._queue.items()

    def _rekey(self, req: Request) -> None:
        self._queue.put(req.request_id, (self._remaining_s(req), self._seq[req.request_id]), req)

    def _remaining_s(self, req: Request) -> float:
        assert req.oracle_output_len is not None  # checked in add_request
        total = min(req.oracle_output_len, req.params.max_tokens)
        left = max(1, min(total - req.num_output_tokens, req.max_model_len - req.num_tokens))
        step_s = self.cost.decode_s(req.num_tokens)
        if req.num_computed_tokens == 0:  # its next iteration prefills and yields a token
            return self.cost.prefill_s(req.num_tokens) + (left - 1) * step_s
        return left * step_s
