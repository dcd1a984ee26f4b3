"""KV block manager: where each request's KV lives (device or host pool) and in which blocks.

Pure bookkeeping over block ids; the executor owns the tensors these ids index and carries out
the copies that `offload` / `upload` return. A request's KV moves as a whole, block by block,
and its block table follows it from one pool to the other.

With prefix caching (`fastserve.core.kv.prefix_cache`) a request's device table may begin with
blocks it shares with others: leaving the device (free, offload) drops its references, and a
cached block nobody references stays on the device until an allocation needs the room.

A finished request's device KV may be parked (`park`; `fastserve.core.kv.forks` keeps it) for
requests that continue its tokens (beam search's next steps): such a request forks it
(`allocate(..., fork_of=...)`), sharing its full blocks and getting a copy of its partial last
block (a device copy in the plan), so it computes only its new tokens.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Sequence

from fastserve.core.kv.block_pool import BlockPool
from fastserve.core.kv.forks import ParkedKV
from fastserve.core.kv.prefix_cache import CachingBlockPool, HostPrefixCache
from fastserve.core.stats import KVStats


def num_blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


class KVLocation(enum.Enum):
    DEVICE = "device"
    HOST = "host"


class KVCacheManager:
    """Per-request block tables over a device block pool and a host (swap) block pool.

    NOTE: host blocks read by an upload are released only at `end_iteration()`. The executor
    runs an iteration's swap-outs before its swap-ins, so a swap-out of the same iteration must
    not be given a host block that a swap-in has yet to read. Likewise an offload may keep its
    device blocks out of the pool until `end_iteration()` (`release_now=False`), so that no
    computation of this iteration writes a block that is still being copied out: until then
    only uploads (whose copies run after the swap-outs) may take them. A fork's copy runs after
    the uploads, so the block it reads stays referenced until `end_iteration()` even if its
    parent is unparked meanwhile.
    """

    def __init__(self, num_device_blocks: int, block_size: int, num_host_blocks: int = 0,
                 enable_prefix_caching: bool = False) -> None:
        self.block_size = block_size
        self.device = CachingBlockPool(num_device_blocks, enable_prefix_caching)
        self.host = BlockPool(num_host_blocks)
        # The prefix cache's host tier: evicted device blocks are copied here when it has room.
        self.host_cache = HostPrefixCache(self.host)
        if enable_prefix_caching and num_host_blocks > 0:
            self.device.on_evict = self._demote
        # This iteration's prefix-cache copies, for the plan: (device, host) demotions of
        # evicted blocks and (host, device) uploads of host hits.
        self._cache_copies_out: list[tuple[int, int]] = []
        self._cache_copies_in: list[tuple[int, int]] = []
        # Prefix blocks copied to the host tier on eviction, and found there, all time (not
        # in num_swap_*_blocks, which count jobs' moves).
        self.num_demoted_blocks = 0
        self.num_host_hit_blocks = 0
        self.num_prefetched_blocks = 0  # host-tier prefix blocks uploaded ahead of a job
        self._tables: dict[str, list[int]] = {}  # device block tables
        self._num_registered: dict[str, int] = {}  # leading blocks of a table registered
        self._host_tables: dict[str, list[int]] = {}
        self._host_releasing: list[int] = []  # read by this iteration's uploads
        self._device_releasing: list[int] = []  # being copied out by this iteration's offloads
        self.forks = ParkedKV(self.device, block_size)  # finished requests' KV kept for forks
        self.peak_used_blocks = 0  # most device blocks in use at once
        self.num_swap_out_blocks = 0  # blocks copied device -> host, all time
        self.num_swap_in_blocks = 0  # blocks copied host -> device, all time

    # -- sizes ------------------------------------------------------------------------------

    @property
    def num_total_blocks(self) -> int:
        return self.device.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.device.num_free

    @property
    def num_free_soon(self) -> int:
        """Device blocks free once this iteration's offloads have been copied out."""
        return self.device.num_free + len(self._device_releasing)

    @property
    def num_total_host_blocks(self) -> int:
        return self.host.num_blocks

    @property
    def num_free_host_blocks(self) -> int:
        """Host blocks free now, cached prefix copies included (offloads evict them); those
        still being read by this iteration's uploads are not."""
        return self.host.num_free + self.host_cache.num_evictable

    @property
    def num_requests(self) -> int:
        """Requests holding blocks, on either pool."""
        return len(self._tables) + len(self._host_tables)

    @property
    def num_swapped(self) -> int:
        """Requests whose KV is on the host."""
        return len(self._host_tables)

    # -- lookups ----------------------------------------------------------------------------

    def where(self, request_id: str) -> KVLocation | None:
        """Which pool holds the request's KV; None when it holds no blocks."""
        if request_id in self._tables:
            return KVLocation.DEVICE
        if request_id in self._host_tables:
            return KVLocation.HOST
        return None

    def has_blocks(self, request_id: str) -> bool:
        """True when the request's KV is on the device."""
        return request_id in self._tables

    def is_swapped(self, request_id: str) -> bool:
        return request_id in self._host_tables

    def swapped_ids(self) -> Iterable[str]:
        """The requests whose KV is on the host."""
        return self._host_tables.keys()

    def block_table(self, request_id: str) -> list[int]:
        """The request's device blocks (empty when it has none there)."""
        return self._tables.get(request_id, [])

    def host_table(self, request_id: str) -> list[int]:
        return self._host_tables.get(request_id, [])

    def num_new_blocks(self, request_id: str, num_tokens: int) -> int:
        """Device blocks still missing for the request to hold `num_tokens` tokens."""
        have = len(self._tables.get(request_id, ()))
        return max(0, num_blocks_for(num_tokens, self.block_size) - have)

    # -- device allocation ------------------------------------------------------------------

    def allocate(self, request_id: str, num_tokens: int, prefix_hashes: Sequence[int] = (),
                 fork_of: str | None = None) -> list[int] | None:
        """Grow the request's device table to hold `num_tokens` tokens; None (nothing taken)
        if short. A request holding no blocks starts with the cached blocks of
        `prefix_hashes` (all cached: `num_cached_prefix`), shared, not copied; or, given
        `fork_of`, with the KV of that parked request (`fork_tokens` says how many tokens).
        NOTE: a swapped request must be uploaded first."""
        if request_id in self._host_tables:
            raise ValueError(f"request {request_id!r} is swapped out; upload it before allocating")
        table = self._tables.get(request_id)
        if table is not None:
            if len(table) * self.block_size >= num_tokens:
                return []  # the common decode step: nothing taken (end_iteration notes the peak)
            prefix_hashes = ()
        elif self.shortfall(request_id, num_tokens, prefix_hashes, fork_of) > 0:
            return None
        elif fork_of is not None:
            self._tables[request_id] = self.forks.fork(fork_of)
        elif prefix_hashes:
            self._tables[request_id] = self._start_from_cache(prefix_hashes)
            self._num_registered[request_id] = len(prefix_hashes)
        need = self.num_new_blocks(request_id, num_tokens)
        table = self._tables.setdefault(request_id, [])
        if need == 0:
            self._note_peak()
            return []
        new = self.device.allocate(need, after=table[-1] if table else None)
        if new is None:
            if not table:
                del self._tables[request_id]
            return None
        table += new
        self._note_peak()
        return new

    def free(self, request_id: str) -> int:
        """Release every block the request holds, on either pool; returns how many."""
        table = self._tables.pop(request_id, None)
        self._num_registered.pop(request_id, None)
        if table is not None:
            self.device.free(table)
            return len(table)
        host = self._host_tables.pop(request_id, [])
        self.host.free(host)
        return len(host)

    # -- parked KV, for forks ---------------------------------------------------------------

    @property
    def num_parked(self) -> int:
        """Finished requests whose KV is parked."""
        return self.forks.num_parked

    @property
    def num_parked_blocks(self) -> int:
        return self.forks.num_blocks

    @property
    def num_dropped_parked(self) -> int:
        """Parked requests' KV dropped for room, all time."""
        return self.forks.num_dropped

    def park(self, request_id: str, token_ids: Sequence[int], cache_salt: str | None) -> bool:
        """The request is done: keep the device blocks holding the KV of `token_ids` (its
        first tokens) for requests that fork from it, until `unpark`; the rest are freed.
        A request with no device KV frees what it has; returns whether anything was parked."""
        table = self._tables.get(request_id)
        keep = num_blocks_for(len(token_ids), self.block_size)
        if table is None or not token_ids or keep > len(table):
            self.free(request_id)
            return False
        del self._tables[request_id]
        self._num_registered.pop(request_id, None)
        self.forks.park(request_id, table, keep, token_ids, cache_salt)
        return True

    def fork_tokens(self, parent_id: str, token_ids: Sequence[int], cache_salt: str | None
                    ) -> int:
        return self.forks.fork_tokens(parent_id, token_ids, cache_salt)

    def unpark(self, request_ids: Iterable[str]) -> None:
        self.forks.unpark(request_ids)

    def drop_parked(self, keep: str | None = None) -> bool:
        return self.forks.drop(keep)

    def take_fork_copies(self) -> list[tuple[int, int]]:
        return self.forks.take_copies()

    # -- moves between pools ----------------------------------------------------------------

    def can_offload(self, request_id: str, num_cached_tokens: int) -> bool:
        return self._num_valid(request_id, num_cached_tokens) <= self.num_free_host_blocks

    def offload(
        self, request_id: str, num_cached_tokens: int, release_now: bool = True
    ) -> list[tuple[int, int]] | None:
        """Move the request's KV to the host pool: (device_block, host_block) copies to run.

        Only the blocks that hold its `num_cached_tokens` tokens are copied (Orca-style
        reservations beyond them hold nothing). Returns None, moving nothing, when the host
        pool is short; the request must hold device blocks. `release_now=False` keeps its
        device blocks from this iteration's allocations (see the class docstring).
        """
        table = self._tables.get(request_id)
        if table is None:
            raise ValueError(f"request {request_id!r} holds no device blocks to offload")
        valid = table[: self._num_valid(request_id, num_cached_tokens)]
        self.host_cache.evict(len(valid) - self.host.num_free)  # running jobs win the host
        host = self.host.allocate(len(valid))
        if host is None:
            return None
        del self._tables[request_id]
        self._num_registered.pop(request_id, None)
        if release_now:
            self.device.free(table)
        else:
            self._device_releasing += self.device.release_later(table)
        self._host_tables[request_id] = host
        self.num_swap_out_blocks += len(valid)
        return list(zip(valid, host, strict=True))

    def can_upload(self, request_id: str, num_tokens: int = 0) -> bool:
        """Whether the device has room for the request's KV and then for `num_tokens` tokens."""
        return self.upload_shortfall(request_id, num_tokens) <= 0

    def upload_shortfall(self, request_id: str, num_tokens: int = 0) -> int:
        """Device pool blocks missing to upload the request and then grow it to `num_tokens`
        tokens (the growth is written this iteration, so it cannot use blocks still being
        copied out; the upload can)."""
        have = len(self._host_tables.get(request_id, ()))
        grow = max(0, num_blocks_for(num_tokens, self.block_size) - have)
        return grow + max(0, have - len(self._device_releasing)) - self.device.num_free

    def upload(self, request_id: str, num_tokens: int = 0) -> list[tuple[int, int]] | None:
        """Move the request's KV back to the device: (host_block, device_block) copies to run.

        The blocks come from the pool (a contiguous run when it can), then, if it is short,
        from blocks still being copied out this iteration (the copy engine runs the swap-outs
        first), leaving in the pool what growing to `num_tokens` tokens will take. Returns
        None, moving nothing, when the device is short.
        """
        host = self._host_tables.get(request_id)
        if host is None:
            raise ValueError(f"request {request_id!r} is not swapped out")
        if self.upload_shortfall(request_id, num_tokens) > 0:
            return None
        grow = max(0, num_blocks_for(num_tokens, self.block_size) - len(host))
        from_pool = max(len(host) - len(self._device_releasing),
                        min(len(host), self.device.num_free - grow))
        device = self.device.allocate(from_pool) or []
        reuse = len(host) - from_pool
        reused = self._device_releasing[:reuse]
        self.device.take_released(reused)
        device += reused
        del self._device_releasing[:reuse]
        del self._host_tables[request_id]
        self._tables[request_id] = device
        self._host_releasing += host
        self.num_swap_in_blocks += len(host)
        self._note_peak()
        return list(zip(host, device, strict=True))

    def end_iteration(self) -> None:
        """The plan is complete: host blocks read by its uploads, and device blocks its fork
        copies read, may be reused from now on."""
        self._note_peak()  # NOTE: also what sharing cached blocks took, noted nowhere else
        self.forks.end_iteration()
        if self._host_releasing:
            self.host.free(self._host_releasing)
            self._host_releasing = []
        self.device.free_released(self._device_releasing)
        self._device_releasing = []
        self.host_cache.flush()

    # -- prefix cache -----------------------------------------------------------------------

    @property
    def is_caching(self) -> bool:
        """Whether prefix caching is on."""
        return self.device.enabled

    @property
    def num_cached_blocks(self) -> int:
        """Device blocks registered in the prefix cache (shared, in use or evictable)."""
        return self.device.num_cached

    @property
    def num_cached_host_blocks(self) -> int:
        """Host blocks holding copies of cached blocks evicted from the device."""
        return self.host_cache.num_cached

    def num_cached_prefix(self, hashes: Sequence[int], max_blocks: int) -> int:
        """How many of the first `max_blocks` of these hashes are cached, from the first on:
        on the device, then on the host tier (changes nothing)."""
        n = self.device.lookup(hashes, max_blocks)
        if self.device.enabled and self.host_cache.num_cached:
            n += self.host_cache.lookup(hashes, n, max_blocks)
        return n

    def cached_hashes(self, max_hashes: int) -> tuple[frozenset[int], bool]:
        """Hashes of the blocks a new request could start from (a router's summary of this
        cache, `ReplicaStats.prefix_hashes`): the device's, then the host tier's copies, at
        most `max_hashes` of them, the most recently used first; and whether it was cut."""
        device = self.device.recent_hashes(max_hashes)
        room = max_hashes - len(device)
        host = self.host_cache.recent_hashes(room) if room > 0 else []
        total = self.device.num_cached + self.host_cache.num_cached
        return frozenset(device).union(host), len(device) + len(host) < total
    def hold_prefix(self, hashes: Sequence[int]) -> list[int]:
        """A reference, owned by no request, to the device-cached blocks of the leading run
        of `hashes`: nothing evicts them until `release_prefix`. A request's later sequences
        share its prompt this way (`fastserve.engine.group`)."""
        return self.device.share(hashes[: self.device.lookup(hashes, len(hashes))])

    def release_prefix(self, block_ids: Sequence[int]) -> None:
        """Drop the references `hold_prefix` took (the blocks stay cached, evictable)."""
        self.device.free(block_ids)

    def take_cache_copies(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """The prefix cache's copies since the last call, for this iteration's plan: (device,
        host) demotions to run with the swap-outs, (host, device) uploads with the swap-ins."""
        out, self._cache_copies_out = self._cache_copies_out, []
        into, self._cache_copies_in = self._cache_copies_in, []
        return out, into

    def prefetch_prefix(self, hashes: Sequence[int], max_blocks: int, room: int) -> int:
        """Upload the host-tier copies that continue the device-cached run of `hashes` (up to
        `max_blocks` in all, at most `room` of them; least recently used cached blocks make
        way), so that a job about to start finds them on the device; returns how many. They
        stay cached, referenced by no one, until the job shares them."""
        if not self.device.enabled or not self.host_cache.num_cached:
            return 0
        num_device = self.device.lookup(hashes, max_blocks)
        n = min(self.host_cache.lookup(hashes, num_device, max_blocks), room,
                self.device.num_free)
        if n <= 0:
            return 0
        wanted = hashes[num_device : num_device + n]
        host = [self.host_cache.claim(h) for h in wanted]
        device = self.device.add_cached(wanted)
        assert device is not None  # n <= what is free or evictable
        self._cache_copies_in += zip(host, device, strict=True)
        self._host_releasing += host
        self.num_prefetched_blocks += n
        return n

    def _start_from_cache(self, hashes: Sequence[int]) -> list[int]:
        """A new table of the cached blocks of `hashes`: the device's shared, the rest
        uploaded from host copies into fresh device blocks (then cached on the device)."""
        num_device = self.device.lookup(hashes, len(hashes))
        table = self.device.share(hashes[:num_device])
        from_host = hashes[num_device:]
        if from_host:
            # NOTE: claimed before allocating: an eviction's demotion may not reuse them.
            host = [self.host_cache.claim(h) for h in from_host]
            device = self.device.allocate(len(host), after=table[-1] if table else None)
            assert device is not None  # `shortfall` counted them
            self.device.register(device, from_host)
            self._cache_copies_in += zip(host, device, strict=True)
            self._host_releasing += host  # read by this iteration's upload
            self.num_host_hit_blocks += len(host)
            table += device
        return table

    def _demote(self, block: int, h: int) -> None:
        """A cached device block is being evicted: keep a copy on the host when there is room
        (the copy runs before anything writes the block: swap-outs come first)."""
        host = self.host_cache.add(h)
        if host is not None:
            self._cache_copies_out.append((block, host))
            self.num_demoted_blocks += 1

    def shortfall(self, request_id: str, num_tokens: int, prefix_hashes: Sequence[int] = (),
                  fork_of: str | None = None) -> int:
        """Device blocks missing for `allocate(request_id, num_tokens, prefix_hashes,
        fork_of)`: the shared prefix needs none of its own, but those of its blocks nobody
        references stop being free (evictable) once it holds them; a fork shares its
        parent's full blocks (referenced: not free)."""
        if request_id in self._tables:
            return self.num_new_blocks(request_id, num_tokens) - self.num_free_blocks
        if fork_of is not None:
            num_shared = self.forks.num_shared_blocks(fork_of)
            return num_blocks_for(num_tokens, self.block_size) - num_shared - self.num_free_blocks
        if not prefix_hashes:
            return self.num_new_blocks(request_id, num_tokens) - self.num_free_blocks
        on_device = prefix_hashes[: self.device.lookup(prefix_hashes, len(prefix_hashes))]
        need = num_blocks_for(num_tokens, self.block_size) - len(on_device)
        pinned = self.device.num_unreferenced(on_device)
        return need + pinned - self.num_free_blocks

    def cache_blocks(self, request_id: str, hashes: Sequence[int], num_blocks: int) -> None:
        """The request's first `num_blocks` blocks are full and computed (their hashes lead
        `hashes`): register them so later requests can share them."""
        done = self._num_registered.get(request_id, 0)
        if num_blocks <= done:
            return
        table = self._tables.get(request_id)
        if table is None:
            return
        n = min(num_blocks, len(table))
        self.device.register(table[done:n], hashes[done:n])
        self._num_registered[request_id] = n

    # -- internals --------------------------------------------------------------------------

    def _num_valid(self, request_id: str, num_cached_tokens: int) -> int:
        have = len(self._tables.get(request_id, ()))
        return min(have, num_blocks_for(num_cached_tokens, self.block_size))

    def stats(self, num_prefix_hashes: int = 0, **counters: int) -> KVStats:
        """The pools' counters, with the moves' and the prefix queries' `counters`, and up to
        `num_prefix_hashes` hashes of cached blocks (`cached_hashes`)."""
        hashes, cut = (self.cached_hashes(num_prefix_hashes)
                       if self.is_caching and num_prefix_hashes > 0 else (frozenset(), False))
        return KVStats(
            num_total_blocks=self.num_total_blocks,
            num_free_blocks=self.num_free_blocks,
            num_total_host_blocks=self.num_total_host_blocks,
            num_free_host_blocks=self.num_free_host_blocks,
            peak_used_blocks=self.peak_used_blocks,
            num_swap_out_blocks=self.num_swap_out_blocks,
            num_swap_in_blocks=self.num_swap_in_blocks,
            num_cached_blocks=self.num_cached_blocks,
            num_cached_host_blocks=self.num_cached_host_blocks,
            num_host_hit_tokens=self.num_host_hit_blocks * self.block_size,
            num_prefetched_tokens=self.num_prefetched_blocks * self.block_size,
            block_size=self.block_size,
            prefix_hashes=hashes,
            is_prefix_truncated=cut,
            **counters,
        )

    def _note_peak(self) -> None:
        self.peak_used_blocks = max(self.peak_used_blocks, self.device.num_used)
