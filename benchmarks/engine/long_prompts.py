"""Long prompts on the tiny preset: a 32k-token prompt served, and what a 16k-token prefill in
chunks costs the decodes running beside it.

1. A tiny checkpoint with a 32,768-token context (`make-model --max-position-embeddings 32768`)
   serves a 32,000-token prompt: time to first token and the iterations it took.
2. Four jobs are decoding when a 16k-token prompt arrives. With chunked prefill (token budget
   `--budget`) they keep getting a token every iteration; their largest inter-token gap while
   the prompt prefills is compared with an iteration at the full token budget (the four decodes
   plus a fresh `--budget`-token prefill, median of 3; acceptance: at most 1.5x), and with the
   gap when the whole prompt is one iteration (budget 16k: chunking off).

The engine sizes late chunks by its cost model (`CostModel.prefill_chunk`): the start-up
profile times chunks after cached contexts, and the fit's pairs and prefill-context terms say
what a chunk after `start_pos` cached tokens costs. Step 0 prints that profile's prediction for
a budget-sized chunk after 0, 8k and 16k cached tokens next to the measured time (the profile
times chunks after at most 3k: this checks its extrapolation).

    flock /tmp/fastserve-bench.lock .venv/bin/python benchmarks/engine/long_prompts.py [--budget 512]
        [--profile PATH: a cost model to use instead of the engine's start-up profile]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from fastserve import SamplingParams
from fastserve.args import engine_config
from fastserve.core.plan import ScheduledRequest, SchedulerOutput
from fastserve.engine.llm_engine import LLMEngine
from fastserve.model.make_model import make_model

DECODE = SamplingParams(max_tokens=100_000, temperature=0.0, ignore_eos=True)
FIRST = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-dir", default=str(Path(tempfile.gettempdir()) / "fastserve-tiny-32k"))
    p.add_argument("--budget", type=int, default=512)
    p.add_argument("--long", type=int, default=16384, help="the prompt prefilled in chunks")
    p.add_argument("--serve", type=int, default=32000, help="the prompt of part 1")
    p.add_argument("--skip-serve", action="store_true")
    p.add_argument("--skip-unchunked", action="store_true")
    p.add_argument("--profile", default=None,
                   help="cost model JSON (default: the engine's cached start-up profile)")
    args = p.parse_args()
    model = make_model("tiny", args.model_dir, max_position_embeddings=32768)
    opts = dict(model=str(model), dtype="float32", block_size=16, num_device_blocks=4200,
                max_batch_size=8, policy="skip-join-mlfq", enable_prefix_caching=False)

    profile = _check_profile(opts, args.profile, args.budget)
    if not args.skip_serve:
        _serve(opts, profile, args.serve, args.budget)
    gaps = _gaps(opts, profile, args.long, args.budget)
    chunked = max(gaps)
    budget_s = _budget_iteration_s(opts, profile, args.budget)
    print(f"2. running decodes while a {args.long}-token prompt prefills in chunks of <= "
          f"{args.budget} tokens: largest inter-token gap {chunked * 1e3:.0f} ms; an iteration "
          f"at the full budget (4 decodes + {args.budget}-token prefill, median of 3) "
          f"{budget_s * 1e3:.0f} ms; ratio {chunked / budget_s:.2f} (<= 1.5 asked)")
    print(f"   the {len(gaps)} gaps: median {statistics.median(gaps) * 1e3:.0f} ms, 90th "
          f"percentile {statistics.quantiles(gaps, n=10)[-1] * 1e3:.0f} ms "
          f"({statistics.median(gaps) / budget_s:.2f}x and "
          f"{statistics.quantiles(gaps, n=10)[-1] / budget_s:.2f}x the budget iteration)")
    if not args.skip_unchunked:
        whole = max(_gaps(opts, profile, args.long, args.long))
        print(f"   chunking off (budget {args.long}): largest gap {whole * 1e3:.0f} ms "
              f"({whole / budget_s:.1f}x the budget iteration)")
    print("   (machine shared with other jobs: absolute times vary, ratios are from one run)")
    return 0


def _engine(opts: dict[str, object], profile: str | None, budget: int) -> LLMEngine:
    return LLMEngine(engine_config(profile_path=profile, max_num_batched_tokens=budget, **opts))


def _check_profile(opts: dict[str, object], profile: str | None, budget: int) -> str:
    """The cost model the engines below use (the start-up profile unless one is given),
    written out, with its prediction for chunks after long contexts next to their timing."""
    engine = _engine(opts, profile, budget)
    bs = 16
    longest = 16384
    table = list(range(-(-(longest + budget) // bs)))

    def chunk_s(start: int) -> float:
        times = []
        for _ in range(3):
            plan = SchedulerOutput(scheduled=[ScheduledRequest(
                "probe", [7] * budget, start, table, FIRST, 0, samples=False)])
            t = time.perf_counter()
            engine.runner.execute(plan)
            times.append(time.perf_counter() - t)
        return statistics.median(times)

    engine.runner.execute(SchedulerOutput(scheduled=[ScheduledRequest(
        "fill", [7] * longest, 0, table, FIRST, 0, samples=False)]))  # the context exists
    c = engine.cost
    print(f"0. cost model: {c.per_prefill_token_s * 1e6:.1f} us per prefill token, "
          f"{c.per_prefill_token2_s * 1e9:.2f} ns per query-key pair, "
          f"{c.per_prefill_context_token_s * 1e6:.2f} us per cached token a chunk reads")
    for start in (0, 8192, longest - budget):
        n = c.prefill_chunk(budget, start)
        print(f"   a {budget}-token chunk after {start} cached tokens: {chunk_s(start) * 1e3:.0f} "
              f"ms, predicted {c.prefill_s(budget, start) * 1e3:.0f} ms; the scheduler's chunk "
              f"there: {n} tokens")
    out = Path(tempfile.gettempdir()) / "fastserve-long-prompts-profile.json"
    c.to_json(out, note="the cost model benchmarks/engine/long_prompts.py ran with")
    return str(out)


def _serve(opts: dict[str, object], profile: str, n: int, budget: int) -> None:
    engine = _engine(opts, profile, budget)
    engine.add_request([5 + i % 3000 for i in range(n)], SamplingParams(
        max_tokens=4, temperature=0.0, ignore_eos=True), request_id="long")
    start = time.perf_counter()
    first = None
    tokens: list[int] = []
    while engine.has_unfinished:
        for o in engine.step():
            if first is None and o.token_ids:
                first = time.perf_counter() - start
            if o.finished:
                tokens = o.token_ids
    print(f"1. a {n}-token prompt on tiny (context 32768): first token after {first:.1f} s, "
          f"{engine.core.num_iterations} iterations, {len(tokens)} tokens out "
          f"({engine.stats().scheduler.num_preemptions} preemptions)")


def _gaps(opts: dict[str, object], profile: str, n: int, budget: int) -> list[float]:
    """Inter-token gaps of four decoding jobs while an n-token prompt prefills."""
    engine = _engine(opts, profile, budget)
    for i in range(4):
        engine.add_request([10 + i] * 32, DECODE, request_id=f"dec{i}")
    last: dict[str, float] = {}
    for _ in range(4):  # all four are decoding
        for o in engine.step():
            last[o.request_id] = time.perf_counter()
    engine.add_request([20 + i % 3000 for i in range(n)], FIRST, request_id="long")
    gaps: list[float] = []
    done = False
    while not done:
        for o in engine.step():
            now = time.perf_counter()
            if o.request_id == "long":
                done = True
            else:
                gaps.append(now - last[o.request_id])
                last[o.request_id] = now
    return gaps


def _budget_iteration_s(opts: dict[str, object], profile: str, budget: int) -> float:
    """One iteration of four decodes and a fresh `budget`-token prefill (median of 3)."""
    engine = _engine(opts, profile, budget)
    for i in range(4):
        engine.add_request([10 + i] * 32, DECODE, request_id=f"dec{i}")
    for _ in range(4):
        engine.step()
    times = []
    for k in range(3):
        engine.add_request([30 + k + i % 2000 for i in range(budget)], FIRST,
                           request_id=f"b{k}")
        t = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t)
        while f"b{k}" in engine.scheduler.requests:
            engine.step()
    return statistics.median(times)


if __name__ == "__main__":
    raise SystemExit(main())
