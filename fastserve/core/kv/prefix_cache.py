"""Automatic prefix caching: full KV blocks named by their tokens, shared between requests.

A full block is identified by a hash chained over its tokens and the hash of the block before
it (as vLLM's automatic prefix caching does), so equal hashes mean equal tokens at equal
positions after equal prefixes: the block's KV is the same, whoever computed it. A request
reuses the longest run of leading blocks that are cached and computes only the rest.

`CachingBlockPool` is the device pool with that bookkeeping: blocks carry reference counts,
a computed full block may be registered under its hash, and a registered block that no request
references stays cached (its KV intact) in least-recently-used order until an allocation needs
room. NOTE: a block is shared only once it is full and computed, and nothing writes a full
block again, so a shared block is never overwritten; it returns to the free pool only when no
request references it, so it is never freed or moved while a job reads it.

Pure Python over ints: no torch, no clock.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence

from fastserve.core.kv.block_pool import BlockPool
from fastserve.request import Request

# The first block's parent: requests without a salt share one namespace.
_ROOT_HASH = 0


def extend_block_hashes(req: Request, block_size: int) -> list[int]:
    """The request's block hashes, extended to every full block of its tokens (prompt and
    output); computed once per block, kept on the request."""
    hashes = req.block_hashes
    num_full = req.num_tokens // block_size
    if len(hashes) == num_full:
        return hashes
    parent = hashes[-1] if hashes else _root(req.cache_salt)
    num_prompt = req.num_prompt_tokens
    start = len(hashes) * block_size
    # NOTE: a slice of the prompt when the blocks lie in it: no copy of a long prompt per call.
    tokens = (req.prompt_token_ids if num_full * block_size <= num_prompt
              else req.all_token_ids())
    for i in range(start, num_full * block_size, block_size):
        parent = hash((parent, *tokens[i : i + block_size]))
        hashes.append(parent)
    return hashes


def chain_block_hashes(token_ids: Sequence[int], block_size: int,
                       cache_salt: str | None = None) -> list[int]:
    """The chained hashes of the full blocks of `token_ids`, as `extend_block_hashes` names
    a request's blocks: what a router walks against a replica's cached hashes to tell how much
    of a prompt that replica would not recompute (`fastserve.fleet`).

    NOTE: ints hash the same in every process; a salt is a string, whose hash differs between
    processes unless PYTHONHASHSEED is fixed, so salted hashes compare only within one."""
    parent = _root(cache_salt)
    out = []
    for i in range(0, len(token_ids) // block_size * block_size, block_size):
        parent = hash((parent, *token_ids[i : i + block_size]))
        out.append(parent)
    return out


def _root(salt: str | None) -> int:
    return _ROOT_HASH if salt is None else hash(("salt", salt))


class CachingBlockPool:
    """A device block pool whose full blocks can be cached by hash and shared (see module).

    `allocate` / `free` behave as `BlockPool`'s (ids or None; free = drop a reference), and
    `num_free` counts the cached blocks nobody references, since an allocation may evict them.
    With caching off nothing is ever registered, so it is a plain pool.
    """

    def __init__(self, num_blocks: int, enabled: bool = True) -> None:
        self.pool = BlockPool(num_blocks)
        self.num_blocks = num_blocks
        self.enabled = enabled
        self._refs = [0] * num_blocks
        self._hash_of: dict[int, int] = {}  # block -> its hash, for registered blocks
        self._block_of: dict[int, int] = {}  # hash -> its block
        # Registered blocks nobody references, least recently released first.
        self._lru: OrderedDict[int, None] = OrderedDict()
        # Registered blocks released while this iteration still copies them out: they join
        # the LRU (become evictable) at `flush`.
        self._parked: list[int] = []
        self.num_evictions = 0
        # Called with (block, hash) as a cached block is evicted, before it is reused: the
        # host tier may keep a copy (`KVCacheManager`).
        self.on_evict: Callable[[int, int], None] | None = None

    # -- sizes ------------------------------------------------------------------------------

    @property
    def num_free(self) -> int:
        """Blocks an allocation can have now: free ones and evictable cached ones."""
        return self.pool.num_free + len(self._lru)

    @property
    def num_used(self) -> int:
        """Blocks some request references (or parked for a copy)."""
        return self.num_blocks - self.num_free

    @property
    def num_cached(self) -> int:
        """Blocks registered under a hash, referenced or not."""
        return len(self._hash_of)

    def can_allocate(self, n: int) -> bool:
        return n <= self.num_free

    # -- allocation -------------------------------------------------------------------------

    def allocate(self, n: int, after: int | None = None) -> list[int] | None:
        """`n` blocks with one reference each, evicting least recently used cached blocks
        only when the free pool is short; None (taking nothing) when even that is short."""
        if n > self.num_free:
            return None
        short = n - self.pool.num_free
        if short > 0:
            evicted = [self._lru.popitem(last=False)[0] for _ in range(short)]
            for b in evicted:
                h = self._forget(b)
                if self.on_evict is not None:
                    self.on_evict(b, h)
            self.pool.free(evicted)
            self.num_evictions += short
        out = self.pool.allocate(n, after)
        assert out is not None
        for b in out:
            self._refs[b] = 1
        return out

    def free(self, block_ids: Sequence[int]) -> None:
        """Drop one reference to each block. A registered block nobody references stays
        cached (evictable); an unregistered one returns to the free pool."""
        self.pool.free(self._release(block_ids, park=False))

    def release_later(self, block_ids: Sequence[int]) -> list[int]:
        """`free` for blocks this iteration still copies out: registered ones stay cached but
        become evictable only at `flush`; unregistered ones nobody references are returned
        for the caller to hand back at `free_released` (until then uploads may reuse them)."""
        return self._release(block_ids, park=True)

    def take_released(self, block_ids: Sequence[int]) -> None:
        """Blocks from `release_later` that the caller gives to a request instead."""
        for b in block_ids:
            self._refs[b] = 1

    def free_released(self, block_ids: Sequence[int]) -> None:
        """The iteration's copies are planned: released blocks go back, parked ones become
        evictable."""
        if block_ids:
            self.pool.free(list(block_ids))
        for b in self._parked:
            if self._refs[b] == 0 and b in self._hash_of:
                self._lru[b] = None
        self._parked = []

    def _release(self, block_ids: Sequence[int], park: bool) -> list[int]:
        unregistered: list[int] = []
        # NOTE: the last blocks first, so that a sequence's tail is evicted before its prefix
        # (the prefix is what other requests share).
        for b in reversed(block_ids):
            refs = self._refs[b] - 1
            if refs < 0:
                raise ValueError(f"double free of block {b}")
            self._refs[b] = refs
            if refs > 0:
                continue
            if b in self._hash_of:
                if park:
                    self._parked.append(b)
                else:
                    self._lru[b] = None
            else:
                unregistered.append(b)
        unregistered.reverse()
        return unregistered

    # -- the cache --------------------------------------------------------------------------

    def lookup(self, hashes: Sequence[int], max_blocks: int) -> int:
        """How many of the first `max_blocks` hashes are cached, from the first on (nothing
        changes)."""
        if not self.enabled:
            return 0
        n = 0
        cached = self._block_of
        for h in hashes:
            if n >= max_blocks or h not in cached:
                break
            n += 1
        return n

    def add_cached(self, hashes: Sequence[int]) -> list[int] | None:
        """Blocks (evicting least recently used ones if need be) registered under `hashes`,
        referenced by no one, for copies of them about to be written: they become evictable
        only at `free_released` (an eviction's demotion would copy them out before they are
        written). None when even eviction is short."""
        blocks = self.allocate(len(hashes))
        if blocks is None:
            return None
        for b, h in zip(blocks, hashes, strict=True):
            self._refs[b] = 0
            self._block_of[h] = b
            self._hash_of[b] = h
        self._parked += blocks
        return blocks

    def recent_hashes(self, limit: int) -> list[int]:
        """Up to `limit` registered hashes: those of blocks in use first (the most recently
        used), then the evictable ones from the most recently released on (changes nothing)."""
        if len(self._block_of) <= limit:
            return list(self._block_of)
        lru = self._lru
        out = [h for b, h in self._hash_of.items() if b not in lru][:limit]
        for b in reversed(lru):
            if len(out) >= limit:
                break
            out.append(self._hash_of[b])
        return out

    def num_unreferenced(self, hashes: Sequence[int]) -> int:
        """How many of these (cached) hashes' blocks nobody references: evictable now."""
        return sum(1 for h in hashes if self._block_of[h] in self._lru)

    def share(self, hashes: Sequence[int]) -> list[int]:
        """A reference to the cached block of each hash (all must be cached: `lookup`)."""
        out = []
        for h in hashes:
            b = self._block_of.get(h)
            if b is None:
                raise ValueError("share() of a block that is not cached; lookup() first")
            if self._refs[b] == 0:
                self._lru.pop(b, None)
                if b in self._parked:
                    self._parked.remove(b)
            self._refs[b] += 1
            out.append(b)
        return out

    def ref(self, block_ids: Sequence[int]) -> None:
        """One more reference to each of these referenced blocks (a fork shares them)."""
        for b in block_ids:
            if self._refs[b] <= 0:
                raise ValueError(f"ref() of block {b}, which nobody references")
            self._refs[b] += 1

    def register(self, block_ids: Sequence[int], hashes: Sequence[int]) -> None:
        """Name computed full blocks by their hashes, so later requests can share them. A
        hash already cached keeps its block (this one stays private to its request)."""
        if not self.enabled:
            return
        for b, h in zip(block_ids, hashes, strict=True):
            if h in self._block_of or b in self._hash_of:
                continue
            self._block_of[h] = b
            self._hash_of[b] = h

    def _forget(self, block: int) -> int:
        h = self._hash_of.pop(block)
        del self._block_of[h]
        return h


