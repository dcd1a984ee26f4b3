"""Parked KV, for forks: a finished request's device KV kept for requests that continue its
tokens (beam search's next steps). Such a request forks it, sharing its full blocks and
getting a copy of its partial last block (a device copy in the plan), so it computes only its
new tokens, with prefix caching on or off.

NOTE: a fork's copy runs after the iteration's uploads, so the block it reads stays
referenced until `end_iteration()` even if its parent is unparked meanwhile.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import NamedTuple

from fastserve.core.kv.prefix_cache import CachingBlockPool


class Parked(NamedTuple):
    """A finished request's device KV, kept for requests that fork from it."""

    block_ids: list[int]
    token_ids: list[int]  # whose KV its blocks hold, from position 0
    cache_salt: str | None  # forks must share it (it names the LoRA adapter too)


class ParkedKV:
    """The parked tables over the device pool, and this iteration's fork copies."""

    def __init__(self, device: CachingBlockPool, block_size: int) -> None:
        self.device = device
        self.block_size = block_size
        self._parked: dict[str, Parked] = {}  # finished requests' KV kept for forks
        self.num_dropped = 0  # parked requests' KV dropped for room, all time
        self._copies: list[tuple[int, int]] = []  # this iteration's (parent, fork) blocks
        # The blocks those copies read, referenced until `end_iteration`: a parent unparked
        # in the same iteration must not hand its partial block to this plan's uploads,
        # which run before the copies.
        self._sources: list[int] = []

    @property
    def num_parked(self) -> int:
        return len(self._parked)

    @property
    def num_blocks(self) -> int:
        """Blocks in parked tables, counted once per table: an upper bound on what unparking
        them all would free (tables share blocks, and forks share theirs)."""
        return sum(len(p.block_ids) for p in self._parked.values())

    def park(self, request_id: str, table: list[int], keep: int, token_ids: Sequence[int],
             cache_salt: str | None) -> None:
        """Keep the first `keep` blocks of a finished request's `table` (the KV of
        `token_ids`); free the rest."""
        self.device.free(table[keep:])
        self._parked[request_id] = Parked(table[:keep], list(token_ids), cache_salt)

    def fork_tokens(self, parent_id: str, token_ids: Sequence[int], cache_salt: str | None
                    ) -> int:
        """How many of `token_ids` a request starting now would find computed by forking
        parked `parent_id`: all of the parent's tokens when they begin `token_ids` and leave
        at least one to compute (its logits give the next token); else 0. Changes nothing."""
        parked = self._parked.get(parent_id)
        if parked is None or parked.cache_salt != cache_salt:
            return 0
        n = len(parked.token_ids)
        if n >= len(token_ids) or list(token_ids[:n]) != parked.token_ids:
            return 0
        return n

    def num_shared_blocks(self, parent_id: str) -> int:
        """The parent's full blocks, which a fork shares (referenced: not free)."""
        return len(self._parked[parent_id].token_ids) // self.block_size

    def fork(self, parent_id: str) -> list[int]:
        """A new table sharing the parent's full blocks and holding a copy of its partial
        last block (the caller's shortfall counted that one)."""
        parent = self._parked[parent_id]
        num_full, partial = divmod(len(parent.token_ids), self.block_size)
        table = parent.block_ids[:num_full]
        self.device.ref(table)
        if partial:
            new = self.device.allocate(1, after=table[-1] if table else None)
            assert new is not None  # the shortfall counted it
            source = parent.block_ids[num_full]
            self.device.ref([source])
            self._sources.append(source)
            self._copies.append((source, new[0]))
            table = [*table, *new]
        return table

    def unpark(self, request_ids: Iterable[str]) -> None:
        """Drop these parked requests' KV (those no longer parked are skipped): forks made
        from it keep what they share."""
        for rid in request_ids:
            parked = self._parked.pop(rid, None)
            if parked is not None:
                self.device.free(parked.block_ids)

    def drop(self, keep: str | None = None) -> bool:
        """Under memory pressure: unpark the longest parked request but `keep` (its forks
        will compute what they would have copied); returns whether one was dropped."""
        oldest = next((rid for rid in self._parked if rid != keep), None)
        if oldest is None:
            return False
        self.unpark([oldest])
        self.num_dropped += 1
        return True

    def take_copies(self) -> list[tuple[int, int]]:
        """This iteration's (parent block, fork block) device copies, for its plan."""
        copies, self._copies = self._copies, []
        return copies

    def end_iteration(self) -> None:
        """The plan is complete: the blocks its fork copies read may be reused."""
        assert not self._copies, "the plan takes its fork copies before it is complete"
        self.device.free(self._sources)
        self._sources = []
