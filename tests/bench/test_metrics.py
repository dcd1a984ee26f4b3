"""Metrics over hand-made jobs."""

from __future__ import annotations

import math

import pytest

from fastserve.bench.metrics import METRIC_KEYS, JobTimes, compute_metrics
from fastserve.request import FinishReason, Request, RequestOutput, SamplingParams


def test_metrics_of_hand_made_jobs() -> None:
    jobs = [
        # arrival, first token, finish, tokens, preemptions
        JobTimes(0.0, 0.5, 2.0, 10, 0),
        JobTimes(1.0, 1.5, 5.0, 20, 2),
        JobTimes(2.0, 4.0, 6.0, 30, 1),
        JobTimes(3.0, None, None, 0, 0, is_ok=False),  # aborted: submitted, not finished
    ]
    m = compute_metrics(jobs)
    assert set(m) == set(METRIC_KEYS)
    assert m["num_requests"] == 4 and m["num_finished"] == 3
    # JCTs 2, 4, 4; TTFTs 0.5, 0.5, 2.
    assert m["jct_mean"] == pytest.approx(10 / 3)
    assert m["jct_p50"] == pytest.approx(4.0)
    assert m["jct_p99"] == pytest.approx(4.0)
    assert m["jct_p90"] == pytest.approx(4.0)
    assert m["ttft_mean"] == pytest.approx(1.0)
    assert m["ttft_p99"] == pytest.approx(1.97)
    assert m["makespan_s"] == pytest.approx(6.0)
    assert m["output_tok_per_s"] == pytest.approx(60 / 6.0)
    assert m["preemptions"] == 3


def test_percentiles_interpolate() -> None:
    jobs = [JobTimes(0.0, 0.1, float(i), 1, 0) for i in range(1, 101)]
    m = compute_metrics(jobs, num_requests=100)
    assert m["jct_p50"] == pytest.approx(50.5)
    assert m["jct_p90"] == pytest.approx(90.1)
    assert m["jct_p99"] == pytest.approx(99.01)


def test_no_finished_jobs_gives_nan_not_an_error() -> None:
    m = compute_metrics([JobTimes(0.0, None, None, 0, 0, is_ok=False)])
    assert m["num_finished"] == 0 and math.isnan(m["jct_mean"]) and m["makespan_s"] == 0.0


def test_jobs_from_requests_and_outputs() -> None:
    req = Request("r", [1, 2, 3], SamplingParams(max_tokens=2), arrival_s=1.0)
    req.output_token_ids = [7, 8]
    req.first_token_s, req.finish_s, req.num_preemptions = 1.5, 3.0, 1
    req.finish_reason = FinishReason.LENGTH
    assert JobTimes.from_request(req) == JobTimes(1.0, 1.5, 3.0, 2, 1, True)
    req.finish_reason = FinishReason.ERROR
    assert not JobTimes.from_request(req).is_ok

    out = RequestOutput("r", None, [1], [5, 6, 7], "", True, "length", 2.0, 2.5, 4.0,
                        num_preemptions=3)
    assert JobTimes.from_output(out) == JobTimes(2.0, 2.5, 4.0, 3, 3, True)