class HostPrefixCache:
    """The host tier: copies of cached blocks evicted from the device, in host pool blocks,
    until the host pool needs the room.

    NOTE: offloaded running jobs win the shared host pool: `evict` gives cached copies up for
    them. A job's KV is work already done that it will certainly need again (losing it means
    recomputing its prompt and every generated token), while a cached prefix is only a chance
    that some later request repeats it. A copy added this iteration may still be written by
    this iteration's copies, so it becomes evictable only at `flush`.
    """

    def __init__(self, pool: BlockPool) -> None:
        self.pool = pool
        self._block_of: dict[int, int] = {}  # hash -> host block
        self._lru: OrderedDict[int, None] = OrderedDict()  # hashes, least recently used first
        self._fresh: list[int] = []  # hashes added this iteration
        self._last: int | None = None  # the host block of the latest copy
        self.num_evictions = 0

    @property
    def num_cached(self) -> int:
        return len(self._block_of)

    @property
    def num_evictable(self) -> int:
        return len(self._lru)

    def lookup(self, hashes: Sequence[int], start: int, max_blocks: int) -> int:
        """How many hashes from `start` on (up to `max_blocks` in all) have a host copy."""
        n = start
        while n < max_blocks and n < len(hashes) and hashes[n] in self._block_of:
            n += 1
        return n - start

    def add(self, h: int) -> int | None:
        """A host block to copy the block of hash `h` into (evicting the least recently used
        copy if the pool is full), or None when there is no room."""
        if h in self._block_of:
            return None
        # NOTE: right after the last copy when that block is free: demotions come one block
        # at a time, and a fresh placement scans every free run of a fragmented pool.
        got = self.pool.allocate(1, after=self._last)
        if got is None:
            if not self._lru:
                return None
            old, _ = self._lru.popitem(last=False)
            got = [self._block_of.pop(old)]
            self.num_evictions += 1
        self._block_of[h] = self._last = got[0]
        self._fresh.append(h)
        return got[0]

    def recent_hashes(self, limit: int) -> list[int]:
        """Up to `limit` hashes with a host copy, the most recently added first."""
        if len(self._block_of) <= limit:
            return list(self._block_of)
        return list(self._block_of)[::-1][:limit]

    def claim(self, h: int) -> int:
        """Take the copy of hash `h` out of the cache (it is being uploaded): its host block
        is the caller's to free once the upload has read it."""
        self._lru.pop(h, None)
        if h in self._fresh:
            self._fresh.remove(h)
        return self._block_of.pop(h)

    def evict(self, n: int) -> None:
        """Give up to `n` least recently used copies back to the host pool."""
        freed: list[int] = []
        while len(freed) < n and self._lru:
            h, _ = self._lru.popitem(last=False)
            freed.append(self._block_of.pop(h))
        if freed:
            self.pool.free(freed)
            self.num_evictions += len(freed)

    def flush(self) -> None:
        for h in self._fresh:
            self._lru[h] = None
        self._fresh = []
