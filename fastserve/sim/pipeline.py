"""The simulator's executor for pipeline parallelism: several batches in flight.

Each of the cost model's P stages spends `CostModel.stage_s` on a batch and takes batches in
the order they were submitted: a batch enters stage s once it has left stage s - 1 and stage s
has finished the batch before it. The engine (`PipelinedEngineCore`) keeps up to P batches in
flight, so in steady state every stage works on a different batch and one leaves the pipeline
every `stage_s`, while each job still waits the whole `iteration_s` for its next token.

KV copies are modelled as `SimExecutor` does (every rank copies its own shard over its own
link, all at once, so one copy engine stands for all): a batch enters stage 0 once the copies
touching its blocks have landed.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass

from fastserve.clock import Clock
from fastserve.core.cost_model import CostModel
from fastserve.core.plan import ExecutorOutput, SchedulerOutput
from fastserve.executor.base import PipelineResult
from fastserve.sim.executor import SimExecutor


@dataclass(frozen=True)
class _SimBatch:
    token_ids: list[int]  # what its jobs sample
    submit_s: float
    done_s: float  # when it leaves the last stage
    swap_wait_s: float


class PipelinedSimExecutor(SimExecutor):
    """Predicted stage times for `cost.pipeline_parallel_size` stages; placeholder tokens."""

    def __init__(self, cost: CostModel, vocab_size: int = 32000, clock: Clock | None = None,
                 eos_after: Mapping[str, tuple[int, int]] | None = None) -> None:
        super().__init__(cost, vocab_size, clock, eos_after)
        self.max_in_flight = cost.pipeline_parallel_size
        self._stage_free_s = [0.0] * cost.pipeline_parallel_size  # when each stage is next free
        self._in_flight: deque[_SimBatch] = deque()
        self.stage_busy_s = [0.0] * cost.pipeline_parallel_size  # for utilisation reports

    def submit(self, plan: SchedulerOutput, now: float) -> None:
        if plan.swap_out or plan.swap_in:
            self._queue_copies(plan, now)
        if plan.is_empty:
            return
        wait_s = self._wait_s(plan, now)
        stage_s = self.cost.stage_s(*plan.shape)
        t = now + wait_s
        for s in range(len(self._stage_free_s)):
            t = max(t, self._stage_free_s[s]) + stage_s
            self._stage_free_s[s] = t
            self.stage_busy_s[s] += stage_s
        self._in_flight.append(_SimBatch(self.tokens(plan), now, t, wait_s))

    def collect(self, now: float) -> PipelineResult:
        b = self._in_flight.popleft()
        out = ExecutorOutput(
            sampled_token_ids=b.token_ids,
            duration_s=b.done_s - b.submit_s,
            swap_wait_s=b.swap_wait_s,
        )
        return PipelineResult(out, max(0.0, b.done_s - now))
