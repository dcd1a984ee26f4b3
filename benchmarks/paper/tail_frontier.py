"""Can any order meet both of issue 56's lines in a cell, even knowing every job's length?

The lines (benchmarks/paper/tail_grid.py): p99 JCT <= FCFS's, and mean JCT <= 1.25 x that of
SRPT with known lengths (`srpt-oracle`). srpt-oracle has the best mean and FCFS meets the p99
line by definition, so the question is whether an order between them meets both. Two
clairvoyant families span srpt-oracle to FCFS with one knob each (the options
`age_weight` and `urgent_after_s`, fastserve/core/policies/keyed_order.py):

  - oracle+age w: key = remaining time alone - w x age (w = 0: srpt-oracle; large: FCFS);
  - oracle+urgent f: a job whose age plus its remaining time alone reaches f x FCFS's p99 in
    the cell runs in arrival order ahead of the rest (f large: srpt-oracle; small: FCFS).

A cell where no knob value of either family meets both lines cannot meet them with this
knowledge: the mean's gain and the tail's bound conflict there. The same two rules on the
non-clairvoyant `gittins` order (which ranks by the lengths of finished jobs; urgency by age
alone) are the candidate for a default, and the default (skip-join-mlfq) is run beside them.
Two more families, run only when named in --families, are the default with a
non-clairvoyant urgency bound (fastserve/core/policies/fcfs_deadline.py): a job whose
expected finish, were it to start only now, passes its arrival plus a factor times its own
estimated FCFS time (default+deadline, `--mlfq-fcfs-deadline`) or times the estimated p99
of finished jobs' FCFS times (default+fcfs-p99, `--mlfq-fcfs-p99`) runs ahead of the rest.

For each cell (simulator, batch 16, ample KV, one workload, as tail_grid.py) it prints FCFS's
p99, srpt-oracle's mean, and per family the best knob value (the lowest mean among those
meeting the p99 line, FCFS itself included; "met" if that mean is also within 1.25x of the
oracle's), then counts.

    .venv/bin/python benchmarks/paper/tail_frontier.py [--num-requests 500] [--jobs 2]
        [--loads 0.5,0.95 --cvs 1,8 --thetas 0.9,1.5] [--out F.json --md F.md --plot F.png]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from concurrent.futures import Future, ProcessPoolExecutor
from pathlib import Path

from tail_grid import (
    DEFAULT,
    FCFS,
    MAX_MEAN_VS_ORACLE,
    MAX_P99_VS_FCFS,
    ORACLE,
    PROFILES,
    Cell,
    grid,
    run_one,
)

GITTINS = "gittins"
WEIGHTS = (0.3, 1.0, 3.0, 10.0)
FRACTIONS = (0.3, 0.5, 0.6, 0.7, 0.85, 1.0)
DEADLINE_FACTORS = (0.8, 1.0, 1.25, 1.5, 2.0)
P99_FACTORS = (0.6, 0.8, 1.0)
# (family name, base policy, knob): each family's members are the base with one knob value.
FAMILIES = (("oracle+age", ORACLE, "age-weight"), ("oracle+urgent", ORACLE, "urgent-after-s"),
            ("gittins+age", GITTINS, "age-weight"), ("gittins+urgent", GITTINS, "urgent-after-s"),
            ("default+deadline", DEFAULT, "mlfq-fcfs-deadline"),
            ("default+fcfs-p99", DEFAULT, "mlfq-fcfs-p99"))
Result = dict[str, float]


def members(base: str, knob: str, fcfs_p99: float, weights: tuple[float, ...] = WEIGHTS,
            fractions: tuple[float, ...] = FRACTIONS,
            factors: tuple[float, ...] = DEADLINE_FACTORS,
            p99_factors: tuple[float, ...] = P99_FACTORS) -> list[tuple[float, str]]:
    """(knob value as reported, policy spec) of one family in a cell: age weights and the
    default's estimated-FCFS factors as they are, urgency bounds as fractions of FCFS's p99
    there (measured: the clairvoyant families)."""
    if knob == "age-weight":
        return [(w, f"{base}:age-weight={w:g}") for w in weights]
    if knob == "mlfq-fcfs-deadline":
        return [(f, f"{base}:mlfq-fcfs-deadline={f:g}") for f in factors]
    if knob == "mlfq-fcfs-p99":
        return [(f, f"{base}:mlfq-fcfs-p99={f:g}") for f in p99_factors]
    return [(f, f"{base}:urgent-after-s={f * fcfs_p99:.6g}") for f in fractions]


def families(names: list[str]) -> tuple[tuple[str, str, str], ...]:
    return tuple(f for f in FAMILIES if f[0] in names)


def best(fam: list[tuple[float, Result]], fcfs: Result, oracle: Result,
         base: Result) -> tuple[str, float, float, bool]:
    """(knob, p99 / FCFS's, mean / oracle's, met) of the member with the lowest mean among
    those meeting the p99 line. The family's ends count: the base policy as knob "0" and FCFS
    itself (which always meets the p99 line) as "fcfs"."""
    options = [("0", base), *((f"{k:g}", r) for k, r in fam), ("fcfs", fcfs)]
    ok = [o for o in options if o[1]["jct_p99"] <= MAX_P99_VS_FCFS * fcfs["jct_p99"]]
    knob, r = min(ok, key=lambda o: o[1]["jct_mean"])
    p99 = r["jct_p99"] / fcfs["jct_p99"]
    mean = r["jct_mean"] / oracle["jct_mean"]
    return knob, p99, mean, mean <= MAX_MEAN_VS_ORACLE


Specs = dict[Cell, dict[str, list[tuple[float, str]]]]
Family = tuple[str, str, str]


def known_met(row: dict) -> bool:
    """Whether an oracle family met both lines in a cell's summary row."""
    return any(row[n][3] for n in ("oracle+age", "oracle+urgent") if n in row)


