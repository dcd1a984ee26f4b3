"""Profiling through the whole engine: per-iteration records and the fit of noisy timings."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import numpy as np
import pytest

from fastserve.core.cost_model import CostModel
from fastserve.core.plan import ScheduledRequest, SchedulerOutput
from fastserve.profiling.fit import Sample, fit_cost_model, predict, total_ratio
from fastserve.profiling.recorder import CostModelCheck, IterationRecorder
from fastserve.request import SamplingParams

PARAMS = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def _plan(*shapes: tuple[int, int]) -> SchedulerOutput:
    """One scheduled request per (start_pos, num_tokens)."""
    return SchedulerOutput(scheduled=[
        ScheduledRequest(f"r{i}", [1] * n, pos, list(range(8)), PARAMS, int(pos > 0))
        for i, (pos, n) in enumerate(shapes)
    ])


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_recorder_times_cycles_and_keeps_the_last_iterations() -> None:
    clock = FakeClock()
    rec = IterationRecorder(capacity=2, clock=clock)

    def step(plan: SchedulerOutput | None, step_s: float, gap_s: float, is_busy: bool) -> None:
        start = rec.begin()
        clock.now += step_s
        rec.end(start, plan, is_busy)
        clock.now += gap_s  # what the serving loop does before the next step (or idle time)

    step(_plan((0, 10), (0, 3)), 0.010, 0.002, is_busy=True)  # cycle = step + gap
    step(_plan((10, 1), (3, 1)), 0.004, 0.001, is_busy=True)
    step(_plan(), 0.001, 0.0, is_busy=True)  # no batch: not an iteration
    step(_plan((11, 1)), 0.003, 5.0, is_busy=False)  # then idle: the step alone

    samples = rec.samples()
    assert rec.num_recorded == 3
    # The ring keeps the last two; the second iteration's cycle runs into the empty step.
    assert [s.features for s in samples] == [[1, 0, 0, 2, 11 + 4, 0], [1, 0, 0, 1, 12, 0]]
    assert [s.duration_s for s in samples] == pytest.approx([0.004 + 0.001, 0.003])
    assert [s.duration_s for s in rec.samples(cycle=False)] == pytest.approx([0.004, 0.003])
    step(_plan((0, 5)), 0.002, 0.0, is_busy=True)  # not closed yet: reported as its step
    last = rec.samples()[-1]
    assert last.features == [1, 5, 25, 0, 0, 0] and last.duration_s == pytest.approx(0.002)
    # A chunk of 4 after 100 cached tokens: its pairs, and the context it reads.
    step(_plan((100, 4)), 0.002, 0.0, is_busy=True)
    assert rec.samples()[-1].features == [1, 4, 4 * 4 + 2 * 4 * 100, 0, 0, 100]
    rec.clear()
    assert rec.samples() == [] and rec.num_recorded == 0
    with pytest.raises(ValueError, match="capacity"):
        IterationRecorder(0)


def test_engine_records_one_sample_per_iteration(tiny_model_path: Path) -> None:
    from fastserve.args import engine_config
    from fastserve.engine.llm_engine import LLMEngine

    engine = LLMEngine(engine_config(model=str(tiny_model_path), warmup=False,
                                     startup_profile=False, record_iterations=1000,
                                     policy="fcfs", num_threads=1, num_device_blocks=256))
    prompts, outputs = [5, 9, 20], [3, 6, 4]
    for p, n in zip(prompts, outputs):
        engine.add_request([7] * p, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
    while engine.has_unfinished:
        engine.step()
    assert engine.recorder is not None
    samples = engine.recorder.samples()
    assert len(samples) == engine.core.num_iterations == max(outputs)
    # Iteration 0 prefills all three prompts; iteration k decodes, with context prompt + k
    # (the token fed this step included), every job that still has tokens to produce.
    assert samples[0] == Sample(sum(prompts), sum(p * p for p in prompts), 0, 0,
                                samples[0].duration_s, 0, engine.cost.iteration_s(
                                    sum(prompts), 0, 0, sum(p * p for p in prompts)))
    for k, s in enumerate(samples[1:], start=1):
        live = [p for p, n in zip(prompts, outputs) if n > k]
        assert (s.num_prefill_tokens, s.num_decodes, s.num_context_tokens) == (
            0, len(live), sum(p + k for p in live)), k
    assert all(s.duration_s > 0 for s in samples)


def test_engine_keeps_only_the_last_iteration_unless_asked(tiny_model_path: Path) -> None:
    from fastserve.args import engine_config
    from fastserve.engine.llm_engine import LLMEngine

    engine = LLMEngine(engine_config(model=str(tiny_model_path), warmup=False,
                                     startup_profile=False, num_device_blocks=256))
    engine.add_request([7] * 5, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    while engine.has_unfinished:
        engine.step()
    assert len(engine.recorder.samples()) == 1
    # ... but every iteration is scored against the cost model.
    assert engine.cost_check.num_iterations == engine.core.num_iterations == 6
    with pytest.raises(ValueError, match="record_iterations"):
        engine_config(record_iterations=-1)


def test_cost_model_check_follows_the_ratio_and_logs_a_drift(
    caplog: pytest.LogCaptureFixture
) -> None:
    cost = CostModel(fixed_s=1e-3, per_prefill_token_s=0.0, per_decode_s=1e-3,
                     per_context_token_s=0.0)
    check = CostModelCheck(cost, half_life=50, min_iterations=20)
    assert check.ratio == 1.0
    decode4 = Sample(0, 0, 4, 40, 5e-3)  # predicted 5 ms: exact
    for _ in range(100):
        check.add(decode4)
    assert check.ratio == pytest.approx(1.0) and not check.is_drifting
    assert not caplog.records
    # The machine slows down by a quarter: the recent ratio follows and the drift is logged.
    with caplog.at_level(logging.INFO, logger="fastserve.profiling.recorder"):
        for _ in range(300):
            check.add(Sample(0, 0, 4, 40, 6.25e-3))
        assert check.ratio == pytest.approx(0.8, abs=0.01) and check.is_drifting
        assert [r.levelname for r in caplog.records] == ["WARNING"]
        assert "cost model drift" in caplog.records[0].getMessage()  # logged as it crosses 10%
        for _ in range(300):  # and back
            check.add(decode4)
    assert not check.is_drifting and [r.levelname for r in caplog.records] == ["WARNING", "INFO"]


def test_calibration_rescales_the_model_in_force_to_follow_the_machine() -> None:
    cost = CostModel(fixed_s=1e-3, per_prefill_token_s=1e-5, per_decode_s=1e-3,
                     per_context_token_s=0.0, kv_block_bytes=1000, swap_bytes_per_s=1e6)
    told: list[CostModel] = []
    check = CostModelCheck(cost, half_life=50, min_iterations=20, calibrate=True,
                           on_calibrate=told.append)
    decode4 = Sample(0, 0, 4, 40, 5e-3)
    for _ in range(100):
        assert check.add(decode4) == pytest.approx(5e-3)
    assert check.scale == 1.0 and not told
    # The machine slows down by a quarter: the model in force follows within a few hundred
    # iterations, as one uniform scale; copies keep their measured bandwidth.
    predicted = [check.add(Sample(0, 0, 4, 40, 6.25e-3)) for _ in range(400)]
    assert check.scale == pytest.approx(1.25, rel=0.04)
    assert check.ratio == pytest.approx(0.8, abs=0.01)  # the profile itself is still off
    assert check.ratio_in_force == pytest.approx(1.0, abs=0.04)
    assert predicted[0] == pytest.approx(5e-3) and predicted[-1] == pytest.approx(6.25e-3, rel=0.04)
    assert told[-1] == cost.scaled(check.scale)
    assert told[-1].iteration_s(100, 4, 40) == pytest.approx(check.scale * cost.iteration_s(100, 4, 40))
    assert told[-1].swap_s(10) == cost.swap_s(10)
    assert told[-1].prefill_chunk(512, 4096) == cost.prefill_chunk(512, 4096)
    # Off: it only watches.
    watch = CostModelCheck(cost, half_life=50, min_iterations=20)
    for _ in range(400):
        assert watch.add(Sample(0, 0, 4, 40, 6.25e-3)) == pytest.approx(5e-3)
    assert watch.scale == 1.0
    with pytest.raises(ValueError, match="scale factor"):
        cost.scaled(0.0)


def test_engine_started_on_a_wrong_profile_decides_with_a_calibrated_one(
    tiny_model_path: Path, one_thread: None, tmp_path: Path
) -> None:
    """A profile that makes every iteration 4x too cheap: within a few hundred iterations the
    engine's cost model (its scheduler's too) is the profile scaled to what its iterations
    take, and what the model in force predicted for the later ones adds up to their time."""
    from fastserve.args import engine_config
    from fastserve.engine.llm_engine import LLMEngine
    from fastserve.profiling.fit import in_force_ratio

    config = engine_config(model=str(tiny_model_path), warmup=False, startup_profile=False,
                           record_iterations=10_000, policy="skip-join-mlfq", num_threads=1,
                           kv_cache_gib=0.125)
    probe = LLMEngine(config)
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)

    def serve(engine: LLMEngine, rounds: int) -> None:
        for r in range(rounds):
            for i in range(8):
                engine.add_request([7 + i + r] * (4 + i), params)
            while engine.has_unfinished:
                engine.step()

    serve(probe, 2)
    true = fit_cost_model(probe.recorder.samples(), kv_block_bytes=probe.runner.block_bytes,
                          fit_mean=True)
    wrong = tmp_path / "wrong.json"
    true.scaled(0.25).to_json(wrong)
    engine = LLMEngine(dataclasses.replace(config, profile_path=str(wrong)))
    assert engine.cost == engine.startup_cost
    assert engine.cost.per_decode_s == pytest.approx(0.25 * true.per_decode_s)
    serve(engine, 12)
    check = engine.cost_check
    assert check.num_calibrations >= 1 and check.scale > 2.0
    assert engine.cost == engine.startup_cost.scaled(check.scale)
    assert engine.scheduler.cost is engine.cost
    later = engine.recorder.samples()[check.min_iterations * 2:]
    # Within 2x either way, from 4x off (uncalibrated, the later iterations would be 4-5x off).
    # NOTE: not tighter: the calibration follows the machine with a lag and the machine is
    # shared (1.35 was seen once in ~30 runs on an AVX2 EPYC, 1.51 once under CI on a Zen 4).
    assert 0.5 <= in_force_ratio(later) <= 2.0
    assert engine.stats().cost_model_scale == check.scale
    # Off: the engine decides with the profile as given, whatever its iterations take.
    fixed = LLMEngine(dataclasses.replace(
        config, profile_path=str(wrong),
        model=dataclasses.replace(config.model, calibrate_cost_model=False)))
    serve(fixed, 3)
    assert fixed.cost == fixed.startup_cost and fixed.cost_check.scale == 1.0


@pytest.mark.timeout(600)  # it profiles afresh
def test_startup_profile_predicts_whole_engine_iterations(
    tiny_model_path: Path, one_thread: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A fresh start-up profile adds the engine's own work per iteration to the executor's
    fit and caches the sum, so that it predicts the engine's whole iterations (the executor's
    fit alone missed about half of each on this model)."""
    from fastserve.args import engine_config
    from fastserve.engine.llm_engine import LLMEngine
    from fastserve.profiling.cache import cached_profile_path, profile_cache_key

    monkeypatch.setenv("FASTSERVE_CACHE", str(tmp_path))
    config = engine_config(model=str(tiny_model_path), num_threads=1, policy="fcfs",
                           record_iterations=10_000)
    engine = LLMEngine(config)
    path = cached_profile_path(profile_cache_key(tiny_model_path, engine.config),
                               tmp_path / "profiles")  # the config as the engine resolved it
    assert CostModel.from_json(path) == engine.cost
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    for i in range(24):
        engine.add_request([7 + i] * (4 + i), params)
    while engine.has_unfinished:
        engine.step()
    samples = engine.recorder.samples()
    # NOTE: no bound on the ratio itself: on the shared machine the load during the start-up
    # profile and during these iterations differ (benchmarks/scheduling/sim_vs_real.py measures it).
    assert engine.cost_check.num_iterations == engine.core.num_iterations
    assert engine.cost_check.ratio == pytest.approx(total_ratio(engine.cost, samples), rel=0.2)


