"""Simulator against the real engine: how far off is a prediction, and why (issue #18).

The real engine starts as a user's would, with its own cached start-up profile (or
`--profile`), and the workload is scaled to each `--loads` with that same cost model. Per load
and policy the real engine (`AsyncLLM`, wall clock) serves it `--reps` times, policies
interleaved (the machine is shared and drifts: a slow spell hits every policy alike). Printed
per load and policy:

- the real runs' average JCT: min, median and max;
- the simulator's prediction with the engine's start-up profile (the cached profile, as a
  user would run the simulator before starting the engine);
- the same with the engine's own cost model in each real run: the start-up profile times the
  scale its running check calibrated it to (`calibrate_cost_model`, on by default), averaged
  over the run's iterations by their time (median over the runs);
- the simulator's prediction with a profile fitted afterwards to each real run's own recorded
  iterations (median over the runs): that removes the machine's drift between profiling and
  running, and leaves the error of the model itself (its form, and what it leaves out:
  arrival jitter, the asyncio front end);
- the engine's cost model scored on the runs' recorded iterations, each against what the
  model in force predicted for it when it ran: median absolute per-iteration error, and total
  predicted / measured (targets <= 10%, 0.95-1.05); and the same for the start-up profile.

    .venv/bin/python benchmarks/scheduling/sim_vs_real.py [--loads 0.5,0.8,0.95] [--reps 3] \\
        [--policies fcfs,skip-join-mlfq] [--profile P.json] [--out results.json]

Defaults: tiny preset, batch 16, Zipf theta 1.5, CV 8, 200 requests, inputs <= 256, outputs
<= 1024, float32, one CPU thread (the client keeps the other core).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import statistics
import sys
from pathlib import Path
from typing import Any

from fastserve.args import engine_config
from fastserve.bench.metrics import compute_metrics
from fastserve.bench.runner import WorkloadSpec, policy_config, run_real, run_sim
from fastserve.config import EngineConfig
from fastserve.core.cost_model import CostModel
from fastserve.profiling.fit import (
    Sample,
    fit_cost_model,
    fit_error,
    in_force_error,
    in_force_ratio,
    mean_scale_in_force,
    total_ratio,
)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--profile", default=None,
                   help="profile JSON for the engine and the simulator (default: the engine's "
                        "own cached start-up profile)")
    p.add_argument("--policies", default="fcfs,skip-join-mlfq")
    p.add_argument("--loads", default="0.5,0.8,0.95")
    p.add_argument("--reps", type=int, default=3, help="real runs per policy and load")
    p.add_argument("--num-requests", type=int, default=200)
    p.add_argument("--zipf-theta", type=float, default=1.5)
    p.add_argument("--cv", type=float, default=8.0)
    p.add_argument("--max-input-len", type=int, default=256)
    p.add_argument("--max-output-len", type=int, default=1024)
    p.add_argument("--max-batch-size", type=int, default=16)
    p.add_argument("--num-threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--out", default=None, help="results JSON")
    args = p.parse_args()

    config = engine_config(profile_path=args.profile, record_iterations=1 << 17,
                           max_batch_size=args.max_batch_size, dtype="float32",
                           num_threads=args.num_threads, seed=args.seed)
    cost = engine_cost(config)
    print(f"engine's cost model: {cost}", flush=True)
    policies = [s.strip() for s in args.policies.split(",") if s.strip()]
    rows: list[dict[str, Any]] = []
    all_samples: list[Sample] = []
    for load in (float(x) for x in args.loads.split(",")):
        spec = WorkloadSpec(num_requests=args.num_requests, cv=args.cv,
                            zipf_theta=args.zipf_theta, max_input_len=args.max_input_len,
                            max_output_len=args.max_output_len, load=load, seed=args.seed)
        workload = spec.build(cost, args.max_batch_size)
        print(f"\nload {load}: {len(workload)} requests over "
              f"{workload[-1].arrival_s - workload[0].arrival_s:.1f} s", flush=True)
        runs: dict[str, list[tuple[float, list[Sample]]]] = {pol: [] for pol in policies}
        for rep in range(args.reps):  # reps outermost: slow spells of the machine hit all
            for pol in policies:
                iterations: list[list[Sample]] = []
                final: list[float] = []
                jobs = asyncio.run(run_real(workload, policy_config(config, pol), args.seed,
                                            iterations_out=iterations, scale_out=final))
                jct = compute_metrics(jobs, len(workload))["jct_mean"]
                runs[pol].append((jct, iterations[0]))
                print(f"  real {pol:16s} rep {rep}: avg JCT {jct:.3f} s, "
                      f"{len(iterations[0])} iterations, the engine's model at "
                      f"{mean_scale_in_force(cost, iterations[0]):.3f}x the start-up profile "
                      f"on average, {final[0]:.3f}x at the end",
                      flush=True)
        for pol in policies:
            cfg = policy_config(config, pol)
            real = [jct for jct, _ in runs[pol]]
            sim_startup = _sim_jct(workload, cfg, cost)
            sim_engine = [_sim_jct(workload, cfg, cost.scaled(mean_scale_in_force(cost, run)))
                          for _, run in runs[pol]]
            # Each run's own iterations, fitted: the machine as it was during that run.
            sim_fitted = [_sim_jct(workload, cfg, _refit(cost, samples))
                          for _, samples in runs[pol]]
            samples = [s for _, run in runs[pol] for s in run]
            all_samples += samples
            rows.append({
                "load": load, "policy": pol, "real_jct_s": real,
                "sim_startup_profile_s": sim_startup, "sim_engine_model_s": sim_engine,
                "sim_run_fitted_s": sim_fitted,
                "iteration_median_abs_error": in_force_error(samples),
                "iteration_total_ratio": in_force_ratio(samples),
                "startup_iteration_median_abs_error": fit_error(cost, samples),
                "startup_iteration_total_ratio": total_ratio(cost, samples),
            })

    print("\naverage JCT (s): real runs vs the simulator, same workload")
    header = ["load", "policy", "real min", "real median", "real max",
              "sim engine's model (median)", "error", "in real min-max",
              "sim start-up profile", "error", "sim run-fitted (median)", "error",
              "iter |err| median", "iter pred/meas", "start-up: iter |err|", "pred/meas"]
    print(" | ".join(header))
    print(" | ".join(["---"] * len(header)))
    for r in rows:
        real = r["real_jct_s"]
        med = statistics.median(real)
        engine = statistics.median(r["sim_engine_model_s"])
        startup = r["sim_startup_profile_s"]
        fitted = statistics.median(r["sim_run_fitted_s"])
        print(" | ".join([
            f"{r['load']:g}", r["policy"], f"{min(real):.3f}", f"{med:.3f}", f"{max(real):.3f}",
            f"{engine:.3f}", f"{(engine - med) / med:+.1%}",
            "yes" if min(real) <= engine <= max(real) else "no",
            f"{startup:.3f}", f"{(startup - med) / med:+.1%}",
            f"{fitted:.3f}", f"{(fitted - med) / med:+.1%}",
            f"{r['iteration_median_abs_error']:.1%}", f"{r['iteration_total_ratio']:.3f}",
            f"{r['startup_iteration_median_abs_error']:.1%}",
            f"{r['startup_iteration_total_ratio']:.3f}",
        ]))
    print(f"\nthe engine's cost model in force on all {len(all_samples)} recorded iterations: "
          f"median |error| {in_force_error(all_samples):.1%} (<= 10%), total predicted / "
          f"measured {in_force_ratio(all_samples):.3f} (0.95-1.05); the start-up profile's: "
          f"{fit_error(cost, all_samples):.1%}, {total_ratio(cost, all_samples):.3f}")
    if args.out:
        Path(args.out).write_text(json.dumps({"args": vars(args), "results": rows}, indent=2))
        print(f"wrote {args.out}")
    return 0


def engine_cost(config: EngineConfig) -> CostModel:
    """The cost model the real engine starts with (its cached start-up profile, measured now
    if there is none, or the given one), copies as its executor makes them."""
    from fastserve.engine.llm_engine import LLMEngine

    engine = LLMEngine(config)
    cost = engine.cost
    engine.shutdown()
    return cost


def _refit(cost: CostModel, samples: list[Sample]) -> CostModel:
    """The cost model fitted to one run's iterations, its copy terms kept."""
    fit = fit_cost_model(samples, kv_block_bytes=cost.kv_block_bytes, fit_mean=True)
    return dataclasses.replace(fit, swap_bytes_per_s=cost.swap_bytes_per_s,
                               copies_overlap=cost.copies_overlap)


def _sim_jct(workload: Any, config: EngineConfig, cost: CostModel) -> float:
    return compute_metrics(run_sim(workload, config, cost), len(workload))["jct_mean"]


if __name__ == "__main__":
    sys.exit(main())
