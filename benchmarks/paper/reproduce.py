"""FastServe's evaluation (Wu et al. 2023, arXiv 2305.05920, section 6), redrawn in the
simulator with the shipped A100 cost models.

One command draws every figure as a PNG and writes a markdown table with the paper's claims
beside ours:

  1. JCT (mean and p99) against arrival rate (offered load), burstiness (Gamma CV) and skew
     (Zipf theta), the default and the paper's skip-join MLFQ against Orca, FasterTransformer
     (request-level batching), vLLM-style FCFS and SRPT with known lengths, on the shipped
     GPT-3 175B profile (16 A100s: 8-way tensor x 2-way pipeline parallel, the paper's setup);
  2. the scheduler design: MLFQ without preemption (`mlfq`), with preemption (`mlfq-preempt`),
     skip-join MLFQ (paper and default), and skip-join's quantum ratio;
  3. KV management: proactive against defer and reactive with the device pool at 25%, 50%
     and 100% of the peak demand (FCFS's peak with ample memory), and the peak KV each
     scheduler holds with ample memory against FCFS's;
  4. scalability: the 175B model on 2 to 16 GPUs (tensor parallel up to 8, then 2 pipeline
     stages), each at the same offered load.

    .venv/bin/python benchmarks/paper/reproduce.py [--num-requests N] [--jobs J] [--out DIR]

Every point is one simulated run of `--num-requests` jobs (Zipf lengths on [1, 1024], as GPT-3's
2048-token context allows, batch 16). Orca's reservation is the request's `max_tokens`, which
these workloads set to the true output length: that favours Orca.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from fastserve.args import engine_config
from fastserve.bench.metrics import KVTotals, compute_metrics
from fastserve.bench.runner import WorkloadSpec, policy_config, run_sim, with_options
from fastserve.core.cost_model import CostModel
from fastserve.sim.simulator import ample_blocks

ROOT = Path(__file__).resolve().parents[2]
GPT3 = ROOT / "profiles" / "gpt3-175b_16xA100_tp8_pp2.json"
BATCH = 16
MAX_LEN = 1024
BASE = {"load": 0.9, "cv": 4.0, "theta": 1.2}  # where one of the three is not swept

DEFAULT = "skip-join-mlfq"
PAPER = "skip-join-mlfq:mlfq-variant=paper"
COMPARED = ("orca", "request-level", "fcfs", DEFAULT, PAPER, "srpt-oracle")
DESIGN = ("mlfq:mlfq-variant=paper", "mlfq-preempt:mlfq-variant=paper", PAPER, DEFAULT)
RATIOS = tuple(f"{PAPER}:quantum-ratio={r}" for r in (2, 4, 8))
KV_POLICIES = ("proactive", "defer", "reactive")
KV_SHARES = (0.25, 0.5, 1.0)
GPUS = ((2, 2, 1), (4, 4, 1), (8, 8, 1), (16, 8, 2))  # (GPUs, tensor, pipeline)

# The paper's headline (v1 abstract, against Orca on GPT-3 175B).
PAPER_MEAN_VS_ORCA = 5.1
PAPER_P99_VS_ORCA = 6.4


@dataclass(frozen=True)
class Point:
    figure: str
    x: float
    series: str  # the line it belongs to
    policy: str
    load: float = BASE["load"]
    cv: float = BASE["cv"]
    theta: float = BASE["theta"]
    kv_share: float | None = None  # device pool as a share of FCFS's peak; None = ample
    kv_policy: str = "proactive"
    gpus: tuple[int, int] = (8, 2)  # (tensor, pipeline)
    options: dict[str, object] = field(default_factory=dict, hash=False, compare=False)


def cost_for(tp: int, pp: int) -> CostModel:
    return dataclasses.replace(CostModel.from_json(GPT3), tensor_parallel_size=tp,
                               pipeline_parallel_size=pp)


def run_point(p: Point, num_requests: int, seed: int) -> tuple[Point, dict[str, float]]:
    cost = cost_for(*p.gpus)
    spec = WorkloadSpec(kind="zipf", num_requests=num_requests, rate=1.0, cv=p.cv,
                        zipf_theta=p.theta, max_input_len=MAX_LEN, max_output_len=MAX_LEN,
                        load=p.load, seed=seed)
    workload = spec.build(cost, BATCH)
    base = engine_config(max_batch_size=BATCH)
    blocks = None
    if p.kv_share is not None:
        kv: list[KVTotals] = []
        run_sim(workload, policy_config(base, "fcfs"), cost, None, kv_out=kv)
        # ... but never below the largest job, which must fit alone.
        largest = max(ample_blocks([w], base.cache.block_size) for w in workload)
        blocks = max(largest, int(p.kv_share * kv[0].peak_kv_blocks))
        base = with_options(base, kv_policy=p.kv_policy,
                            num_host_blocks=ample_blocks(workload, base.cache.block_size))
    kv_out: list[KVTotals] = []
    jobs = run_sim(workload, policy_config(base, p.policy), cost, blocks, kv_out=kv_out)
    return p, compute_metrics(jobs, len(workload), kv=kv_out[0])


def points() -> list[Point]:
    out: list[Point] = []
    for load in (0.5, 0.7, 0.9, 0.95):
        out += [Point("rate", load, pol, pol, load=load) for pol in COMPARED]
        out += [Point("design", load, pol, pol, load=load) for pol in DESIGN + RATIOS]
        out += [Point("peak-kv", load, pol, pol, load=load) for pol in ("fcfs", DEFAULT, PAPER)]
    for cv in (1.0, 2.0, 4.0, 8.0):
        out += [Point("cv", cv, pol, pol, cv=cv) for pol in COMPARED]
    for theta in (0.9, 1.2, 1.5):
        out += [Point("skew", theta, pol, pol, theta=theta) for pol in COMPARED]
    for share in KV_SHARES:
        for kvp in KV_POLICIES:
            out.append(Point("kv-slots", share, kvp, DEFAULT, kv_share=share, kv_policy=kvp))
    for load in (0.7, 0.9, 0.95):
        for kvp in KV_POLICIES:
            out.append(Point("kv-rate", load, kvp, DEFAULT, load=load, kv_share=0.25,
                             kv_policy=kvp))
    for gpus, tp, pp in GPUS:
        out += [Point("gpus", gpus, pol, pol, gpus=(tp, pp)) for pol in ("fcfs", "orca", DEFAULT)]
    return out


XLABEL = {"rate": "offered load (arrival rate / capacity)", "design": "offered load",
          "peak-kv": "offered load", "cv": "arrival CV", "skew": "Zipf theta",
          "kv-slots": "device KV pool / FCFS's peak demand (load 0.9)",
          "kv-rate": "offered load (KV pool at 25% of peak demand)", "gpus": "GPUs"}


def plot(out_dir: Path, res: dict[Point, dict[str, float]]) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    files = []
    for fig_name in XLABEL:
        pts = [p for p in res if p.figure == fig_name]
        metrics = (("peak_kv_blocks", "peak KV blocks"),) if fig_name == "peak-kv" else (
            ("jct_mean", "mean JCT (s)"), ("jct_p99", "p99 JCT (s)"))
        fig, axes = plt.subplots(1, len(metrics), figsize=(5.2 * len(metrics), 3.8),
                                 squeeze=False)
        for ax, (key, label) in zip(axes[0], metrics, strict=True):
            for series in dict.fromkeys(p.series for p in pts):
                line = sorted((p.x, res[p][key]) for p in pts if p.series == series)
                ax.plot([x for x, _ in line], [y for _, y in line], marker="o",
                        label=series.replace("skip-join-mlfq", "sj"))
            ax.set_xlabel(XLABEL[fig_name])
            ax.set_ylabel(label)
            if key != "peak_kv_blocks":
                ax.set_yscale("log")
        axes[0][0].legend(fontsize=7)
        fig.suptitle(f"{fig_name}: GPT-3 175B profile, simulator")
        fig.tight_layout()
        path = out_dir / f"paper-{fig_name}.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        files.append(path.name)
    return files


def table(res: dict[Point, dict[str, float]]) -> str:
    """The paper's claims beside ours."""
    def get(fig: str, x: float, series: str) -> dict[str, float]:
        return next(res[p] for p in res if p.figure == fig and p.x == x and p.series == series)

    lines = ["| figure | x | " + " | ".join(f"{s.replace('skip-join-mlfq', 'sj')} mean / p99 s"
                                            for s in COMPARED) + " |",
             "|" + " --- |" * (2 + len(COMPARED))]
    best_mean = best_p99 = 0.0
    for fig, xs in (("rate", (0.5, 0.7, 0.9, 0.95)), ("cv", (1.0, 2.0, 4.0, 8.0)),
                    ("skew", (0.9, 1.2, 1.5))):
        for x in xs:
            row = [get(fig, x, s) for s in COMPARED]
            lines.append(f"| {fig} | {x:g} | " + " | ".join(
                f"{m['jct_mean']:.1f} / {m['jct_p99']:.0f}" for m in row) + " |")
            orca, sj = get(fig, x, "orca"), get(fig, x, DEFAULT)
            best_mean = max(best_mean, orca["jct_mean"] / sj["jct_mean"])
            best_p99 = max(best_p99, orca["jct_p99"] / sj["jct_p99"])
    lines += ["", "| claim | paper | here (max over the rate, CV and skew points) |",
              "| --- | --- | --- |",
              f"| mean JCT, Orca / FastServe | up to {PAPER_MEAN_VS_ORCA}x | {best_mean:.2f}x |",
              f"| p99 JCT, Orca / FastServe | up to {PAPER_P99_VS_ORCA}x | {best_p99:.2f}x |"]
    kv = ["", "| KV pool / peak | " + " | ".join(f"{k} mean / p99 s" for k in KV_POLICIES)
          + " |", "|" + " --- |" * (1 + len(KV_POLICIES))]
    for share in KV_SHARES:
        kv.append(f"| {share:g} | " + " | ".join(
            f"{get('kv-slots', share, k)['jct_mean']:.1f} / {get('kv-slots', share, k)['jct_p99']:.0f}"
            for k in KV_POLICIES) + " |")
    rest = ["", "The other figures, every point (peak KV in blocks):", "",
            "| figure | x | series | mean JCT s | p99 JCT s | peak KV blocks |",
            "| --- | --- | --- | --- | --- | --- |"]
    for fig in ("design", "kv-rate", "peak-kv", "gpus"):
        for p in sorted((p for p in res if p.figure == fig), key=lambda p: (p.series, p.x)):
            m = res[p]
            rest.append(f"| {fig} | {p.x:g} | {p.series.replace('skip-join-mlfq', 'sj')} "
                        f"| {m['jct_mean']:.2f} | {m['jct_p99']:.1f} "
                        f"| {m['peak_kv_blocks']:.0f} |")
    return "\n".join(lines + kv + rest) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-requests", type=int, default=500, help="jobs per point")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="worker processes")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="paper-results", help="folder for the PNGs and table")
    args = ap.parse_args(argv)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    pts = points()
    print(f"{len(pts)} simulated runs of {args.num_requests} jobs, {args.jobs} processes",
          flush=True)
    start = time.perf_counter()
    res: dict[Point, dict[str, float]] = {}
    with ProcessPoolExecutor(max_workers=args.jobs) as pool:
        for p, metrics in pool.map(run_point, pts, [args.num_requests] * len(pts),
                                   [args.seed] * len(pts)):
            res[p] = metrics
    print(f"done in {time.perf_counter() - start:.0f} s")
    text = table(res)
    (out_dir / "paper-table.md").write_text(text)
    print(text)
    print("wrote " + ", ".join(plot(out_dir, res)) + f" and paper-table.md in {out_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
