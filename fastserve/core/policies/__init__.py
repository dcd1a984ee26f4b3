"""Scheduling policies: one class each, all over the shared `Scheduler` mechanism."""

from __future__ import annotations

from collections.abc import Sequence

from fastserve.config import SchedulerConfig
from fastserve.core.cost_model import CostModel
from fastserve.core.kv import KVCacheManager, KVPolicy
from fastserve.core.policies.fcfs import FCFSScheduler, OrcaScheduler
from fastserve.core.policies.gittins import GittinsScheduler
from fastserve.core.policies.mlfq import (
    MLFQKeepBatchScheduler,
    MLFQPreemptScheduler,
    MLFQScheduler,
    SkipJoinMLFQScheduler,
)
from fastserve.core.policies.oracle import SRPTOracleScheduler
from fastserve.core.policies.request_level import RequestLevelScheduler
from fastserve.core.scheduler import Scheduler

POLICY_CLASSES: dict[str, type[Scheduler]] = {
    "skip-join-mlfq": SkipJoinMLFQScheduler,
    "mlfq": MLFQScheduler,
    "mlfq-keep-batch": MLFQKeepBatchScheduler,
    "mlfq-preempt": MLFQPreemptScheduler,
    "fcfs": FCFSScheduler,
    "orca": OrcaScheduler,
    "request-level": RequestLevelScheduler,
    "srpt-oracle": SRPTOracleScheduler,
    "gittins": GittinsScheduler,
}


def make_scheduler(
    config: SchedulerConfig,
    kv: KVCacheManager,
    cost: CostModel,
    eos_token_ids: Sequence[int] = (),
    kv_policy: KVPolicy | None = None,
) -> Scheduler:
    """The policy `config.policy` names; `kv_policy` (default: `proactive` with no reserve,
    which without host blocks acts as `defer`) decides what gives way when blocks run short."""
    try:
        cls = POLICY_CLASSES[config.policy]
    except KeyError:
        raise ValueError(
            f"scheduler policy {config.policy!r} is not available; choose from {sorted(POLICY_CLASSES)}"
        ) from None
    return cls(config, kv, cost, eos_token_ids, kv_policy)
