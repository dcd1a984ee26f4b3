"""The engine's stats: the scheduler's (`SchedulerStats`, with the KV cache's) and the
engine's own, in one typed value that `/metrics`, the benchmarks and the tests read."""

from __future__ import annotations

from dataclasses import dataclass

from fastserve.core.stats import SchedulerStats


@dataclass(frozen=True, slots=True)
class LoRAStats:
    """The LoRA adapters served (present only with `--enable-lora`)."""

    max_loras: int  # adapters that may be loaded at once (--max-loras)
    # adapter name -> {"running": n, "waiting": m}; every adapter loaded is listed, idle at 0
    requests: dict[str, dict[str, int]]


@dataclass(frozen=True, slots=True)
class EngineStats:
    """A snapshot of the engine: its scheduler's queues and counters, and its own."""

    scheduler: SchedulerStats
    # What the executor runs, as chosen at start-up (device, dtype and why, kernels).
    executor: dict[str, str]
    swap_wait_s: float  # time iterations spent waiting on KV copies
    num_iterations: int  # engine iterations that ran a batch
    # Recent predicted (start-up profile) / measured iteration time, and the scale the
    # engine's cost model puts on the profile (`CostModelCheck`).
    cost_model_ratio: float = 1.0
    cost_model_scale: float = 1.0
    lora: LoRAStats | None = None
