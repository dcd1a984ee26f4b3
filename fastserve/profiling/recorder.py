"""The running engine's own iterations: batch shape and wall time (`--record-iterations N`),
which `fastserve profile --through-engine` fits into the cost model."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from fastserve.clock import Timer
from fastserve.core.cost_model import CostModel
from fastserve.core.plan import SchedulerOutput
from fastserve.profiling.fit import Sample

logger = logging.getLogger(__name__)

# One recorded iteration: prefill tokens, their pairs, decodes, decode context tokens, prefill
# context tokens, step_s, cycle_s, and what the cost model in force then predicted (nan: none).
_Row = tuple[int, int, int, int, int, float, float, float]
_NAN = float("nan")


class CostModelCheck:
    """How well the engine's cost model predicts its own iterations, kept up to date, and
    (with `calibrate`) the model kept in step with the machine.

    Each recorded iteration (its cycle, as `IterationRecorder` times it) adds the start-up
    profile's (`cost`) predicted seconds and the measured ones to sums that decay by half
    every `half_life` iterations, so `ratio` (predicted / measured) follows the machine as it
    drifts (other load, a slower phase). A ratio off by more than `tolerance` is logged once
    when the drift starts (after `min_iterations`) and once when it ends: the scheduler's
    placement and the KV policy's copy budget rest on this model.

    With `calibrate`, every `every` iterations from `calibrate_after` on, when the iterations
    take a multiple of the profile's prediction more than `deadband` away from the `scale` in
    force, the scale becomes that multiple and `on_calibrate` gets the profile scaled by it
    (`CostModel.scaled`): the engine decides with it from then on. The multiple is measured
    like `ratio` but over a shorter half-life (`calibrate_half_life`): on recorded runs of this
    machine 100 iterations tracked its drift to a median per-iteration error of 5-7%, 500 to
    7-11% (50 did a little better still, but chases noise). A uniform scale only: the
    profile's shape (what a prefill token costs against a decode) stays.
    """

    def __init__(self, cost: CostModel, half_life: int = 500, tolerance: float = 0.10,
                 min_iterations: int = 200, calibrate: bool = False,
                 on_calibrate: Callable[[CostModel], None] | None = None,
                 deadband: float = 0.03, every: int = 25, calibrate_after: int = 50,
                 calibrate_half_life: int = 100) -> None:
        self.cost = cost
        self.decay = 0.5 ** (1.0 / half_life)
        self.tolerance = tolerance
        self.min_iterations = min_iterations
        self.calibrate = calibrate
        self.on_calibrate = on_calibrate
        self.deadband = deadband
        self.every = every
        self.calibrate_after = calibrate_after
        self._cal_decay = 0.5 ** (1.0 / calibrate_half_life)
        self._cal_predicted_s = 0.0
        self._cal_measured_s = 0.0
        self.scale = 1.0  # the model in force: `cost.scaled(scale)`
        self.num_calibrations = 0
        self.num_iterations = 0
        self._predicted_s = 0.0
        self._measured_s = 0.0
        self.is_drifting = False

    @property
    def ratio(self) -> float:
        """Recent predicted (by the start-up profile) / measured iteration time (1.0 before
        any iteration)."""
        return self._predicted_s / self._measured_s if self._measured_s > 0 else 1.0

    @property
    def ratio_in_force(self) -> float:
        """The same for the model the engine decides with (the profile times `scale`)."""
        return self.ratio * self.scale

    def add(self, sample: Sample) -> float:
        """Score one iteration; returns what the model in force predicted for it."""
        s = sample
        predicted = self.cost.iteration_s(s.num_prefill_tokens, s.num_decodes,
                                          s.num_context_tokens, s.sum_prefill_sq,
                                          s.num_prefill_context_tokens)
        in_force = predicted * self.scale
        self._predicted_s = self._predicted_s * self.decay + predicted
        self._measured_s = self._measured_s * self.decay + s.duration_s
        if self.calibrate:
            self._cal_predicted_s = self._cal_predicted_s * self._cal_decay + predicted
            self._cal_measured_s = self._cal_measured_s * self._cal_decay + s.duration_s
        self.num_iterations += 1
        if self.calibrate and self.num_iterations >= self.calibrate_after \
                and self.num_iterations % self.every == 0:
            self._calibrate()
        if self.num_iterations < self.min_iterations:
            return in_force
        drifting = abs(self.ratio - 1.0) > self.tolerance
        if drifting != self.is_drifting:
            self.is_drifting = drifting
            if drifting:
                logger.warning(
                    "cost model drift: iterations take %.2fx what the start-up profile predicts "
                    "(over the last ~%d); %s", 1.0 / self.ratio, round(1 / (1 - self.decay)),
                    "the engine rescales its cost model to follow" if self.calibrate else
                    "scheduling decisions rest on it. Delete the cached start-up profile or "
                    "pass --profile to measure again")
            else:
                logger.info("cost model back within %.0f%% of the measured iterations",
                            100 * self.tolerance)
        return in_force

    def _calibrate(self) -> None:
        if self._cal_predicted_s <= 0:
            return
        target = self._cal_measured_s / self._cal_predicted_s
        if abs(target / self.scale - 1.0) > self.deadband:
            self.scale = target
            self.num_calibrations += 1
            logger.debug("cost model calibrated: the start-up profile x %.3f", target)
            if self.on_calibrate is not None:
                self.on_calibrate(self.cost.scaled(target))


class IterationRecorder:
    """The engine's last `capacity` iterations: batch shape and wall time, in a ring buffer.

    An iteration's time is its *cycle*: from the start of `LLMEngine.step()` to the start of
    the next one when the engine went straight on (it still had work), which also counts what
    the serving loop does between steps (handing outputs over, taking new requests); else the
    step alone. That is what the simulator's clock must advance by per iteration. Steps that
    ran no batch are not recorded.

    NOTE: a caller that holds work back between steps inflates the cycles; the engine's own
    loops (`AsyncLLM`, `LLM.generate`) step again at once.
    """

    def __init__(self, capacity: int, clock: Timer = time.perf_counter,
                 check: CostModelCheck | None = None) -> None:
        if capacity < 1:
            raise ValueError(f"record capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self.clock = clock
        self.check = check  # told every iteration recorded
        # (prefill tokens, sum of squared prefill lengths, decodes, decode context tokens,
        #  prefill context tokens, step_s, cycle_s, predicted_s); preallocated so recording
        #  allocates one tuple per iteration.
        self._rows: list[_Row | None] = [None] * capacity
        self._num_recorded = 0
        # Cycle not closed yet: the row's first five, start_s, step_s.
        self._open: tuple[int, int, int, int, int, float, float] | None = None

    @property
    def num_recorded(self) -> int:
        """Iterations recorded since the start (the buffer keeps the last `capacity`)."""
        return self._num_recorded + (self._open is not None)

    def begin(self) -> float:
        """Called first thing in a step: closes the previous iteration's cycle."""
        now = self.clock()
        if self._open is not None:
            a, b, c, d, e, start_s, step_s = self._open
            self._push(a, b, c, d, e, step_s, now - start_s)
            self._open = None
        return now

    def end(self, start_s: float, plan: SchedulerOutput | None, is_busy: bool) -> None:
        """Called last thing in a step; `is_busy`: work is left, so the next step follows."""
        if plan is None or plan.is_empty:
            return
        num_prefill, num_decodes, num_context, sum_sq, prefill_context = plan.shape
        step_s = self.clock() - start_s
        if is_busy:  # cycle closes at the next begin(); start_s kept in the cycle slot
            self._open = (num_prefill, sum_sq, num_decodes, num_context, prefill_context,
                          start_s, step_s)
        else:
            self._push(num_prefill, sum_sq, num_decodes, num_context, prefill_context,
                       step_s, step_s)

    def samples(self, cycle: bool = True) -> list[Sample]:
        """The buffered iterations, oldest first, timed by cycle (default) or by step alone;
        each with what the engine's cost model in force predicted for it, when it was scored."""
        n, cap = self._num_recorded, self.capacity
        rows = [self._rows[i % cap] for i in range(max(0, n - cap), n)]
        if self._open is not None:  # the last step: no next step to close its cycle
            a, b, c, d, e, _start_s, step_s = self._open
            rows.append((a, b, c, d, e, step_s, step_s, _NAN))
        return [Sample(a, b, c, d, cyc if cycle else step, e, None if p != p else p)
                for a, b, c, d, e, step, cyc, p in (r for r in rows if r is not None)]

    def clear(self) -> None:
        self._rows = [None] * self.capacity
        self._num_recorded = 0
        self._open = None

    def _push(self, a: int, b: int, c: int, d: int, e: int, step_s: float,
              cycle_s: float) -> None:
        predicted = _NAN if self.check is None else self.check.add(Sample(a, b, c, d, cycle_s, e))
        self._rows[self._num_recorded % self.capacity] = (a, b, c, d, e, step_s, cycle_s,
                                                          predicted)
        self._num_recorded += 1
