"""The engine's own work per iteration, on top of the executor's profile.

The start-up profile times the executor alone on a grid of batches; an engine iteration also
schedules, samples, detokenizes and builds outputs, which on a small model is about half of
it. `measure_engine_overhead` serves short jobs through the engine's own `step()` and fits
what each iteration took beyond the executor's prediction, so the cached profile predicts
whole iterations (what the scheduler's placement and the simulator both need).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from fastserve.core.cost_model import CostModel
from fastserve.profiling.recorder import IterationRecorder
from fastserve.request import SamplingParams


class Steppable(Protocol):
    """What the measurement needs of the engine (`LLMEngine`)."""

    cost: CostModel
    recorder: IterationRecorder
    max_model_len: int

    @property
    def has_unfinished(self) -> bool: ...

    def add_request(self, prompt: list[int], params: SamplingParams) -> Any: ...

    def step(self) -> Any: ...


@dataclass(frozen=True)
class EngineOverhead:
    """What an engine iteration costs beyond the executor's fit: `fixed_s` per iteration
    plus `per_job_s` per decoding job (scheduling, sampling's hand-over, detokenizing,
    building outputs), measured through `LLMEngine.step`."""

    fixed_s: float
    per_job_s: float
    num_iterations: int

    def apply(self, cost: CostModel) -> CostModel:
        """`cost` with the overhead added to its fixed and per-decode terms."""
        knee = cost.decode_knee
        return dataclasses.replace(
            cost, fixed_s=cost.fixed_s + self.fixed_s,
            per_decode_s=cost.per_decode_s + self.per_job_s,
            per_decode_beyond_knee_s=cost.per_decode_beyond_knee_s + self.per_job_s
            if knee else 0.0)


def measure_engine_overhead(
    engine: Steppable, batch_sizes: tuple[int, ...] = (16, 1, 8, 2, 4), rounds: int = 2,
    prompt_len: int = 8, output_len: int = 16,
) -> EngineOverhead | None:
    """Serve short jobs through the engine's own `step()`, `batch_sizes` at a time, and fit
    each decode iteration's cycle (`IterationRecorder`) less what the engine's cost model
    predicts, as a line in the batch's decodes. None when the engine cannot hold the jobs.

    NOTE: call it on an idle engine right after start-up; it leaves the scheduler's counters
    moved (the caller builds a fresh core).
    """
    cost = engine.cost
    saved, engine.recorder = engine.recorder, IterationRecorder(1 << 12)
    prompt_len = max(1, min(prompt_len, engine.max_model_len - output_len - 1))
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    try:
        for _ in range(rounds):
            for batch in batch_sizes:
                for _ in range(batch):
                    engine.add_request([1 + i % 7 for i in range(prompt_len)], params)
                while engine.has_unfinished:
                    engine.step()
        samples = engine.recorder.samples()
    except ValueError:  # a pool too small for the jobs
        return None
    finally:
        engine.recorder = saved
    decodes = [s for s in samples if s.num_prefill_tokens == 0 and s.num_decodes > 0]
    if len({s.num_decodes for s in decodes}) < 2:
        return None
    # Medians per batch size: one slow iteration (another process) must not move the line.
    by_size: dict[int, list[float]] = {}
    for s in decodes:
        extra = s.duration_s - cost.iteration_s(0, s.num_decodes, s.num_context_tokens)
        by_size.setdefault(s.num_decodes, []).append(extra)
    sizes = sorted(by_size)
    extras = [float(np.median(by_size[n])) for n in sizes]
    slope, intercept = np.polyfit(sizes, extras, 1)
    if slope < 0:  # noise: a flat overhead
        slope, intercept = 0.0, float(np.mean(extras))
    return EngineOverhead(max(0.0, float(intercept)), float(slope), len(decodes))
