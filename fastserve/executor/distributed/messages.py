"""What the driver sends the workers on the control channel, and what they answer."""

from __future__ import annotations

from dataclasses import dataclass

from fastserve.core.plan import SchedulerOutput
from fastserve.executor.grammar import GrammarMasks
from fastserve.model.lora import Adapter


@dataclass(frozen=True)
class Step:
    """Carry out one iteration's plan: swaps, then this rank's share of the batch; the rank
    that samples masks the structured requests' rows with `masks` (a pipeline's driver fills
    them: the grammars live there)."""

    plan: SchedulerOutput
    masks: GrammarMasks | None = None


@dataclass(frozen=True)
class LoadLoRA:
    """Put a LoRA adapter (the full model's factors) in a slot: this rank's shard of it."""

    slot: int
    adapter: Adapter


@dataclass(frozen=True)
class ClearLoRA:
    """No adapter in the slot any more."""

    slot: int


@dataclass(frozen=True)
class StatsRequest:
    """Answer with `RankStats`; `reset` starts a new measurement window afterwards."""

    reset: bool = False


@dataclass(frozen=True)
class Stop:
    """Leave the worker loop and exit."""


Message = Step | StatsRequest | Stop


@dataclass(frozen=True)
class RankStats:
    """How busy one rank was since its stats were last reset (for the pipeline benchmark)."""

    rank: int
    stage: int
    num_batches: int
    busy_s: float  # computing: its layers, logits and sampling (not waiting for activations)
    window_s: float  # from the first batch's start to the last batch's end

    @property
    def idle_share(self) -> float:
        return 1.0 - self.busy_s / self.window_s if self.window_s > 0 else 0.0
