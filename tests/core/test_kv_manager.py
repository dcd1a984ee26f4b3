"""The KV manager: block tables over the device and host pools, and the copies a move needs."""

from __future__ import annotations

import pytest

from fastserve.core.kv.manager import KVCacheManager, KVLocation


def test_offload_and_upload_move_the_table_between_pools() -> None:
    kv = KVCacheManager(num_device_blocks=8, block_size=4, num_host_blocks=8)
    assert kv.allocate("a", 14) is not None  # 4 blocks, the last one reserved
    table = kv.block_table("a")
    pairs = kv.offload("a", num_cached_tokens=10)  # only the 3 blocks holding KV move
    assert pairs is not None and [d for d, _ in pairs] == table[:3]
    assert kv.where("a") is KVLocation.HOST and kv.host_table("a") == [h for _, h in pairs]
    assert kv.num_free_blocks == 8 and kv.num_free_host_blocks == 5
    with pytest.raises(ValueError, match="swapped out"):
        kv.allocate("a", 14)
    back = kv.upload("a", num_tokens=13)  # and room to grow to 13 tokens
    assert back is not None and [h for h, _ in back] == [h for _, h in pairs]
    assert kv.where("a") is KVLocation.DEVICE and len(kv.block_table("a")) == 3
    # The host blocks it was read from stay taken until the plan is complete.
    assert kv.num_free_host_blocks == 5
    kv.end_iteration()
    assert kv.num_free_host_blocks == 8
    assert (kv.num_swap_out_blocks, kv.num_swap_in_blocks) == (3, 3)
    assert kv.free("a") == 3 and kv.num_free_blocks == 8


def test_blocks_still_being_copied_out_serve_only_uploads() -> None:
    kv = KVCacheManager(num_device_blocks=4, block_size=4, num_host_blocks=8)
    assert kv.allocate("a", 16) is not None  # the whole device
    assert kv.offload("a", 16, release_now=False) is not None
    assert kv.num_free_blocks == 0 and kv.num_free_soon == 4
    assert kv.allocate("b", 4) is None  # no computation may write them this iteration
    kv.end_iteration()
    assert kv.num_free_blocks == 4
    assert kv.allocate("b", 8) is not None
    assert kv.offload("b", 8, release_now=False) is not None
    # An upload may take them (its copy runs after the swap-out) ...
    assert kv.upload_shortfall("a") <= 0 and kv.upload("a") is not None
    assert sorted(kv.block_table("a")) == [0, 1, 2, 3]
    # ... but not growth, which this iteration's computation would write.
    kv.end_iteration()
    assert kv.upload_shortfall("b", 12) > 0 and kv.upload("b", 12) is None
    kv.free("a")
    assert kv.upload("b", 12) is not None
    kv.end_iteration()
    kv.free("b")
    assert kv.num_free_blocks == 4 and kv.num_free_host_blocks == 8


def test_offload_fails_cleanly_when_the_host_is_full() -> None:
    kv = KVCacheManager(num_device_blocks=8, block_size=4, num_host_blocks=2)
    assert kv.allocate("a", 12) is not None
    assert not kv.can_offload("a", 12)
    assert kv.offload("a", 12) is None
    assert kv.where("a") is KVLocation.DEVICE and kv.num_free_host_blocks == 2
