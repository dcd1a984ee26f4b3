"""The default scheduler's tail against FCFS and its mean against SRPT, over a grid.

In the simulator (the production schedulers, ample KV, batch 16), for each cost model
(`A100-13B`: sim/profiles.py's LLaMA-2-13B on one A100; `175B`: the shipped
profiles/gpt3-175b_16xA100_tp8_pp2.json) and each cell of load {0.5, 0.7, 0.9, 0.95} x
Gamma-arrival CV {1, 2, 4, 8} x Zipf theta {0.9, 1.2, 1.5}, it runs FCFS, the default
(skip-join-mlfq) and srpt-oracle (SRPT with known output lengths) on one workload, then checks
the targets:

  1. the default's p99 JCT <= FCFS's, in every cell;
  2. its mean JCT <= 1.25 x srpt-oracle's, in every cell;
  3. its mean JCT >= 1.5x lower than FCFS's where load >= 0.9, CV >= 4 and theta >= 1.2.

It prints one row per cell (means, p99 JCT and p99 slowdown, which is JCT over the job's time
alone, per policy) and writes the rows as JSON (`--out`), a markdown table (`--md`) and a
plot (`--plot`). Prompt and output lengths are Zipf on [1, 2048] for A100-13B and on [1, 1024]
for 175B (GPT-3's context is 2048 tokens).

    .venv/bin/python benchmarks/paper/tail_grid.py [--num-requests N] [--jobs J]
        [--profiles A100-13B,175B] [--policies fcfs,skip-join-mlfq,srpt-oracle,...]
        [--out F.json] [--md F.md] [--plot F.png]
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from fastserve.args import engine_config
from fastserve.bench.metrics import KVTotals, compute_metrics
from fastserve.bench.runner import WorkloadSpec, policy_config, run_sim, with_options
from fastserve.core.cost_model import CostModel
from fastserve.sim.profiles import A100_13B
from fastserve.sim.simulator import ample_blocks

ROOT = Path(__file__).resolve().parents[2]
PROFILES = {
    "A100-13B": (None, 2048),  # (profile JSON, longest prompt and output)
    "175B": (ROOT / "profiles" / "gpt3-175b_16xA100_tp8_pp2.json", 1024),
}
BATCH = 16
LOADS = (0.5, 0.7, 0.9, 0.95)
CVS = (1.0, 2.0, 4.0, 8.0)
THETAS = (0.9, 1.2, 1.5)

FCFS, DEFAULT, ORACLE = "fcfs", "skip-join-mlfq", "srpt-oracle"
MAX_P99_VS_FCFS = 1.0
MAX_MEAN_VS_ORACLE = 1.25
MIN_GAIN_HEAVY = 1.5


@dataclass(frozen=True)
class Cell:
    profile: str
    load: float
    cv: float
    theta: float

    @property
    def name(self) -> str:
        return f"{self.profile} load={self.load:.2f} cv={self.cv:g} th={self.theta:g}"

    @property
    def is_heavy(self) -> bool:
        """Where line 3 applies: FCFS queues behind long jobs."""
        return self.load >= 0.9 and self.cv >= 4 and self.theta >= 1.2


def cost_of(profile: str) -> CostModel:
    path, _ = PROFILES[profile]
    return A100_13B if path is None else CostModel.from_json(path)


def run_one(cell: Cell, policy: str, num_requests: int, seed: int,
            kv_share: float | None = None) -> tuple[Cell, str, dict]:
    """One simulation. `kv_share`: the device KV pool as a share of FCFS's peak demand with
    ample memory (never below the largest job), with an ample host pool to swap to; None =
    ample device memory."""
    cost = cost_of(cell.profile)
    _, max_len = PROFILES[cell.profile]
    spec = WorkloadSpec(kind="zipf", num_requests=num_requests, rate=1.0, cv=cell.cv,
                        zipf_theta=cell.theta, max_input_len=max_len, max_output_len=max_len,
                        load=cell.load, seed=seed)
    workload = spec.build(cost, BATCH)
    base = engine_config(max_batch_size=BATCH)
    blocks = None
    if kv_share is not None:
        peak: list[KVTotals] = []
        run_sim(workload, policy_config(base, FCFS), cost, None, kv_out=peak)
        largest = max(ample_blocks([w], base.cache.block_size) for w in workload)
        blocks = max(largest, int(kv_share * peak[0].peak_kv_blocks))
        base = with_options(base, num_host_blocks=ample_blocks(workload, base.cache.block_size))
    kv: list[KVTotals] = []
    jobs = run_sim(workload, policy_config(base, policy), cost, blocks, kv_out=kv)
    return cell, policy, compute_metrics(jobs, len(workload), kv=kv[0])


def check(cell: Cell, r: dict[str, dict[str, float]], policy: str = DEFAULT) -> list[str]:
    """The lines `policy` misses in one cell."""
    m, f, o = r[policy], r[FCFS], r[ORACLE]
    out = []
    if m["jct_p99"] > MAX_P99_VS_FCFS * f["jct_p99"]:
        out.append(f"p99 {m['jct_p99'] / f['jct_p99']:.3f}x FCFS")
    if m["jct_mean"] > MAX_MEAN_VS_ORACLE * o["jct_mean"]:
        out.append(f"mean {m['jct_mean'] / o['jct_mean']:.2f}x oracle")
    if cell.is_heavy and f["jct_mean"] < MIN_GAIN_HEAVY * m["jct_mean"]:
        out.append(f"mean only {f['jct_mean'] / m['jct_mean']:.2f}x lower than FCFS")
    return out


def row(cell: Cell, r: dict[str, dict[str, float]], policies: list[str]) -> str:
    f, o = r[FCFS], r[ORACLE]
    parts = [f"{cell.name:36s} fcfs {f['jct_mean']:7.2f}s p99 {f['jct_p99']:7.1f}s "
             f"sd99 {f['slowdown_p99']:6.0f} | oracle/fcfs {o['jct_mean'] / f['jct_mean']:.2f} "
             f"p99 {o['jct_p99'] / f['jct_p99']:.2f} |"]
    for p in policies:
        if p in (FCFS, ORACLE):
            continue
        m = r[p]
        parts.append(f"{short(p)}: fcfs/ {f['jct_mean'] / m['jct_mean']:.2f} "
                     f"p99/fcfs {m['jct_p99'] / f['jct_p99']:.3f} "
                     f"/oracle {m['jct_mean'] / o['jct_mean']:.2f} "
                     f"sd99 {m['slowdown_p99']:.0f} |")
    return " ".join(parts)


def short(policy: str) -> str:
    return "default" if policy == DEFAULT else policy.replace("skip-join-mlfq", "sj")


def grid(profiles: list[str], loads: tuple[float, ...] = LOADS, cvs: tuple[float, ...] = CVS,
         thetas: tuple[float, ...] = THETAS) -> list[Cell]:
    return [Cell(p, load, cv, th)
            for p, load, cv, th in itertools.product(profiles, loads, cvs, thetas)]


def markdown(cells: list[Cell], res: dict[Cell, dict[str, dict[str, float]]],
             seeds_p99: dict[Cell, list[float]] | None = None, policy: str = DEFAULT) -> str:
    """The default's row per cell; with `seeds_p99`, its p99 / FCFS's on every seed too."""
    lines = ["| profile | load | CV | theta | FCFS mean s | FCFS p99 s | FCFS p99 slowdown "
             "| oracle mean s | oracle p99 s | default mean s | default p99 s "
             "| default p99 slowdown | FCFS/default mean | default/FCFS p99 "
             "| default/oracle mean | lines missed |"
             + (" default/FCFS p99 by seed |" if seeds_p99 else ""),
             "|" + " --- |" * (17 if seeds_p99 else 16)]
    for c in cells:
        r = res[c]
        f, o, m = r[FCFS], r[ORACLE], r[policy]
        miss = "; ".join(check(c, r, policy)) or "-"
        lines.append(
            f"| {c.profile} | {c.load:g} | {c.cv:g} | {c.theta:g} | {f['jct_mean']:.2f} "
            f"| {f['jct_p99']:.1f} | {f['slowdown_p99']:.0f} | {o['jct_mean']:.2f} "
            f"| {o['jct_p99']:.1f} | {m['jct_mean']:.2f} | {m['jct_p99']:.1f} "
            f"| {m['slowdown_p99']:.0f} | {f['jct_mean'] / m['jct_mean']:.2f} "
            f"| {m['jct_p99'] / f['jct_p99']:.3f} | {m['jct_mean'] / o['jct_mean']:.2f} "
            f"| {miss} |"
            + (f" {', '.join(f'{x:.3f}' for x in seeds_p99[c])} |" if seeds_p99 else ""))
    return "\n".join(lines) + "\n"


def plot(path: str, cells: list[Cell], res: dict[Cell, dict[str, dict[str, float]]],
         policies: list[str]) -> None:
    """Per profile: each policy's p99 JCT / FCFS's and mean JCT / FCFS's, cell by cell."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    profiles = sorted({c.profile for c in cells})
    fig, axes = plt.subplots(2, len(profiles), figsize=(7 * len(profiles), 6.5), squeeze=False)
    for j, prof in enumerate(profiles):
        mine = [c for c in cells if c.profile == prof]
        xs = range(len(mine))
        for p in policies:
            if p == FCFS:
                continue
            axes[0][j].plot(xs, [res[c][p]["jct_p99"] / res[c][FCFS]["jct_p99"] for c in mine],
                            marker=".", label=short(p))
            axes[1][j].plot(xs, [res[c][p]["jct_mean"] / res[c][FCFS]["jct_mean"] for c in mine],
                            marker=".", label=short(p))
        for ax, what in ((axes[0][j], "p99 JCT / FCFS's"), (axes[1][j], "mean JCT / FCFS's")):
            ax.axhline(1.0, color="k", lw=0.8)
            ax.set_ylabel(what)
            ax.set_title(f"{prof}: cells by load, then CV, then theta")
            for k, c in enumerate(mine):
                if c.cv == CVS[0] and c.theta == THETAS[0]:
                    ax.axvline(k - 0.5, color="grey", lw=0.4)
                    ax.text(k, ax.get_ylim()[1], f"load {c.load:g}", fontsize=7, va="top")
        axes[1][j].set_yscale("log")
        axes[0][j].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


