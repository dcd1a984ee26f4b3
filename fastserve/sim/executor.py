"""An executor that runs no model: it predicts each iteration's time with the cost model.

It has the real executor's interface (`execute(plan) -> ExecutorOutput`), so `EngineCore`
steps the production scheduler over it unchanged, on a virtual clock.

KV swaps are modelled as the real executors carry them out: one copy engine works through the
plan's copies in order (an iteration's swap-outs, then its swap-ins), each run of consecutive
blocks taking `run bytes / swap_bytes_per_s` (`CostModel.swap_s`), in the background. An
iteration starts computing once every copy touching a block it reads or writes has landed, and
no sooner: it waits only for its own blocks, and copies for later iterations (proactive uploads,
offloads of jobs not running) overlap its compute. Not modelled: a copy slowing the compute it
overlaps (PCIe DMA takes no SM time), and layer-by-layer pipelining of an upload with the
iteration that reads it (the whole job must land first), which makes just-in-time uploads cost
a little more than they might.

Where copies cannot overlap compute (`CostModel.copies_overlap` false: a CPU whose cores the
compute fills, the engine's inline copies), every copy of a plan runs before its iteration and
adds its time to it, as the real `InlineSwapper` does; a plan with copies and no batch still
takes their time.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping

from fastserve.clock import Clock
from fastserve.core.cost_model import CostModel
from fastserve.core.kv import copy_runs
from fastserve.core.plan import ExecutorOutput, SchedulerOutput

EOS_TOKEN_ID = 0  # what a job of `SimExecutor.eos_after` samples last


class SimExecutor:
    """Predicted durations and placeholder tokens.

    Every sampled token is the same id (`vocab_size - 1`): simulated requests finish by length
    (`ignore_eos`, `max_tokens` = the target output length), except those in `eos_after`
    (request id -> (prompt tokens, output tokens)): a job whose client capped `max_tokens`
    above its true length, which samples `EOS_TOKEN_ID` as its last output token, as a model
    ends its answer before the cap.

    `clock` (the engine's virtual clock) lets the copy engine drain while the engine idles;
    without it the executor keeps its own time from the durations it returns.
    """

    def __init__(
        self, cost: CostModel, vocab_size: int = 32000, clock: Clock | None = None,
        eos_after: Mapping[str, tuple[int, int]] | None = None,
    ) -> None:
        if vocab_size < 2:
            raise ValueError(f"vocab_size must be >= 2, got {vocab_size}")
        self.cost = cost
        self.token_id = vocab_size - 1
        self.eos_after = eos_after or {}
        self.clock = clock
        self._time_s = 0.0  # own time, when no clock is given
        self._copies_done_s = 0.0  # when the copy engine finishes what it has queued
        self._ready_s: dict[int, float] = {}  # device block -> when its pending copy lands
        self.batch_job_s = 0.0  # sum over iterations of duration x batch size (concurrency)
        # Seconds of iterations by the device blocks their batch reads: how much KV the
        # schedule needed on the device at once, whatever else was resident.
        self.batch_kv_s: defaultdict[int, float] = defaultdict(float)

    def execute(self, plan: SchedulerOutput) -> ExecutorOutput:
        start_s = self.clock.now() if self.clock is not None else self._time_s
        if not self.cost.copies_overlap:
            # Inline copies: all of the plan's copies run first, on the compute's cores.
            wait_s = self.cost.swap_s(len(plan.swap_out) + len(plan.swap_in))
            if plan.is_empty:
                self._time_s = start_s + wait_s
                return ExecutorOutput(sampled_token_ids=[], duration_s=wait_s,
                                      swap_wait_s=wait_s)
        else:
            if plan.swap_out or plan.swap_in:
                self._queue_copies(plan, start_s)
            if plan.is_empty:
                return ExecutorOutput(sampled_token_ids=[], duration_s=0.0)
            wait_s = self._wait_s(plan, start_s)
        compute_s = self.cost.iteration_s(*plan.shape)
        duration_s = wait_s + compute_s
        self._time_s = start_s + duration_s
        self.batch_job_s += duration_s * len(plan.scheduled)
        self.batch_kv_s[sum(len(s.block_ids) for s in plan.scheduled)] += duration_s
        return ExecutorOutput(
            sampled_token_ids=self.tokens(plan),
            duration_s=duration_s,
            swap_wait_s=wait_s,
        )

    def tokens(self, plan: SchedulerOutput) -> list[int]:
        """The placeholder token of each scheduled job, EOS where a job of `eos_after` samples
        its last output token."""
        if not self.eos_after:
            return [self.token_id] * len(plan.scheduled)
        out = []
        for s in plan.scheduled:
            lengths = self.eos_after.get(s.request_id)
            # The token sampled after feeding up to position p is output number p - prompt + 1.
            is_last = lengths is not None and (
                s.start_pos + len(s.token_ids) - lengths[0] + 1 == lengths[1])
            out.append(EOS_TOKEN_ID if is_last else self.token_id)
        return out

    def _queue_copies(self, plan: SchedulerOutput, start_s: float) -> None:
        t = max(self._copies_done_s, start_s)
        for src, _dst, n in copy_runs(plan.swap_out):
            t += self.cost.swap_s(n)
            for b in range(src, src + n):
                self._ready_s[b] = t
        for _src, dst, n in copy_runs(plan.swap_in):
            t += self.cost.swap_s(n)
            for b in range(dst, dst + n):
                self._ready_s[b] = t
        self._copies_done_s = t

    def _wait_s(self, plan: SchedulerOutput, start_s: float) -> float:
        """How long the iteration waits for copies touching its blocks."""
        if not self._ready_s:
            return 0.0
        if self._copies_done_s <= start_s:
            self._ready_s.clear()  # everything has landed
            return 0.0
        ready = self._ready_s
        until_s = start_s
        for s in plan.scheduled:
            for b in s.block_ids:
                t = ready.get(b)
                if t is not None and t > until_s:
                    until_s = t
        return until_s - start_s
