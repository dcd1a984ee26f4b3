"""Scheduling overhead: wall time of one `Scheduler.schedule()` call with many jobs waiting.

For each policy and each queue length N, N jobs (prompts of 16-512 tokens, outputs long enough
that none finishes during the run) are added at once to the real scheduler over a KV manager
with blocks for all of them. The engine loop then runs on the simulator's executor and a
virtual clock: a few warm-up iterations mix running, preempted and demoted jobs, then each
`schedule()` call is timed alone (execute and update are not timed). The target is < 1 ms at
N = 1,000, growing no faster than linearly in N.

    PYTHONPATH=. .venv/bin/python benchmarks/scheduling/sched_overhead.py [--sizes 100 1000 10000] [--iters 50]

`--max-batch-size 128 --sizes 128` times the engine's case instead: every job in the batch, so
the per-job work of building the plan counts, and `update()` too (a GPU step waits for both).
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import statistics
import time

from fastserve.clock import VirtualClock
from fastserve.config import POLICIES, SchedulerConfig
from fastserve.core.cost_model import CostModel
from fastserve.core.kv import KVCacheManager, num_blocks_for
from fastserve.core.policies import make_scheduler
from fastserve.core.scheduler import Scheduler
from fastserve.request import Request, SamplingParams
from fastserve.sim.executor import SimExecutor

BLOCK_SIZE = 16
# Longer than the warm-up plus timed iterations, so nobody finishes while we measure; small
# enough that orca's prompt + max_tokens reservation fits the pool too.
MAX_TOKENS = 200


def build(policy: str, variant: str, n: int, seed: int, max_batch_size: int | None = None
          ) -> Scheduler:
    rng = random.Random(seed)
    prompt_lens = [rng.randint(16, 512) for _ in range(n)]
    blocks = sum(num_blocks_for(p + MAX_TOKENS, BLOCK_SIZE) for p in prompt_lens)
    kv = KVCacheManager(blocks, BLOCK_SIZE)
    config = SchedulerConfig(policy=policy, mlfq_variant=variant)
    if max_batch_size is not None:
        config = dataclasses.replace(config, max_batch_size=max_batch_size)
    sched = make_scheduler(config, kv, CostModel())
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    prompts = {p: [1] * p for p in set(prompt_lens)}  # shared: nothing mutates a prompt
    for i, p in enumerate(prompt_lens):
        req = Request(f"r{i}", prompts[p], params, 0.0, oracle_output_len=rng.randint(1, MAX_TOKENS))
        sched.add_request(req, 0.0)
    return sched


def time_schedule(sched: Scheduler, warmup: int, iters: int
                  ) -> tuple[list[float], list[float]]:
    """Seconds per schedule() and per update() call over `iters` iterations after `warmup`
    untimed ones."""
    executor = SimExecutor(sched.cost)
    clock = VirtualClock()
    times, update_times = [], []
    for i in range(warmup + iters):
        t0 = time.perf_counter()
        plan = sched.schedule(clock.now())
        elapsed = time.perf_counter() - t0
        out = executor.execute(plan)
        clock.advance(out.duration_s)
        t0 = time.perf_counter()
        sched.update(plan, out, clock.now())
        if i >= warmup:
            times.append(elapsed)
            update_times.append(time.perf_counter() - t0)
    return times, update_times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[100, 1_000, 10_000])
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--policies", nargs="+", default=list(POLICIES))
    parser.add_argument("--max-batch-size", type=int, default=None,
                        help="the scheduler's (default: SchedulerConfig's)")
    args = parser.parse_args()
    if args.warmup + args.iters >= MAX_TOKENS:
        parser.error(f"--warmup + --iters must stay below {MAX_TOKENS} so no job finishes")

    cases = [(p, "robust") for p in args.policies]
    cases += [(p, "paper") for p in args.policies if "mlfq" in p]
    # p95 rather than the maximum: a shared machine's scheduler hiccups are not ours.
    print(f"schedule() wall time, median (p95) over {args.iters} calls, in microseconds "
          f"[update() median]")
    header = f"{'policy':<24}" + "".join(f"{f'N={n:,}':>22}" for n in args.sizes)
    print(header)
    print("-" * len(header))
    for policy, variant in cases:
        name = policy + (" (paper)" if variant == "paper" else "")
        cells = []
        for n in args.sizes:
            times, updates = time_schedule(build(policy, variant, n, 0, args.max_batch_size),
                                           args.warmup, args.iters)
            med = statistics.median(times) * 1e6
            p95 = statistics.quantiles(times, n=20)[-1] * 1e6
            cells.append(f"{med:>6.0f} ({p95:>5.0f}) [{statistics.median(updates) * 1e6:>4.0f}]")
        print(f"{name:<24}" + "".join(f"{c:>22}" for c in cells), flush=True)


if __name__ == "__main__":
    main()
