"""Routing decisions from real replicas' snapshots: each policy does what it promises."""

from __future__ import annotations

import dataclasses
from collections import Counter

import pytest

from fastserve.fleet import RouteRequest, make_router
from tests.fleet.factories import BLOCK_SIZE, Replica, prompt, request


def fleet(n: int) -> list[Replica]:
    return [Replica(f"r{i}") for i in range(n)]


def short_job(rid: str) -> RouteRequest:
    return RouteRequest.from_tokens(rid, prompt(99, 8), BLOCK_SIZE)


def test_power_of_two_takes_the_shorter_queue_of_two_seeded_draws() -> None:
    a, b = Replica("a"), Replica("b")
    a.add(*(request(f"a{i}", prompt(i, 8), 50) for i in range(3)))
    router = make_router("pow2", seed=1)
    router.update(a.stats())
    router.update(b.stats())
    # Two candidates: both are drawn, and the one with fewer requests wins, every time
    # (the router's own count of what it sent b grows, but stays below a's 3 for 2 sends).
    # NOTE: a tie keeps the draw's order, which is Ray's behaviour too.
    assert [router.choose(short_job(f"x{i}"), 0.0) for i in range(2)] == ["b", "b"]
    # Seeded: the same calls give the same draws; another seed other draws.
    ids = [f"r{i}" for i in range(16)]

    def draws(seed: int) -> list[list[str]]:
        r = make_router("pow2", seed=seed)
        return [r.rank(short_job(str(i)), 0.0, ids) for i in range(20)]

    assert draws(7) == draws(7) != draws(8)
    assert all(len(d) == 2 for d in draws(7))


def test_round_robin_cycles_over_sorted_ids() -> None:
    router = make_router("round-robin")
    got = [router.choose(short_job(str(i)), 0.0, ["c", "a", "b"]) for i in range(5)]
    assert got == ["a", "b", "c", "a", "b"]


def test_prefix_affinity_goes_where_the_prefix_is_cached() -> None:
    reps = fleet(4)
    tokens = prompt(5, 20 * BLOCK_SIZE)
    reps[2].add(request("turn1", tokens, 4))
    reps[2].run_all()
    for name in ("prefix-affinity", "fastserve"):
        router = make_router(name)
        for r in reps:
            router.update(r.stats())
        turn2 = RouteRequest.from_tokens("turn2", tokens + prompt(6, 40), BLOCK_SIZE)
        assert router.choose(turn2, 0.0) == "r2", name


def test_fastserve_sends_a_short_job_past_long_jobs_that_give_way_to_it() -> None:
    """Replica `busy-top` has 3 new jobs in Q1; `long-jobs` has 6 jobs that ran their way
    down to the lowest level, which a new short job preempts. Power of two counts requests
    and picks the 3; the MLFQ-aware router sees nothing ahead of a short job on the other."""
    top, low = Replica("busy-top"), Replica("long-jobs")
    top.add(*(request(f"t{i}", prompt(i, 8), 500) for i in range(3)))
    low.add(*(request(f"l{i}", prompt(10 + i, 8), 500) for i in range(6)))
    low.step(200)
    lowest = low.stats().num_levels - 1
    assert {low.scheduler.level_of(f"l{i}") for i in range(6)} == {lowest}
    fs, p2 = make_router("fastserve"), make_router("pow2")
    for router in (fs, p2):
        router.update(top.stats())
        router.update(low.stats())
    assert fs.choose(short_job("s"), 0.0) == "long-jobs"
    assert p2.choose(short_job("s"), 0.0) == "busy-top"


def test_imbalance_bound_overrides_prefix_affinity() -> None:
    reps = fleet(2)
    tokens = prompt(5, 20 * BLOCK_SIZE)
    reps[0].add(request("turn1", tokens, 4))
    reps[0].run_all()
    reps[0].add(*(request(f"q{i}", prompt(20 + i, 8), 500) for i in range(6)))
    reps[0].step(200)  # down to the lowest level: they give way to a new job
    turn2 = RouteRequest.from_tokens("turn2", tokens + prompt(6, 40), BLOCK_SIZE)
    for bound, expected in ((8, "r0"), (4, "r1")):
        router = make_router(f"fastserve:max-imbalance={bound}:deep-weight=0")
        for r in reps:
            router.update(r.stats())
        assert router.choose(turn2, 0.0) == expected


