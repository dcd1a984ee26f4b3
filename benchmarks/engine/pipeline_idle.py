"""Pipeline parallelism: how idle each stage is with several batches in flight, and with one.

Two pipeline stages (P = 2, gloo on CPU, one process per stage, one thread each). The same
workload runs twice on the same engine: FastServe's way, two batches in flight (while stage 1
computes batch k, stage 0 computes batch k+1), then one batch at a time, as FasterTransformer's
request-level scheduling does. With one batch each stage waits for the other half of every
iteration, so expect each to be idle about half the time.

    .venv/bin/python benchmarks/engine/pipeline_idle.py [--model DIR] [--requests 16] [--batch 8]
        [--input-len 64] [--output-len 64]

Default model: the `small` preset (12 layers, 768 hidden) in float32.
"""

from __future__ import annotations

import argparse
import time

import torch

from fastserve import LLM, SamplingParams
from fastserve.engine.core import PipelinedEngineCore
from fastserve.executor.distributed.executor import DistributedExecutor
from fastserve.executor.distributed.messages import RankStats
from fastserve.model.make_model import cached_model_path


def run(llm: LLM, prompts: list[list[int]], params: SamplingParams,
        max_in_flight: int) -> tuple[float, list[RankStats]]:
    engine = llm.engine
    runner = engine.runner
    assert isinstance(runner, DistributedExecutor)
    engine.core = PipelinedEngineCore(engine.scheduler, runner, engine.clock, max_in_flight)
    runner.rank_stats(reset=True)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    assert all(len(o.token_ids) == params.max_tokens for o in outs)
    return elapsed, runner.rank_stats(reset=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="model directory (default: the small preset)")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--batch", type=int, default=8, help="max_batch_size (jobs per batch)")
    ap.add_argument("--input-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=64)
    args = ap.parse_args()

    model = args.model or str(cached_model_path("small"))
    llm = LLM(model=model, dtype="float32", pipeline_parallel_size=2, policy="fcfs",
              max_batch_size=args.batch, kv_policy="defer", warmup=False)
    g = torch.Generator().manual_seed(0)
    vocab = llm.engine.arch.vocab_size
    prompts = [torch.randint(3, vocab, (args.input_len,), generator=g).tolist()
               for _ in range(args.requests)]
    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    run(llm, prompts[:2], SamplingParams(max_tokens=4, ignore_eos=True), 2)  # warm-up

    print(f"P=2 stages, {args.requests} requests x ({args.input_len} in, {args.output_len} out), "
          f"batches of {args.batch}")
    print(f"{'batches in flight':>18} {'wall s':>7} {'tok/s':>7}  idle share per stage")
    for in_flight in (2, 1):
        elapsed, stats = run(llm, prompts, params, in_flight)
        tok_s = args.requests * args.output_len / elapsed
        idle = "  ".join(f"stage {s.stage}: {s.idle_share:5.1%}" for s in stats)
        print(f"{in_flight:>18} {elapsed:7.2f} {tok_s:7.1f}  {idle}")
    llm.engine.shutdown()


if __name__ == "__main__":
    main()
