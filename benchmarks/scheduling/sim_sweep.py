"""Acceptance sweep for the scheduler: skip-join MLFQ against FCFS and the SRPT oracle.

Runs the production schedulers in the simulator (ample KV, batch 16) on
  - Zipf lengths (theta 0.6/0.9/1.2/1.5, up to 2048 tokens) x Gamma arrivals (CV 1/4/8)
    x offered load 0.5/0.8/0.95, and
  - windows of the Azure conversation trace (lengths scaled) at load 0.5 to 1.1,
then prints per cell FCFS's average and p99 JCT, and the ratios of each skip-join variant
(`sj` = default, `paper` = --mlfq-variant paper) to FCFS (average, p99) and to the oracle
(average), and checks the targets:
  1. default skip-join-mlfq average JCT <= 1.05 x FCFS's, in every cell;
  2. its p99 JCT <= FCFS's p99 / 0.8, in every cell;
  3. >= 3x lower average JCT than FCFS at theta 1.5, CV 8, load 0.95 (outputs up to 2048);
  4. average JCT within 1.5x of srpt-oracle's, in every cell.

    .venv/bin/python benchmarks/scheduling/sim_sweep.py [--quick] [--profile P] [--jobs N] [--out F]

Without --profile it uses A100_7B, a hand-written cost model of a 7B model in fp16 on an
A100-class GPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass

from fastserve.args import engine_config
from fastserve.bench.metrics import compute_metrics
from fastserve.bench.runner import WorkloadSpec, policy_config, run_sim
from fastserve.core.cost_model import CostModel
from fastserve.sim.profiles import A100_7B

TRACE = os.environ.get("FASTSERVE_TRACE", "/work/shared/traces/azure_conv_2023.csv")
BATCH = 16

MLFQ = "skip-join-mlfq"
PAPER = "skip-join-mlfq:mlfq-variant=paper"
FCFS = "fcfs"
ORACLE = "srpt-oracle"
REQUIRED = (FCFS, MLFQ, PAPER, ORACLE)
EXTRA = ("orca", "mlfq", "mlfq-preempt", "request-level", "gittins")

# Targets (see the module docstring).
MAX_AVG_VS_FCFS = 1.05
MAX_P99_VS_FCFS = 1 / 0.8
MIN_SPEEDUP_HEAVY_TAIL = 3.0
MAX_VS_ORACLE = 1.5


@dataclass(frozen=True)
class Cell:
    name: str
    workload: WorkloadSpec
    is_heavy_tail: bool = False  # the cell of target 3


def zipf_cells(num_requests: int, thetas: list[float], cvs: list[float], loads: list[float],
               seed: int) -> list[Cell]:
    return [
        Cell(
            f"zipf th={th:<3} cv={cv:<2} load={load:.2f}",
            WorkloadSpec(kind="zipf", num_requests=num_requests, rate=1.0, cv=cv, zipf_theta=th,
                         max_input_len=2048, max_output_len=2048, load=load, seed=seed),
            is_heavy_tail=(th, cv, load) == (1.5, 8, 0.95),
        )
        for th, cv, load in itertools.product(thetas, cvs, loads)
    ]


def trace_cells(window_s: float, starts: list[float], loads: list[float]) -> list[Cell]:
    # Lengths halved and capped so a prompt always fits the 4096-token iteration budget with a
    # full batch of decodes beside it (a longer one stalls every policy until the batch drains).
    return [
        Cell(
            f"azure t={start:<4.0f}+{window_s:.0f}s load={load:.2f}",
            WorkloadSpec(kind=f"trace:{TRACE}", window_start_s=start, window_s=window_s,
                         length_scale=0.5, max_input_len=2048, max_output_len=2048, load=load),
        )
        for start, load in itertools.product(starts, loads)
    ]


def grid(quick: bool = False, num_requests: int = 1000, trace_window_s: float = 600.0,
         seed: int = 0) -> list[Cell]:
    """The sweep's cells (`quick`: a smaller grid, for a quick look)."""
    if quick:
        cells = zipf_cells(min(num_requests, 500), [0.9, 1.5], [1, 8], [0.8, 0.95], seed)
        return cells + trace_cells(min(trace_window_s, 300.0), [0.0], [0.8, 1.1])
    cells = zipf_cells(num_requests, [0.6, 0.9, 1.2, 1.5], [1, 4, 8], [0.5, 0.8, 0.95], seed)
    return cells + trace_cells(trace_window_s, [0.0, 1200.0, 2400.0], [0.5, 0.8, 0.95, 1.1])


def run_one(cell: Cell, policy: str, cost: CostModel) -> tuple[str, str, dict[str, float], float]:
    start = time.perf_counter()
    config = policy_config(engine_config(max_batch_size=BATCH), policy)
    workload = cell.workload.build(cost, BATCH)
    jobs = run_sim(workload, config, cost)
    return cell.name, policy, compute_metrics(jobs, len(workload)), time.perf_counter() - start


