"""Fleet test factories: real schedulers brought to a known state, and their snapshots."""

from __future__ import annotations

from collections.abc import Sequence

from fastserve.clock import VirtualClock
from fastserve.core.cost_model import CostModel
from fastserve.core.replica_stats import ReplicaStats
from fastserve.core.scheduler import Scheduler
from fastserve.engine.core import EngineCore
from fastserve.request import Request, SamplingParams
from fastserve.sim.executor import SimExecutor
from tests.core.factories import make_scheduler

# A GPU-like model: the fixed cost dominates a decode step, so batching is nearly free.
COST = CostModel(fixed_s=10e-3, per_prefill_token_s=5e-5, per_decode_s=1e-4,
                 per_context_token_s=0.0)
BLOCK_SIZE = 16


def request(rid: str, prompt: Sequence[int], output_len: int, arrival_s: float = 0.0) -> Request:
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    return Request(rid, list(prompt), params, arrival_s)


def prompt(seed: int, n: int) -> list[int]:
    return [(seed * 131 + 7 * j) % 997 + 1 for j in range(n)]


class Replica:
    """A real skip-join MLFQ scheduler stepped on a virtual clock."""

    def __init__(self, replica_id: str, num_blocks: int = 4096, **config: object) -> None:
        self.replica_id = replica_id
        self.scheduler: Scheduler = make_scheduler(
            "skip-join-mlfq", num_blocks=num_blocks, block_size=BLOCK_SIZE, cost=COST,
            prefix_caching=True, **config)
        self.clock = VirtualClock()
        self.core = EngineCore(self.scheduler, SimExecutor(COST, clock=self.clock), self.clock)

    def add(self, *reqs: Request) -> None:
        for r in reqs:
            self.scheduler.add_request(r, self.clock.now())

    def step(self, n: int = 1) -> None:
        for _ in range(n):
            self.core.step()

    def run_all(self) -> None:
        while self.scheduler.has_unfinished:
            self.core.step()

    def stats(self, time_s: float = 0.0) -> ReplicaStats:
        return self.scheduler.replica_stats(self.replica_id, time_s)
