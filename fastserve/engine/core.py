"""The step loop: schedule -> execute -> update (and its pipelined form), and its wiring."""

from __future__ import annotations

import dataclasses
import logging
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

from fastserve.clock import Clock
from fastserve.config import EngineConfig
from fastserve.core.cost_model import CostModel
from fastserve.core.kv import KVCacheManager, make_kv_policy
from fastserve.core.plan import ExecutorOutput, SchedulerOutput
from fastserve.core.policies import make_scheduler
from fastserve.core.scheduler import Scheduler
from fastserve.core.speculative import Drafter
from fastserve.executor.base import (
    AsyncExecutor,
    Executor,
    ExecutorDeadError,
    PipelinedExecutor,
)
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
    asked = config.scheduler.async_scheduling
    drafting = config.speculative.speculative_method is not None
    # NOTE: a draft follows the request's last token: only loops that schedule a request
    # once its previous token is back draft (not async scheduling's, below).
    if isinstance(executor, PipelinedExecutor) and executor.max_in_flight > 1:
        if asked:
            logger.info("pipeline parallelism keeps its own batches in flight: "
                        "--async-scheduling adds nothing to it")
        # A request is in one batch in flight at most: it is scheduled with its tokens known.
        scheduler.use_drafter(Drafter(config.speculative))
        return PipelinedEngineCore(scheduler, executor, clock)
    if asked or (asked is None and default_async_scheduling(config)):
        if isinstance(executor, AsyncExecutor) and scheduler.policy.can_schedule_ahead:
            if drafting:
                logger.warning("speculative decoding: only requests with a prediction draft "
                               "under async scheduling (a draft follows the token still on "
                               "the device); --no-async-scheduling drafts for every request")
            if asked is None:
                logger.info("async scheduling: on (the default on one CUDA device; "
                            "--no-async-scheduling turns it off)")
            # A request with a prediction sits out the plan after each of its steps, whose
            # token its next draft follows (`Drafter.wants_last_token`).
            scheduler.use_drafter(Drafter(
                dataclasses.replace(config.speculative, speculative_method=None)))
            return AsyncEngineCore(scheduler, executor, clock)
    if asked:
        logger.warning("async scheduling needs an executor that launches (one stage) and a "
                       "policy that can schedule ahead (not %s): scheduling in step",
                       config.scheduler.policy)
    scheduler.use_drafter(Drafter(config.speculative))
    return EngineCore(scheduler, executor, clock)


def default_async_scheduling(config: EngineConfig) -> bool:
    """Async scheduling's default: on where it was measured to pay, one process on a CUDA
    device (an H200 ran a 7B model's offline batches 1.13x faster at 32 and 1.28x at 128).
    On a CPU the host and the "device" are the same cores, so nothing overlaps."""
    p = config.parallel
    return (config.model.device.startswith("cuda")
            and p.tensor_parallel_size * p.pipeline_parallel_size == 1)


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
        # Called with the requests of each update once the scheduler has their tokens: the
        # engine advances their grammars here, before async scheduling's next draw masks with
        # them (`AsyncEngineCore`).
        self.on_update: Callable[[list[Request]], None] = lambda touched: None

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
        return self._update(plan, out)

    def _update(self, plan: SchedulerOutput, out: ExecutorOutput) -> list[Request]:
        touched = self.scheduler.update(plan, out, self.clock.now())
        self.on_update(touched)
        return touched

    def _fail(self, plan: SchedulerOutput, exc: Exception) -> list[Request]:
        logger.exception("iteration failed; failing its %d requests", len(plan.scheduled))
        failed = []
        now = self.clock.now()
        for s in plan.scheduled:
            req = self.scheduler.requests.get(s.request_id)
            if req is not None:
                self.scheduler.finish(req, FinishReason.ERROR, now, f"{type(exc).__name__}: {exc}")
                failed.append(req)
        return failed