def summarize(cells: list[Cell], res: dict[Cell, dict[str, Result]], specs: Specs,
              fams: tuple[Family, ...]) -> dict[Cell, dict]:
    out: dict[Cell, dict] = {}
    for c in cells:
        r = res[c]
        f, o = r[FCFS], r[ORACLE]
        row: dict = {}
        for name, base, _ in fams:
            fam = [(k, r[s]) for k, s in specs[c][name]]
            row[name] = best(fam, f, o, r[base])
        d = r[DEFAULT]
        row["default"] = ("-", d["jct_p99"] / f["jct_p99"], d["jct_mean"] / o["jct_mean"],
                          d["jct_p99"] <= MAX_P99_VS_FCFS * f["jct_p99"]
                          and d["jct_mean"] <= MAX_MEAN_VS_ORACLE * o["jct_mean"])
        out[c] = row
    return out


def markdown(cells: list[Cell], res: dict[Cell, dict[str, Result]],
             summary: dict[Cell, dict], names: list[str]) -> str:
    fams = names
    head = ("| cell | FCFS p99 s | oracle mean s | oracle p99 / FCFS's | FCFS mean / oracle's | "
            + " | ".join(f"{n}: knob, p99/FCFS, mean/oracle" for n in fams)
            + " | default: p99/FCFS, mean/oracle | both lines with known lengths |")
    lines = [head, "|" + " --- |" * (7 + len(fams))]
    for c in cells:
        r, s = res[c], summary[c]
        f, o = r[FCFS], r[ORACLE]

        def cellfmt(t: tuple[str, float, float, bool], with_knob: bool = True) -> str:
            knob, p99, mean, met = t
            text = f"{knob}, {p99:.3f}, {mean:.2f}" if with_knob else f"{p99:.3f}, {mean:.2f}"
            return f"**{text}**" if met else text

        known = known_met(s)
        lines.append(
            f"| {c.profile} {c.load:g} / {c.cv:g} / {c.theta:g} | {f['jct_p99']:.1f} "
            f"| {o['jct_mean']:.2f} | {o['jct_p99'] / f['jct_p99']:.3f} "
            f"| {f['jct_mean'] / o['jct_mean']:.2f} | "
            + " | ".join(cellfmt(s[n]) for n in fams)
            + f" | {cellfmt(s['default'], False)} | {'met' if known else 'NOT met'} |")
    return "\n".join(lines) + "\n"


