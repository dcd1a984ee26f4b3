"""Does the default KV policy ever lose? The simulator's grid of issue #18.

For each profile (this machine's tiny-model profile, where KV copies run inline on the
compute's cores, and a GPU profile whose copies overlap compute on their own stream), each
cell (Zipf theta 0.9 / 1.2 / 1.5, Gamma arrivals CV 1 / 8, load 0.9, outputs and inputs
<= 512, batch 16, the default scheduler) and each device pool (15%, 25% and 50% of the peak
KV of the default policy's run with unlimited memory, at least the largest job), the default
KV policy runs beside every alternative on the same workload and pool. Target: the default's
average JCT <= 1.05x the best alternative's in every cell.

    .venv/bin/python benchmarks/kv/kv_defaults.py --cpu-profile profiles/cpu-tiny-2threads-quiet.json \\
        [--seeds 0] [--jobs 2] [--num-requests 1000] [--load 0.9]

`profiles/cpu-tiny-2threads-quiet.json` is `fastserve profile --through-engine --num-threads 2`
on the tiny preset, measured on a quiet machine (KV copies 19 us a block);
`profiles/cpu-tiny-2threads.json` was measured under heavy load (628 us a block) and is kept
as a case where copies are dear (a test pins its decisions to it).

The GPU profile is `kv_policies.A100_13B` (LLaMA-2-13B on an A100, PCIe 4.0 copies).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from kv_policies import HOST_GIB, largest_job_blocks

from fastserve.args import engine_config
from fastserve.bench.metrics import JobTimes, compute_metrics
from fastserve.bench.workloads import WorkItem, scale_to_load, zipf_workload
from fastserve.config import CacheConfig
from fastserve.core.cost_model import CostModel
from fastserve.sim.profiles import A100_13B
from fastserve.sim.simulator import ample_blocks, simulate_run

BATCH = 16
MAX_LEN = 512
THETAS = (0.9, 1.2, 1.5)
CVS = (1.0, 8.0)
FRACTIONS = (0.15, 0.25, 0.50)
TARGET = 1.05
DEFAULT = CacheConfig().kv_policy
ALTERNATIVES = tuple(p for p in ("defer", "reactive", "recompute") if p != DEFAULT)


@dataclass(frozen=True)
class Cell:
    profile: str  # a label
    theta: float
    cv: float
    load: float
    num_requests: int
    seed: int


def avg_jct(wl: Sequence[WorkItem], cost: CostModel, blocks: int, kv_policy: str
            ) -> tuple[float, int]:
    """(average JCT, peak device blocks) of the default scheduler with `kv_policy`."""
    config = engine_config(kv_policy=kv_policy, max_batch_size=BATCH, swap_space_gib=HOST_GIB)
    run = simulate_run(wl, config, cost, blocks)
    m = compute_metrics([JobTimes.from_request(r) for r in run.finished], len(wl))
    assert m["num_finished"] == len(wl), "a job was lost"
    return m["jct_mean"], run.peak_kv_blocks


def run_cell(cell: Cell, cost: CostModel) -> list[tuple[Cell, float, int, dict[str, float]]]:
    """One row per pool fraction: (cell, fraction, blocks, avg JCT per KV policy)."""
    items = zipf_workload(cell.num_requests, 1.0, cell.cv, cell.theta, MAX_LEN, MAX_LEN,
                          seed=cell.seed)
    wl = scale_to_load(items, cell.load, cost, BATCH)
    _, peak = avg_jct(wl, cost, ample_blocks(wl, 16), DEFAULT)
    rows = []
    for fraction in FRACTIONS:
        blocks = max(largest_job_blocks(wl), round(fraction * peak))
        jct = {p: avg_jct(wl, cost, blocks, p)[0] for p in (DEFAULT, *ALTERNATIVES)}
        rows.append((cell, fraction, blocks, jct))
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cpu-profile", default=None,
                   help="this machine's tiny-model profile (`fastserve profile --through-engine "
                        "--num-threads 2`, copies inline); without it the GPU profile only")
    p.add_argument("--skip-gpu", action="store_true", help="the CPU profile only")
    p.add_argument("--seeds", default="0")
    p.add_argument("--num-requests", type=int, default=1000)
    p.add_argument("--load", type=float, default=0.9)
    p.add_argument("--jobs", type=int, default=2, help="cells simulated in parallel")
    args = p.parse_args()
    profiles = {Path(args.cpu_profile).stem: CostModel.from_json(args.cpu_profile)
                } if args.cpu_profile else {}
    if not args.skip_gpu:
        profiles["A100_13B"] = A100_13B
    cells = [Cell(name, th, cv, args.load, args.num_requests, int(s))
             for name in profiles for th in THETAS for cv in CVS
             for s in args.seeds.split(",")]
    t0 = time.time()
    with ProcessPoolExecutor(args.jobs) as pool:
        results = list(pool.map(run_cell, cells, [profiles[c.profile] for c in cells]))
    for name, cost in profiles.items():
        print(f"- {name}: copies {'overlap compute' if cost.copies_overlap else 'inline'}, "
              f"{cost.swap_s(1) * 1e6:.1f} us per block")
    header = ["profile", "theta", "cv", "seed", "pool", "blocks", f"{DEFAULT} s",
              *(f"{a} s" for a in ALTERNATIVES), f"{DEFAULT}/best (<={TARGET})"]
    print("\n" + " | ".join(header))
    print(" | ".join(["---"] * len(header)))
    worst = 0.0
    misses = 0
    for rows in results:
        for cell, fraction, blocks, jct in rows:
            best = min(jct[a] for a in ALTERNATIVES)
            ratio = jct[DEFAULT] / best
            worst = max(worst, ratio)
            misses += ratio > TARGET
            print(" | ".join([
                cell.profile, f"{cell.theta:g}", f"{cell.cv:g}", str(cell.seed),
                f"{fraction:.0%}", str(blocks), *(f"{jct[k]:.3f}" for k in (DEFAULT, *ALTERNATIVES)),
                f"{ratio:.3f}" + (" MISS" if ratio > TARGET else ""),
            ]))
    n = sum(len(r) for r in results)
    print(f"\n{DEFAULT}/best alternative: worst {worst:.3f}; {n - misses} of {n} cells <= "
          f"{TARGET} ({time.time() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
