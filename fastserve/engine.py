"""The step loop: schedule -> execute -> update."""

from __future__ import annotations

import logging
from typing import Protocol

from fastserve.clock import Clock
from fastserve.core.plan import ExecutorOutput, SchedulerOutput
from fastserve.core.scheduler import Scheduler
from fastserve.request import FinishReason, Request

logger = logging.getLogger(__name__)


class Executor(Protocol):
    """Runs one iteration's plan: the real model (`ModelRunner`) or the simulator."""

    def execute(self, plan: SchedulerOutput) -> ExecutorOutput: ...


class EngineCore:
    """Scheduler + executor + clock. Both the real engine and the simulator step this."""

    def __init__(self, scheduler: Scheduler, executor: Executor, clock: Clock) -> None:
        self.scheduler = scheduler
        self.executor = executor
        self.clock = clock
        self.num_iterations = 0
        self.busy_s = 0.0  # time spent in iterations
        self.swap_wait_s = 0.0

    def step(self) -> list[Request]:
        """Run one iteration; returns the requests that got a token or failed."""
        plan = self.scheduler.schedule(self.clock.now())
        try:
            out = self.executor.execute(plan)
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
