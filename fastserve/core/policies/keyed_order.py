"""Requests kept sorted by a priority key that changes for only a few of them per iteration.

Re-sorting every unfinished request each iteration costs O(n log n) Python comparisons (about a
millisecond at 10,000 jobs). Between two iterations only the batched jobs (at most
max_batch_size) change priority, so each is moved instead: a binary search plus one C-level
`memmove` of the list tail. Reading the order is then a plain list copy.
"""

from __future__ import annotations

import bisect
from typing import Generic, TypeVar

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
