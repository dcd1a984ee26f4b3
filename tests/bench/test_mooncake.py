"""Mooncake traces: shared prefixes from hash ids, scaled, replayed by the simulator with the
production prefix cache."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from fastserve.args import engine_config
from fastserve.bench.workloads import (
    mooncake_workload,
    scale_to_load,
    unbounded_cache_prompt_tokens,
)
from fastserve.core.cost_model import CostModel
from fastserve.prompts import prompt_tokens
from fastserve.sim.simulator import ample_blocks, simulate_run

COST = CostModel(fixed_s=1e-3, per_prefill_token_s=1e-5, per_decode_s=1e-4,
                 per_context_token_s=1e-8, per_prefill_token2_s=1e-9)


def _trace(tmp_path: Path) -> Path:
    rows = [  # three conversations, each turn repeating the one before; and a one-off
        {"timestamp": 0, "input_length": 1100, "output_length": 40, "hash_ids": [0, 1, 2]},
        {"timestamp": 500, "input_length": 900, "output_length": 20, "hash_ids": [10, 11]},
        {"timestamp": 1500, "input_length": 1600, "output_length": 30, "hash_ids": [0, 1, 2, 3]},
        {"timestamp": 2000, "input_length": 700, "output_length": 10, "hash_ids": [20, 21]},
        {"timestamp": 2500, "input_length": 1400, "output_length": 30, "hash_ids": [10, 11, 12]},
        {"timestamp": 3000, "input_length": 2100, "output_length": 16,
         "hash_ids": [0, 1, 2, 3, 4]},
    ]
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_equal_hash_ids_give_equal_tokens_at_a_scaled_size(tmp_path: Path) -> None:
    work = mooncake_workload(_trace(tmp_path), time_scale=2.0, token_scale=16)
    assert [w.input_len for w in work] == [69, 56, 100, 44, 88, 131]  # 1100/16 = 68.75 -> 69
    assert work[1].arrival_s == 1.0 and work[0].block_tokens == 32
    tokens = prompt_tokens(work, 4096, seed=0)
    assert [len(t) for t in tokens] == [w.input_len for w in work]
    assert tokens[2][:69] == tokens[0][:69]  # blocks 0, 1 and the first 5 tokens of 2
    assert tokens[5][:100] == tokens[2]
    assert tokens[4][:56] == tokens[1]
    assert tokens[3][:32] != tokens[1][:32]
    # Unbounded cache, 16-token blocks: job 2 skips the 4 of job 0 (64 tokens), job 4 the 3
    # of job 1 (48), job 5 the 6 of job 2 (96).
    computed = unbounded_cache_prompt_tokens(tokens, block_size=16)
    assert computed == sum(w.input_len for w in work) - 64 - 48 - 96
    with pytest.raises(ValueError, match="token_scale must divide 512"):
        mooncake_workload(_trace(tmp_path), token_scale=3)


def test_simulated_prefix_cache_computes_what_an_unbounded_cache_would(tmp_path: Path) -> None:
    work = mooncake_workload(_trace(tmp_path), time_scale=3.0, token_scale=16)
    blocks = ample_blocks(work, 16)
    on = simulate_run(work, engine_config(num_device_blocks=blocks), COST, blocks)
    off = simulate_run(work, engine_config(num_device_blocks=blocks,
                                           enable_prefix_caching=False), COST, blocks)
    assert off.computed_prompt_tokens == sum(w.input_len for w in work)
    tokens = prompt_tokens(work, 32000, seed=0)
    assert on.computed_prompt_tokens == unbounded_cache_prompt_tokens(tokens, 16)
    assert [r.num_output_tokens for r in on.finished] == [r.num_output_tokens for r in off.finished]
    mean_ttft = lambda run: sum(r.first_token_s - r.arrival_s for r in run.finished) / 6  # noqa: E731
    assert mean_ttft(on) < mean_ttft(off)


def test_the_host_tier_recovers_hits_a_small_device_pool_loses(tmp_path: Path) -> None:
    work = mooncake_workload(_trace(tmp_path), time_scale=3.0, token_scale=16)
    blocks = 12  # the largest job (131 + 1 tokens) needs 9 blocks of 16
    device_only = simulate_run(work, engine_config(num_device_blocks=blocks, num_host_blocks=0,
                                                   kv_policy="recompute"), COST, blocks)
    with_host = simulate_run(work, engine_config(num_device_blocks=blocks, num_host_blocks=64),
                             COST, blocks)
    assert with_host.prefix_host_hit_tokens > 0
    assert with_host.prefix_hit_tokens > device_only.prefix_hit_tokens
    assert [r.num_output_tokens for r in with_host.finished] == \
        [r.num_output_tokens for r in device_only.finished]


def test_proactive_uploads_a_waiting_jobs_host_tier_prefix_ahead_of_its_turn() -> None:
    """Jobs wait (two at a time, arrivals three times the capacity) on a pool that evicts
    their prefixes to the host: the proactive policy uploads them while the jobs wait."""
    trace = Path(__file__).resolve().parents[3] / "shared" / "traces" / "mooncake_synthetic.jsonl"
    if not trace.is_file():
        pytest.skip("the shared Mooncake trace is not here")
    work = mooncake_workload(trace, token_scale=32, sample_conversations=64)
    work = scale_to_load(work, 3.0, COST, 2)
    config = engine_config(num_device_blocks=300, num_host_blocks=20000, max_batch_size=2,
                           max_num_batched_tokens=512)
    run = simulate_run(work, config, COST, 300)
    assert len(run.finished) == len(work)
    assert run.prefix_prefetched_tokens > 0
    assert [r.num_output_tokens for r in run.finished] == \
        [r.params.max_tokens for r in run.finished]
    # Where copies hold up the iteration (a CPU), nothing is fetched early: a job's host-tier
    # prefix is uploaded when it starts, and the hits are still there.
    inline = simulate_run(work, config, dataclasses.replace(COST, copies_overlap=False), 300)
    assert inline.prefix_prefetched_tokens == 0
    assert inline.prefix_host_hit_tokens > 0
    assert inline.prefix_hit_tokens >= 0.9 * run.prefix_hit_tokens
    assert [r.num_output_tokens for r in inline.finished] == \
        [r.params.max_tokens for r in inline.finished]
