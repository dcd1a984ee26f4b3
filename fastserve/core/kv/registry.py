"""The KV policies by `--kv-policy` name, and the host pool they need."""

from __future__ import annotations

from fastserve.config import CacheConfig
from fastserve.core.kv.policy import DeferPolicy, KVPolicy, ReactivePolicy, RecomputePolicy
from fastserve.core.kv.proactive import ProactivePolicy

KV_POLICY_CLASSES: dict[str, type[KVPolicy]] = {
    "proactive": ProactivePolicy,
    "reactive": ReactivePolicy,
    "defer": DeferPolicy,
    "recompute": RecomputePolicy,
}


def make_kv_policy(config: CacheConfig) -> KVPolicy:
    """The policy `config.kv_policy` names, with its knobs."""
    if config.kv_policy == "proactive":
        return ProactivePolicy(config.kv_reserve_blocks, config.burst_queues)
    try:
        return KV_POLICY_CLASSES[config.kv_policy]()
    except KeyError:
        raise ValueError(
            f"kv_policy {config.kv_policy!r} is not available; "
            f"choose from {sorted(KV_POLICY_CLASSES)}"
        ) from None


def uses_host(config: CacheConfig) -> bool:
    """Whether the configured policy needs a host pool (`defer` and `recompute` do not)."""
    cls = KV_POLICY_CLASSES.get(config.kv_policy)
    return cls is not None and cls.uses_host


def host_pool_blocks(cache: CacheConfig, block_bytes: int) -> int:
    """Host blocks for `cache`: `num_host_blocks`, else `swap_space_gib` worth of
    `block_bytes` blocks (none when that size is unknown, 0); none for the policies that never
    offload (`defer`, `recompute`). The real executors and the simulator size their pools here."""
    if not uses_host(cache):
        return 0
    if cache.num_host_blocks is not None:
        return cache.num_host_blocks
    if block_bytes <= 0:
        return 0
    return int(cache.swap_space_gib * (1 << 30)) // block_bytes
