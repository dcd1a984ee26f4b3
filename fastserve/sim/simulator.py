"""Run a workload through the production scheduler and engine loop on a virtual clock.

Nothing here schedules: `make_scheduler` builds the same policy object the server runs, and
`EngineCore.step` is the same loop. The simulator only injects requests at their arrival times
and jumps the clock over idle gaps.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field

from tqdm import tqdm

from fastserve.clock import VirtualClock
from fastserve.config import EngineConfig
from fastserve.core.cost_model import CostModel
from fastserve.core.kv import host_pool_blocks, num_blocks_for
from fastserve.core.stats import SchedulerStats
from fastserve.engine.core import build_engine_core
from fastserve.prompts import prompt_tokens
from fastserve.request import Request, SamplingParams, WorkItem
from fastserve.sim.executor import EOS_TOKEN_ID, SimExecutor
from fastserve.sim.pipeline import PipelinedSimExecutor

PROMPT_TOKEN_ID = 1  # any id: the simulated model never reads it
SIM_VOCAB_SIZE = 32000  # token ids of shared-prefix prompts: only the prefix cache reads them


def ample_blocks(workload: Sequence[WorkItem], block_size: int) -> int:
    """A KV pool that holds every job of the workload at once: memory never binds."""
    return max(1, sum(num_blocks_for(w.input_len + max(w.output_len, w.max_tokens or 0),
                                     block_size) for w in workload))


def make_requests(workload: Sequence[WorkItem]) -> list[Request]:
    """One request per item: fixed output length, and the oracle told that length.

    NOTE: requests of equal prompt length share one prompt list; nothing mutates a prompt, and
    a 20,000-job trace would otherwise hold ~25M token ids.
    """
    prompts: dict[int, list[int]] = {}
    params: dict[int, SamplingParams] = {}
    reqs = []
    # Jobs that say which prompts share prefixes (Mooncake hash ids) get real token ids.
    shared = prompt_tokens(workload, SIM_VOCAB_SIZE, 0) if any(w.hash_ids for w in workload) \
        else None
    for i, w in enumerate(workload):
        if shared is not None and w.hash_ids:
            reqs.append(Request(f"sim-{i}", shared[i], _params(params, w.output_len),
                                w.arrival_s, oracle_output_len=w.output_len))
            continue
        prompt = prompts.setdefault(w.input_len, [PROMPT_TOKEN_ID] * w.input_len)
        p = _params(params, w.output_len) if w.max_tokens is None else SamplingParams(
            max_tokens=w.max_tokens, temperature=0.0)  # stops at EOS (`SimExecutor.eos_after`)
        # NOTE: the shared prompt lists stand for different prompts: a salt per request keeps
        # the prefix cache from sharing them.
        reqs.append(Request(f"sim-{i}", prompt, p, w.arrival_s, oracle_output_len=w.output_len,
                            cache_salt=f"sim-{i}"))
    return reqs


def _params(memo: dict[int, SamplingParams], output_len: int) -> SamplingParams:
    p = memo.get(output_len)
    if p is None:
        p = memo[output_len] = SamplingParams(max_tokens=output_len, temperature=0.0,
                                              ignore_eos=True)
    return p


@dataclass
class SimRun:
    """What a simulated run produced: the finished requests, the scheduler's stats at the end
    (its KV counters among them) and the loop's time."""

    finished: list[Request]  # in finish order
    scheduler: SchedulerStats  # at the end of the run
    swap_wait_s: float  # time iterations spent waiting on KV copies
    busy_s: float  # time spent in iterations (pipelined: each batch's time through every stage)
    # Busy time of the busiest pipeline stage, the bottleneck that offered load is counted
    # against (`busy_s` with one stage).
    stage_busy_s: float = 0.0
    mean_batch_size: float = 0.0  # jobs per iteration, weighted by its duration (not pipelined)
    # Seconds of iterations by the device blocks their batch read (not pipelined).
    batch_kv_s: dict[int, float] = field(default_factory=dict)

    @property
    def swap_out_blocks(self) -> int:
        return self.scheduler.kv.num_swap_out_blocks

    @property
    def swap_in_blocks(self) -> int:
        return self.scheduler.kv.num_swap_in_blocks

    @property
    def peak_kv_blocks(self) -> int:
        """Most device blocks in use at once."""
        return self.scheduler.kv.peak_used_blocks

    @property
    def prefix_query_tokens(self) -> int:
        """Prefix cache: tokens of the jobs (re)started."""
        return self.scheduler.kv.num_prefix_query_tokens

    @property
    def prefix_hit_tokens(self) -> int:
        """Of those, the tokens found cached."""
        return self.scheduler.kv.num_prefix_hit_tokens

    @property
    def prefix_host_hit_tokens(self) -> int:
        """Of the hits, those uploaded from the host tier."""
        return self.scheduler.kv.num_host_hit_tokens

    @property
    def prefix_prefetched_tokens(self) -> int:
        """Host-tier tokens uploaded ahead of their job's turn."""
        return self.scheduler.kv.num_prefetched_tokens

    @property
    def computed_prompt_tokens(self) -> int:
        """Tokens the prefills computed (recomputes included): what the cache did not save."""
        return self.prefix_query_tokens - self.prefix_hit_tokens

    def share_batch_kv_over(self, num_blocks: int) -> float:
        """The share of busy time whose batch read more than `num_blocks` device blocks: on a
        pool of that size this run's schedule was impossible that long, whatever the KV policy
        (every job in a batch reads its KV from the device)."""
        total = sum(self.batch_kv_s.values())
        over = sum(s for n, s in self.batch_kv_s.items() if n > num_blocks)
        return over / total if total > 0 else 0.0


