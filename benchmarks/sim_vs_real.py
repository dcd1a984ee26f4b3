"""Simulator against the real engine: per-policy average JCT on the same workload (issue #3).

For each profile given (default: two measured now, the executor-only grid and the whole engine
under load, `fastserve profile [--through-engine]`), the workload is scaled to `--load` with that
profile, served by the real engine (`AsyncLLM`, wall clock, the profile as its cost model)
`--reps` times per policy, and simulated once with the same profile. Prints the median real
average JCT, the simulated one and the error. The real runs also record their iterations, and
each profile's prediction of those iterations is scored (sum predicted / sum measured): the
error in service time that the JCT error grows from.

    .venv/bin/python benchmarks/sim_vs_real.py [--profiles A.json,B.json] [--reps 3] \\
        [--policies fcfs,skip-join-mlfq] [--out results.json]

Defaults are issue #3's acceptance setting: tiny preset, batch 16, zipf theta 1.5, CV 8,
load 0.95, 300 requests, inputs <= 256, outputs <= 1536, float32, one CPU thread.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

from fastserve.args import engine_config
from fastserve.bench.metrics import compute_metrics
from fastserve.bench.runner import WorkloadSpec, policy_config, run_real, run_sim
from fastserve.core.cost_model import CostModel
from fastserve.profiling.fit import Sample, fit_error, total_ratio


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--profiles", default=None,
                   help="comma-separated profile JSONs (default: measure executor-only and "
                        "through-engine profiles into --profile-dir)")
    p.add_argument("--profile-dir", default="/tmp/sim_vs_real")
    p.add_argument("--profile-budget-s", type=float, default=30.0)
    p.add_argument("--policies", default="fcfs,skip-join-mlfq")
    p.add_argument("--reps", type=int, default=3, help="real runs per policy and profile")
    p.add_argument("--num-requests", type=int, default=300)
    p.add_argument("--zipf-theta", type=float, default=1.5)
    p.add_argument("--cv", type=float, default=8.0)
    p.add_argument("--load", type=float, default=0.95)
    p.add_argument("--max-input-len", type=int, default=256)
    p.add_argument("--max-output-len", type=int, default=1536)
    p.add_argument("--max-batch-size", type=int, default=16)
    p.add_argument("--num-threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--out", default=None, help="results JSON")
    args = p.parse_args()

    engine_opts = dict(max_batch_size=args.max_batch_size, dtype="float32",
                       num_threads=args.num_threads, seed=args.seed)
    profiles = (args.profiles.split(",") if args.profiles
                else measure_profiles(Path(args.profile_dir), args.num_threads,
                                      args.profile_budget_s))
    policies = [s.strip() for s in args.policies.split(",") if s.strip()]
    spec = WorkloadSpec(num_requests=args.num_requests, cv=args.cv, zipf_theta=args.zipf_theta,
                        max_input_len=args.max_input_len, max_output_len=args.max_output_len,
                        load=args.load, seed=args.seed)
    costs = {path: CostModel.from_json(path) for path in profiles}

    rows: list[dict[str, Any]] = []
    scores: list[dict[str, Any]] = []
    for path, cost in costs.items():
        workload = spec.build(cost, args.max_batch_size)
        config = engine_config(profile_path=path, record_iterations=1 << 17, **engine_opts)
        print(f"\n{path}: {len(workload)} requests over "
              f"{workload[-1].arrival_s - workload[0].arrival_s:.1f} s", flush=True)
        real: dict[str, list[float]] = {pol: [] for pol in policies}
        iterations: list[list[Sample]] = []
        for rep in range(args.reps):  # reps outermost: slow spells of the machine hit all
            for pol in policies:
                jobs = asyncio.run(run_real(workload, policy_config(config, pol), args.seed,
                                            iterations_out=iterations))
                jct = compute_metrics(jobs, len(workload))["jct_mean"]
                real[pol].append(jct)
                print(f"  real {pol:16s} rep {rep}: avg JCT {jct:.3f} s", flush=True)
        for pol in policies:
            cfg = policy_config(config, pol)
            sim = compute_metrics(run_sim(workload, cfg, cost), len(workload))["jct_mean"]
            med = statistics.median(real[pol])
            rows.append({"profile": path, "policy": pol, "real_jct_s": real[pol],
                         "real_jct_median_s": med, "sim_jct_s": sim,
                         "error": (sim - med) / med})
        samples = [s for run in iterations for s in run]
        for other, other_cost in costs.items():
            scores.append({"workload_profile": path, "predicting_profile": other,
                           **score(other_cost, samples)})

    print("\naverage JCT, real (median of reps) vs simulated, same workload and profile")
    print(f"{'profile':40s} {'policy':16s} {'real s':>7s} {'sim s':>7s} {'error':>7s}  real runs")
    for r in rows:
        runs = " ".join(f"{x:.3f}" for x in r["real_jct_s"])
        print(f"{Path(r['profile']).name:40s} {r['policy']:16s} {r['real_jct_median_s']:7.3f} "
              f"{r['sim_jct_s']:7.3f} {r['error']:+7.1%}  {runs}")
    print("\nreal iterations (cycle: step start to next step start) predicted by each profile")
    print(f"{'real runs of':40s} {'predicted by':40s} {'sum pred/meas':>13s} {'median |rel err|':>16s}")
    for s in scores:
        print(f"{Path(s['workload_profile']).name:40s} {Path(s['predicting_profile']).name:40s} "
              f"{s['sum_ratio']:13.3f} {s['median_rel_error']:16.1%}")
    if args.out:
        Path(args.out).write_text(json.dumps(
            {"args": vars(args), "results": rows, "iteration_scores": scores}, indent=2))
        print(f"wrote {args.out}")
    return 0


def measure_profiles(out_dir: Path, num_threads: int, budget_s: float) -> list[str]:
    """Executor-only and through-engine profiles of this machine, via `fastserve profile`."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, extra in (("executor", []), ("through-engine", ["--through-engine"])):
        path = out_dir / f"profile-{name}.json"
        subprocess.run([sys.executable, "-m", "fastserve.cli", "profile", "--out", str(path),
                        "--num-threads", str(num_threads), "--time-budget-s", str(budget_s),
                        *extra], check=True)
        paths.append(str(path))
    return paths


def score(cost: CostModel, samples: list[Sample]) -> dict[str, Any]:
    """How well `cost` predicts recorded iterations: in total and typically."""
    if not samples:
        return {"sum_ratio": float("nan"), "median_rel_error": float("nan"), "num": 0}
    return {"sum_ratio": total_ratio(cost, samples),
            "median_rel_error": fit_error(cost, samples), "num": len(samples)}


if __name__ == "__main__":
    sys.exit(main())