def members_markdown(cells: list[Cell], res: dict[Cell, dict[str, Result]], specs: Specs,
                     names: list[str]) -> str:
    """Per cell: every member's p99 over FCFS's and mean over srpt-oracle's, the default's
    first; bold where both lines are met."""
    cols = [("default", DEFAULT)] + [(f"{n} {k:g}", k) for n in names for k, _ in specs[cells[0]][n]]
    lines = ["| cell | FCFS p99 s | oracle mean s | " + " | ".join(c for c, _ in cols) + " |",
             "|" + " --- |" * (3 + len(cols))]
    for c in cells:
        r = res[c]
        f, o = r[FCFS], r[ORACLE]
        row = [DEFAULT] + [spec for n in names for _, spec in specs[c][n]]
        parts = []
        for spec in row:
            p99, mean = r[spec]["jct_p99"] / f["jct_p99"], r[spec]["jct_mean"] / o["jct_mean"]
            text = f"{p99:.3f}, {mean:.2f}"
            met = p99 <= MAX_P99_VS_FCFS and mean <= MAX_MEAN_VS_ORACLE
            parts.append(f"**{text}**" if met else text)
        lines.append(f"| {c.profile} {c.load:g} / {c.cv:g} / {c.theta:g} | {f['jct_p99']:.1f} "
                     f"| {o['jct_mean']:.2f} | " + " | ".join(parts) + " |")
    return "\n".join(lines) + "\n"


def plot(path: str, cells: list[Cell], res: dict[Cell, dict[str, Result]],
         specs: Specs) -> None:
    """Per profile: each cell's oracle families as curves of (mean / oracle's, p99 / FCFS's),
    from srpt-oracle to FCFS; the box where both lines are met."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    profiles = sorted({c.profile for c in cells})
    fig, axes = plt.subplots(1, len(profiles), figsize=(7 * len(profiles), 5.5), squeeze=False)
    for j, prof in enumerate(profiles):
        ax = axes[0][j]
        mine = [c for c in cells if c.profile == prof]
        for k, c in enumerate(mine):
            r = res[c]
            f, o = r[FCFS], r[ORACLE]
            color = f"C{k % 10}"
            for name, style in (("oracle+age", "-"), ("oracle+urgent", ":")):
                pts = [r[ORACLE], *(r[s] for _, s in specs[c][name]), f]
                xs = [p["jct_mean"] / o["jct_mean"] for p in pts]
                ys = [p["jct_p99"] / f["jct_p99"] for p in pts]
                ax.plot(xs, ys, style, marker=".", color=color,
                        label=f"{c.load:g}/{c.cv:g}/{c.theta:g}" if name == "oracle+age" else None)
            d = r[DEFAULT]
            ax.plot([d["jct_mean"] / o["jct_mean"]], [d["jct_p99"] / f["jct_p99"]], "x",
                    color=color, ms=8)
        ax.axvline(MAX_MEAN_VS_ORACLE, color="k", lw=0.8)
        ax.axhline(MAX_P99_VS_FCFS, color="k", lw=0.8)
        ax.set_xscale("log")
        ax.set_xlabel("mean JCT / srpt-oracle's (line: 1.25)")
        ax.set_ylabel("p99 JCT / FCFS's (line: 1.0)")
        ax.set_title(f"{prof}: known-length orders from srpt-oracle (left) to FCFS\n"
                     "solid: age weight, dotted: urgency bound, x: the default")
        ax.legend(fontsize=7, title="load / CV / theta", title_fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_best(path: str, cells: list[Cell], res: dict[Cell, dict[str, Result]],
              summary: dict[Cell, dict], names: list[str]) -> None:
    """Per profile, cell by cell: each family's lowest mean over the oracle's among the knob
    values that keep p99 <= FCFS's (FCFS itself included), FCFS's own, and the default's
    (filled where its p99 meets the line too)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    profiles = sorted({c.profile for c in cells})
    fig, axes = plt.subplots(len(profiles), 1, figsize=(14, 4 * len(profiles)), squeeze=False)
    for j, prof in enumerate(profiles):
        ax = axes[j][0]
        mine = [c for c in cells if c.profile == prof]
        xs = range(len(mine))
        ax.plot(xs, [res[c][FCFS]["jct_mean"] / res[c][ORACLE]["jct_mean"] for c in mine],
                "_", color="grey", ms=12, label="FCFS")
        for k, name in enumerate(names):
            ax.plot(xs, [summary[c][name][2] for c in mine], "o", mfc="none", color=f"C{k}",
                    label=f"{name}: best with p99 <= FCFS's")
        ok = [summary[c]["default"][1] <= MAX_P99_VS_FCFS for c in mine]
        ax.plot([x for x, o in zip(xs, ok, strict=True) if o],
                [summary[c]["default"][2] for c, o in zip(mine, ok, strict=True) if o],
                "x", color="k", label="default, p99 <= FCFS's")
        ax.plot([x for x, o in zip(xs, ok, strict=True) if not o],
                [summary[c]["default"][2] for c, o in zip(mine, ok, strict=True) if not o],
                "x", color="r", label="default, p99 > FCFS's")
        ax.axhline(MAX_MEAN_VS_ORACLE, color="k", lw=0.8)
        ax.set_yscale("log")
        ax.set_ylabel("mean JCT / srpt-oracle's")
        ax.set_xticks(list(xs))
        ax.set_xticklabels([f"{c.load:g}/{c.cv:g}/{c.theta:g}" for c in mine], rotation=90,
                           fontsize=7)
        ax.set_title(f"{prof}: the mean the p99 line costs with known lengths "
                     "(cells load/CV/theta; line: 1.25)")
        ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-requests", type=int, default=500, help="jobs per cell")
    ap.add_argument("--profiles", default=",".join(PROFILES))
    ap.add_argument("--loads", default="0.5,0.95")
    ap.add_argument("--cvs", default="1,8")
    ap.add_argument("--thetas", default="0.9,1.5")
    ap.add_argument("--jobs", type=int, default=2, help="worker processes")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--families", default=",".join(f[0] for f in FAMILIES[:4]),
                    help="comma-separated subset of " + ", ".join(f[0] for f in FAMILIES))
    ap.add_argument("--weights", default=",".join(f"{w:g}" for w in WEIGHTS),
                    help="the age weights tried")
    ap.add_argument("--fractions", default=",".join(f"{f:g}" for f in FRACTIONS),
                    help="the urgency bounds tried, as fractions of FCFS's p99 in the cell")
    ap.add_argument("--deadline-factors", default=",".join(f"{f:g}" for f in DEADLINE_FACTORS),
                    help="default+deadline: the factors of each job's estimated FCFS time "
                         "tried (--mlfq-fcfs-deadline)")
    ap.add_argument("--p99-factors", default=",".join(f"{f:g}" for f in P99_FACTORS),
                    help="default+fcfs-p99: the factors of the estimated FCFS p99 tried "
                         "(--mlfq-fcfs-p99)")
    ap.add_argument("--out", help="every run's metrics and the summary, JSON")
    ap.add_argument("--md", help="the per-cell table, markdown")
    ap.add_argument("--md-members", help="markdown: per cell, every family member's p99 over "
                                         "FCFS's and mean over srpt-oracle's, and the default's")
    ap.add_argument("--plot", help="PNG: per cell, the lowest mean over the oracle's that keeps "
                                   "p99 <= FCFS's, per family, and the default's")
    ap.add_argument("--plot-curves", help="PNG: the oracle families' curves per cell")
    ap.add_argument("--from-json", help="read the runs from this --out file instead of "
                                        "simulating (tables, counts and plots again)")
    args = ap.parse_args(argv)

    def floats(text: str) -> tuple[float, ...]:
        return tuple(float(x) for x in text.split(","))

    fams = families(args.families.split(","))
    if args.from_json:
        cells, res, specs = load(args.from_json)
        fams = families(list(specs[cells[0]]))
    else:
        cells = grid(args.profiles.split(","), floats(args.loads), floats(args.cvs),
                     floats(args.thetas))
        res, specs = simulate(args, cells, fams, floats(args.weights), floats(args.fractions),
                              floats(args.deadline_factors), floats(args.p99_factors))
    report(args, cells, res, specs, fams)
    return 0


