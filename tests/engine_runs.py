"""Driving a real `LLMEngine` in tests: requests run to their end, and the plans it launches."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from fastserve.core.plan import SchedulerOutput
from fastserve.engine.llm_engine import LLMEngine
from fastserve.request import RequestOutput, SamplingParams


def run_to_end(engine: LLMEngine, prompts: Sequence[list[int]],
               params: Sequence[SamplingParams]) -> list[RequestOutput]:
    """Each prompt's final output, in order (all added at once, stepped until done)."""
    ids = [engine.add_request(p, sp).request_id for p, sp in zip(prompts, params, strict=True)]
    done: dict[str, RequestOutput] = {}
    while engine.has_unfinished:
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    return [done[i] for i in ids]


def record_launches(engine: LLMEngine) -> list[SchedulerOutput]:
    """The plans the engine's runner launches from now on (appended as they are)."""
    launched: list[SchedulerOutput] = []
    launch = engine.runner.launch

    def recording_launch(plan: SchedulerOutput) -> Any:
        launched.append(plan)
        return launch(plan)

    engine.runner.launch = recording_launch  # type: ignore[method-assign]
    return launched
