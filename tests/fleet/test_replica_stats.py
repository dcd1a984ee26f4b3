"""What a replica reports (`Scheduler.replica_stats`), built from real schedulers."""

from __future__ import annotations

import json

from fastserve.core.kv.prefix_cache import chain_block_hashes, extend_block_hashes
from fastserve.core.replica_stats import ReplicaStats
from fastserve.fleet import RouteRequest
from tests.fleet.factories import BLOCK_SIZE, Replica, prompt, request


def test_router_hashes_a_prompt_as_the_prefix_cache_does() -> None:
    tokens = prompt(1, 5 * BLOCK_SIZE + 3)
    for salt in (None, "tenant-a"):
        req = request("a", tokens, 4)
        req.cache_salt = salt
        assert chain_block_hashes(tokens, BLOCK_SIZE, salt) == extend_block_hashes(req, BLOCK_SIZE)
        assert len(RouteRequest.from_tokens("a", tokens, BLOCK_SIZE, salt).block_hashes) == 5
    assert chain_block_hashes(tokens, BLOCK_SIZE, "a") != chain_block_hashes(tokens, BLOCK_SIZE)


def test_snapshot_counts_requests_work_per_level_and_free_blocks() -> None:
    rep = Replica("r0")
    idle = rep.stats()
    assert idle.num_requests == 0 and idle.queued_work_s == (0.0,) * idle.num_levels
    assert idle.num_free_blocks == idle.num_total_blocks == 4096
    short, long_prompt = request("s", prompt(1, 8), 3), request("l", prompt(2, 2000), 3)
    rep.add(short, long_prompt)
    stats = rep.stats(time_s=1.5)
    assert stats.num_requests == 2 and stats.time_s == 1.5
    lv = rep.scheduler.level_of
    assert lv("s") == 0 and lv("l") is not None and lv("l") > 0  # the long prompt skips Q1
    quanta = stats.model.quanta_s
    # A job joining Q1 waits behind the short job only (its Q1 quantum); deeper levels add the
    # long prompt's quantum and, for the short job, the quanta it passes on the way down.
    assert stats.queued_work_s[0] == quanta[0]
    assert all(a <= b for a, b in zip(stats.queued_work_s, stats.queued_work_s[1:]))
    assert stats.queued_work_s[lv("l")] > stats.queued_work_s[lv("l") - 1] + quanta[lv("l")] / 2
    rep.step()  # the prefills run: their blocks are taken
    assert rep.stats().num_free_blocks < 4096


def test_snapshot_names_the_cached_prefix_so_a_router_finds_its_hit() -> None:
    rep = Replica("r0")
    tokens = prompt(3, 10 * BLOCK_SIZE)
    rep.add(request("first", tokens, 2))
    rep.run_all()
    stats = rep.stats()
    same = RouteRequest.from_tokens("again", tokens + [5, 6], BLOCK_SIZE)
    other = RouteRequest.from_tokens("other", prompt(4, 10 * BLOCK_SIZE), BLOCK_SIZE)
    assert set(same.block_hashes[:10]) <= stats.prefix_hashes
    assert not set(other.block_hashes) & stats.prefix_hashes
    # The bound keeps the most recent hashes and says it cut.
    small = rep.scheduler.replica_stats("r0", 0.0, max_prefix_hashes=4)
    assert len(small.prefix_hashes) == 4 and small.is_prefix_truncated
    assert not stats.is_prefix_truncated


def test_snapshot_round_trips_through_json() -> None:
    rep = Replica("r0")
    rep.add(request("a", prompt(1, 3 * BLOCK_SIZE), 5))
    rep.run_all()
    stats = rep.stats(2.0)
    assert ReplicaStats.from_json(json.loads(json.dumps(stats.to_json()))) == stats
    assert stats.level_reach and stats.level_reach[0] == 1.0  # one finished job, which reached Q1