def simulate(
    workload: Sequence[WorkItem],
    config: EngineConfig,
    cost: CostModel,
    num_device_blocks: int,
    progress: bool = False,
) -> list[Request]:
    """Serve `workload` with `config`'s policy; returns the finished requests in finish order.

    Each request carries arrival_s, first_token_s, finish_s and num_preemptions on the virtual
    clock (seconds from the workload's time origin).
    """
    return simulate_run(workload, config, cost, num_device_blocks, progress).finished


def simulate_run(
    workload: Sequence[WorkItem],
    config: EngineConfig,
    cost: CostModel,
    num_device_blocks: int,
    progress: bool = False,
) -> SimRun:
    """`simulate`, also returning the KV counters (swaps, copy waits, peak blocks)."""
    # NOTE: only jobs that say which prompts share prefixes (Mooncake hash ids) can hit the
    # cache; for the others it stays off, so it neither hashes nor copies evicted blocks.
    caching = config.cache.enable_prefix_caching and any(w.hash_ids for w in workload)
    config = dataclasses.replace(
        config, cache=dataclasses.replace(config.cache, enable_prefix_caching=caching))
    clock = VirtualClock(start_s=min((w.arrival_s for w in workload), default=0.0))
    # Pipeline parallelism: P batches in flight, one per stage.
    # Jobs whose client set max_tokens above the true length end by sampling EOS.
    eos_after = {f"sim-{i}": (w.input_len, w.output_len) for i, w in enumerate(workload)
                 if w.max_tokens is not None and w.max_tokens > w.output_len}
    executor = (PipelinedSimExecutor(cost, clock=clock, eos_after=eos_after)
                if cost.pipeline_parallel_size > 1
                else SimExecutor(cost, clock=clock, eos_after=eos_after))
    core = build_engine_core(config, executor, cost, clock, num_device_blocks,
                             host_pool_blocks(config.cache, cost.kv_block_bytes),
                             eos_token_ids=(EOS_TOKEN_ID,))
    scheduler = core.scheduler
    pending = sorted(make_requests(workload), key=lambda r: r.arrival_s)
    for r in pending:  # refused up front, as `Scheduler.add_request` would refuse it later
        scheduler.check_fits(r)
    finished: list[Request] = []
    bar = tqdm(total=len(pending), desc=config.scheduler.policy, unit="req", disable=not progress,
               leave=False)
    i = 0
    while i < len(pending) or scheduler.has_unfinished:
        now = clock.now()
        while i < len(pending) and pending[i].arrival_s <= now:
            scheduler.add_request(pending[i], now)
            i += 1
        if not scheduler.has_unfinished:
            clock.advance_to(pending[i].arrival_s)  # idle: jump to the next arrival
            continue
        num_iterations, num_in_flight = core.num_iterations, core.num_in_flight
        for req in core.step():
            if req.is_finished:
                finished.append(req)
                bar.update()
        if core.num_iterations == num_iterations and num_in_flight == 0:  # nothing could run
            if i == len(pending):
                kv_now = scheduler.stats().kv
                raise RuntimeError(
                    f"policy {config.scheduler.policy!r} scheduled nothing with "
                    f"{len(scheduler.requests)} requests left and no arrivals to come "
                    f"({kv_now.num_free_blocks}/{kv_now.num_total_blocks} KV blocks free)"
                )
            clock.advance_to(pending[i].arrival_s)
    bar.close()
    return SimRun(
        finished=finished,
        scheduler=scheduler.stats(),
        swap_wait_s=core.swap_wait_s,
        busy_s=core.busy_s,
        stage_busy_s=(max(executor.stage_busy_s) if isinstance(executor, PipelinedSimExecutor)
                      else core.busy_s),
        mean_batch_size=executor.batch_job_s / core.busy_s if core.busy_s > 0 else 0.0,
        batch_kv_s=dict(executor.batch_kv_s),
    )
