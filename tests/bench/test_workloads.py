"""Workloads: Zipf/Gamma statistics, trace parsing and its errors, load scaling."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from fastserve.bench.workloads import (
    WorkItem,
    client_max_tokens,
    job_work_s,
    offered_load,
    scale_to_load,
    trace_workload,
    zipf_workload,
)
from fastserve.core.cost_model import CostModel

AZURE = Path("/work/shared/traces/azure_conv_2023.csv")


def _zipf(**kw: object) -> list[WorkItem]:
    args: dict[str, object] = dict(num_requests=2000, rate=4.0, cv=1.0, theta=1.0,
                                   max_input_len=512, max_output_len=256, seed=0)
    args.update(kw)
    return zipf_workload(**args)  # type: ignore[arg-type]


@pytest.mark.parametrize("rate,cv", [(4.0, 1.0), (0.5, 2.0), (10.0, 4.0)])
def test_gamma_arrivals_have_the_asked_rate_and_cv(rate: float, cv: float) -> None:
    wl = _zipf(num_requests=40_000, rate=rate, cv=cv)
    gaps = np.diff([w.arrival_s for w in wl])
    assert wl[0].arrival_s == 0.0
    assert (gaps >= 0).all()
    assert 1 / gaps.mean() == pytest.approx(rate, rel=0.05)
    assert gaps.std() / gaps.mean() == pytest.approx(cv, rel=0.1)


def test_zipf_lengths_stay_in_bounds_and_skew_grows_with_theta() -> None:
    medians, ones = [], []
    for theta in (0.6, 0.9, 1.2, 1.5):
        wl = _zipf(theta=theta, num_requests=5000)
        ins = np.array([w.input_len for w in wl])
        outs = np.array([w.output_len for w in wl])
        assert ins.min() >= 1 and ins.max() <= 512
        assert outs.min() >= 1 and outs.max() <= 256
        medians.append(np.median(outs))
        ones.append((outs == 1).mean())
    assert medians == sorted(medians, reverse=True) and medians[0] > 4 * medians[-1]
    assert ones == sorted(ones)
    # Bounded Zipf reaches its maximum: the tail is there.
    assert max(w.output_len for w in _zipf(theta=0.6)) > 200


def test_zipf_is_deterministic_per_seed() -> None:
    assert _zipf(seed=3) == _zipf(seed=3)
    assert _zipf(seed=3) != _zipf(seed=4)


@pytest.mark.parametrize(
    "kw,name",
    [
        ({"rate": 0}, "rate"),
        ({"rate": -1.0}, "rate"),
        ({"cv": 0}, "cv"),
        ({"theta": -0.5}, "theta"),
        ({"max_input_len": 0}, "max_input_len"),
        ({"max_output_len": 0}, "max_output_len"),
        ({"num_requests": 0}, "num_requests"),
    ],
)
def test_zipf_rejects_bad_parameters_by_name(kw: dict[str, object], name: str) -> None:
    with pytest.raises(ValueError, match=name):
        _zipf(**kw)


# -- traces ------------------------------------------------------------------------------------


def _csv(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "trace.csv"
    p.write_text(text)
    return p


def test_trace_window_count_and_scaling(tmp_path: Path) -> None:
    p = _csv(tmp_path, "arrival_s,input_tokens,output_tokens\n"
                       "0,100,10\n1.5,200,20\n3,300,30\n4.5,4000,3\n\n")
    assert trace_workload(p) == [
        WorkItem(0.0, 100, 10), WorkItem(1.5, 200, 20), WorkItem(3.0, 300, 30),
        WorkItem(4.5, 4000, 3),
    ]
    wl = trace_workload(p, window_start_s=1.0, window_s=3.0, time_scale=2.0, length_scale=0.5,
                        max_input_len=120)
    # Times restart at the window start; lengths are scaled, kept >= 1 and capped.
    assert wl == [WorkItem(1.0, 100, 10), WorkItem(4.0, 120, 15)]
    assert len(trace_workload(p, num_requests=2)) == 2
    assert trace_workload(p, length_scale=0.1)[3] == WorkItem(4.5, 400, 1)


def test_trace_rows_are_sorted_by_arrival(tmp_path: Path) -> None:
    p = _csv(tmp_path, "arrival_s,input_tokens,output_tokens\n2,1,1\n0,2,2\n1,3,3\n")
    assert [w.input_len for w in trace_workload(p)] == [2, 3, 1]


@pytest.mark.parametrize(
    "text,message",
    [
        ("a,b,c\n0,1,1\n", "line 1: header must be arrival_s,input_tokens,output_tokens"),
        ("", "header"),
        ("arrival_s,input_tokens,output_tokens\n0,1,1\n1,x,1\n", "line 3: field input_tokens is not a number: 'x'"),
        ("arrival_s,input_tokens,output_tokens\n0,1,-2\n", "line 2: field output_tokens must be a finite value >= 0"),
        ("arrival_s,input_tokens,output_tokens\n-1,1,1\n", "line 2: field arrival_s"),
        ("arrival_s,input_tokens,output_tokens\n0,1.5,1\n", "line 2: field input_tokens must be a whole number"),
        ("arrival_s,input_tokens,output_tokens\n0,1\n", "line 2: expected 3 fields, got 2"),
        ("arrival_s,input_tokens,output_tokens\n0,1,nan\n", "line 2: field output_tokens"),
    ],
)
def test_malformed_traces_name_the_line_and_field(tmp_path: Path, text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        trace_workload(_csv(tmp_path, text))


def test_trace_option_errors(tmp_path: Path) -> None:
    p = _csv(tmp_path, "arrival_s,input_tokens,output_tokens\n0,1,1\n")
    with pytest.raises(ValueError, match="trace file not found"):
        trace_workload(tmp_path / "missing.csv")
    with pytest.raises(ValueError, match="no requests in the window"):
        trace_workload(p, window_start_s=10)
    for kw, name in [({"time_scale": 0}, "time_scale"), ({"length_scale": -1}, "length_scale"),
                     ({"window_s": 0}, "window_s"), ({"num_requests": 0}, "num_requests"),
                     ({"max_input_len": 0}, "max_input_len"), ({"window_start_s": -1}, "window_start_s")]:
        with pytest.raises(ValueError, match=name):
            trace_workload(p, **kw)  # type: ignore[arg-type]


@pytest.mark.skipif(not AZURE.is_file(), reason="the Azure trace is not here")
def test_the_azure_trace_parses() -> None:
    wl = trace_workload(AZURE)
    assert len(wl) == 19366
    assert wl[-1].arrival_s == pytest.approx(3502, abs=1)
    window = trace_workload(AZURE, window_start_s=600, window_s=300)
    assert window[0].arrival_s >= 0 and window[-1].arrival_s < 300


# -- load -------------------------------------------------------------------------------------


def test_scale_to_load_hits_the_target_and_keeps_lengths() -> None:
    cost = CostModel(fixed_s=10e-3, per_prefill_token_s=5e-5, per_decode_s=1e-4,
                     per_context_token_s=2e-7)
    wl = _zipf()
    for load in (0.5, 0.95, 1.1):
        scaled = scale_to_load(wl, load, cost, max_batch_size=16)
        assert offered_load(scaled, cost, 16) == pytest.approx(load)
        assert [(w.input_len, w.output_len) for w in scaled] == [(w.input_len, w.output_len) for w in wl]
    # Higher load = arrivals closer together.
    assert scale_to_load(wl, 0.9, cost, 16)[-1].arrival_s < scale_to_load(wl, 0.5, cost, 16)[-1].arrival_s
    with pytest.raises(ValueError, match="load"):
        scale_to_load(wl, 0, cost, 16)
    with pytest.raises(ValueError, match="at least 2 requests"):
        scale_to_load(wl[:1], 0.5, cost, 16)


# Profiles live at the repository root; the shipped 175B one is FastServe's own deployment.
GPT3_175B = Path(__file__).resolve().parents[2] / "profiles" / "gpt3-175b_16xA100_tp8_pp2.json"


def _served_until(workload: list[WorkItem], cost: CostModel) -> tuple[float, float]:
    """(last finish, busiest pipeline stage's busy time) of FCFS at batch 16 in the simulator."""
    from fastserve.args import engine_config
    from fastserve.sim.simulator import ample_blocks, simulate_run

    run = simulate_run(workload, engine_config(max_batch_size=16, policy="fcfs"), cost,
                       ample_blocks(workload, 16))
    return max(r.finish_s for r in run.finished if r.finish_s is not None), run.stage_busy_s


def test_capacity_counts_tensor_and_pipeline_parallelism() -> None:
    # A burst of equal jobs keeps the 175B pipeline (8-way TP x 2 stages) saturated: the work
    # `job_work_s` counts must take about as long as the simulator takes to serve it (one
    # device's coefficients would count 16x too much work per job).
    cost = CostModel.from_json(GPT3_175B)
    burst = [WorkItem(0.0, 256, 256) for _ in range(160)]
    finish_s, busy_s = _served_until(burst, cost)
    work_s = sum(job_work_s(w, cost, 16) for w in burst)
    assert 0.85 < work_s / finish_s <= 1.0
    assert busy_s / finish_s > 0.9


def test_load_on_the_175b_profile_is_the_pipelines_load() -> None:
    # Poisson arrivals at load 0.9 are served as they come (the last job is done soon after
    # it arrives; the busiest stage works ~90-100% of the time, more than 0.9 only because
    # part-full batches cost nearly what full ones do); at 1.3 the backlog grows.
    cost = CostModel.from_json(GPT3_175B)
    rng = np.random.default_rng(0)
    base = [WorkItem(float(t), 128, 128) for t in np.cumsum(rng.exponential(1.0, 300))]
    at = {}
    for load in (0.9, 1.3):
        wl = scale_to_load(base, load, cost, 16)
        finish_s, busy_s = _served_until(wl, cost)
        at[load] = (finish_s / wl[-1].arrival_s, busy_s / wl[-1].arrival_s)
    assert at[0.9][0] < 1.15 and 0.85 < at[0.9][1] <= 1.0
    assert at[1.3][0] > 1.3


# -- max_tokens as clients send it -----------------------------------------------------------


def _sim(workload: list[WorkItem], policy: str, blocks: int | None = None) -> list:
    from fastserve.args import engine_config
    from fastserve.sim.simulator import ample_blocks, simulate_run

    cost = CostModel(fixed_s=10e-3, per_prefill_token_s=5e-5, per_decode_s=1e-4,
                     per_context_token_s=2e-7)
    config = engine_config(max_batch_size=8, policy=policy, kv_policy="defer")
    return simulate_run(workload, config, cost, blocks or ample_blocks(workload, 16)).finished


def test_client_caps_are_at_or_above_the_true_length() -> None:
    wl = _zipf(num_requests=400)
    pow2 = client_max_tokens(wl, "pow2", 256)
    assert all(w.max_tokens is not None and w.max_tokens >= w.output_len for w in pow2)
    assert all(w.max_tokens & (w.max_tokens - 1) == 0 for w in pow2 if w.max_tokens)
    assert any(w.max_tokens and w.max_tokens >= 2 * w.output_len for w in pow2)
    assert {w.max_tokens for w in client_max_tokens(wl, "max", 256)} == {256}
    assert client_max_tokens(wl, "length", 256) == wl
    with pytest.raises(ValueError, match="max_tokens mode"):
        client_max_tokens(wl, "guess", 256)


def test_capped_jobs_stop_at_their_length_and_cost_orca_its_reservations() -> None:
    wl = scale_to_load(_zipf(num_requests=120, max_input_len=64, max_output_len=128), 0.9,
                       CostModel(fixed_s=10e-3, per_prefill_token_s=5e-5, per_decode_s=1e-4,
                                 per_context_token_s=2e-7), 8)
    capped = client_max_tokens(wl, "max", 512)
    # The simulated model ends each answer at its true length, below the cap: the same
    # schedule as when max_tokens is the length, with ample KV.
    exact, free = _sim(wl, "fcfs"), _sim(capped, "fcfs")
    assert sorted(r.num_output_tokens for r in free) == sorted(w.output_len for w in wl)
    assert [r.finish_s for r in free] == [r.finish_s for r in exact]
    assert {r.finish_reason.value for r in free} == {"stop"}
    # Orca reserves prompt + max_tokens: with a pool of 8 jobs' worth of true lengths it
    # admits far fewer capped jobs at once, and they finish later.
    blocks = 8 * (64 + 128) // 16
    mean = lambda rs: sum(r.finish_s - r.arrival_s for r in rs) / len(rs)  # noqa: E731
    assert mean(_sim(capped, "orca", blocks)) > 1.3 * mean(_sim(wl, "orca", blocks))
