"""The multi-replica simulator, the recorded-trace replay and the bench's fleet option."""

from __future__ import annotations

import argparse
import json
import random
from collections import Counter
from pathlib import Path

import pytest

from fastserve.args import engine_config
from fastserve.bench.cli import add_bench_parser, run_bench
from fastserve.bench.workloads import zipf_workload
from fastserve.core.cost_model import CostModel
from fastserve.fleet import make_router
from fastserve.fleet.trace import RecordingRouter, load_trace, replay
from fastserve.request import WorkItem
from fastserve.sim.fleet import simulate_fleet
from fastserve.sim.simulator import simulate_run

REPO = Path(__file__).resolve().parents[2]
COST = CostModel(fixed_s=10e-3, per_prefill_token_s=5e-5, per_decode_s=1e-4,
                 per_context_token_s=2e-7)
CONFIG = engine_config(policy="skip-join-mlfq", max_batch_size=8)


def conversations(n: int) -> list[WorkItem]:
    """Multi-turn jobs: turn k of conversation c repeats its first k blocks (Mooncake-like)."""
    items = []
    for i in range(n):
        conv, turn = i % 9, i // 9
        ids = tuple(conv * 100 + k for k in range(turn + 2))
        items.append(WorkItem(arrival_s=0.02 * i, input_len=32 * len(ids) - 5,
                              output_len=3 + (i * 13) % 40, hash_ids=ids, block_tokens=32))
    return items


def test_one_replica_fleet_serves_exactly_as_the_simulator() -> None:
    work = zipf_workload(120, rate=40.0, cv=2.0, theta=1.1, max_input_len=200,
                         max_output_len=120, seed=4)
    single = simulate_run(work, CONFIG, COST, 4000)
    fleet = simulate_fleet(work, CONFIG, COST, 1, make_router("fastserve"), 4000)
    times = {r.request_id: (r.first_token_s, r.finish_s) for r in single.finished}
    assert {r.request_id: (r.first_token_s, r.finish_s) for r in fleet.finished} == times
    assert fleet.num_unfinished == 0 and set(fleet.placements.values()) == {"replica-0"}


@pytest.mark.parametrize("name", ["fastserve", "pow2", "prefix-affinity", "round-robin"])
def test_every_router_serves_every_job_on_a_fleet(name: str) -> None:
    work = conversations(60)
    run = simulate_fleet(work, CONFIG, COST, 4, make_router(name, seed=2), 2000)
    assert run.num_unfinished == 0 and len(run.finished) == 60
    assert all(r.finish_s is not None and r.finish_s > r.arrival_s for r in run.finished)
    assert len(set(run.placements.values())) > 1
    assert run.num_stats > 4


def test_prefix_aware_routers_keep_conversations_where_their_prefix_is() -> None:
    work = conversations(70)
    hit = {name: simulate_fleet(work, CONFIG, COST, 4, make_router(name, seed=0), 2000)
           for name in ("prefix-affinity", "fastserve", "round-robin")}
    rate = {k: r.prefix_hit_tokens / r.prefix_query_tokens for k, r in hit.items()}
    assert rate["prefix-affinity"] > rate["round-robin"] + 0.2
    # NOTE: fastserve also weighs each replica's queue: over these 70 jobs on 4 replicas it
    # caches 0.42 of prompt tokens (0.47 with near-ratio=0: a conversation's first turn then
    # goes to the busier replica whose prediction is lower by a hair), round robin 0.27.
    assert rate["fastserve"] > rate["round-robin"] + 0.1


@pytest.mark.parametrize("seed", [1, 2])
def test_a_burst_of_like_requests_is_split_evenly(seed: int) -> None:
    """Issue 60's burst, small: like requests (100 tokens out, prompts of 64-127 tokens, so
    they skip-join different levels) all at once on two replicas of this machine's measured
    profile. Split as predicted-work noise says, one replica gets a few more, runs its last
    jobs in a batch of a few, and the burst ends later; split evenly, it does not."""
    cost = CostModel(**json.loads((REPO / "profiles" / "cpu-tiny-2threads-quiet.json")
                                  .read_text())["cost_model"])
    config = engine_config(policy="skip-join-mlfq", max_batch_size=16, warmup=False)
    rng = random.Random(seed)
    work = [WorkItem(0.01 * i, rng.randint(64, 127), 100) for i in range(8)]  # warm-up
    work += [WorkItem(5.0, rng.randint(64, 127), 100) for _ in range(64)]
    ends = {}
    for spec in ("fastserve", "fastserve:near-ratio=0"):
        run = simulate_fleet(work, config, cost, 2, make_router(spec), 4000, stats_period_s=0.5)
        split = sorted(Counter(run.placements.values()).values())
        ends[spec] = max(r.finish_s for r in run.finished if r.finish_s is not None) - 5.0
        assert (split == [36, 36]) == (spec == "fastserve"), (spec, split)
    assert ends["fastserve:near-ratio=0"] > 1.15 * ends["fastserve"]


def test_recorded_trace_replays_to_the_simulators_placements(tmp_path: Path) -> None:
    work = conversations(50)
    for spec in ("fastserve", "pow2"):
        recorder = RecordingRouter(make_router(spec, seed=5), spec)
        run = simulate_fleet(work, CONFIG, COST, 3, recorder, 2000, stats_period_s=0.05)
        path = tmp_path / f"{spec}.json"
        recorder.write(path)
        trace = load_trace(path)
        sent = {e["request_id"]: e["replica_id"] for e in trace["events"]
                if e["event"] == "sent"}
        assert sent == run.placements  # the trace holds the simulator's decisions
        assert replay(trace) == []  # and a fresh router fed the same inputs makes them again
        # A replica reporting other state gives other placements: the replay compares.
        changed = json.loads(path.read_text())
        for ev in changed["events"]:
            if ev["event"] == "stats" and ev["stats"]["replica_id"] == "replica-0":
                ev["stats"]["num_requests"] += 50
                ev["stats"]["queued_work_s"] = [w + 5.0 for w in ev["stats"]["queued_work_s"]]
        assert replay(changed) != []


def test_bench_runs_each_router_on_a_fleet(tmp_path: Path) -> None:
    profile, out, trace = tmp_path / "p.json", tmp_path / "r.json", tmp_path / "t.json"
    COST.to_json(profile)
    parser = argparse.ArgumentParser()
    add_bench_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args([
        "bench", "--executor", "sim", "--profile", str(profile), "--policies", "skip-join-mlfq",
        "--replicas", "3", "--router", "fastserve,pow2", "--num-requests", "90", "--cv", "4",
        "--load", "0.9", "--out", str(out), "--record-trace", str(trace)])
    assert run_bench(args) == 0
    data = json.loads(out.read_text())
    assert list(data["results"]) == ["fastserve", "pow2"]
    assert all(m["num_finished"] == 90 for m in data["results"].values())
    assert data["config"]["replicas"] == 3 and data["config"]["offered_load"] == pytest.approx(2.7)
    assert replay(load_trace(trace)) == []
    args.executor = "real"
    with pytest.raises(ValueError, match="--executor sim"):
        run_bench(args)