KV_POLICIES = ("proactive", "defer", "reactive")


def kv_spec(kv_policy: str) -> str:
    return f"{DEFAULT}:kv-policy={kv_policy}"


def kv_misses(r: dict[str, dict[str, float]]) -> list[str]:
    """Where proactive is worse than defer or reactive (mean or p99 JCT) in one cell."""
    pro = r[kv_spec("proactive")]
    out = []
    for other in KV_POLICIES[1:]:
        o = r[kv_spec(other)]
        for key in ("jct_mean", "jct_p99"):
            if pro[key] > o[key]:
                out.append(f"{key[4:]} {pro[key] / o[key]:.3f}x {other}")
    return out


def kv_row(cell: Cell, r: dict[str, dict[str, float]], policies: list[str]) -> str:
    parts = [f"{cell.name:36s}"]
    for k in KV_POLICIES:
        m = r[kv_spec(k)]
        parts.append(f"{k} {m['jct_mean']:7.2f}s p99 {m['jct_p99']:7.1f}s "
                     f"swap-out {m['swap_out_blocks']:7d} |")
    miss = kv_misses(r)
    parts.append("proactive worse: " + "; ".join(miss) if miss else "proactive no worse")
    return " ".join(parts)


def kv_summary(args: argparse.Namespace, cells: list[Cell],
               res: dict[Cell, dict[str, dict[str, float]]]) -> int:
    misses = [(c, kv_misses(res[c])) for c in cells]
    misses = [(c, m) for c, m in misses if m]
    for key in ("jct_mean", "jct_p99"):
        for other in KV_POLICIES[1:]:
            ratios = [res[c][kv_spec("proactive")][key] / res[c][kv_spec(other)][key]
                      for c in cells]
            print(f"proactive/{other} {key[4:]}: max {max(ratios):.3f}, median "
                  f"{sorted(ratios)[len(ratios) // 2]:.3f}")
    print(f"proactive is worse than defer or reactive in {len(misses)}/{len(cells)} cells")
    for c, m in misses:
        print(f"  {c.name}: {'; '.join(m)}")
    if args.out:
        Path(args.out).write_text(json.dumps(
            [{"profile": c.profile, "load": c.load, "cv": c.cv, "theta": c.theta,
              "kv_share": args.kv_share, "results": res[c]} for c in cells], indent=1))
    if args.md:
        lines = ["| profile | load | CV | theta | " + " | ".join(
            f"{k} mean / p99 s" for k in KV_POLICIES) + " | proactive worse |",
            "|" + " --- |" * (5 + len(KV_POLICIES))]
        for c in cells:
            r = res[c]
            lines.append(f"| {c.profile} | {c.load:g} | {c.cv:g} | {c.theta:g} | " + " | ".join(
                f"{r[kv_spec(k)]['jct_mean']:.2f} / {r[kv_spec(k)]['jct_p99']:.1f}"
                for k in KV_POLICIES) + f" | {'; '.join(kv_misses(r)) or '-'} |")
        Path(args.md).write_text("\n".join(lines) + "\n")
    if args.plot:
        kv_plot(args.plot, cells, res)
    return 1 if misses else 0


