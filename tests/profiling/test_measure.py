"""The profiler: timing grid, cost-model fit and the per-model cache."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from fastserve.core.cost_model import CostModel
from fastserve.core.plan import ExecutorOutput, SchedulerOutput
from fastserve.profiling.cache import load_or_profile, profile_engine
from fastserve.profiling.fit import FEATURES, Sample, fit_cost_model
from fastserve.profiling.measure import ProfileGrid

TRUE = CostModel(fixed_s=2e-3, per_prefill_token_s=4e-5, per_prefill_token2_s=1e-8,
                 per_decode_s=3e-4, per_context_token_s=2e-7, per_prefill_context_token_s=5e-7)


@dataclass
class FakeRunner:
    """A runner whose iterations take exactly what `cost` says, on a fake clock."""

    cost: CostModel
    num_blocks: int = 4096
    block_size: int = 16
    block_bytes: int = 1234
    arch: SimpleNamespace = field(default_factory=lambda: SimpleNamespace(max_position_embeddings=2048))
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    now: float = 0.0
    plans: list[SchedulerOutput] = field(default_factory=list)

    def clock(self) -> float:
        return self.now

    def execute(self, plan: SchedulerOutput) -> ExecutorOutput:
        self.plans.append(plan)
        for s in plan.scheduled:  # plans must be valid for the real runner too
            assert s.num_context_tokens <= len(s.block_ids) * self.block_size
            assert max(s.block_ids) < self.num_blocks
        if plan.is_empty:
            return ExecutorOutput([], 0.0)
        d = self.cost.iteration_s(*plan.shape)
        self.now += d
        return ExecutorOutput([0] * len(plan.scheduled), d)


def test_profile_recovers_the_cost_model() -> None:
    runner = FakeRunner(TRUE)
    cost = profile_engine(runner, ProfileGrid(), clock=runner.clock)  # type: ignore[arg-type]
    _assert_close(cost, TRUE)
    assert cost.kv_block_bytes == 1234
    # Sampler state of every profile request is dropped at the end.
    started = {s.request_id for p in runner.plans for s in p.scheduled}
    dropped = {rid for p in runner.plans for rid in p.finished_ids}
    assert started == dropped


def test_profile_finds_where_decodes_get_cheaper_per_job() -> None:
    """A CPU batches the weights' products more efficiently as decodes are added: the fit
    takes a knee where the timings bend, and keeps a straight line where they do not."""
    bent = CostModel(fixed_s=8e-4, per_prefill_token_s=8e-5, per_decode_s=3.2e-4,
                     per_context_token_s=5e-7, decode_knee=4, per_decode_beyond_knee_s=1.8e-4)
    runner = FakeRunner(bent)
    # Two timed batch sizes on each side of a knee (the start-up grid's 1, 4, 16 have not).
    sizes = ProfileGrid(decode_batches=tuple((b, c) for b in (1, 2, 4, 8, 16) for c in (16, 1024)))
    cost = profile_engine(runner, sizes, clock=runner.clock)  # type: ignore[arg-type]
    assert cost.decode_knee == 4
    assert cost.per_decode_s == pytest.approx(3.2e-4, rel=0.02)
    assert cost.per_decode_beyond_knee_s == pytest.approx(1.8e-4, rel=0.02)
    assert cost.iteration_s(0, 16, 4000) == pytest.approx(bent.iteration_s(0, 16, 4000), rel=0.01)
    # 16 decodes: 4 at the first slope, 12 at the second.
    assert bent.decodes_s(16) == pytest.approx(4 * 3.2e-4 + 12 * 1.8e-4)
    straight = FakeRunner(TRUE)
    assert profile_engine(straight, ProfileGrid(), clock=straight.clock).decode_knee == 0  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="decode_knees"):
        fit_cost_model([Sample(0, 0, 1, 10, 1e-3)] * 2, decode_knees=())


def test_a_knee_survives_the_profile_file(tmp_path: Path) -> None:
    bent = CostModel(per_decode_s=3e-4, decode_knee=8, per_decode_beyond_knee_s=1e-4)
    bent.to_json(tmp_path / "p.json")
    assert CostModel.from_json(tmp_path / "p.json") == bent
    with pytest.raises(ValueError, match="decode_knee"):
        CostModel(decode_knee=-1)


def test_the_time_budget_cuts_the_grid_but_keeps_enough_points() -> None:
    full, cut = FakeRunner(TRUE), FakeRunner(TRUE)
    profile_engine(full, ProfileGrid(), clock=full.clock)  # type: ignore[arg-type]
    cost = profile_engine(cut, ProfileGrid(time_budget_s=0.0), clock=cut.clock)  # type: ignore[arg-type]
    assert len(cut.plans) < len(full.plans) and cut.now < full.now / 2
    _assert_close(cost, TRUE)  # exact timings: even the shortest profile fits every term


def test_fit_drops_terms_that_noise_makes_negative() -> None:
    samples = [Sample(n, n * n, 0, 0, 1e-3 + 1e-5 * n) for n in (10, 100, 1000)]
    samples += [Sample(0, 0, b, b * 100, 1e-3 + 2e-4 * b) for b in (1, 8, 16)]
    samples.append(Sample(0, 0, 4, 4000, 1e-3 + 8e-4 - 1e-5))  # a little less than it should
    cost = fit_cost_model(samples)
    assert all(getattr(cost, f) >= 0 for f in FEATURES)
    assert cost.iteration_s(0, 8, 800) == pytest.approx(1e-3 + 8 * 2e-4, rel=0.05)
    with pytest.raises(ValueError, match="at least 2"):
        fit_cost_model(samples[:1])


def test_load_or_profile_caches_per_key(tmp_path: Path) -> None:
    runner = FakeRunner(TRUE)
    grid = ProfileGrid(time_budget_s=0.0)
    a = load_or_profile(runner, "model-a|float32|cpu", tmp_path, grid, clock=runner.clock)  # type: ignore[arg-type]
    n = len(runner.plans)
    assert load_or_profile(runner, "model-a|float32|cpu", tmp_path, grid, clock=runner.clock) == a  # type: ignore[arg-type]
    assert len(runner.plans) == n  # read from the cache, nothing run
    (path,) = tmp_path.glob("profile-*.json")
    path.write_text("{ not json")
    _assert_close(load_or_profile(runner, "model-a|float32|cpu", tmp_path, grid, clock=runner.clock), a)  # type: ignore[arg-type]
    assert len(runner.plans) > n  # profiled again
    load_or_profile(runner, "model-b|float32|cpu", tmp_path, grid, clock=runner.clock)  # type: ignore[arg-type]
    assert len(list(tmp_path.glob("profile-*.json"))) == 2
    _assert_close(CostModel.from_json(path), a)


def _assert_close(cost: CostModel, want: CostModel) -> None:
    for name in FEATURES:
        assert getattr(cost, name) == pytest.approx(getattr(want, name), rel=1e-6, abs=1e-12), name


def test_profile_of_the_real_tiny_model(tiny_model_path: Path, one_thread: None) -> None:
    from fastserve.args import engine_config
    from fastserve.profiling.fit import fit_error
    from fastserve.profiling.measure import build_runner, measure

    config = engine_config(model=str(tiny_model_path), num_device_blocks=64, warmup=False)
    runner, _ = build_runner(config)
    grid = ProfileGrid(prefill_lens=(8, 128, 32), decode_batches=((1, 16), (4, 64), (2, 128)),
                       decode_steps=2, repeats=1, time_budget_s=5.0, chunk_starts=(256, 512, 4096),
                       chunk_lens=(16, 64))
    samples = measure(runner, grid)
    # Chunks after 256 and 512 cached tokens (4096 is beyond the pool), prefills, decodes.
    assert len(samples) == 2 * 2 + 3 + 3 * 2
    assert [(s.num_prefill_tokens, s.num_prefill_context_tokens) for s in samples[:4]] == [
        (16, 256), (64, 256), (16, 512), (64, 512)]
    cost = fit_cost_model(samples, kv_block_bytes=runner.block_bytes)
    assert cost.kv_block_bytes == runner.block_bytes and cost.iteration_s(0, 1, 16) > 0
    assert cost.iteration_s(128, 0, 0, 128 * 128) > cost.iteration_s(8, 0, 0, 64)
    assert fit_error(cost, samples) < 1.0  # a loose bound: CI machines are noisy


def test_cache_keys_separate_what_changes_timings(tmp_path: Path) -> None:
    from fastserve.args import engine_config
    from fastserve.profiling.cache import profile_cache_key

    base = profile_cache_key(tmp_path, engine_config())
    assert profile_cache_key(tmp_path, engine_config()) == base
    for change in ({"dtype": "bfloat16"}, {"block_size": 32}, {"num_threads": 4},
                   {"tensor_parallel_size": 2}):
        assert profile_cache_key(tmp_path, engine_config(**change)) != base, change
