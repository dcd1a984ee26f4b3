"""`fastserve bench` end to end on the simulator."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import pytest

from fastserve.args import engine_config
from fastserve.bench.cli import add_bench_parser, run_bench
from fastserve.bench.metrics import METRIC_KEYS
from fastserve.bench.runner import policy_config
from fastserve.core.cost_model import CostModel


def bench(*argv: str) -> int:
    parser = argparse.ArgumentParser()
    add_bench_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["bench", *argv])
    return run_bench(args)


@pytest.fixture
def profile(tmp_path: Path) -> Path:
    p = tmp_path / "profile.json"
    CostModel(fixed_s=10e-3, per_prefill_token_s=5e-5, per_decode_s=1e-4,
              per_context_token_s=2e-7).to_json(p)
    return p


def test_bench_sim_writes_every_metric_per_policy(tmp_path: Path, profile: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "results.json"
    policies = "fcfs,orca,skip-join-mlfq,skip-join-mlfq:mlfq-variant=paper,srpt-oracle"
    assert bench("--executor", "sim", "--profile", str(profile), "--policies", policies,
                 "--num-requests", "150", "--cv", "4", "--zipf-theta", "1.2", "--load", "0.8",
                 "--max-batch-size", "8", "--seed", "3", "--out", str(out)) == 0
    data = json.loads(out.read_text())
    assert list(data["results"]) == policies.split(",")
    for metrics in data["results"].values():
        assert set(metrics) == set(METRIC_KEYS)
        assert metrics["num_requests"] == metrics["num_finished"] == 150
        assert metrics["jct_mean"] > 0 and metrics["jct_p99"] >= metrics["jct_p50"]
    cfg = data["config"]
    assert cfg["executor"] == "sim" and cfg["workload"]["load"] == 0.8
    assert cfg["workload"]["seed"] == 3 and cfg["engine"]["scheduler"]["max_batch_size"] == 8
    assert cfg["offered_load"] == pytest.approx(0.8)
    assert cfg["cost_model"]["fixed_s"] == 10e-3
    printed = capsys.readouterr().out
    assert "avg JCT s" in printed and "skip-join-mlfq:mlfq-variant=paper" in printed


def test_bench_sweep_writes_results_per_value_and_a_plot(tmp_path: Path, profile: Path,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    out, plot = tmp_path / "sweep.json", tmp_path / "sweep.png"
    assert bench("--profile", str(profile), "--policies", "fcfs,skip-join-mlfq",
                 "--num-requests", "100", "--sweep", "zipf-theta=0.9,1.5", "--load", "0.9",
                 "--out", str(out), "--plot", str(plot)) == 0
    data = json.loads(out.read_text())
    assert data["config"]["sweep"] == {"param": "zipf_theta", "values": ["0.9", "1.5"]}
    assert list(data["results"]) == ["0.9", "1.5"]
    assert set(data["results"]["1.5"]) == {"fcfs", "skip-join-mlfq"}
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "zipf_theta \\ jct_mean" in capsys.readouterr().out


def test_bench_replays_a_trace(tmp_path: Path) -> None:
    trace = tmp_path / "t.csv"
    trace.write_text("arrival_s,input_tokens,output_tokens\n"
                     + "".join(f"{i * 0.05},{10 + i},{1 + i % 7}\n" for i in range(40)))
    out = tmp_path / "r.json"
    assert bench("--workload", f"trace:{trace}", "--window-s", "1", "--policies", "fcfs",
                 "--out", str(out)) == 0
    assert json.loads(out.read_text())["results"]["fcfs"]["num_finished"] == 20


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--sweep", "colour=1,2"], "--sweep must be PARAM"),
        (["--policies", "fcfs,nope"], "nope"),
        (["--policies", "fcfs:colour=red"], "colour"),
        (["--rate", "0"], "rate must be > 0"),
        (["--max-output-len", "0"], "max_output_len must be an integer >= 1"),
        (["--workload", "poisson"], "workload must be 'zipf', 'mooncake:PATH' or 'trace:PATH'"),
        (["--load", "0.5", "--executor", "real"], "load needs a cost model"),
    ],
)
def test_bench_errors_name_the_bad_option(tmp_path: Path, argv: list[str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        bench(*argv, "--num-requests", "5", "--out", str(tmp_path / "x.json"))


def test_policy_specs_set_options() -> None:
    cfg = policy_config(engine_config(max_batch_size=4), "skip-join-mlfq:mlfq-variant=paper:quantum-ratio=4")
    assert cfg.scheduler.policy == "skip-join-mlfq"
    assert cfg.scheduler.mlfq_variant == "paper" and cfg.scheduler.quantum_ratio == 4
    assert cfg.scheduler.max_batch_size == 4


def test_bench_sim_defaults_show_the_scheduler_matters(tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    # No profile and no workload flags: the A100-13B model, heavy-tailed lengths and bursty
    # arrivals at load 0.9, where skip-join-mlfq's mean JCT is well below FCFS's (2.8x); the
    # ratio is printed.
    out = tmp_path / "r.json"
    assert bench("--out", str(out)) == 0
    data = json.loads(out.read_text())
    w = data["config"]["workload"]
    assert (w["cv"], w["zipf_theta"], w["load"], w["max_output_len"]) == (8.0, 1.2, 0.9, 2048)
    assert data["config"]["cost_model"]["fixed_s"] == 18e-3  # A100_13B
    r = data["results"]
    assert r["fcfs"]["jct_mean"] > 2 * r["skip-join-mlfq"]["jct_mean"]
    assert "fcfs / skip-join-mlfq: mean JCT" in capsys.readouterr().out
    # A flag given wins over the simulator's default; a rate given is not rescaled.
    assert bench("--num-requests", "50", "--cv", "1", "--rate", "3") == 0
    assert "over" in capsys.readouterr().out


def test_bench_fleet_plots_each_router(tmp_path: Path, profile: Path,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    out, plot = tmp_path / "fleet.json", tmp_path / "fleet.png"
    assert bench("--profile", str(profile), "--policies", "fcfs", "--replicas", "2",
                 "--router", "fastserve,pow2", "--num-requests", "40", "--load", "0.5",
                 "--out", str(out), "--plot", str(plot)) == 0
    assert set(json.loads(out.read_text())["results"]) == {"fastserve", "pow2"}
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"wrote {out} and {plot}" in capsys.readouterr().out


def test_bench_plot_without_matplotlib_is_refused_before_the_run(
        tmp_path: Path, profile: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # what an install without it imports
    out = tmp_path / "fleet.json"
    with pytest.raises(ValueError, match=r"--plot needs matplotlib.*fastserve-mlfq\[plot\]"):
        bench("--profile", str(profile), "--replicas", "2", "--num-requests", "20",
              "--out", str(out), "--plot", str(tmp_path / "x.png"))
    assert not out.exists()
