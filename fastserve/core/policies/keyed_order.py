"""Requests kept sorted by a priority key that changes for only a few of them per iteration.

Re-sorting every unfinished request each iteration costs O(n log n) Python comparisons (about a
millisecond at 10,000 jobs). Between two iterations only the batched jobs (at most
max_batch_size) change priority, so each is moved instead: a binary search plus one C-level
`memmove` of the list tail. Reading the order is then a plain list copy.
`KeyedOrderPolicy` is the policy skeleton over it for keys that change only when a job runs.
"""

from __future__ import annotations

import bisect
from abc import abstractmethod
from typing import Generic, TypeVar

from fastserve.config import SchedulerConfig
from fastserve.core.cost_model import CostModel
from fastserve.core.scheduling_policy import SchedulingPolicy
from fastserve.request import Request

T = TypeVar("T")
# Compared element-wise; NOTE: the last element must be unique per item (an arrival sequence
# number) so that two keys never tie and items never need comparing.
Key = tuple[float, ...]


class KeyedOrder(Generic[T]):
    """Items in ascending key order, addressed by id."""

    def __init__(self) -> None:
        self._keys: list[Key] = []
        self._items: list[T] = []
        self._key_of: dict[str, Key] = {}

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, item_id: str) -> bool:
        return item_id in self._key_of

    def put(self, item_id: str, key: Key, item: T) -> None:
        """Insert the item, or move it to `key` if it is already here."""
        old = self._key_of.get(item_id)
        if old == key:
            return
        if old is not None:
            self._delete(old)
        i = bisect.bisect_left(self._keys, key)
        self._keys.insert(i, key)
        self._items.insert(i, item)
        self._key_of[item_id] = key

    def remove(self, item_id: str) -> None:
        key = self._key_of.pop(item_id, None)
        if key is not None:
            self._delete(key)

    def items(self) -> list[T]:
        """A copy of the items, lowest key first."""
        return self._items.copy()

    def _delete(self, key: Key) -> None:
        i = bisect.bisect_left(self._keys, key)
        if i == len(self._keys) or self._keys[i] != key:
            raise KeyError(f"key {key} is not in the order")  # NOTE: would mean a stale key
        del self._keys[i]
        del self._items[i]


class KeyedOrderPolicy(SchedulingPolicy):
    """A policy whose order is one number per job (lowest first, ties in arrival order) that
    changes only when the job runs or loses its KV: the batched jobs are re-keyed after each
    iteration, a recomputed job at once (`srpt-oracle`, `gittins`).

    Two optional bounds on how long a job may be passed, both off by default, move the order
    towards arrival order (FCFS):

    - `age_weight` w: the key is the rank plus w x the job's arrival time. Every job ages at
      the same rate, so this orders as rank - w x age would, and keys still change only when a
      job runs. w = 0 is the plain rank; a w large against the ranks' spread is arrival order.
    - `urgent_after_s` D: a job whose age plus `remaining_s` (what it still needs alone; 0 for
      a policy that does not know) reaches D runs ahead of every other job, urgent jobs in
      arrival order. D = 0 is off; a tiny D is arrival order. NOTE: when on, `order` walks
      every unfinished job each iteration (measurement, not a serving default).
    """

    def __init__(self, config: SchedulerConfig, cost: CostModel) -> None:
        super().__init__(config, cost)
        self._queue: KeyedOrder[Request] = KeyedOrder()
        self._seq: dict[str, int] = {}  # arrival number, the tie-break
        self._num_added = 0
        self.age_weight = config.age_weight
        self.urgent_after_s = config.urgent_after_s

    def on_update(self, touched: list[Request]) -> None:
        for req in touched:
            if not req.is_finished:
                self._rekey(req)

    def on_recompute(self, req: Request) -> None:
        self._rekey(req)  # it has a prefill to redo now

    def on_add(self, req: Request, now: float) -> None:
        self._seq[req.request_id] = self._num_added
        self._num_added += 1
        self._rekey(req)

    def on_finish(self, req: Request, now: float) -> None:
        self._queue.remove(req.request_id)
        self._seq.pop(req.request_id, None)

    def order(self, now: float) -> list[Request]:
        ordered = self._queue.items()
        if self.urgent_after_s <= 0:
            return ordered
        due = now - self.urgent_after_s  # urgent: age + remaining >= D
        urgent = [req for req in self.requests.values()  # in arrival order
                  if req.arrival_s - self.remaining_s(req) <= due]
        if not urgent:
            return ordered
        ids = {req.request_id for req in urgent}
        return urgent + [req for req in ordered if req.request_id not in ids]

    def remaining_s(self, req: Request) -> float:
        """What the job still needs, run alone, as far as the policy knows (for
        `urgent_after_s`); 0 here: only its age counts."""
        return 0.0

    def _rekey(self, req: Request) -> None:
        rid = req.request_id
        key = self._priority(req)
        if self.age_weight > 0:
            key += self.age_weight * req.arrival_s  # (on the clock `order`'s `now` reads)
        self._queue.put(rid, (key, self._seq[rid]), req)

    @abstractmethod
    def _priority(self, req: Request) -> float:
        """The job's key now: lower runs first."""