TRUE = CostModel(fixed_s=1e-3, per_prefill_token_s=1e-4, per_decode_s=3e-4,
                 per_context_token_s=1e-6)


def _noisy_samples(n: int, seed: int) -> list[Sample]:
    """Iterations whose times carry right-skewed noise (other processes only ever add time)."""
    rng = np.random.default_rng(seed)
    samples = []
    for _ in range(n):
        if rng.random() < 0.1:
            pre, dec, ctx = int(rng.integers(4, 512)), 0, 0
        else:
            pre, dec = 0, int(rng.integers(1, 17))
            ctx = dec * int(rng.integers(16, 1500))
        t = TRUE.iteration_s(pre, dec, ctx, pre * pre) * rng.lognormal(0.0, 0.6)
        samples.append(Sample(pre, pre * pre, dec, ctx, t))
    return samples


def test_fit_mean_adds_up_to_the_measured_total() -> None:
    train, held_out = _noisy_samples(3000, seed=0), _noisy_samples(3000, seed=1)
    fit = fit_cost_model(train, fit_mean=True)
    assert total_ratio(fit, train) == pytest.approx(1, rel=1e-9)  # its own total, exactly
    assert total_ratio(fit, held_out) == pytest.approx(1, abs=0.05)
    # Weighting by the measured times fits below the mean: the simulator would run fast.
    assert total_ratio(fit_cost_model(train), held_out) < 0.9


