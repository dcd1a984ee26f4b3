"""KV memory: where each request's KV lives, what gives way when blocks run short, and the
copies that follow. The scheduler holds one `KVSpace` (`space.py`) and asks it nine things;
inside are the pools and block tables (`manager.py`, `block_pool.py`), parked KV for forks
(`forks.py`), the prefix cache (`prefix_cache.py`), the moves (`moves.py`) and the KV policies
(`policy.py`, `proactive.py`, `registry.py`). Only this module is imported from outside the
package (`.importlinter`): the pools and the policies are exported for building a scheduler and
for tests."""

from __future__ import annotations

from fastserve.core.kv.block_pool import copy_runs, is_contiguous
from fastserve.core.kv.manager import KVCacheManager, num_blocks_for
from fastserve.core.kv.policy import (
    DeferPolicy,
    KVPolicy,
    ReactivePolicy,
    RecomputePolicy,
    SchedulerView,
)
from fastserve.core.kv.prefix_cache import chain_block_hashes, extend_block_hashes
from fastserve.core.kv.proactive import ProactivePolicy
from fastserve.core.kv.registry import (
    KV_POLICY_CLASSES,
    host_pool_blocks,
    make_kv_policy,
    uses_host,
)
from fastserve.core.kv.space import KVCopies, KVSpace, OrderView, PrefixHold, Reuse, check_fits

__all__ = [
    "KV_POLICY_CLASSES",
    "KVCacheManager",
    "KVCopies",
    "KVSpace",
    "OrderView",
    "PrefixHold",
    "Reuse",
    "check_fits",
    "DeferPolicy",
    "KVPolicy",
    "ProactivePolicy",
    "ReactivePolicy",
    "RecomputePolicy",
    "SchedulerView",
    "chain_block_hashes",
    "copy_runs",
    "extend_block_hashes",
    "host_pool_blocks",
    "is_contiguous",
    "make_kv_policy",
    "num_blocks_for",
    "uses_host",
]
