"""The running engine's own iterations: batch shape and wall time (`--record-iterations N`),
which `fastserve profile --through-engine` fits into the cost model."""

from __future__ import annotations

import time

from fastserve.clock import Timer
from fastserve.core.plan import SchedulerOutput
from fastserve.profiling.fit import Sample


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

    def __init__(self, capacity: int, clock: Timer = time.perf_counter) -> None:
        if capacity < 1:
            raise ValueError(f"record capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self.clock = clock
        # (prefill tokens, sum of squared prefill lengths, decodes, decode context tokens,
        #  step_s, cycle_s); preallocated so recording allocates one tuple per iteration.
        self._rows: list[tuple[int, int, int, int, float, float] | None] = [None] * capacity
        self._num_recorded = 0
        self._open: tuple[int, int, int, int, float, float] | None = None  # cycle not closed yet

    @property
    def num_recorded(self) -> int:
        """Iterations recorded since the start (the buffer keeps the last `capacity`)."""
        return self._num_recorded + (self._open is not None)

    def begin(self) -> float:
        """Called first thing in a step: closes the previous iteration's cycle."""
        now = self.clock()
        if self._open is not None:
            a, b, c, d, start_s, step_s = self._open
            self._push((a, b, c, d, step_s, now - start_s))
            self._open = None
        return now

    def end(self, start_s: float, plan: SchedulerOutput | None, is_busy: bool) -> None:
        """Called last thing in a step; `is_busy`: work is left, so the next step follows."""
        if plan is None or plan.is_empty:
            return
        num_prefill, num_decodes, num_context, sum_sq = plan.shape
        step_s = self.clock() - start_s
        if is_busy:  # cycle closes at the next begin(); start_s kept in the cycle slot
            self._open = (num_prefill, sum_sq, num_decodes, num_context, start_s, step_s)
        else:
            self._push((num_prefill, sum_sq, num_decodes, num_context, step_s, step_s))

    def samples(self, cycle: bool = True) -> list[Sample]:
        """The buffered iterations, oldest first, timed by cycle (default) or by step alone."""
        n, cap = self._num_recorded, self.capacity
        rows = [self._rows[i % cap] for i in range(max(0, n - cap), n)]
        if self._open is not None:  # the last step: no next step to close its cycle
            a, b, c, d, _start_s, step_s = self._open
            rows.append((a, b, c, d, step_s, step_s))
        return [Sample(a, b, c, d, cyc if cycle else step)
                for a, b, c, d, step, cyc in (r for r in rows if r is not None)]

    def clear(self) -> None:
        self._rows = [None] * self.capacity
        self._num_recorded = 0
        self._open = None

    def _push(self, row: tuple[int, int, int, int, float, float]) -> None:
        self._rows[self._num_recorded % self.capacity] = row
        self._num_recorded += 1
