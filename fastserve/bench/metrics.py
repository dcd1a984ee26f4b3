"""Job-level metrics of a benchmark run: completion time, time to first token, throughput."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from fastserve.core.cost_model import CostModel
from fastserve.core.stats import SchedulerStats
from fastserve.request import FinishReason, Request, RequestOutput

METRIC_KEYS = (
    "num_requests",
    "num_finished",
    "jct_mean",
    "jct_p50",
    "jct_p90",
    "jct_p99",
    # JCT over the job's time alone on the engine (`alone_s`): NaN where it is not known.
    "slowdown_mean",
    "slowdown_p99",
    "ttft_mean",
    "ttft_p99",
    "output_tok_per_s",
    "makespan_s",
    "preemptions",
    # KV cache (`KVTotals`): blocks copied out / in, time iterations waited on those copies,
    # most device blocks in use at once.
    "swap_out_blocks",
    "swap_in_blocks",
    "swap_wait_s",
    "peak_kv_blocks",
)


@dataclass(frozen=True, slots=True)
class KVTotals:
    """A run's KV totals for its report, projected from the typed `SchedulerStats` at the
    run's end (the same for the simulator and the engine)."""

    swap_out_blocks: int = 0
    swap_in_blocks: int = 0
    swap_wait_s: float = 0.0  # time iterations spent waiting on KV copies
    peak_kv_blocks: int = 0  # most device blocks in use at once
    # Prefix cache: tokens of the jobs (re)started, and of those found cached.
    prefix_query_tokens: int = 0
    prefix_hit_tokens: int = 0

    @classmethod
    def from_stats(cls, stats: SchedulerStats, swap_wait_s: float) -> KVTotals:
        """A run's counters from its scheduler's stats (`EngineStats.scheduler`,
        `SimRun.scheduler`) and the time its iterations waited on copies."""
        return cls(
            swap_out_blocks=stats.kv.num_swap_out_blocks,
            swap_in_blocks=stats.kv.num_swap_in_blocks,
            swap_wait_s=swap_wait_s,
            peak_kv_blocks=stats.kv.peak_used_blocks,
            prefix_query_tokens=stats.kv.num_prefix_query_tokens,
            prefix_hit_tokens=stats.kv.num_prefix_hit_tokens,
        )


@dataclass(frozen=True, slots=True)
class JobTimes:
    """What metrics need from one job, whether it came from the simulator or the engine."""

    arrival_s: float
    first_token_s: float | None
    finish_s: float | None
    num_output_tokens: int
    num_preemptions: int
    # Aborted or failed jobs count as submitted but not finished.
    is_ok: bool = True
    # Its prefill and decode steps one after another with nothing else batched, from the
    # cost model (`alone_s`): the denominator of its slowdown. None where no model is known.
    alone_s: float | None = None

    @classmethod
    def from_request(cls, req: Request, cost: CostModel | None = None) -> JobTimes:
        """`cost`: the model to price the job's time alone with (no slowdown without it)."""
        return cls(
            arrival_s=req.arrival_s,
            first_token_s=req.first_token_s,
            finish_s=req.finish_s,
            num_output_tokens=req.num_output_tokens,
            num_preemptions=req.num_preemptions,
            is_ok=req.finish_reason in (FinishReason.STOP, FinishReason.LENGTH),
            alone_s=None if cost is None else alone_s(req.num_prompt_tokens,
                                                      req.num_output_tokens, cost),
        )

    @classmethod
    def from_output(cls, out: RequestOutput) -> JobTimes:
        return cls(
            arrival_s=out.arrival_s,
            first_token_s=out.first_token_s,
            finish_s=out.finish_s,
            num_output_tokens=len(out.token_ids),
            num_preemptions=out.num_preemptions,
            is_ok=out.finished and out.finish_reason in ("stop", "length"),
        )


def compute_metrics(
    jobs: Sequence[JobTimes], num_requests: int | None = None, kv: KVTotals | None = None
) -> dict[str, float]:
    """Metrics in seconds over the jobs that finished normally.

    `num_requests` is how many were submitted (default: len(jobs)). The makespan runs from the
    first arrival to the last finish; NaN stands for a statistic with no data. `kv`: the run's
    KV counters (zeros when not given).
    """
    kv = kv or KVTotals()
    done = [j for j in jobs if j.is_ok and j.finish_s is not None]
    finish = np.array([j.finish_s for j in done], dtype=np.float64)
    jct = finish - np.array([j.arrival_s for j in done], dtype=np.float64)
    ttft = np.array(
        [j.first_token_s - j.arrival_s for j in done if j.first_token_s is not None],
        dtype=np.float64,
    )
    alone = np.array([j.alone_s for j in done if j.alone_s], dtype=np.float64)
    slowdown = jct / alone if alone.size == jct.size else np.array([], dtype=np.float64)
    makespan = float(finish.max()) - min(j.arrival_s for j in jobs) if done else 0.0
    num_tokens = sum(j.num_output_tokens for j in done)
    return {
        "num_requests": len(jobs) if num_requests is None else num_requests,
        "num_finished": len(done),
        "jct_mean": _mean(jct),
        "jct_p50": _pct(jct, 50),
        "jct_p90": _pct(jct, 90),
        "jct_p99": _pct(jct, 99),
        "slowdown_mean": _mean(slowdown),
        "slowdown_p99": _pct(slowdown, 99),
        "ttft_mean": _mean(ttft),
        "ttft_p99": _pct(ttft, 99),
        "output_tok_per_s": num_tokens / makespan if makespan > 0 else float("nan"),
        "makespan_s": makespan,
        "preemptions": sum(j.num_preemptions for j in jobs),
        "swap_out_blocks": kv.swap_out_blocks,
        "swap_in_blocks": kv.swap_in_blocks,
        "swap_wait_s": kv.swap_wait_s,
        "peak_kv_blocks": kv.peak_kv_blocks,
    }


def alone_s(num_prompt_tokens: int, num_output_tokens: int, cost: CostModel) -> float:
    """A job's completion time with the engine to itself: its prefill (which samples the first
    token), then a decode step per further token, each over the context so far."""
    decodes = max(0, num_output_tokens - 1)
    first = cost.decode_s(num_prompt_tokens + 1)
    # NOTE: a decode step's time is linear in its context, so the steps sum in closed form.
    per_token_s = cost.decode_s(num_prompt_tokens + 2) - first
    return (cost.prefill_s(num_prompt_tokens) + decodes * first
            + per_token_s * decodes * (decodes - 1) / 2)


def _mean(x: np.ndarray) -> float:
    return float(x.mean()) if x.size else float("nan")


def _pct(x: np.ndarray, q: float) -> float:
    return float(np.percentile(x, q)) if x.size else float("nan")