def check(cell: Cell, res: dict[str, dict[str, float]]) -> list[str]:
    """Violations of the targets in one cell."""
    m, f, o = res[MLFQ], res[FCFS], res[ORACLE]
    out = []
    if m["jct_mean"] > MAX_AVG_VS_FCFS * f["jct_mean"]:
        out.append(f"avg JCT {m['jct_mean'] / f['jct_mean']:.2f}x FCFS (> {MAX_AVG_VS_FCFS})")
    if m["jct_p99"] > MAX_P99_VS_FCFS * f["jct_p99"]:
        out.append(f"p99 JCT {m['jct_p99'] / f['jct_p99']:.2f}x FCFS (> {MAX_P99_VS_FCFS:.2f})")
    if cell.is_heavy_tail and f["jct_mean"] < MIN_SPEEDUP_HEAVY_TAIL * m["jct_mean"]:
        out.append(f"only {f['jct_mean'] / m['jct_mean']:.2f}x lower avg JCT than FCFS "
                   f"(< {MIN_SPEEDUP_HEAVY_TAIL})")
    if m["jct_mean"] > MAX_VS_ORACLE * o["jct_mean"]:
        out.append(f"avg JCT {m['jct_mean'] / o['jct_mean']:.2f}x srpt-oracle (> {MAX_VS_ORACLE})")
    return out


def print_cell(cell: Cell, res: dict[str, dict[str, float]], policies: list[str]) -> None:
    f, o = res[FCFS], res[ORACLE]
    parts = [f"{cell.name:34s} fcfs {f['jct_mean']:8.3f}s p99 {f['jct_p99']:8.2f}s "
             f"oracle/fcfs {o['jct_mean'] / f['jct_mean']:4.2f} |"]
    for label, p in (("sj", MLFQ), ("paper", PAPER)):
        r = res[p]
        parts.append(f"{label}/fcfs {r['jct_mean'] / f['jct_mean']:5.2f} "
                     f"p99 {r['jct_p99'] / f['jct_p99']:5.2f} "
                     f"/oracle {r['jct_mean'] / o['jct_mean']:5.2f} |")
    extra = [p for p in policies if p not in REQUIRED]
    if extra:
        parts.append(" ".join(f"{p}/fcfs {res[p]['jct_mean'] / f['jct_mean']:.2f}" for p in extra))
    print(" ".join(parts), flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--profile", help="cost-model JSON (default: the A100_7B model)")
    ap.add_argument("--num-requests", type=int, default=1000, help="jobs per Zipf cell")
    ap.add_argument("--trace-window-s", type=float, default=600.0)
    ap.add_argument("--extra-policies", action=argparse.BooleanOptionalAction, default=True,
                    help=f"also run {', '.join(EXTRA)}")
    ap.add_argument("--quick", action="store_true", help="a smaller grid, for a quick look")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="worker processes")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", help="write every cell's metrics to this JSON")
    args = ap.parse_args(argv)

    cost = CostModel.from_json(args.profile) if args.profile else A100_7B
    policies = list(REQUIRED) + (list(EXTRA) if args.extra_policies else [])
    cells = grid(args.quick, args.num_requests, args.trace_window_s, args.seed)
    print(f"cost model: {dataclasses.asdict(cost)}")
    print(f"{len(cells)} cells x {len(policies)} policies ({', '.join(policies)}), batch {BATCH}, "
          f"ample KV, {args.jobs} processes", flush=True)

    start = time.perf_counter()
    tasks = [(c, p) for c in cells for p in policies]
    results: dict[str, dict[str, dict[str, float]]] = {c.name: {} for c in cells}
    sim_s = 0.0
    with ProcessPoolExecutor(max_workers=args.jobs) as pool:
        futures = [pool.submit(run_one, c, p, cost) for c, p in tasks]
        by_cell = {c.name: c for c in cells}
        pending = {c.name: len(policies) for c in cells}
        for fut in futures:  # in submission order: cells print as they complete
            name, policy, metrics, took = fut.result()
            sim_s += took
            results[name][policy] = metrics
            pending[name] -= 1
            if pending[name] == 0:
                print_cell(by_cell[name], results[name], policies)

    violations = [(c.name, v) for c in cells for v in check(c, results[c.name])]
    print(f"\n{len(tasks)} simulations in {time.perf_counter() - start:.0f} s "
          f"({sim_s:.0f} s of simulation)")
    print(summary_line("sj (skip-join-mlfq)", MLFQ, results))
    print(summary_line("paper (skip-join-mlfq, paper variant)", PAPER, results))
    for policy in policies:
        if policy not in REQUIRED:
            print(summary_line(policy, policy, results))
    if violations:
        print(f"{len(violations)} target violations:")
        for name, v in violations:
            print(f"  {name}: {v}")
    else:
        print("all targets met")
    if args.out:
        with open(args.out, "w") as fh:
            json.dump({"cost_model": dataclasses.asdict(cost), "results": results}, fh, indent=1)
    return 1 if violations else 0


def summary_line(label: str, policy: str, results: dict[str, dict[str, dict[str, float]]]) -> str:
    avg = [r[policy]["jct_mean"] / r[FCFS]["jct_mean"] for r in results.values()]
    p99 = [r[policy]["jct_p99"] / r[FCFS]["jct_p99"] for r in results.values()]
    orc = [r[policy]["jct_mean"] / r[ORACLE]["jct_mean"] for r in results.values()]
    return (f"{label}: avg/fcfs {min(avg):.2f}..{max(avg):.2f}, p99/fcfs {min(p99):.2f}.."
            f"{max(p99):.2f}, avg/oracle {min(orc):.2f}..{max(orc):.2f}")


if __name__ == "__main__":
    sys.exit(main())
