"""Shared prefixes on the Mooncake trace: what the prefix cache saves, real engine and simulator.

The trace (`../shared/traces/mooncake_synthetic.jsonl`) is scaled to fit this machine: lengths
and the 512-token block divided by `--token-scale` (32: 16-token blocks, one engine block), one
conversation in `--sample` kept whole (jobs whose first block is the same; sharing is
long-range, so a window of consecutive jobs would share far less than the trace does), and
arrivals stretched or compressed so the offered load is `--load` under the cost model (the
engine's start-up profile of the tiny preset unless `--profile`). Prints:

1. prompt tokens computed with caching off, on (device pool holding every live job) and what an
   unbounded cache would compute (acceptance: on / unbounded <= 1.1), simulated and real;
2. with a device pool of 10% of the trace's distinct prefix blocks (simulated): the hit rate
   device-only, with the host tier, and the share of the lost hits the host tier recovers
   (acceptance: >= 0.5);
3. average TTFT and JCT with vs without caching (acceptance: >= 2x better), simulated and real;
4. the simulator's average JCT against the real engine's at that load (acceptance: within 15%),
   with the start-up profile and with the model the engine calibrated itself to in the run.

    flock /tmp/fastserve-bench.lock .venv/bin/python benchmarks/kv/prefix_cache.py \\
        [--sample 16] [--token-scale 32] [--load 0.8] [--sim-only]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
from pathlib import Path
from typing import Any

from fastserve.args import engine_config
from fastserve.bench.runner import run_real
from fastserve.bench.workloads import (
    WorkItem,
    mooncake_workload,
    scale_to_load,
    unbounded_cache_prompt_tokens,
)
from fastserve.config import EngineConfig
from fastserve.core.cost_model import CostModel
from fastserve.core.kv import num_blocks_for
from fastserve.model.make_model import make_model
from fastserve.profiling.fit import Sample, mean_scale_in_force
from fastserve.prompts import prompt_tokens
from fastserve.sim.simulator import SIM_VOCAB_SIZE, SimRun, ample_blocks, simulate_run

TRACE = Path(__file__).resolve().parents[3] / "shared" / "traces" / "mooncake_synthetic.jsonl"
BLOCK_SIZE = 16


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trace", default=str(TRACE))
    p.add_argument("--sample", type=int, default=16,
                   help="keep 1 conversation in N (whole, over the whole trace) for the real "
                        "runs (default 16: 290 jobs)")
    p.add_argument("--sim-sample", type=int, default=4,
                   help="the same for the simulated figures 1 and 2 (default 4: 1105 jobs)")
    p.add_argument("--token-scale", type=float, default=32.0)
    p.add_argument("--load", type=float, default=0.8)
    p.add_argument("--max-batch-size", type=int, default=16)
    p.add_argument("--profile", default=None, help="cost model JSON (default: the engine's "
                   "start-up profile of the tiny preset)")
    p.add_argument("--sim-only", action="store_true")
    p.add_argument("--model-dir", default=str(Path(tempfile.gettempdir()) / "fastserve-tiny-32k"),
                   help="the tiny preset with a 32k context (made if missing): the longest "
                        "scaled prompts exceed the default 2048")
    args = p.parse_args()

    model = make_model("tiny", args.model_dir, max_position_embeddings=32768)
    base = dict(model=str(model), max_batch_size=args.max_batch_size, dtype="float32",
                block_size=BLOCK_SIZE, max_num_batched_tokens=512, policy="skip-join-mlfq")
    cost = CostModel.from_json(args.profile) if args.profile else _engine_cost(base)
    print(f"cost model: fixed {cost.fixed_s * 1e3:.2f} ms, {cost.per_prefill_token_s * 1e6:.1f} us"
          f"/prefill token, {cost.per_decode_s * 1e3:.2f} ms/decode (machine shared)")

    # 1 and 2: the simulator over the larger slice.
    sim_work = _load(args.trace, args.sim_sample, args.token_scale, args.load, cost,
                     args.max_batch_size)
    print(f"\nsimulated: {_describe(sim_work)}")
    _computed(sim_work, base, cost)
    _host_tier(sim_work, base, cost)

    # 3 and 4: real engine and simulator over the smaller slice.
    work = _load(args.trace, args.sample, args.token_scale, args.load, cost,
                 args.max_batch_size)
    print(f"\nreal vs simulated: {_describe(work)}")
    blocks = ample_blocks(work, BLOCK_SIZE)
    sims = {on: simulate_run(work, _config(base, blocks, on), cost, blocks) for on in (True, False)}
    unbounded = unbounded_cache_prompt_tokens(prompt_tokens(work, SIM_VOCAB_SIZE, 0), BLOCK_SIZE)
    print(f"  sim  computed prompt tokens: off {sims[False].computed_prompt_tokens}, "
          f"on {sims[True].computed_prompt_tokens}, unbounded {unbounded} "
          f"(on/unbounded {sims[True].computed_prompt_tokens / unbounded:.3f})")
    for on in (True, False):
        ttft, jct = _means(sims[on].finished)
        print(f"  sim  caching {'on ' if on else 'off'}: mean TTFT {ttft:.3f} s, JCT {jct:.3f} s")
    _ratios("sim ", sims[False].finished, sims[True].finished)
    if args.sim_only:
        return 0
    reals: dict[bool, Any] = {}
    final: list[float] = []  # the engine's calibration scale at the end of each run
    iterations: list[list[Sample]] = []
    for on in (False, True):
        kv: list[Any] = []
        config = _config(base, blocks, on, args.profile, record_iterations=1 << 17)
        jobs = asyncio.run(run_real(work, config, kv_out=kv, scale_out=final,
                                    iterations_out=iterations))
        reals[on] = jobs
        ttft, jct = _means(jobs)
        computed = kv[0].prefix_query_tokens - kv[0].prefix_hit_tokens
        print(f"  real caching {'on ' if on else 'off'}: mean TTFT {ttft:.3f} s, JCT {jct:.3f} s, "
              f"{len(jobs)} jobs, computed prompt tokens {computed} "
              f"({computed / unbounded:.3f} x unbounded)")
    _ratios("real", reals[False], reals[True])
    real_jct = _means(reals[True])[1]
    sim_jct = _means(sims[True].finished)[1]
    print(f"  sim vs real mean JCT (caching on, load {args.load}), start-up profile: sim "
          f"{sim_jct:.3f} s, real {real_jct:.3f} s, error {(sim_jct - real_jct) / real_jct:+.1%}")
    # The engine calibrates its cost model to its iterations as it runs (one scale on the
    # start-up profile): the simulator with the model it decided with over the run (its
    # scale averaged over the run's iterations, by time), and with the one it ended with.
    for label, scale in (("the engine's calibrated model, averaged over the run",
                          mean_scale_in_force(cost, iterations[-1])),
                         ("the engine's model at the end of the run", final[-1])):
        engine_run = simulate_run(work, _config(base, blocks, True), cost.scaled(scale), blocks)
        engine_jct = _means(engine_run.finished)[1]
        print(f"  sim vs real mean JCT (caching on, load {args.load}), {label} ({scale:.3f}x "
              f"the profile): sim {engine_jct:.3f} s, real {real_jct:.3f} s, error "
              f"{(engine_jct - real_jct) / real_jct:+.1%} (within 15%)")
    return 0


def _engine_cost(base: dict[str, Any]) -> CostModel:
    """The cost model the real engine uses (its start-up profile, measured once and cached)."""
    from fastserve.engine.llm_engine import LLMEngine

    engine = LLMEngine(engine_config(**base, num_device_blocks=2048))
    cost = engine.cost
    engine.shutdown()
    return cost


def _load(path: str, sample: int, token_scale: float, load: float, cost: CostModel,
          batch: int) -> list[WorkItem]:
    work = mooncake_workload(path, token_scale=token_scale, sample_conversations=sample)
    return scale_to_load(work, load, cost, batch)


def _describe(work: list[WorkItem]) -> str:
    n = len(work)
    span = work[-1].arrival_s - work[0].arrival_s
    return (f"{n} jobs over {span:.0f} s, mean prompt {sum(w.input_len for w in work) / n:.0f} "
            f"tokens, mean output {sum(w.output_len for w in work) / n:.1f}, "
            f"block {work[0].block_tokens} tokens")


def _config(base: dict[str, Any], blocks: int, caching: bool, profile: str | None = None,
            **kw: Any) -> EngineConfig:
    opts = {**base, "num_device_blocks": blocks, "enable_prefix_caching": caching, **kw}
    return engine_config(profile_path=profile, **opts)


def _computed(work: list[WorkItem], base: dict[str, Any], cost: CostModel) -> None:
    blocks = ample_blocks(work, BLOCK_SIZE)
    on = simulate_run(work, _config(base, blocks, True), cost, blocks)
    off = simulate_run(work, _config(base, blocks, False), cost, blocks)
    unbounded = unbounded_cache_prompt_tokens(prompt_tokens(work, SIM_VOCAB_SIZE, 0), BLOCK_SIZE)
    print(f"  1. computed prompt tokens: caching off {off.computed_prompt_tokens}, on "
          f"{on.computed_prompt_tokens}, unbounded cache {unbounded}: on/unbounded "
          f"{on.computed_prompt_tokens / unbounded:.3f} (<= 1.1 asked)")
    _ratios("     sim", off.finished, on.finished)


def _host_tier(work: list[WorkItem], base: dict[str, Any], cost: CostModel) -> None:
    prompts = prompt_tokens(work, SIM_VOCAB_SIZE, 0)
    distinct = _distinct_blocks(prompts)
    largest = max(num_blocks_for(w.input_len + w.output_len, BLOCK_SIZE) for w in work)
    pool = max(distinct // 10, largest)
    ample = ample_blocks(work, BLOCK_SIZE)
    runs: dict[str, SimRun] = {
        "unbounded device": simulate_run(work, _config(base, ample, True), cost, ample),
        "device only": simulate_run(work, _config(base, pool, True, kv_policy="recompute"),
                                    cost, pool),
        "device + host tier": simulate_run(
            work, _config(base, pool, True, num_host_blocks=ample), cost, pool),
    }
    print(f"  2. device pool {pool} blocks = 10% of {distinct} distinct prefix blocks "
          f"(largest job {largest}):")
    rate = {k: r.prefix_hit_tokens / r.prefix_query_tokens for k, r in runs.items()}
    for k, r in runs.items():
        ttft, jct = _means(r.finished)
        print(f"     {k:18s} hit rate {rate[k]:.3f} (host {r.prefix_host_hit_tokens} tokens), "
              f"mean TTFT {ttft:.3f} s, JCT {jct:.3f} s")
    lost = rate["unbounded device"] - rate["device only"]
    got = rate["device + host tier"] - rate["device only"]
    print(f"     the host tier recovers {got / lost:.2f} of the hit rate the small pool loses "
          f"(>= 0.5 asked)" if lost > 0 else "     the small pool loses no hits")


def _distinct_blocks(prompts: list[list[int]]) -> int:
    seen: set[int] = set()
    for tokens in prompts:
        parent = 0
        for k in range(len(tokens) // BLOCK_SIZE):
            parent = hash((parent, *tokens[k * BLOCK_SIZE : (k + 1) * BLOCK_SIZE]))
            seen.add(parent)
    return len(seen)


def _means(reqs: list[Any]) -> tuple[float, float]:
    return (statistics.fmean(r.first_token_s - r.arrival_s for r in reqs),
            statistics.fmean(r.finish_s - r.arrival_s for r in reqs))


def _ratios(label: str, off: list[Any], on: list[Any]) -> None:
    (t_off, j_off), (t_on, j_on) = _means(off), _means(on)
    print(f"  {label} TTFT off/on {t_off / t_on:.2f}x, JCT off/on {j_off / j_on:.2f}x "
          f"(>= 2x asked)")


if __name__ == "__main__":
    raise SystemExit(main())
