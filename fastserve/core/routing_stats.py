"""A replica's snapshot for a fleet router (`ReplicaStats`), built from its scheduler: the
KV pool's state and prefix hashes, and what its policy says of its queues (levels, queued
work, how far jobs go down). `Scheduler.replica_stats` is the entry point."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

from fastserve.config import SchedulerConfig
from fastserve.core.cost_model import CostModel
from fastserve.core.kv import KVSpace
from fastserve.core.replica_stats import ReplicaModel, ReplicaStats
from fastserve.core.scheduling_policy import SchedulingPolicy
from fastserve.request import Request


class RoutedScheduler(Protocol):
    config: SchedulerConfig
    kv: KVSpace
    cost: CostModel
    policy: SchedulingPolicy

    @property
    def requests(self) -> Mapping[str, Request]: ...


class RoutingStats:
    """Builds the snapshots; keeps the static part (`ReplicaModel`) between them."""

    def __init__(self) -> None:
        self._model: ReplicaModel | None = None

    def replica_stats(self, sched: RoutedScheduler, replica_id: str, now: float,
                      max_prefix_hashes: int) -> ReplicaStats:
        kv = sched.kv.stats(max_prefix_hashes)
        return ReplicaStats(
            replica_id=replica_id, time_s=now, num_requests=len(sched.requests),
            queued_work_s=tuple(sched.policy.queued_work_s()),
            num_free_blocks=kv.num_free_blocks, num_total_blocks=kv.num_total_blocks,
            prefix_hashes=kv.prefix_hashes, model=self.replica_model(sched),
            is_prefix_truncated=kv.is_prefix_truncated,
            level_reach=tuple(sched.policy.level_reach()))

    def replica_model(self, sched: RoutedScheduler) -> ReplicaModel:
        """The static part of `replica_stats`, built once (again after `recalibrate`)."""
        model = self._model
        if model is None or model.cost is not sched.cost:
            quanta_s, charge_mode = sched.policy.routing_levels()
            config = sched.config
            model = self._model = ReplicaModel(
                block_size=sched.kv.stats().block_size, max_batch_size=config.max_batch_size,
                max_num_batched_tokens=config.max_num_batched_tokens, quanta_s=quanta_s,
                charge_mode=charge_mode, cost=sched.cost, policy=config.policy)
        return model
