"""Benchmark reports: readable tables, the results JSON and JCT-vs-parameter plots."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

Results = Mapping[str, Mapping[str, float]]  # policy -> metric -> value

_COLUMNS = (
    ("jct_mean", "avg JCT s"),
    ("jct_p50", "p50 s"),
    ("jct_p90", "p90 s"),
    ("jct_p99", "p99 s"),
    ("ttft_mean", "avg TTFT s"),
    ("ttft_p99", "p99 TTFT s"),
    ("output_tok_per_s", "tok/s"),
    ("num_finished", "done"),
    ("preemptions", "preempt"),
)


def format_table(results: Results) -> str:
    """One row per policy, one column per metric."""
    header = ["policy"] + [title for _, title in _COLUMNS]
    rows = [[policy] + [_fmt(m[key]) for key, _ in _COLUMNS] for policy, m in results.items()]
    return _render(header, rows)


def format_sweep_table(param: str, sweep: Mapping[str, Results], metric: str = "jct_mean") -> str:
    """One row per swept value, one column per policy."""
    policies = list(next(iter(sweep.values()), {}))
    rows = [[value] + [_fmt(res[p][metric]) for p in policies] for value, res in sweep.items()]
    return _render([f"{param} \\ {metric}"] + policies, rows)


def write_json(path: str | Path, data: Mapping[str, Any]) -> None:
    """Strict JSON: NaN (a statistic without data) becomes null."""
    Path(path).write_text(json.dumps(_nan_to_none(data), indent=2) + "\n")


# The two JCT statistics every plot shows side by side: a policy that cuts the mean by starving
# long jobs shows it in the tail.
_PLOTTED = (("jct_mean", "average JCT (s)"), ("jct_p99", "p99 JCT (s)"))


def plot_sweep(path: str | Path, param: str, sweep: Mapping[str, Results], title: str = "") -> None:
    """Average and p99 JCT of each policy against the swept parameter (the paper's figure
    style), one panel each."""
    plt = require_pyplot()

    values = list(sweep)
    xs = [float(v) for v in values]
    fig, axes = plt.subplots(1, len(_PLOTTED), figsize=(9.0, 3.6))
    for ax, (key, label) in zip(axes, _PLOTTED, strict=True):
        for policy in next(iter(sweep.values()), {}):
            ax.plot(xs, [sweep[v][policy][key] for v in values], marker="o", label=policy)
        ax.set_xlabel(param)
        ax.set_ylabel(label)
        ax.grid(True, alpha=0.3)
    axes[0].legend(fontsize="small")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_bars(path: str | Path, results: Results, title: str = "") -> None:
    """Average and p99 JCT per policy (one workload, no sweep), one panel each."""
    plt = require_pyplot()

    fig, axes = plt.subplots(1, len(_PLOTTED), figsize=(9.0, 3.6))
    for ax, (key, label) in zip(axes, _PLOTTED, strict=True):
        ax.bar(list(results), [m[key] for m in results.values()])
        ax.set_ylabel(label)
        ax.tick_params(axis="x", labelrotation=20)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def require_pyplot() -> Any:
    """matplotlib's pyplot on the file-only Agg backend; matplotlib is the `plot` extra, which
    serving does not need."""
    try:
        import matplotlib
    except ImportError:
        raise ValueError("--plot needs matplotlib, which is not installed: "
                         "pip install 'fastserve-mlfq[plot]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _fmt(x: float) -> str:
    if isinstance(x, int):
        return str(x)
    if math.isnan(x):
        return "-"
    return f"{x:.4g}" if abs(x) < 1e5 else f"{x:.3e}"


def _render(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(str(c).rjust(w) if i else str(c).ljust(w) for i, (c, w) in
                       enumerate(zip(row, widths, strict=True))) for row in [header, *rows]]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _nan_to_none(x: Any) -> Any:
    if isinstance(x, float) and math.isnan(x):
        return None
    if isinstance(x, Mapping):
        return {k: _nan_to_none(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_nan_to_none(v) for v in x]
    return x