def kv_plot(path: str, cells: list[Cell], res: dict[Cell, dict[str, dict[str, float]]]) -> None:
    """Per profile: proactive's mean and p99 JCT over defer's and reactive's, cell by cell."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    profiles = sorted({c.profile for c in cells})
    fig, axes = plt.subplots(2, len(profiles), figsize=(7 * len(profiles), 6.5), squeeze=False)
    for j, prof in enumerate(profiles):
        mine = [c for c in cells if c.profile == prof]
        for i, key in enumerate(("jct_mean", "jct_p99")):
            ax = axes[i][j]
            for other in KV_POLICIES[1:]:
                ax.plot(range(len(mine)), [res[c][kv_spec("proactive")][key]
                                           / res[c][kv_spec(other)][key] for c in mine],
                        marker=".", label=f"proactive / {other}")
            ax.axhline(1.0, color="k", lw=0.8)
            ax.set_ylabel(f"{key[4:]} JCT ratio")
            ax.set_title(f"{prof}: cells by load, then CV, then theta")
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-requests", type=int, default=1000, help="jobs per cell")
    ap.add_argument("--profiles", default=",".join(PROFILES))
    ap.add_argument("--policies", default=f"{FCFS},{DEFAULT},{ORACLE}",
                    help="comma-separated; fcfs and srpt-oracle are always run")
    ap.add_argument("--loads", default=None, help="comma-separated subset of the grid's loads")
    ap.add_argument("--cvs", default=None)
    ap.add_argument("--thetas", default=None)
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="worker processes")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--extra-seeds", default="",
                    help="comma-separated seeds on which FCFS and the default are run again: "
                         "the default's p99 over FCFS's per seed shows which cells it misses "
                         "by the draw of one workload")
    ap.add_argument("--kv-share", type=float, default=None,
                    help="KV mode: the device KV pool at this share of FCFS's peak demand; runs "
                         "the default with each KV policy (proactive, defer, reactive) and checks "
                         "that proactive is no worse than the others in every cell")
    ap.add_argument("--out", help="every cell's metrics, JSON")
    ap.add_argument("--md", help="the default's table, markdown")
    ap.add_argument("--plot", help="PNG of the ratios to FCFS per cell")
    args = ap.parse_args(argv)

    def floats(text: str | None, default: tuple[float, ...]) -> tuple[float, ...]:
        return default if text is None else tuple(float(x) for x in text.split(","))

    cells = grid(args.profiles.split(","), floats(args.loads, LOADS), floats(args.cvs, CVS),
                 floats(args.thetas, THETAS))
    if args.kv_share is not None:
        policies = [kv_spec(k) for k in KV_POLICIES]
    else:
        policies = [p for p in args.policies.split(",") if p]
        for p in (FCFS, ORACLE):
            if p not in policies:
                policies.append(p)
    memory = "ample KV" if args.kv_share is None else f"KV pool at {args.kv_share:g} of peak"
    print(f"{len(cells)} cells x {len(policies)} policies, {args.num_requests} jobs each, "
          f"batch {BATCH}, {memory}, {args.jobs} processes", flush=True)
    start = time.perf_counter()
    res: dict[Cell, dict[str, dict[str, float]]] = {c: {} for c in cells}
    show = kv_row if args.kv_share is not None else row
    with ProcessPoolExecutor(max_workers=args.jobs) as pool:
        futures = [pool.submit(run_one, c, p, args.num_requests, args.seed, args.kv_share)
                   for c in cells for p in policies]
        for fut in futures:
            cell, policy, metrics = fut.result()
            res[cell][policy] = metrics
            if len(res[cell]) == len(policies):
                print(show(cell, res[cell], policies), flush=True)
        extra_seeds = [int(x) for x in args.extra_seeds.split(",") if x]
        extra_futures = [pool.submit(run_one, c, p, args.num_requests, seed)
                         for seed in extra_seeds for c in cells for p in (FCFS, DEFAULT)]
        seeds_p99: dict[Cell, list[float]] = {
            c: [res[c][DEFAULT]["jct_p99"] / res[c][FCFS]["jct_p99"]] if DEFAULT in res[c]
            else [] for c in cells}
        extra: dict[tuple[int, Cell], dict[str, dict[str, float]]] = {}
        for k, fut in enumerate(extra_futures):
            cell, policy, metrics = fut.result()
            r = extra.setdefault((extra_seeds[k // (2 * len(cells))], cell), {})
            r[policy] = metrics
            if len(r) == 2:
                seeds_p99[cell].append(r[DEFAULT]["jct_p99"] / r[FCFS]["jct_p99"])
    print(f"\n{len(futures) + len(extra_futures)} simulations in "
          f"{time.perf_counter() - start:.0f} s")
    if args.kv_share is not None:
        return kv_summary(args, cells, res)
    if extra_seeds:
        n = 1 + len(extra_seeds)
        met = [sum(x <= MAX_P99_VS_FCFS for x in seeds_p99[c]) for c in cells]
        print(f"\ndefault p99 / FCFS's over seeds {[args.seed, *extra_seeds]}: met in all {n} "
              f"in {sum(m == n for m in met)}/{len(cells)} cells, in none in "
              f"{sum(m == 0 for m in met)}, in some in {sum(0 < m < n for m in met)}")
        for c in cells:
            print(f"  {c.name}: " + " ".join(f"{x:.3f}" for x in seeds_p99[c]))
    failed = 0
    for p in policies:
        if p in (FCFS, ORACLE):
            continue
        misses = [(c, check(c, res[c], p)) for c in cells]
        misses = [(c, m) for c, m in misses if m]
        p99 = [res[c][p]["jct_p99"] / res[c][FCFS]["jct_p99"] for c in cells]
        orc = [res[c][p]["jct_mean"] / res[c][ORACLE]["jct_mean"] for c in cells]
        gain = [res[c][FCFS]["jct_mean"] / res[c][p]["jct_mean"] for c in cells if c.is_heavy]
        print(f"{short(p)}: p99/fcfs max {max(p99):.3f}; mean/oracle max {max(orc):.2f}; "
              f"fcfs/mean in the heavy cells min {min(gain, default=math.nan):.2f}; "
              f"{len(misses)}/{len(cells)} cells miss a line")
        for c, m in misses:
            print(f"  {c.name}: {'; '.join(m)}")
        if p == DEFAULT:
            failed = len(misses)
    if args.out:
        Path(args.out).write_text(json.dumps(
            [{"profile": c.profile, "load": c.load, "cv": c.cv, "theta": c.theta,
              "results": res[c], "default_p99_vs_fcfs_by_seed": seeds_p99[c]}
             for c in cells], indent=1))
    if args.md and DEFAULT in policies:
        Path(args.md).write_text(markdown(cells, res, seeds_p99 if extra_seeds else None))
    if args.plot:
        plot(args.plot, cells, res, policies)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
