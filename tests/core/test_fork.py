"""Parked KV and forks (beam search's steps): a finished request's device KV stays parked for
the requests that continue its tokens; such a request shares the parent's full blocks, gets a
copy of its partial last block (a device copy in the plan) and computes only its new token.
Parked KV is the first to go when blocks run short."""

from __future__ import annotations

import pytest

from fastserve.core.kv.manager import KVCacheManager
from fastserve.request import Request, SamplingParams
from tests.core.factories import UNIT_COST, kv_scheduler, make_requests, make_scheduler, serve

TOKENS = list(range(100, 110))  # 10 tokens: 2 full blocks of 4 and a partial one


def _req(rid: str, tokens: list[int], fork_of: str | None = None, keep_kv: bool = False,
         salt: str | None = None) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=1, ignore_eos=True), 0.0,
                   keep_kv=keep_kv, fork_of=fork_of, cache_salt=salt)


def test_a_fork_shares_the_full_blocks_and_copies_the_partial_one() -> None:
    kv = KVCacheManager(num_device_blocks=8, block_size=4)
    assert kv.allocate("p", 11) is not None  # its 10 tokens and the sampled one's room
    parent = kv.block_table("p")
    assert kv.park("p", TOKENS, None) and kv.num_parked == 1 and kv.num_requests == 0
    assert kv.num_free_blocks == 5  # 3 blocks hold the 10 tokens' KV
    # Only a request that continues all of the parent's tokens, with its salt, forks it.
    assert kv.fork_tokens("p", [*TOKENS, 7], None) == 10
    assert kv.fork_tokens("p", [*TOKENS[:-1], 8, 7], None) == 0
    assert kv.fork_tokens("p", [*TOKENS, 7], "other adapter") == 0
    assert kv.fork_tokens("p", TOKENS, None) == 0  # nothing left to compute
    assert kv.allocate("c", 11, fork_of="p") is not None
    child = kv.block_table("c")
    assert child[:2] == parent[:2] and child[2] not in parent
    assert kv.take_fork_copies() == [(parent[2], child[2])]
    assert kv.take_fork_copies() == []
    assert kv.num_free_blocks == 4
    kv.free("c")
    assert kv.num_free_blocks == 5  # the parent still holds what it shared
    kv.unpark(["p", "never parked"])
    kv.end_iteration()  # (the plan that copied the block is complete)
    assert kv.num_parked == 0 and kv.num_free_blocks == 8


def test_the_block_a_fork_copies_outlives_its_parent_until_the_plan_is_complete() -> None:
    """The plan's uploads run before its fork copies: a parent dropped in the same iteration
    must not hand the block a copy reads to an upload (or anything else) of that plan."""
    kv = KVCacheManager(num_device_blocks=4, block_size=4)
    assert kv.allocate("p", 11) is not None
    source = kv.block_table("p")[2]
    assert kv.park("p", TOKENS, None)
    assert kv.allocate("c", 11, fork_of="p") is not None  # the last free block: the copy
    kv.unpark(["p"])  # dropped for room, in the same iteration
    assert kv.num_free_blocks == 0  # the source is still being read
    assert kv.allocate("other", 1) is None
    assert kv.take_fork_copies() == [(source, kv.block_table("c")[2])]
    kv.end_iteration()
    assert kv.num_free_blocks == 1 and kv.allocate("other", 1) == [source]


def test_a_fork_at_a_block_boundary_copies_nothing() -> None:
    kv = KVCacheManager(num_device_blocks=8, block_size=4)
    assert kv.allocate("p", 9) is not None
    parent = kv.block_table("p")
    assert kv.park("p", TOKENS[:8], None)
    assert kv.num_free_blocks == 6  # its third block held only the sampled token's room
    assert kv.shortfall("c", 9, fork_of="p") == 1 - 6
    assert kv.allocate("c", 9, fork_of="p") is not None
    child = kv.block_table("c")
    assert child[:2] == parent[:2] and len(child) == 3  # its new token's block is its own
    assert kv.take_fork_copies() == []
    kv.unpark(["p"])
    kv.free("c")
    assert kv.num_free_blocks == 8


