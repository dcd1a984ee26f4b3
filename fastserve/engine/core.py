"""The step loop: schedule -> execute -> update (and its pipelined form), and its wiring."""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Sequence

from fastserve.clock import Clock
from fastserve.config import EngineConfig
from fastserve.core.cost_model import CostModel
from fastserve.core.kv_manager import KVCacheManager
from fastserve.core.kv_policy import make_kv_policy
from fastserve.core.plan import ExecutorOutput, SchedulerOutput
from fastserve.core.policies import make_scheduler
from fastserve.core.scheduler import Scheduler
from fastserve.executor.base import Executor, ExecutorDeadError, PipelinedExecutor
from fastserve.request import FinishReason, Request

logger = logging.getLogger(__name__)


def build_engine_core(config: EngineConfig, executor: Executor, cost: CostModel, clock: Clock,
                      num_device_blocks: int, num_host_blocks: int,
                      eos_token_ids: Sequence[int] = ()) -> EngineCore:
    """The KV manager, the configured scheduler and KV policy, and the step loop over
    `executor`: the one wiring of the real engine and the simulator. An executor that keeps
    more than one batch in flight gets the pipelined loop."""
    kv = KVCacheManager(num_device_blocks, config.cache.block_size, num_host_blocks,
                        enable_prefix_caching=config.cache.enable_prefix_caching)
    scheduler = make_scheduler(config.scheduler, kv, cost, eos_token_ids,
                               make_kv_policy(config.cache))
    if isinstance(executor, PipelinedExecutor) and executor.max_in_flight > 1:
        return PipelinedEngineCore(scheduler, executor, clock)
    return EngineCore(scheduler, executor, clock)


class EngineCore:
    """Scheduler + executor + clock. Both the real engine and the simulator step this."""

    def __init__(self, scheduler: Scheduler, executor: Executor, clock: Clock) -> None:
        self.scheduler = scheduler
        self.executor = executor
        self.clock = clock
        self.num_iterations = 0
        self.busy_s = 0.0  # time spent in iterations
        self.swap_wait_s = 0.0
        # The plan of the latest step (`LLMEngine` records its batch shape per iteration).
        self.last_plan: SchedulerOutput | None = None
        # What the executor returned for the requests of the latest step's update (None when
        # the step handed back no batch): the engine takes their log-probabilities from it.
        self.last_output: ExecutorOutput | None = None

    @property
    def num_in_flight(self) -> int:
        """Batches started but not yet back (only the pipelined loop has any)."""
        return 0

    def step(self) -> list[Request]:
        """Run one iteration; returns the requests that got a token or failed."""
        plan = self.last_plan = self.scheduler.schedule(self.clock.now())
        self.last_output = None
        try:
            out = self.last_output = self.executor.execute(plan)
        except ExecutorDeadError:
            raise
        except Exception as exc:  # NOTE: one failing batch must not take the engine down
            return self._fail(plan, exc)
        self.clock.advance(out.duration_s)
        self.num_iterations += not plan.is_empty
        self.busy_s += out.duration_s
        self.swap_wait_s += out.swap_wait_s
        return self.scheduler.update(plan, out, self.clock.now())

    def _fail(self, plan: SchedulerOutput, exc: Exception) -> list[Request]:
        logger.exception("iteration failed; failing its %d requests", len(plan.scheduled))
        failed = []
        now = self.clock.now()
        for s in plan.scheduled:
            req = self.scheduler.requests.get(s.request_id)
            if req is not None:
                self.scheduler.finish(req, FinishReason.ERROR, now)
                req.error = f"{type(exc).__name__}: {exc}"
                failed.append(req)
        return failed


class PipelinedEngineCore(EngineCore):
    """The step loop with up to `max_in_flight` batches in the pipeline, each stage working on
    a different one (pipeline parallelism).

    A step launches a batch while a pipeline slot is free and there is work to run; otherwise
    it waits for the oldest batch and hands its tokens to the scheduler. Jobs of batches in
    flight are running: the scheduler leaves them out (`Scheduler.in_flight`), so batch k+1 is
    scheduled without waiting for batch k.
    """

    def __init__(
        self,
        scheduler: Scheduler,
        executor: PipelinedExecutor,
        clock: Clock,
        max_in_flight: int | None = None,
    ) -> None:
        super().__init__(scheduler, executor, clock)
        self.pipeline = executor
        self.max_in_flight = max_in_flight or executor.max_in_flight
        scheduler.pipeline_depth = self.max_in_flight
        self._in_flight: deque[SchedulerOutput] = deque()

    @property
    def num_in_flight(self) -> int:
        return len(self._in_flight)

    def step(self) -> list[Request]:
        """Launch a batch, or finish the oldest; returns the requests that got a token or failed."""
        self.last_plan = None  # a collect step launches nothing
        self.last_output = None
        if len(self._in_flight) < self.max_in_flight:
            plan = self.last_plan = self.scheduler.schedule(self.clock.now())
            try:
                self.pipeline.submit(plan, self.clock.now())
            except ExecutorDeadError:
                raise
            except Exception as exc:
                return self._fail(plan, exc)
            if not plan.is_empty:
                self._in_flight.append(plan)
                self.scheduler.in_flight.update(s.request_id for s in plan.scheduled)
                self.num_iterations += 1
                return []
        if not self._in_flight:
            return []
        plan = self._in_flight.popleft()
        self.scheduler.in_flight.difference_update(s.request_id for s in plan.scheduled)
        try:
            result = self.pipeline.collect(self.clock.now())
        except ExecutorDeadError:
            raise
        except Exception as exc:
            return self._fail(plan, exc)
        self.last_output = result.out
        self.clock.advance(result.wait_s)
        self.busy_s += result.out.duration_s
        self.swap_wait_s += result.out.swap_wait_s
        return self.scheduler.update(plan, result.out, self.clock.now())
