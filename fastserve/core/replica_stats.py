"""What one replica reports to the fleet's router: the few numbers a placement needs.

Built by `Scheduler.replica_stats` (pure, no clock: `now` is passed in), so the simulator's
replicas and the real engine report the same way; read by `fastserve.fleet` routers. Lives in
core because the scheduler builds it and core imports nothing above itself.

Both dataclasses are frozen and turn into plain JSON (`to_json` / `from_json`): Ray Serve ships
them as routing stats, and a recorded fleet trace stores them (`fastserve.fleet.trace`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from fastserve.core.cost_model import CostModel


@dataclass(frozen=True)
class ReplicaModel:
    """What does not change while a replica serves: enough for a router to predict, without
    asking the replica, where a new job would join its MLFQ and what its prefill would cost.
    A replica builds it once and sends the same object with every snapshot."""

    block_size: int  # tokens per KV block: the prefix cache hashes whole blocks of this size
    max_batch_size: int  # jobs per iteration (power-of-two's and the charge model's batch)
    max_num_batched_tokens: int  # the iteration's token budget: a prefill's chunk size
    # Per MLFQ level, Q1 first: the service a job may attain in it (all levels the policy may
    # open; `ReplicaStats.queued_work_s` says how many are in use). One entry for a policy
    # without levels. A new job joins the first level whose quantum covers its prefill.
    quanta_s: tuple[float, ...]
    # How the replica charges service: "own" (each job its share of an iteration, so charges
    # add up to device time) or "iteration" (every batched job the whole iteration).
    charge_mode: str
    cost: CostModel  # the replica's iteration cost model (the fleet shares one profile)
    policy: str = "skip-join-mlfq"  # the replica's scheduling policy, for reports

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ReplicaModel:
        d = dict(data)
        d["quanta_s"] = tuple(float(q) for q in d["quanta_s"])
        d["cost"] = CostModel(**d["cost"])
        return cls(**d)


@dataclass(frozen=True)
class ReplicaStats:
    """One replica's state at `time_s`, as a router sees it (a snapshot, possibly stale).

    NOTE: `time_s` is on the same time base as the `now` the router is given (the simulator's
    virtual clock; in Ray, `time.time()` on both sides). Without `admitted` the router drops its
    own bookkeeping of the requests sent before `time_s`, which the snapshot then counts (true
    where a request reaches the scheduler the moment it is sent: the simulator).
    """

    replica_id: str  # the name the router returns for it
    time_s: float  # when the snapshot was taken
    num_requests: int  # unfinished requests (power-of-two choices' "queue length")
    # Per MLFQ level j in use (index 0 = Q1): the predicted service, in seconds of the
    # replica's charge, that jobs now queued at levels <= j will get before a job that joins
    # level j now has its turn (FastServe's ENST: each such job's rest of its current quantum
    # plus the quanta of the levels between its level and j; the lowest level's quantum stands
    # in for its unbounded one). Nondecreasing in j. Its length is the number of levels in use.
    queued_work_s: tuple[float, ...]
    num_free_blocks: int  # device KV blocks an allocation can have now (evictable cached ones too)
    num_total_blocks: int
    # Chained block hashes (`fastserve.core.kv.prefix_cache`) of the device prefix cache, the
    # most recently used ones when there are more than the replica's bound: a request's hit
    # length here is the number of its leading block hashes found in this set.
    prefix_hashes: frozenset[int]
    model: ReplicaModel
    # Whether `prefix_hashes` was cut to the bound (the cache holds more than it says).
    is_prefix_truncated: bool = False
    extra: dict[str, float] = field(default_factory=dict)  # additive, for reports only
    # Per level j in use: the share of the replica's recently finished jobs that ended in
    # level j or below (so reached it): how likely a new job is to meet the work queued down
    # there. Empty before any job finished (a router then counts its join level's work only).
    level_reach: tuple[float, ...] = ()
    # Per sender (a fleet ingress's `Router.source`): how many of its requests this replica's
    # engine has taken in, since it started, as of this snapshot. A router that sends as one of
    # them keeps counting each request it sent here until this count includes it: between the
    # send and the engine's intake (the network, the replica's HTTP server, its engine's next
    # iteration) neither the snapshot nor a time stamp says whether it is in. None: not
    # counted (the simulator, where the send is the intake).
    admitted: dict[str, int] | None = None

    @property
    def num_levels(self) -> int:
        return len(self.queued_work_s)

    def to_json(self) -> dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        d["queued_work_s"] = list(self.queued_work_s)
        d["level_reach"] = list(self.level_reach)
        d["prefix_hashes"] = sorted(self.prefix_hashes)
        d["model"] = self.model.to_json()
        d["extra"] = dict(self.extra)
        d["admitted"] = None if self.admitted is None else dict(self.admitted)
        return d

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ReplicaStats:
        d = dict(data)
        d["queued_work_s"] = tuple(float(w) for w in d["queued_work_s"])
        d["level_reach"] = tuple(float(x) for x in d.get("level_reach", ()))
        d["prefix_hashes"] = frozenset(int(h) for h in d["prefix_hashes"])
        d["model"] = ReplicaModel.from_json(d["model"])
        if d.get("admitted") is not None:
            d["admitted"] = {str(k): int(v) for k, v in d["admitted"].items()}
        return cls(**d)
