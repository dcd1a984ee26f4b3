"""KV-cache policies under memory pressure: the acceptance runs of proactive offloading.

1. The paper's setting (simulator, GPU-class profile `A100_13B`): Zipf lengths (theta 0.9 to
   1.5) and Gamma arrivals (CV 1 to 8) at heavy load, device KV so tight that Orca's
   reservations admit only 3-4 jobs at once (the pool is sized by search so that Orca's
   duration-weighted batch size is about 3.5), host-device copies at PCIe 4.0 x16 speed.
   Targets: skip-join-mlfq + proactive >= 5x lower average JCT than orca, >= 2x lower p99,
   >= 1.3x lower average JCT than fcfs with recompute preemption.
2. Same profile, device KV about 25% of the peak demand of the run with unlimited device
   memory. Targets: proactive >= 2x lower average JCT than defer, >= 1.3x lower than
   reactive, within 1.2x of the unlimited run. Three more columns say how far any KV policy
   could get: proactive again with copies that take no time (what moving KV could give at
   best), the share of the unlimited run's busy time whose batch alone read more KV than the
   pool holds (its schedule is impossible there, whatever moves where), and defer over the
   unlimited run (the most a KV policy could gain over defer, if it matched unlimited memory).
   Table 2b runs schedulers (`--others`, by default skip-join-mlfq, gittins and srpt-oracle)
   with proactive on robust's pools: how much the memory costs even a scheduler that knows the
   output lengths.
3. The real engine on this machine (CPU, the tiny model in float32), the same memory pressure
   (25% of the unlimited run's peak), a heavy-tailed bursty workload. Targets: proactive >= 2x
   better than defer on average JCT and not worse than reactive; and (issue #18) within 1.05x
   of the best of defer, reactive and recompute, each run interleaved; swap_wait_s as a share
   of the run. Each run also prints its iterations' measured time over what the cost model predicts
   for their shapes: the copies' cost to the compute, apart from the schedule they allow.
   `--copy-workers inline,thread` runs proactive with each CPU copy mode side by side.

    .venv/bin/python benchmarks/kv/kv_policies.py [--part sim1|sim2|real|all] [--quick] [--jobs N]
        [--seeds 0,1,...] [--reps R] [--copy-workers auto|thread|inline[,...]]

Whether the copies overlap compute on a GPU is measured by benchmarks/gpu/copy_overlap.py.

Part 1 uses the default skip-join-mlfq (robust variant); parts 2 and 3 also run the paper
variant (`--mlfq-variant paper`): the robust variant serves each level in arrival order, so few
jobs are ever started and preempted at once and its peak KV stays near one batch's working set
(25% of it cannot hold a batch, whatever the KV policy); the paper variant's turn-taking within
a level is what makes MLFQ's peak KV several times FCFS's, the situation proactive offloading is
for. Both are printed, and the robust variant again on the paper variant's pool (the same
memory for both). `--variants robust:levels=4` runs robust with its levels fixed at 4: by
default it opens two more on heavy-tailed lengths, which these workloads have, and that
deeper MLFQ loses much less than the 4-level one to `defer` (see the scheduler's docs).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fastserve.args import engine_config
from fastserve.bench.metrics import JobTimes, KVTotals, compute_metrics
from fastserve.bench.runner import random_prompts
from fastserve.bench.workloads import WorkItem, scale_to_load, zipf_workload
from fastserve.config import EngineConfig
from fastserve.core.cost_model import CostModel
from fastserve.core.kv import num_blocks_for
from fastserve.request import SamplingParams
from fastserve.sim.profiles import A100_13B
from fastserve.sim.simulator import SimRun, ample_blocks, simulate_run

BATCH = 16
HOST_GIB = 256.0  # the host pool (a node's RAM): never the constraint here
MAX_INPUT, MAX_OUTPUT = 512, 2048
ORCA_JOBS = 3.5  # Orca's target duration-weighted batch size in part 1


@dataclass(frozen=True)
class Cell:
    theta: float
    cv: float
    load: float
    num_requests: int = 1000
    seed: int = 0

    @property
    def name(self) -> str:
        seed = f" seed={self.seed}" if self.seed else ""
        return f"theta={self.theta} cv={self.cv:g} load={self.load:g}{seed}"

    def workload(self, cost: CostModel) -> list[WorkItem]:
        items = zipf_workload(self.num_requests, 1.0, self.cv, self.theta, MAX_INPUT, MAX_OUTPUT,
                              seed=self.seed)
        return scale_to_load(items, self.load, cost, BATCH)


@dataclass(frozen=True)
class Result:
    jct_mean: float
    jct_p99: float
    run: SimRun  # the KV counters, batch sizes and the rest


def mlfq_options(variant: str) -> dict[str, Any]:
    """Engine options of a variant name: `robust`, `paper`, or either with its number of
    levels fixed, e.g. `robust:levels=4` (robust's levels before they adapted to the lengths)."""
    name, _, levels = variant.partition(":levels=")
    return {"mlfq_variant": name, "mlfq_levels": int(levels) if levels else None}


def sim(workload: Sequence[WorkItem], blocks: int, policy: str, kv_policy: str,
        variant: str = "robust", cost: CostModel = A100_13B) -> Result:
    config = engine_config(policy=policy, kv_policy=kv_policy, **mlfq_options(variant),
                           max_batch_size=BATCH, swap_space_gib=HOST_GIB)
    run = simulate_run(workload, config, cost, blocks)
    return _result(run, len(workload))


def _result(run: SimRun, n: int) -> Result:
    m = compute_metrics([JobTimes.from_request(r) for r in run.finished], n)
    assert m["num_finished"] == n, "a job was lost"
    return Result(m["jct_mean"], m["jct_p99"], run)


def largest_job_blocks(workload: Sequence[WorkItem]) -> int:
    return max(num_blocks_for(w.input_len + w.output_len, 16) for w in workload)


# -- part 1: the paper's setting ------------------------------------------------------------


def orca_sized_blocks(workload: Sequence[WorkItem], orca_jobs: float = ORCA_JOBS
                      ) -> tuple[int, float]:
    """The device pool on which Orca's duration-weighted batch size is closest to
    `orca_jobs` (at least the largest job: smaller pools could not run it)."""
    lo, hi = largest_job_blocks(workload), ample_blocks(workload, 16)
    best = (lo, sim(workload, lo, "orca", "defer").run.mean_batch_size)
    while hi - lo > max(2, lo // 50):
        mid = (lo + hi) // 2
        jobs = sim(workload, mid, "orca", "defer").run.mean_batch_size
        if abs(jobs - orca_jobs) < abs(best[1] - orca_jobs):
            best = (mid, jobs)
        if jobs < orca_jobs:
            lo = mid
        else:
            hi = mid
    return best


def part1_cell(cell: Cell, orca_jobs: float = ORCA_JOBS) -> str:
    wl = cell.workload(A100_13B)
    blocks, orca_found = orca_sized_blocks(wl, orca_jobs)
    orca = sim(wl, blocks, "orca", "defer")
    fcfs = sim(wl, blocks, "fcfs", "recompute")
    fast = sim(wl, blocks, "skip-join-mlfq", "proactive")
    return _row([
        cell.name, blocks, f"{orca_found:.2f}",
        f"{orca.jct_mean:.2f}/{orca.jct_p99:.1f}", f"{fcfs.jct_mean:.2f}/{fcfs.jct_p99:.1f}",
        f"{fast.jct_mean:.2f}/{fast.jct_p99:.1f}",
        _ratio(orca.jct_mean, fast.jct_mean, 5.0), _ratio(orca.jct_p99, fast.jct_p99, 2.0),
        _ratio(fcfs.jct_mean, fast.jct_mean, 1.3), _share(fast),
    ])


PART1_HEADER = ["cell", "blocks", "orca jobs", "orca avg/p99 s", "fcfs+recompute avg/p99 s",
                "sj-mlfq+proactive avg/p99 s", "orca/sj avg (>=5)", "orca/sj p99 (>=2)",
                "fcfs/sj avg (>=1.3)", "swap wait"]


# -- part 2: 25% of peak demand -------------------------------------------------------------


def part2_cell(cell: Cell, variant: str, pool_variant: str | None = None,
               fraction: float = 0.25) -> str:
    """One row; `pool_variant` sizes the pool from that variant's peak instead (the same
    memory for both variants)."""
    wl = cell.workload(A100_13B)
    unlimited, blocks = _pool_of(wl, variant, fraction)
    if pool_variant not in (None, variant):
        blocks = _pool_of(wl, pool_variant, fraction)[1]
    r = {kv: sim(wl, blocks, "skip-join-mlfq", kv, variant)
         for kv in ("proactive", "reactive", "defer")}
    pro = r["proactive"]
    # The same with copies that take no time: what moving KV could give at best here.
    instant = sim(wl, blocks, "skip-join-mlfq", "proactive", variant,
                  dataclasses.replace(A100_13B, swap_bytes_per_s=math.inf))
    return _row([
        f"{variant:6s} {cell.name}" + (f" ({pool_variant}'s pool)" if pool_variant else ""),
        f"{blocks}/{unlimited.run.peak_kv_blocks}",
        f"{unlimited.jct_mean:.2f}", f"{pro.jct_mean:.2f}", f"{r['reactive'].jct_mean:.2f}",
        f"{r['defer'].jct_mean:.2f}",
        _ratio(r["defer"].jct_mean, pro.jct_mean, 2.0),
        _ratio(r["reactive"].jct_mean, pro.jct_mean, 1.3),
        _ratio(pro.jct_mean, unlimited.jct_mean, 1.2, at_most=True),
        f"{_share(pro)}/{_share(r['reactive'])}",
        f"{instant.jct_mean / unlimited.jct_mean:.2f}",
        f"{100 * unlimited.run.share_batch_kv_over(blocks):.0f}%",
        f"{r['defer'].jct_mean / unlimited.jct_mean:.2f}",
    ])


def _pool_of(wl: Sequence[WorkItem], variant: str, fraction: float = 0.25) -> tuple[Result, int]:
    """skip-join-mlfq + proactive with unlimited memory, and the pool of `fraction` of its
    peak KV (at least the largest job)."""
    unlimited = sim(wl, ample_blocks(wl, 16), "skip-join-mlfq", "proactive", variant)
    return unlimited, max(largest_job_blocks(wl), round(fraction * unlimited.run.peak_kv_blocks))


def _share(r: Result) -> str:
    return f"{100 * r.run.swap_wait_s / r.run.busy_s:.1f}%"


def part2_others_cell(cell: Cell, policies: Sequence[str]) -> str:
    """Other schedulers, each with proactive, on the robust pool of `part2_cell` (25% of
    the default skip-join-mlfq's unlimited peak): each one's average JCT there and over its
    own run with unlimited memory. What the memory costs a scheduler that knows the lengths
    (srpt-oracle) shows what no KV policy could avoid."""
    wl = cell.workload(A100_13B)
    sj_unlimited, blocks = _pool_of(wl, "robust")
    cells: list[object] = [cell.name, blocks]
    for policy in policies:
        tight = sim(wl, blocks, policy, "proactive").jct_mean
        unlimited = sj_unlimited.jct_mean if policy == "skip-join-mlfq" else sim(
            wl, ample_blocks(wl, 16), policy, "proactive").jct_mean
        cells.append(f"{tight:.2f} / {unlimited:.2f} ({tight / unlimited:.2f}x)")
    return _row(cells)


PART2_HEADER = ["variant cell", "blocks/peak", "unlimited s", "proactive s", "reactive s",
                "defer s", "defer/pro (>=2)", "reactive/pro (>=1.3)", "pro/unlimited (<=1.2)",
                "swap wait pro/rea", "pro with instant copies/unlimited",
                "unlimited's batches over the pool",
                "defer/unlimited (defer/pro's ceiling)"]


# -- part 3: the real engine ----------------------------------------------------------------


REAL_RATE = 30.0  # requests/s: heavy for this CPU


def real_workload(quick: bool, rate: float = REAL_RATE, n: int | None = None) -> list[WorkItem]:
    """Heavy-tailed (Zipf 1.2) and bursty (CV 4) arrivals."""
    n = n or (500 if quick else 1000)
    return zipf_workload(n, rate, 4.0, 1.2, 256, 1024, seed=0)


def run_engine(workload: Sequence[WorkItem], config: EngineConfig, seed: int = 0) -> tuple[
        list[JobTimes], KVTotals, float, float]:
    """The real `LLMEngine` on the wall clock, each job added at its arrival time (one thread,
    no HTTP or asyncio front end). Returns the jobs, the KV counters, the run's length and its
    iterations' measured time over what the engine's cost model predicts for them (how much
    slower each batch ran than its shape alone explains: a copy worker competing with the
    compute for the cores shows here, whatever the schedule did)."""
    from fastserve.engine.llm_engine import LLMEngine

    engine = LLMEngine(dataclasses.replace(
        config, model=dataclasses.replace(config.model, record_iterations=1 << 20)))
    prompts = random_prompts(workload, engine.arch.vocab_size, seed)
    jobs: list[JobTimes] = []
    start = time.monotonic()
    i = 0
    while i < len(workload) or engine.has_unfinished:
        now = time.monotonic()
        while i < len(workload) and start + workload[i].arrival_s <= now:
            w = workload[i]
            params = SamplingParams(max_tokens=w.output_len, temperature=0.0, ignore_eos=True)
            engine.add_request(prompts[i], params, f"job-{i}", arrival_s=start + w.arrival_s,
                               oracle_output_len=w.output_len)
            i += 1
        if not engine.has_unfinished:
            time.sleep(max(0.0, start + workload[i].arrival_s - time.monotonic()))
            continue
        jobs += [JobTimes.from_output(o) for o in engine.step() if o.finished]
    run_s = time.monotonic() - start
    stats = engine.stats()
    assert stats.scheduler.kv.num_free_blocks == stats.scheduler.kv.num_total_blocks, "device blocks leaked"
    assert stats.scheduler.kv.num_free_host_blocks == stats.scheduler.kv.num_total_host_blocks, "host blocks leaked"
    engine.runner.swapper.close()  # type: ignore[union-attr]
    assert engine.recorder is not None
    samples = engine.recorder.samples(cycle=False)
    cost = engine.scheduler.cost
    predicted = sum(cost.iteration_s(x.num_prefill_tokens, x.num_decodes, x.num_context_tokens,
                                     x.sum_prefill_sq) for x in samples)
    slowdown = sum(x.duration_s for x in samples) / predicted if predicted > 0 else math.nan
    return jobs, KVTotals.from_stats(stats.scheduler, stats.swap_wait_s), run_s, slowdown


def part3(variant: str, quick: bool, fixed_blocks: int | None = None, reps: int = 1,
          copy_workers: Sequence[str] = ("auto",), sim_profile: str | None = None,
          rate: float = REAL_RATE, num_requests: int | None = None,
          engine: dict[str, Any] | None = None, pool: int = 50_000) -> list[str]:
    """The real engine: the unlimited run sizes the pool, then each KV policy runs `reps`
    times, interleaved in an order that rotates each repetition (this machine is shared: a
    slow minute hits every policy alike). The ratios are of the medians, and paired: the
    median over repetitions of proactive's average JCT over each other policy's in the same
    repetition. With several `copy_workers`, proactive runs once per CPU copy mode in each
    repetition (`proactive/<mode>`); the first is the one the ratios use.
    With `sim_profile`, the simulator's prediction for the same workload and pool follows.
    `engine` overrides the engine's options (model, device, dtype, load_format: a GPU run);
    `pool` is the unlimited run's device pool and every run's host pool, in blocks."""
    wl = real_workload(quick, rate, num_requests)
    label = f"{variant} @{rate:g}/s"

    def config(kv_policy: str, blocks: int, worker: str = "auto") -> EngineConfig:
        return engine_config(policy="skip-join-mlfq", **mlfq_options(variant), kv_policy=kv_policy,
                             num_device_blocks=blocks, num_host_blocks=pool,
                             max_batch_size=BATCH, cpu_copy_worker=worker,
                             **{"dtype": "float32", **(engine or {})})

    rows = []
    jobs, kv, run_s, slow = run_engine(wl, config("proactive", pool))
    unlimited = compute_metrics(jobs, len(wl), kv)
    # NOTE: the peak moves from run to run (wall-clock timing changes the schedule), so
    # --real-blocks can pin the pool for comparisons across runs.
    blocks = fixed_blocks or max(largest_job_blocks(wl), round(0.25 * unlimited["peak_kv_blocks"]))
    rows.append(_real_row(label, "unlimited", pool, unlimited, run_s, slow))
    runs = [("proactive", w, "proactive" if len(copy_workers) == 1 else f"proactive/{w}")
            for w in copy_workers] + [("reactive", copy_workers[0], "reactive"),
                                      ("defer", copy_workers[0], "defer"),
                                      ("recompute", copy_workers[0], "recompute")]
    jct: dict[str, list[float]] = {name: [] for _, _, name in runs}
    for rep in range(reps):
        # The order rotates each repetition: no policy always runs first (a fresh host pool
        # to fault in after the pool-less `recompute`) or after the same one.
        for kv_policy, worker, name in runs[rep % len(runs):] + runs[:rep % len(runs)]:
            jobs, kv, run_s, slow = run_engine(wl, config(kv_policy, blocks, worker))
            m = compute_metrics(jobs, len(wl), kv)
            jct[name].append(m["jct_mean"])
            rows.append(_real_row(label, name, blocks, m, run_s, slow))
    med = {k: statistics.median(v) for k, v in jct.items()}
    pro = med[runs[0][2]]
    runs_text = "; ".join(f"{k} " + "/".join(f"{x:.2f}" for x in v) for k, v in jct.items())
    best = min(med[k] for k in ("defer", "reactive", "recompute"))
    rows.append(f"  {label}, medians of {reps}: proactive / best of defer, reactive, recompute "
                f"{_ratio(pro, best, 1.05, at_most=True)} (<= 1.05)")
    # Paired: each repetition's runs share its minutes of the machine, whose speed drifts by
    # tens of percent between them; the ratio within a repetition leaves that out.
    paired = {k: statistics.median(p / a for p, a in zip(jct[runs[0][2]], jct[k], strict=True))
              for k in ("defer", "reactive", "recompute")}
    worst = max(paired, key=lambda k: paired[k])
    rows.append(f"  {label}, paired (median over repetitions of proactive / the other in the same "
                f"repetition): " + ", ".join(f"/{k} {v:.2f}" for k, v in paired.items())
                + f"; against the best ({worst}) {_ratio(paired[worst], 1.0, 1.05, at_most=True)}"
                  " (<= 1.05)")
    rows.append(
        f"  {label}, medians of {reps}: defer/proactive {_ratio(med['defer'], pro, 2.0)}, "
        f"reactive/proactive {_ratio(med['reactive'], pro, 1.0)}, "
        f"proactive/unlimited {pro / unlimited['jct_mean']:.2f}, defer/unlimited (defer/pro's "
        f"ceiling) {med['defer'] / unlimited['jct_mean']:.2f} (avg JCT runs: {runs_text})"
    )
    if sim_profile:
        rows.append(_sim_of_part3(wl, variant, blocks, sim_profile, med, unlimited["jct_mean"],
                                  label, pool))
    return rows


def _sim_of_part3(wl: Sequence[WorkItem], variant: str, blocks: int, profile: str,
                  real: dict[str, float], real_unlimited: float, label: str,
                  unlimited: int = 50_000) -> str:
    """The simulator on part 3's workload and pool, with a profile of this machine (e.g.
    `fastserve profile --through-engine --num-threads 2`): its average JCT per KV policy
    beside the real medians."""
    cost = CostModel.from_json(profile)
    simulated = {}
    for name, kv_policy, pool in (("unlimited", "proactive", unlimited),
                                  ("proactive", "proactive", blocks),
                                  ("reactive", "reactive", blocks), ("defer", "defer", blocks)):
        config = engine_config(policy="skip-join-mlfq", **mlfq_options(variant), kv_policy=kv_policy,
                               max_batch_size=BATCH, dtype="float32", num_host_blocks=unlimited)
        simulated[name] = _result(simulate_run(wl, config, cost, pool), len(wl)).jct_mean
    real = {**real, "unlimited": real_unlimited}
    pairs = ", ".join(f"{k} {simulated[k]:.2f} vs {real[k]:.2f}" for k in simulated if k in real)
    return (f"  {label}, simulated with {Path(profile).name} vs real (avg JCT s): {pairs}; "
            f"simulated defer/proactive {simulated['defer'] / simulated['proactive']:.2f}, "
            f"defer/unlimited {simulated['defer'] / simulated['unlimited']:.2f}")


def _real_row(variant: str, name: str, blocks: int, m: dict[str, float], run_s: float,
              slowdown: float) -> str:
    return _row([
        variant, name, blocks, m["num_finished"], f"{m['jct_mean']:.2f}", f"{m['jct_p99']:.2f}",
        f"{run_s:.1f}", m["peak_kv_blocks"], m["swap_out_blocks"],
        f"{m['swap_wait_s']:.2f}", f"{100 * m['swap_wait_s'] / run_s:.2f}%", f"{slowdown:.2f}",
    ])


PART3_HEADER = ["variant", "kv policy", "blocks", "done", "avg JCT s", "p99 s", "run s",
                "peak blocks", "swap-out blocks", "swap_wait_s", "wait share",
                "iteration time / cost model"]


# -- output -----------------------------------------------------------------------------------


def _ratio(a: float, b: float, target: float, at_most: bool = False) -> str:
    r = a / b if b > 0 else math.inf
    ok = r <= target if at_most else r >= target
    return f"{r:.2f}{'' if ok else ' MISS'}"


def _row(cells: Sequence[object]) -> str:
    return " | ".join(str(c) for c in cells)


def _table(title: str, header: list[str], rows: list[str]) -> None:
    print(f"\n## {title}\n")
    print(_row(header))
    print(_row(["---"] * len(header)))
    for r in rows:
        print(r)
    sys.stdout.flush()


def _map(fn: Callable[..., str], args: Sequence[tuple[object, ...]], jobs: int) -> list[str]:
    if jobs <= 1:
        return [fn(*a) for a in args]
    with ProcessPoolExecutor(jobs) as pool:
        return list(pool.map(fn, *zip(*args, strict=True)))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--part", choices=("sim1", "sim2", "real", "all"), default="all")
    p.add_argument("--quick", action="store_true", help="fewer cells and requests")
    p.add_argument("--jobs", type=int, default=2, help="simulations run in parallel")
    p.add_argument("--variants", default="paper,robust",
                   help="MLFQ variants for parts 2 and 3, comma-separated: robust, paper, or "
                        "either with a fixed number of levels, e.g. robust:levels=4")
    p.add_argument("--others", default="skip-join-mlfq,gittins,srpt-oracle",
                   help="part 2: schedulers run with proactive on the same pools, each against "
                        "its own unlimited run (empty: none)")
    p.add_argument("--reps", type=int, default=1,
                   help="part 3: runs per KV policy, interleaved; ratios of the medians, and "
                        "the medians of the ratios within a repetition")
    p.add_argument("--copy-workers", default="auto",
                   help="part 3: CPU copy modes for proactive (auto, thread, inline), "
                        "comma-separated to run each side by side")
    p.add_argument("--orca-jobs", type=float, default=ORCA_JOBS,
                   help="part 1: size the pool so that Orca runs this many jobs at once on "
                        "average (the issue: 3-4; default %(default)s)")
    p.add_argument("--seeds", default="0",
                   help="parts 1 and 2: workload seeds, comma-separated (each cell runs on each)")
    p.add_argument("--sim-profile", default=None,
                   help="part 3: also simulate its workload and pool with this profile of the "
                        "machine (e.g. from `fastserve profile --through-engine --num-threads 2`)")
    p.add_argument("--real-rates", default=str(REAL_RATE),
                   help="part 3: arrival rates (requests/s), comma-separated; each runs in turn")
    p.add_argument("--real-requests", type=int, default=None,
                   help="part 3's number of requests (default 1000, --quick 500)")
    p.add_argument("--real-blocks", type=int, default=None,
                   help="part 3's device pool (default: 25%% of the unlimited run's peak)")
    p.add_argument("--real-model", default=None,
                   help="part 3's checkpoint (default: tiny; a preset name such as llama-2-7b "
                   "is made without weights and served with --load-format dummy)")
    p.add_argument("--real-device", default="cpu", help="part 3's device: cpu or cuda")
    p.add_argument("--real-dtype", default="float32")
    p.add_argument("--real-pool-gib", type=float, default=None,
                   help="part 3's unlimited device pool and host pool, in GiB of this model's "
                   "KV blocks (default: 50,000 blocks, which a 7B model's KV is far past "
                   "any GPU's memory)")
    args = p.parse_args()
    thetas = (1.2,) if args.quick else (0.9, 1.2, 1.5)
    cvs = (4.0,) if args.quick else (1.0, 4.0, 8.0)
    n = 500 if args.quick else 1000
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    seeds = [int(x) for x in args.seeds.split(",")]
    rates = [float(x) for x in args.real_rates.split(",")]
    t0 = time.time()
    if args.part in ("sim1", "all"):
        cells = [Cell(th, cv, 0.9, n, s) for th in thetas for cv in cvs for s in seeds]
        _table(f"1. The paper's setting: sim, A100 13B profile, Orca admits ~{args.orca_jobs:g} "
               "jobs at once", PART1_HEADER,
               _map(part1_cell, [(c, args.orca_jobs) for c in cells], args.jobs))
    if args.part in ("sim2", "all"):
        shapes = [(1.2, 4.0, 1.0)] if args.quick else [
            (1.2, 4.0, 1.0), (1.2, 4.0, 0.9), (1.2, 8.0, 0.9), (0.9, 4.0, 0.9), (1.5, 4.0, 0.9),
        ]
        cells = [Cell(th, cv, load, n, s) for th, cv, load in shapes for s in seeds]
        work: list[tuple[Cell, str, str | None]] = [(c, v, None) for v in variants for c in cells]
        if {"robust", "paper"} <= set(variants):  # both variants on the same memory too
            work += [(c, "robust", "paper") for c in cells]
        _table("2. Device KV at 25% of the peak demand: sim, A100 13B profile, skip-join-mlfq",
               PART2_HEADER, _map(part2_cell, work, args.jobs))
        others = [x.strip() for x in args.others.split(",") if x.strip()]
        if others:
            _table("2b. Other schedulers with proactive on the robust pools: avg JCT s, that "
                   "pool / unlimited memory", ["cell", "blocks", *others],
                   _map(part2_others_cell, [(c, others) for c in cells], args.jobs))
    if args.part in ("real", "all"):
        import torch

        torch.set_num_threads(2)
        workers = [w.strip() for w in args.copy_workers.split(",") if w.strip()]
        engine = _real_engine(args.real_model, args.real_device, args.real_dtype)
        pool = _pool_blocks(engine, args.real_pool_gib) if args.real_pool_gib else 50_000
        rows = [row for v in variants
                for rate in rates
                for row in part3(v, args.quick, args.real_blocks, args.reps, workers,
                                 args.sim_profile, rate, args.real_requests, engine, pool)]
        _table(f"3. Real engine, {args.real_device}, {args.real_model or 'tiny'} "
               f"({args.real_dtype}), 25% of peak KV, Zipf 1.2 / CV 4", PART3_HEADER, rows)
    print(f"\n({time.time() - t0:.0f} s)")


def _real_engine(model: str | None, device: str, dtype: str) -> dict[str, Any]:
    """Part 3's engine options: a checkpoint directory, or a preset made into the cache (the
    production shapes without weights, served with random weights made on the device)."""
    from fastserve.model.make_model import PRESETS, cached_model_path

    options: dict[str, Any] = {"device": device, "dtype": dtype}
    if model in PRESETS:
        path = cached_model_path(model)
        options["load_format"] = "auto" if any(path.glob("*.safetensors")) else "dummy"
        model = str(path)
    if model is not None:
        options["model"] = model
    return options


def _pool_blocks(engine: dict[str, Any], gib: float) -> int:
    """KV blocks of 16 tokens in `gib` GiB for part 3's model (the tiny preset by default)."""
    import torch

    from fastserve.executor.model_runner import kv_block_bytes
    from fastserve.model.loader import read_arch_config
    from fastserve.model.make_model import cached_model_path

    path = Path(engine["model"]) if "model" in engine else cached_model_path("tiny")
    block = kv_block_bytes(read_arch_config(path), 16, getattr(torch, engine["dtype"]))
    return int(gib * (1 << 30)) // block


if __name__ == "__main__":
    main()
