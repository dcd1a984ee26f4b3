"""What the engine core asks of an executor: the real model (`ModelRunner`), the distributed
executor, or the simulator's (`fastserve.sim`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from fastserve.core.plan import ExecutorOutput, SchedulerOutput


class Executor(Protocol):
    """Runs one iteration's plan: the real model (`ModelRunner`) or the simulator."""

    def execute(self, plan: SchedulerOutput) -> ExecutorOutput: ...


class ExecutorDeadError(RuntimeError):
    """The executor can run no more iterations (a distributed rank died or stopped answering):
    the engine must stop, not just fail the batch."""


@dataclass(frozen=True)
class PipelineResult:
    """A batch back from the pipeline."""

    out: ExecutorOutput
    # How long the engine waited for it: a virtual clock advances by this (the wall clock
    # moves by itself).
    wait_s: float


@runtime_checkable
class PipelinedExecutor(Executor, Protocol):
    """An executor that keeps up to `max_in_flight` batches in its pipeline stages at once.
    Batches come back in the order they were submitted."""

    max_in_flight: int

    def submit(self, plan: SchedulerOutput, now: float) -> None:
        """Start a plan. One with no batch (only swaps and finished ids) is done at once and is
        not collected."""
        ...

    def collect(self, now: float) -> PipelineResult:
        """Wait for the oldest batch in flight."""
        ...


@runtime_checkable
class AsyncExecutor(Executor, Protocol):
    """An executor that starts an iteration and reads its tokens back later, so that the
    engine schedules the next iteration while this one runs on the device (async
    scheduling). A decode token of the next plan that is PENDING_TOKEN is fed from the
    device: the token the launched batch sampled for that request."""

    def launch(self, plan: SchedulerOutput) -> Any:
        """Queue the plan's work on the device; returns what `finish` takes."""
        ...

    def draw(self, launched: Any) -> Any:
        """Queue the sampling of a launched plan whose draw waited for the previous plan's
        tokens (a grammar's request, its token pending on the device, is masked as its
        grammar stands once that token is back); returns what `finish` takes. A plan drawn
        at launch is returned as it is."""
        ...

    def finish(self, launched: Any) -> ExecutorOutput:
        """Wait for a launched (and drawn) plan and read its tokens back (in launch order)."""
        ...
