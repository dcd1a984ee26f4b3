"""Clocks: the engine reads time only through one of these, so a simulation can run on a
virtual clock the same code that serves on the wall clock."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Protocol

# A stopwatch reading in seconds (`time.perf_counter`): what the profiler times iterations by.
Timer = Callable[[], float]


class Clock(Protocol):
    def now(self) -> float: ...

    def advance(self, seconds: float) -> None:
        """Account for an iteration that took `seconds` (the wall clock moves by itself)."""


class WallClock:
    def now(self) -> float:
        return time.monotonic()

    def advance(self, seconds: float) -> None:
        pass


class VirtualClock:
    def __init__(self, start_s: float = 0.0) -> None:
        self._now = start_s

    def now(self) -> float:
        return self._now

    def advance(self, seconds: float) -> None:
        self._now += seconds

    def advance_to(self, t: float) -> None:
        self._now = max(self._now, t)