class PipelinedEngineCore(EngineCore):
    """The step loop with up to `max_in_flight` batches in the pipeline, each stage working on
    a different one (pipeline parallelism).

    A step launches a batch while a pipeline slot is free and there is work to run; otherwise
    it waits for the oldest batch and hands its tokens to the scheduler. Jobs of batches in
    flight are running: the scheduler leaves them out (`InFlight`), so batch k+1 is
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
        scheduler.flight.set_depth(self.max_in_flight)
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
                self.scheduler.flight.launched(plan)
                self.num_iterations += 1
                return []
        if not self._in_flight:
            return []
        plan = self._in_flight.popleft()
        self.scheduler.flight.back(plan)
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
        return self._update(plan, result.out)


class AsyncEngineCore(EngineCore):
    """The step loop with the next iteration scheduled while this one runs (async
    scheduling, as vLLM's `--async-scheduling` does): the host's work per iteration (scheduling,
    the inputs, the launch, the tokens' update and outputs) overlaps the device's instead of
    adding to it.

    A step counts the batch on the device as computed (`Scheduler.schedule_ahead`: its jobs'
    next tokens are placeholders the executor feeds from the device), schedules and launches
    the next batch, then reads the previous one's tokens back and hands them to the
    scheduler. A job that stopped (EOS, a stop string) spent one more step on the device,
    whose token is dropped; one whose last token by length is on the device is not
    scheduled ahead. A batch with a grammar's job in it is launched as well, but drawn from
    only once the previous batch's tokens are back and its grammars have taken them
    (`on_update`): its forward pass still overlaps the host's work (vLLM defers the same).
    """

    def __init__(self, scheduler: Scheduler, executor: AsyncExecutor, clock: Clock) -> None:
        super().__init__(scheduler, executor, clock)
        self.runner = executor
        self._on_device: tuple[SchedulerOutput, Any] | None = None

    @property
    def num_in_flight(self) -> int:
        return int(self._on_device is not None)

    def step(self) -> list[Request]:
        """Launch the next batch, then finish the one before it; returns the requests that got
        a token or failed."""
        self.last_output = None
        prev, self._on_device = self._on_device, None
        if prev is not None:
            self.scheduler.schedule_ahead(prev[0])
        plan = self.last_plan = self.scheduler.schedule(self.clock.now())
        failed: list[Request] = []
        launched = None
        try:
            launched = self.runner.launch(plan)
        except ExecutorDeadError:
            raise
        except Exception as exc:  # NOTE: one failing batch must not take the engine down
            failed = self._fail(plan, exc)
        touched = failed + (self._finish(*prev) if prev is not None else [])
        if launched is not None and not plan.is_empty:
            # NOTE: after `_finish`: a grammar masks the plan's draw with the token just back.
            seen = {id(r) for r in touched}
            touched += [r for r in self._draw(plan, launched) if id(r) not in seen]
        return touched

    def _draw(self, plan: SchedulerOutput, launched: Any) -> list[Request]:
        """Sample the launched plan where its draw waited for the previous plan's tokens (a
        grammar's mask follows them); from then on it is on the device. Returns the requests
        failed if the draw fails."""
        try:
            launched = self.runner.draw(launched)
        except ExecutorDeadError:
            raise
        except Exception as exc:
            return self._fail(plan, exc)
        self._on_device = (plan, launched)
        self.num_iterations += 1
        return []

    def _finish(self, plan: SchedulerOutput, launched: Any) -> list[Request]:
        try:
            out = self.last_output = self.runner.finish(launched)
        except ExecutorDeadError:
            raise
        except Exception as exc:
            self._back(plan)
            return self._fail(plan, exc)
        self.clock.advance(out.duration_s)
        self.busy_s += out.duration_s
        self.swap_wait_s += out.swap_wait_s
        touched = self._update(plan, out)
        self._back(plan)
        return touched

    def _back(self, plan: SchedulerOutput) -> None:
        """The plan is back: its jobs that sat the next plan out may run again (and, had it
        failed, none of its jobs is still ahead of its tokens)."""
        self.scheduler.flight.back(plan)