def test_bookkeeping_spreads_a_burst_between_snapshots_and_yields_to_a_newer_one() -> None:
    reps = fleet(4)
    router = make_router("fastserve")
    for r in reps:
        router.update(r.stats(time_s=0.0))
    got = Counter(router.choose(short_job(f"b{i}"), 0.05) for i in range(8))
    assert sorted(got.values()) == [2, 2, 2, 2]
    view = router.views["r0"]
    assert view.num_requests() == 2
    router.update(reps[0].stats(time_s=0.0))  # not newer than the sends: they still count
    assert view.num_requests() == 2
    router.update(reps[0].stats(time_s=0.1))  # newer: its count (0, none arrived) stands
    assert view.num_requests() == 0


def test_a_send_counts_until_the_replica_says_it_took_it_in() -> None:
    """An ingress's router (with a `source`): a snapshot taken after a send but before the
    replica's engine took the request in does not drop it; the replica's count does, and a
    request that never arrived is forgotten by name."""
    reps = fleet(2)
    router = make_router("fastserve")
    router.source = "ingress-a"

    def snapshot(rep: Replica, time_s: float, admitted: int) -> None:
        stats = dataclasses.replace(rep.stats(time_s), admitted={"ingress-a": admitted,
                                                                 "ingress-b": 7})
        router.update(stats)

    for r in reps:
        snapshot(r, 0.0, 0)
    got = Counter(router.choose(short_job(f"b{i}"), 0.05) for i in range(8))
    assert sorted(got.values()) == [4, 4]
    view = router.views["r0"]
    snapshot(reps[0], 1.0, 0)  # newer than every send, none arrived yet: all still count
    assert view.num_requests() == 4
    reps[0].add(*(request(f"x{i}", prompt(i, 8), 4) for i in range(3)))
    snapshot(reps[0], 1.1, 3)  # three arrived: the snapshot counts them, the router the 4th
    assert view.num_requests() == 4
    sent = [s.request_id for s in view.sent]
    assert len(sent) == 1
    router.forget(sent[0], "r0")  # it never reached the engine
    assert view.num_requests() == 3
    # Another ingress's requests are not this router's: the same count drops nothing more.
    router.choose(short_job("c0"), 1.2, ["r0"])
    snapshot(reps[0], 1.3, 3)
    assert view.num_requests() == 4
    # A send no snapshot ever counted stops counting after UNACKED_SEND_S.
    snapshot(reps[0], 1.2 + 61.0, 3)
    assert view.num_requests() == 3
    # A replica that restarted counts from 0 again: its first count covers the sends again.
    router.choose(short_job("d0"), 70.0, ["r0"])
    router.choose(short_job("d1"), 70.0, ["r0"])
    snapshot(reps[0], 70.5, 1)
    assert view.num_requests() == 3 + 1


def test_bad_router_specs_are_refused_by_name() -> None:
    with pytest.raises(ValueError, match="router must be one of"):
        make_router("nearest")
    with pytest.raises(ValueError, match="key=value"):
        make_router("fastserve:oops")
    with pytest.raises(ValueError, match="max_imbalance"):
        make_router("fastserve:max-imbalance=-1")
    with pytest.raises(ValueError, match="near_ratio"):
        make_router("fastserve:near-ratio=-0.1")
    with pytest.raises(ValueError, match="no replica"):
        make_router("pow2").choose(short_job("x"), 0.0)


def test_deep_levels_count_as_likely_as_finished_jobs_reached_them() -> None:
    """Two replicas hold the same 6 long jobs in the lowest level; one has seen 20 short
    jobs finish in Q1, the other 20 long ones finish in the lowest level. A new job is
    expected to meet the long jobs only where jobs like it got that far."""
    reps = []
    for name, out_len in (("shorts-done", 2), ("longs-done", 400)):
        rep = Replica(name)
        rep.add(*(request(f"{name}-d{i}", prompt(50 + i, 8), out_len) for i in range(20)))
        rep.run_all()
        rep.add(*(request(f"{name}-l{i}", prompt(10 + i, 8), 500) for i in range(6)))
        rep.step(200)
        reps.append(rep)
    short_reach, long_reach = (r.stats().level_reach for r in reps)
    assert short_reach[-1] == 0.0 and long_reach[-1] == 1.0
    router = make_router("fastserve")
    for r in reps:
        router.update(r.stats())
    assert router.choose(short_job("new"), 0.0) == "shorts-done"