def load(path: str) -> tuple[list[Cell], dict[Cell, dict[str, Result]], Specs]:
    rows = json.loads(Path(path).read_text())
    cells = [Cell(r["profile"], r["load"], r["cv"], r["theta"]) for r in rows]
    res = {c: r["results"] for c, r in zip(cells, rows, strict=True)}
    specs = {c: {name: [(k, spec) for k, spec in fam] for name, fam in r["specs"].items()}
             for c, r in zip(cells, rows, strict=True)}
    return cells, res, specs


def simulate(args: argparse.Namespace, cells: list[Cell], fams: tuple[Family, ...],
             weights: tuple[float, ...], fractions: tuple[float, ...],
             factors: tuple[float, ...] = DEADLINE_FACTORS,
             p99_factors: tuple[float, ...] = P99_FACTORS
             ) -> tuple[dict[Cell, dict[str, Result]], Specs]:
    start = time.perf_counter()
    res: dict[Cell, dict[str, Result]] = {c: {} for c in cells}
    specs: Specs = {}
    bases = [ORACLE, DEFAULT] + ([GITTINS] if any(b == GITTINS for _, b, _ in fams) else [])
    with ProcessPoolExecutor(max_workers=args.jobs) as pool:
        def run_all(jobs: list[tuple[Cell, str]]) -> None:
            futures: list[Future] = [pool.submit(run_one, c, p, args.num_requests, args.seed)
                                     for c, p in jobs]
            for fut in futures:
                cell, policy, metrics = fut.result()
                res[cell][policy] = metrics

        run_all([(c, FCFS) for c in cells])  # the urgency bounds are fractions of its p99
        jobs: list[tuple[Cell, str]] = []
        for c in cells:
            specs[c] = {name: members(base, knob, res[c][FCFS]["jct_p99"], weights, fractions,
                                      factors, p99_factors)
                        for name, base, knob in fams}
            jobs += [(c, p) for p in bases]
            jobs += [(c, s) for fam in specs[c].values() for _, s in fam]
        print(f"{len(cells)} cells, {1 + len(jobs) // len(cells)} simulations each, "
              f"{args.num_requests} jobs, {args.jobs} processes", flush=True)
        run_all(jobs)
    print(f"{len(cells) + len(jobs)} simulations in {time.perf_counter() - start:.0f} s\n")
    return res, specs


