"""Block pool and KV manager: allocation, contiguity, no leaks, clear failures."""

from __future__ import annotations

import random

import pytest

from fastserve.core.kv.block_pool import BlockPool, is_contiguous
from fastserve.core.kv.manager import KVCacheManager


def test_allocate_returns_none_when_short_and_takes_nothing() -> None:
    pool = BlockPool(8)
    assert pool.allocate(5) is not None
    assert pool.allocate(4) is None
    assert pool.num_free == 3


def test_growth_stays_contiguous_for_interleaved_requests() -> None:
    kv = KVCacheManager(num_device_blocks=1024, block_size=16)
    ids = [f"r{i}" for i in range(16)]
    for rid in ids:
        assert kv.allocate(rid, 128) is not None  # 8 blocks each
    for tokens in range(129, 513, 16):  # all grow, interleaved, like decoding, to half the pool
        for rid in ids:
            assert kv.allocate(rid, tokens) is not None
    assert all(is_contiguous(kv.block_table(rid)) for rid in ids)
    for rid in ids:
        kv.free(rid)
    assert kv.num_free_blocks == 1024


def test_fragmented_pool_still_allocates_and_frees_everything() -> None:
    rng = random.Random(0)
    kv = KVCacheManager(num_device_blocks=200, block_size=4)
    live: dict[str, int] = {}
    for step in range(2000):
        if live and (rng.random() < 0.3 or kv.num_free_blocks < 10):
            rid = rng.choice(sorted(live))
            kv.free(rid)
            del live[rid]
        rid = f"r{step % 40}"
        tokens = live.get(rid, 0) + rng.randint(1, 30)
        if kv.allocate(rid, tokens) is not None:
            live[rid] = tokens
            table = kv.block_table(rid)
            assert len(table) == -(-tokens // 4) and len(set(table)) == len(table)
    all_blocks = [b for rid in live for b in kv.block_table(rid)]
    assert len(all_blocks) == len(set(all_blocks)) == 200 - kv.num_free_blocks
    for rid in list(live):
        kv.free(rid)
    assert kv.num_free_blocks == 200
    assert kv.allocate("big", 800) is not None and is_contiguous(kv.block_table("big"))


def test_double_free_is_an_error() -> None:
    pool = BlockPool(4)
    blocks = pool.allocate(2)
    assert blocks is not None
    pool.free(blocks)
    with pytest.raises(ValueError, match="double free"):
        pool.free(blocks)
