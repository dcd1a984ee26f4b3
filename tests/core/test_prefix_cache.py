"""The prefix cache's bookkeeping: shared blocks, reference counts, LRU eviction for room."""

from __future__ import annotations

import pytest

from fastserve.core.kv.manager import KVCacheManager
from fastserve.core.kv.prefix_cache import CachingBlockPool, extend_block_hashes
from fastserve.request import Request, SamplingParams
from tests.core.factories import UNIT_COST, make_requests, make_scheduler, serve


def _req(rid: str, tokens: list[int], salt: str | None = None) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=2, ignore_eos=True), 0.0,
                   cache_salt=salt)


def test_hashes_chain_over_the_prefix_and_the_salt() -> None:
    a = extend_block_hashes(_req("a", [1, 2, 3, 4, 5, 6, 7, 8, 9]), 4)
    b = extend_block_hashes(_req("b", [1, 2, 3, 4, 5, 6, 7, 8]), 4)
    c = extend_block_hashes(_req("c", [0, 2, 3, 4, 5, 6, 7, 8]), 4)
    d = extend_block_hashes(_req("d", [1, 2, 3, 4, 5, 6, 7, 8], salt="x"), 4)
    assert len(a) == 2 and a == b  # full blocks only; equal tokens, equal hashes
    assert c[1] != a[1]  # same second block after a different first one: not the same KV
    assert not set(d) & set(a)


def test_cached_blocks_stay_until_an_allocation_needs_the_room_then_go_lru() -> None:
    pool = CachingBlockPool(6)
    a = pool.allocate(2)
    b = pool.allocate(2)
    assert a is not None and b is not None
    pool.register(a, [10, 11])
    pool.register(b, [20, 21])
    pool.free(a)  # released first: evicted first
    pool.free(b)
    assert pool.num_free == 6 and pool.num_cached == 4
    assert pool.allocate(2) is not None  # two never-used blocks: nothing evicted
    assert pool.num_cached == 4 and pool.lookup([10, 11], 2) == 2
    assert pool.allocate(2) is not None  # now the least recently used (a's) go
    assert pool.lookup([10, 11], 2) == 0 and pool.lookup([20, 21], 2) == 2
    assert pool.num_evictions == 2


def test_a_shared_block_is_freed_only_when_its_last_reader_leaves() -> None:
    kv = KVCacheManager(num_device_blocks=4, block_size=4, enable_prefix_caching=True)
    assert kv.allocate("a", 8) is not None
    table = kv.block_table("a")
    kv.cache_blocks("a", [1, 2], 2)
    assert kv.num_cached_prefix([1, 2, 3], 3) == 2
    assert kv.allocate("b", 12, prefix_hashes=[1, 2]) is not None
    assert kv.block_table("b")[:2] == table  # shared, not copied
    assert kv.num_free_blocks == 1
    kv.free("a")
    assert kv.num_free_blocks == 1  # b still reads them
    # Nothing can evict them while b holds them: a 2-block job does not fit.
    assert kv.allocate("c", 8) is None
    kv.free("b")
    assert kv.num_free_blocks == 4 and kv.num_cached_blocks == 2
    with pytest.raises(ValueError, match="double free"):
        kv.device.free(table)


def test_caching_off_shares_nothing() -> None:
    kv = KVCacheManager(num_device_blocks=4, block_size=4, enable_prefix_caching=False)
    assert kv.allocate("a", 8) is not None
    kv.cache_blocks("a", [1, 2], 2)
    assert kv.num_cached_prefix([1, 2], 2) == 0 and kv.num_cached_blocks == 0


@pytest.mark.parametrize("policy", ["skip-join-mlfq", "fcfs"])
def test_a_repeated_prompt_computes_only_its_last_block(policy: str) -> None:
    sched = make_scheduler(policy, cost=UNIT_COST, block_size=4, num_blocks=64,
                           max_num_batched_tokens=64, prefix_caching=True)
    [first] = make_requests([30], [3])
    again = _req("again", list(first.prompt_token_ids))
    serve(sched, [first])
    run = serve(sched, [again])
    fed = [(s.request_id, s.start_pos, len(s.token_ids)) for p in run.plans for s in p.scheduled]
    assert ("again", 28, 2) in fed  # 7 cached blocks; the partial 8th is computed
    assert again.num_cached_tokens == 28 and first.num_cached_tokens == 0
    assert sched.stats().kv.num_prefix_hit_tokens == 28
    assert sched.stats().kv.num_prefix_query_tokens == 60
    assert sched.kv._kv.num_free_blocks == sched.kv._kv.num_total_blocks


def test_skip_join_places_a_job_by_the_prefill_of_its_uncached_part() -> None:
    sched = make_scheduler("skip-join-mlfq", cost=UNIT_COST, block_size=4, num_blocks=256,
                           base_quantum_ms=2.0, prefix_caching=True)
    [long_req] = make_requests([200], [2])
    sched.add_request(long_req, 0.0)
    assert sched.level_of(long_req.request_id) == 3  # 200 ms of prefill: the lowest level
    serve(sched, [])
    follow_up = _req("follow-up", long_req.prompt_token_ids + [5])
    sched.add_request(follow_up, 0.0)
    # 200 of its 201 tokens are cached: a 1 ms prefill, which Q1's 2 ms quantum covers.
    assert sched.level_of("follow-up") == 0


def test_a_held_prefix_outlives_its_request_until_released() -> None:
    """`n` > 1: a request's later sequences share its prompt's blocks; the group holds them
    from the first sequence's first token until all have started (fastserve.engine.group)."""
    kv = KVCacheManager(num_device_blocks=4, block_size=4, enable_prefix_caching=True)
    assert kv.allocate("a", 9) is not None
    kv.cache_blocks("a", [1, 2], 2)
    held = kv.hold_prefix([1, 2, 3])  # the run that is cached: two blocks
    assert held == kv.block_table("a")[:2]
    kv.free("a")  # the first sequence finished at once
    assert kv.num_free_blocks == 2
    assert kv.allocate("other", 12) is None  # would evict them: refused
    assert kv.allocate("b", 9, prefix_hashes=[1, 2]) is not None  # the later sequence shares
    assert kv.block_table("b")[:2] == held
    kv.release_prefix(held)
    kv.free("b")
    assert kv.num_free_blocks == 4 and kv.num_cached_blocks == 2