STALL = 3.0  # an iteration this many times over both models' predictions was stalled


def test_through_engine_fit_predicts_engine_iterations_better(
    tiny_model_path: Path, one_thread: None
) -> None:
    """Cross-fitted on the engine's recorded iterations (each half predicted by the fit of the
    other): within 10% of the measured total, and no worse than the executor-only grid profile,
    which misses the engine's own work."""
    from fastserve.args import engine_config
    from fastserve.bench.through_engine import EngineLoad, measure_through_engine
    from fastserve.profiling.measure import ProfileGrid, build_runner, measure

    config = engine_config(model=str(tiny_model_path), num_threads=1, num_device_blocks=512)
    load = EngineLoad(batch_sizes=(8, 1, 4), max_prompt_len=128, max_output_len=64,
                      time_budget_s=3.0)
    samples, block_bytes = measure_through_engine(config, load)
    assert len(samples) > 50 and block_bytes > 0

    runner, _ = build_runner(config)
    grid = ProfileGrid(prefill_lens=(8, 128, 32), decode_batches=((1, 16), (8, 64), (4, 128)),
                       repeats=2, time_budget_s=3.0)
    executor_fit = fit_cost_model(measure(runner, grid))

    # Iterations the machine stalled (over 3x what either model predicts: another process had
    # the cores) are left out of both the fits and the score: one such stall moved a total by
    # 30%.
    whole_fit = fit_cost_model(samples, fit_mean=True)
    kept = [s for s in samples
            if s.duration_s <= STALL * max(predict(whole_fit, s), predict(executor_fit, s))]
    assert len(kept) >= 0.95 * len(samples)
    # A random split: every other iteration would not do, the engine's iterations come in
    # patterns (a prefill, then decodes), and such halves were seen 10% apart.
    order = np.random.default_rng(0).permutation(len(kept))
    halves = [kept[i] for i in order[0::2]], [kept[i] for i in order[1::2]]
    fits = [fit_cost_model(half, fit_mean=True) for half in halves]
    predicted = sum(predict(fits[1 - i], s) for i, half in enumerate(halves) for s in half)
    measured = sum(s.duration_s for s in kept)
    engine_err = abs(np.log(predicted / measured))
    executor_err = abs(np.log(total_ratio(executor_fit, kept)))
    # The engine's fit predicts the held-out iterations' total within 10% (seen: under 2%, on
    # a machine with another process busy). The executor-only grid usually under-predicts it
    # by 10-30% (the engine's own work per iteration), but on a quiet run it can land as close
    # (seen: 0.04-27%), so the comparison allows a small margin rather than a strict win.
    assert engine_err < np.log(1.10), (engine_err, executor_err)
    assert engine_err < executor_err + np.log(1.05), (engine_err, executor_err)


def test_run_real_reports_the_engines_counters_after_the_run(tiny_model_path: Path) -> None:
    # The engine goes at shutdown: its KV counters, recorded iterations and calibration
    # scale must be read before (they were read after, which raised AttributeError).
    import asyncio

    from fastserve.args import engine_config
    from fastserve.bench.metrics import KVTotals
    from fastserve.bench.runner import run_real
    from fastserve.request import WorkItem

    config = engine_config(model=str(tiny_model_path), warmup=False, startup_profile=False,
                           record_iterations=1000, policy="fcfs", num_threads=1,
                           num_device_blocks=256)
    workload = [WorkItem(0.0, 5, 3), WorkItem(0.0, 9, 6)]
    kv: list[KVTotals] = []
    iterations: list[list[Sample]] = []
    scale: list[float] = []
    jobs = asyncio.run(run_real(workload, config, kv_out=kv, iterations_out=iterations,
                                scale_out=scale))
    assert [j.num_output_tokens for j in jobs] == [3, 6]
    assert kv[0].peak_kv_blocks > 0
    assert len(iterations[0]) == 6  # one prefill iteration, then five decodes
    assert scale[0] > 0