def test_a_request_with_no_device_kv_parks_nothing() -> None:
    kv = KVCacheManager(num_device_blocks=8, block_size=4, num_host_blocks=8)
    assert kv.allocate("p", 11) is not None
    assert kv.offload("p", 10) is not None
    assert not kv.park("p", TOKENS, None)
    assert kv.num_parked == 0 and kv.num_free_host_blocks == 8 and kv.num_free_blocks == 8


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_a_forked_step_computes_its_new_token_alone(prefix_caching: bool) -> None:
    sched = make_scheduler("skip-join-mlfq", cost=UNIT_COST, block_size=4, num_blocks=64,
                           prefix_caching=prefix_caching)
    (first,) = serve(sched, [_req("p", TOKENS, keep_kv=True)]).plans
    parent_block = first.scheduled[0].block_ids[2]
    assert sched.kv._kv.num_parked == 1 and sched.kv._kv.num_requests == 0
    children = [_req(f"c{i}", [*TOKENS, t], fork_of="p", keep_kv=True) for i, t in enumerate((7, 8))]
    run = serve(sched, children)
    (plan,) = run.plans
    assert [(s.request_id, s.start_pos, len(s.token_ids)) for s in plan.scheduled] == [
        ("c0", 10, 1), ("c1", 10, 1)]
    assert [src for src, _ in plan.copies] == [parent_block, parent_block]
    assert [dst for _, dst in plan.copies] == [s.block_ids[2] for s in plan.scheduled]
    assert [c.num_cached_tokens for c in children] == [10, 10]
    # A forked step counts its parent's tokens as prefix hits.
    assert sched.stats().kv.num_prefix_hit_tokens == 20
    sched.kv._kv.unpark(["p", "c0", "c1"])
    assert sched.kv._kv.num_free_blocks == sched.kv._kv.num_total_blocks


def test_a_step_whose_parent_is_gone_computes_its_partial_block() -> None:
    sched = make_scheduler("fcfs", cost=UNIT_COST, block_size=4, num_blocks=64,
                           prefix_caching=True)
    serve(sched, [_req("p", TOKENS, keep_kv=True)])
    sched.kv._kv.unpark(["p"])
    run = serve(sched, [_req("c", [*TOKENS, 7], fork_of="p")])
    (plan,) = run.plans
    # The prefix cache has the parent's 2 full blocks; the partial third is computed again.
    assert [(s.start_pos, len(s.token_ids)) for s in plan.scheduled] == [(8, 3)]
    assert plan.copies == []


def test_parked_kv_makes_way_for_a_job_that_needs_its_blocks() -> None:
    sched = make_scheduler("fcfs", cost=UNIT_COST, block_size=4, num_blocks=6)
    serve(sched, [_req("p", TOKENS, keep_kv=True)])  # 3 of the 6 blocks stay parked
    big = Request("big", list(range(1, 21)), SamplingParams(max_tokens=3, ignore_eos=True), 0.0)
    run = serve(sched, [big])  # 20 + 3 tokens: all 6 blocks (it would never run otherwise)
    assert big.num_output_tokens == 3 and big.num_preemptions == 0
    assert sched.kv._kv.num_parked == 0 and not any(p.preempted_ids for p in run.plans)
    assert sched.kv._kv.num_free_blocks == sched.kv._kv.num_total_blocks


def test_the_proactive_reserve_takes_parked_kv_before_moving_a_job() -> None:
    """Parked KV short of the proactive policy's reserve is dropped (a fork would lose a
    partial block's computation) before any job's KV is offloaded (a copy out and back)."""
    sched = kv_scheduler("skip-join-mlfq", "proactive", num_blocks=16, reserve=6,
                         max_batch_size=1)
    serve(sched, [_req("p", TOKENS, keep_kv=True)])  # 3 blocks parked
    jobs = make_requests([14, 14], [6, 6])  # 5 blocks each, taking turns: one waits resident
    run = serve(sched, jobs)
    assert all(j.num_output_tokens == 6 for j in jobs)
    assert sched.kv._kv.num_dropped_parked == 1 and sched.stats().kv.num_offloads == 0
    assert not any(p.swap_out for p in run.plans)


def test_parked_kv_stays_when_dropping_it_could_not_make_the_room() -> None:
    sched = make_scheduler("fcfs", cost=UNIT_COST, block_size=4, num_blocks=8)
    serve(sched, [_req("p", TOKENS, keep_kv=True)])  # 3 blocks parked, 5 free
    first = Request("first", list(range(1, 17)), SamplingParams(max_tokens=1, ignore_eos=True), 0.0)
    # 5 blocks, short by 4 while the first holds its 4: more than the parked 3 could give.
    # It waits for the first to finish instead, and fits then.
    second = Request("second", list(range(20, 37)), SamplingParams(max_tokens=3, ignore_eos=True),
                     0.0)
    run = serve(sched, [first, second])
    assert [s.request_id for s in run.plans[0].scheduled] == ["first"]
    assert first.num_output_tokens == 1 and second.num_output_tokens == 3
    assert sched.kv._kv.num_dropped_parked == 0 and sched.kv._kv.num_parked == 1