def report(args: argparse.Namespace, cells: list[Cell], res: dict[Cell, dict[str, Result]],
           specs: Specs, fams: tuple[Family, ...]) -> None:
    names = [name for name, _, _ in fams]
    bases = [ORACLE, DEFAULT] + ([GITTINS] if any(b == GITTINS for _, b, _ in fams) else [])
    summary = summarize(cells, res, specs, fams)
    for c in cells:
        r, s = res[c], summary[c]
        parts = [f"{c.name:36s} fcfs p99 {r[FCFS]['jct_p99']:6.1f}s oracle mean "
                 f"{r[ORACLE]['jct_mean']:6.2f}s p99/fcfs {r[ORACLE]['jct_p99'] / r[FCFS]['jct_p99']:.3f} |"]
        for name in [*names, "default"]:
            knob, p99, mean, met = s[name]
            parts.append(f"{name} {knob} {p99:.3f} {mean:.2f}{' MET' if met else ''} |")
        print(" ".join(parts))
    print()
    known = [c for c in cells if known_met(summary[c])]
    has_oracle = any(n.startswith("oracle+") for n in names)
    if has_oracle:
        print(f"both lines met with known lengths (an oracle family): {len(known)}/{len(cells)}")
    for name in [*names, "default"]:
        met = sum(summary[c][name][3] for c in cells)
        what = "the default itself" if name == "default" else "its best knob in each cell"
        print(f"  {name}, {what}: {met}/{len(cells)}")
    print("one knob value for every cell (p99 line, mean line, both):")
    for name in names:
        for k in range(len(specs[cells[0]][name])):
            value = specs[cells[0]][name][k][0]
            rs = [(res[c][specs[c][name][k][1]], res[c]) for c in cells]
            p99 = [m["jct_p99"] <= MAX_P99_VS_FCFS * r[FCFS]["jct_p99"] for m, r in rs]
            mean = [m["jct_mean"] <= MAX_MEAN_VS_ORACLE * r[ORACLE]["jct_mean"] for m, r in rs]
            print(f"  {name} {value:g}: {sum(p99)}, {sum(mean)}, "
                  f"{sum(a and b for a, b in zip(p99, mean, strict=True))} of {len(cells)}")
    for p in bases:
        p99 = [res[c][p]["jct_p99"] <= MAX_P99_VS_FCFS * res[c][FCFS]["jct_p99"] for c in cells]
        mean = [res[c][p]["jct_mean"] <= MAX_MEAN_VS_ORACLE * res[c][ORACLE]["jct_mean"]
                for c in cells]
        print(f"  {p}: {sum(p99)}, {sum(mean)}, "
              f"{sum(a and b for a, b in zip(p99, mean, strict=True))} of {len(cells)}")
    for c in cells:
        if has_oracle and c not in known:
            print(f"  not met with known lengths: {c.name}")
    if args.out:
        Path(args.out).write_text(json.dumps(
            [{"profile": c.profile, "load": c.load, "cv": c.cv, "theta": c.theta,
              "results": res[c], "specs": specs[c],
              "best": {k: list(v) for k, v in summary[c].items()}} for c in cells], indent=1))
    if args.md:
        Path(args.md).write_text(markdown(cells, res, summary, names))
    if args.md_members:
        Path(args.md_members).write_text(members_markdown(cells, res, specs, names))
    if args.plot:
        plot_best(args.plot, cells, res, summary, names)
    if args.plot_curves:
        plot(args.plot_curves, cells, res, specs)


if __name__ == "__main__":
    sys.exit(main())
