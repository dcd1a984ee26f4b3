"""What the driver sends the workers on the control channel, and what they answer."""

from __future__ import annotations

from dataclasses import dataclass

from fastserve.core.plan import ExecutorOutput, SchedulerOutput
from fastserve.executor.grammar import GrammarMasks
from fastserve.model.lora import Adapter
from fastserve.request import TokenLogprobs


@dataclass(frozen=True)
class Step:
    """Carry out one iteration's plan: swaps, then this rank's share of the batch; the rank
    that samples masks the structured requests' rows with `masks` (a pipeline's driver fills
    them, since the grammars live there, and sends them to that rank only)."""

    plan: SchedulerOutput
    masks: GrammarMasks | None = None


@dataclass(frozen=True)
class SamplerExtras:
    """What a pipeline's sampler rank sends the driver after a batch's tokens, when the batch
    asked for it (`stage.ships_extras`) or a row failed: the `ExecutorOutput` fields beyond
    the tokens."""

    sample_logprobs: dict[str, TokenLogprobs]
    prompt_logprobs: dict[str, tuple[int, list[TokenLogprobs]]]
    verified_token_ids: dict[str, list[int]]
    verified_logprobs: dict[str, list[TokenLogprobs]]
    failed: dict[str, str]  # why each failed row failed (its token is FAILED_TOKEN)

    @classmethod
    def of(cls, out: ExecutorOutput) -> SamplerExtras:
        return cls(out.sample_logprobs, out.prompt_logprobs, out.verified_token_ids,
                   out.verified_logprobs, out.failed)


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
