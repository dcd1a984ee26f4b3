"""Scheduling policies: one `SchedulingPolicy` object each (`fastserve.core.scheduling_policy`),
given to the one `Scheduler` by `make_scheduler`."""

from __future__ import annotations

from collections.abc import Sequence

from fastserve.config import SchedulerConfig
from fastserve.core.cost_model import CostModel
from fastserve.core.kv import KVCacheManager, KVPolicy
from fastserve.core.policies.fcfs import FCFSPolicy, OrcaPolicy
from fastserve.core.policies.gittins import GittinsPolicy
from fastserve.core.policies.mlfq import (
    MLFQKeepBatchPolicy,
    MLFQPolicy,
    MLFQPreemptPolicy,
    SkipJoinMLFQPolicy,
)
from fastserve.core.policies.oracle import SRPTOraclePolicy
from fastserve.core.policies.request_level import RequestLevelPolicy
from fastserve.core.scheduler import Scheduler
from fastserve.core.scheduling_policy import SchedulingPolicy

POLICY_CLASSES: dict[str, type[SchedulingPolicy]] = {
    "skip-join-mlfq": SkipJoinMLFQPolicy,
    "mlfq": MLFQPolicy,
    "mlfq-keep-batch": MLFQKeepBatchPolicy,
    "mlfq-preempt": MLFQPreemptPolicy,
    "fcfs": FCFSPolicy,
    "orca": OrcaPolicy,
    "request-level": RequestLevelPolicy,
    "srpt-oracle": SRPTOraclePolicy,
    "gittins": GittinsPolicy,
}


def make_scheduler(
    config: SchedulerConfig,
    kv: KVCacheManager,
    cost: CostModel,
    eos_token_ids: Sequence[int] = (),
    kv_policy: KVPolicy | None = None,
) -> Scheduler:
    """The scheduler over the policy `config.policy` names; `kv_policy` (default: `proactive`
    with no reserve, which without host blocks acts as `defer`) decides what gives way when
    blocks run short."""
    try:
        cls = POLICY_CLASSES[config.policy]
    except KeyError:
        raise ValueError(
            f"scheduler policy {config.policy!r} is not available; choose from {sorted(POLICY_CLASSES)}"
        ) from None
    return Scheduler(config, kv, cost, cls(config, cost), eos_token_ids, kv_policy)
