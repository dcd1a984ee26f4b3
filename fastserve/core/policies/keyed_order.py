"""Requests kept sorted by a priority key that changes for only a few of them per iteration.

Re-sorting every unfinished request each iteration costs O(n log n) Python comparisons (about a
millisecond at 10,000 jobs). Between two iterations only the batched jobs (at most
max_batch_size) change priority, so each is moved instead: a binary search plus one C-level
`memmove` of the list tail. Reading the order is then a plain list copy.
`KeyedOrderScheduler` is the policy skeleton over it for keys that change only when a job runs.
"""

from __future__ import annotations

import bisect
from abc import abstractmethod
from collections.abc import Sequence
from typing import Generic, TypeVar

from fastserve.config import SchedulerConfig
from fastserve.core.cost_model import CostModel
from fastserve.core.kv import KVCacheManager, KVPolicy
from fastserve.core.plan import ExecutorOutput, SchedulerOutput
from fastserve.core.scheduler import Scheduler
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


class KeyedOrderScheduler(Scheduler):
    """A policy whose order is one number per job (lowest first, ties in arrival order) that
    changes only when the job runs or loses its KV: the batched jobs are re-keyed after each
    iteration, a recomputed job at once (`srpt-oracle`, `gittins`)."""

    def __init__(
        self,
        config: SchedulerConfig,
        kv: KVCacheManager,
        cost: CostModel,
        eos_token_ids: Sequence[int] = (),
        kv_policy: KVPolicy | None = None,
    ) -> None:
        super().__init__(config, kv, cost, eos_token_ids, kv_policy)
        self._queue: KeyedOrder[Request] = KeyedOrder()
        self._seq: dict[str, int] = {}  # arrival number, the tie-break
        self._num_added = 0

    def update(self, plan: SchedulerOutput, out: ExecutorOutput, now: float) -> list[Request]:
        touched = super().update(plan, out, now)
        for req in touched:
            if not req.is_finished:
                self._rekey(req)
        return touched

    def _on_recompute(self, req: Request) -> None:
        self._rekey(req)  # it has a prefill to redo now

    def _on_add(self, req: Request, now: float) -> None:
        self._seq[req.request_id] = self._num_added
        self._num_added += 1
        self._rekey(req)

    def _on_finish(self, req: Request, now: float) -> None:
        self._queue.remove(req.request_id)
        self._seq.pop(req.request_id, None)

    def _order(self, now: float) -> list[Request]:
        return self._queue.items()

    def _rekey(self, req: Request) -> None:
        rid = req.request_id
        self._queue.put(rid, (self._priority(req), self._seq[rid]), req)

    @abstractmethod
    def _priority(self, req: Request) -> float:
        """The job's key now: lower runs first."""
