"""Decode step time against context length: how much of a decode step grows with the context.

One decode iteration of `--batch` (32) requests through the real executor (`ModelRunner.execute`:
input preparation, forward, sampling), each request with `--contexts` tokens of context
already in the paged KV cache (128 and 512 by default), timed `--steps` times per repetition;
the contexts take turns within each repetition and the ratio to the first context is the
median of per-repetition ratios (issue #16's target: ctx 512 / ctx 128 <= 1.5x at batch 32).

Block tables are laid out three ways: `contiguous` (each request's blocks adjacent, what a fresh
pool hands out), `interleaved` (request i owns blocks i, i + batch, i + 2 x batch, ...) and
`scattered` (the blocks of a seeded random permutation of the cache: a pool after churn, which
the hardware prefetcher cannot follow), since attention may take a shortcut for the first.

    flock /tmp/fastserve-bench.lock .venv/bin/python benchmarks/cpu/decode_context.py \\
        [--batch 32] [--contexts 128,512] [--dtype float32] [--reps 5]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from pathlib import Path

import torch

from fastserve import LLM, SamplingParams
from fastserve.core.plan import ScheduledRequest, SchedulerOutput
from fastserve.model.make_model import cached_model_path

LAYOUTS = ("contiguous", "interleaved", "scattered")


def decode_plan(batch: int, ctx: int, block_size: int, layout: str,
                num_blocks: int) -> SchedulerOutput:
    """`batch` requests decoding their token at position `ctx` (ctx + 1 tokens of context)."""
    per = -(-(ctx + 1) // block_size)
    params = SamplingParams(max_tokens=1 << 20, temperature=0.0, ignore_eos=True)
    shuffled = random.Random(0).sample(range(num_blocks), batch * per)
    scheduled = []
    for i in range(batch):
        if layout == "contiguous":
            table = list(range(i * per, (i + 1) * per))
        elif layout == "interleaved":
            table = [i + k * batch for k in range(per)]
        else:
            table = shuffled[i * per:(i + 1) * per]
        scheduled.append(ScheduledRequest(f"d{i}", [17], ctx, table, params, 1))
    return SchedulerOutput(scheduled=scheduled)


def step_ms(llm: LLM, plan: SchedulerOutput, steps: int) -> float:
    runner = llm.engine.runner
    times = []
    for _ in range(steps):
        if runner.device.type == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        runner.execute(plan)
        if runner.device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="HF checkpoint (default: the small preset)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--contexts", default="128,512")
    ap.add_argument("--steps", type=int, default=10, help="timed steps per context and rep (median)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--layouts", default=",".join(LAYOUTS))
    args = ap.parse_args()
    contexts = [int(c) for c in args.contexts.split(",")]
    layouts = [s for s in args.layouts.split(",") if s]
    path = Path(args.model) if args.model else cached_model_path("small")
    llm = LLM(model=str(path), dtype=args.dtype, device=args.device, max_batch_size=args.batch,
              policy="fcfs", startup_profile=False)
    bs = llm.engine.runner.block_size
    need = args.batch * -(-(max(contexts) + 1) // bs)
    if need > llm.engine.runner.num_blocks:
        llm = LLM(model=str(path), dtype=args.dtype, device=args.device, max_batch_size=args.batch,
                  policy="fcfs", startup_profile=False, num_device_blocks=need)
    num_blocks = llm.engine.runner.num_blocks
    plans = {(lay, c): decode_plan(args.batch, c, bs, lay, num_blocks) for lay in layouts
             for c in contexts}
    for plan in plans.values():  # warm-up: every shape once
        step_ms(llm, plan, 2)
    ms: dict[tuple[str, int], list[float]] = {k: [] for k in plans}
    for _ in range(args.reps):
        for key, plan in plans.items():
            ms[key].append(step_ms(llm, plan, args.steps))
    print(f"{path.name} {args.dtype} {args.device}, batch {args.batch}, torch threads "
          f"{torch.get_num_threads()}; median of {args.reps} reps x {args.steps} steps")
    for lay in layouts:
        base = contexts[0]
        cells = []
        for c in contexts:
            ratio = statistics.median(a / b for a, b in zip(ms[(lay, c)], ms[(lay, base)], strict=True))
            cells.append(f"ctx {c}: {statistics.median(ms[(lay, c)]):.1f} ms ({ratio:.2f}x)")
        print(f"  {lay:<12} " + ", ".join(cells))
    print(f"ratio = median of per-rep ratios to ctx {contexts[0]} (issue #16 target at batch 32: "
          "ctx 512 / ctx 128 <= 1.5x)")


if __name__ == "__main__":
    main()
