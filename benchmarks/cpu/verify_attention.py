"""What one speculative-decoding iteration costs against a plain decode step, on the CPU
backend, with the drafted tokens' attention run two ways: each request's 1 + k tokens as one
`extend_attention` call per request per layer, or as decode rows (one per token, at its own
length) in the batch's one `decode_attention` call per layer (`backends/cpu.py`,
MAX_QUERY_ROWS). Whole iterations through the runner (model, attention, verification),
median of `--reps`, the three interleaved.

    .venv/bin/python benchmarks/cpu/verify_attention.py [--preset small] [--dtype float32] \\
        [--batch 1 8 32] [--context 128 512 2000] [--k 5] [--reps 7]
"""

from __future__ import annotations

import argparse
import statistics
import time

from fastserve import SamplingParams
from fastserve.args import engine_config
from fastserve.core.plan import ScheduledRequest, SchedulerOutput
from fastserve.engine.llm_engine import LLMEngine
from fastserve.executor.backends import cpu
from fastserve.model.make_model import cached_model_path, make_model

BLOCK = 16


def _step(tables: list[list[int]], ctx: int, k: int, params: SamplingParams) -> SchedulerOutput:
    """Every request's last token at position `ctx`, with `k` drafts after it."""
    return SchedulerOutput([
        ScheduledRequest(f"r{i}", [7, *range(10, 10 + k)], ctx, t, params, 1, num_draft_tokens=k)
        for i, t in enumerate(tables)])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="small")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--context", type=int, nargs="+", default=[128, 512, 2000])
    ap.add_argument("--k", type=int, default=5)
    ap.add_argument("--reps", type=int, default=7)
    args = ap.parse_args()

    model = make_model(args.preset, cached_model_path(args.preset))
    per_req = -(-(max(args.context) + args.k + 1) // BLOCK)
    engine = LLMEngine(engine_config(
        model=str(model), dtype=args.dtype, block_size=BLOCK, warmup=False,
        num_device_blocks=per_req * max(args.batch), startup_profile=False))
    runner = engine.runner
    params = SamplingParams(temperature=0.0, max_tokens=1 << 20)
    default_rows = cpu.MAX_QUERY_ROWS
    print(f"{args.preset}, {args.dtype}, k={args.k} drafts, {args.reps} reps: median ms per "
          "iteration; ratio to the plain decode step")
    for batch in args.batch:
        tables = [list(range(i * per_req, (i + 1) * per_req)) for i in range(batch)]
        for ctx in args.context:
            # The context's KV: one prefill per request (its values do not matter here).
            for i, t in enumerate(tables):
                runner.execute(SchedulerOutput([ScheduledRequest(f"p{i}", [5] * ctx, 0, t, params, 0)]))

            runs = {"decode step": (_step(tables, ctx, 0, params), default_rows),
                    "verify, extend call per request": (_step(tables, ctx, args.k, params), 0),
                    "verify, decode rows": (_step(tables, ctx, args.k, params), default_rows)}
            times: dict[str, list[float]] = {name: [] for name in runs}
            for _ in range(args.reps):
                for name, (plan, rows) in runs.items():
                    cpu.MAX_QUERY_ROWS = rows
                    start = time.perf_counter()
                    runner.execute(plan)
                    times[name].append(time.perf_counter() - start)
            cpu.MAX_QUERY_ROWS = default_rows
            base = statistics.median(times["decode step"])
            for name, ts in times.items():
                med = statistics.median(ts)
                print(f"  batch {batch:3d} context {ctx:5d}  {name:32s} {med * 1e3:8.2f} ms  "
                      f"{med / base:5.2f}x", flush=True)
    engine.shutdown()


if __name__ == "__main__":
    main()
