"""KV moves: offload, upload and recompute, done by the scheduler and its KV policy alike.

One object owns them, so the rules hold whoever moves: no job moves both ways in one iteration
(its host blocks would be written and read at once), a job in a pipeline batch still in flight
is no victim, and every move is counted. The iteration's copies go into the next plan.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence

from fastserve.core.kv.manager import KVCacheManager
from fastserve.request import Request, RequestStatus


class KVMoves:
    def __init__(self, kv: KVCacheManager, in_flight: Collection[str],
                 on_recompute: Callable[[Request], None]) -> None:
        self.kv = kv
        self._in_flight = in_flight  # the scheduler's jobs in pipeline batches, read live
        self._on_recompute = on_recompute  # a policy's order may depend on the work left
        # This iteration's copies, as (device, host) and (host, device) block pairs.
        self.swap_out: list[tuple[int, int]] = []
        self.swap_in: list[tuple[int, int]] = []
        self._offloaded_ids: set[str] = set()
        self._uploaded_ids: set[str] = set()
        self.num_recomputes = 0  # times a request's KV was dropped for recompute
        self.num_offloads = 0  # times a request's KV was moved to host memory
        self.num_uploads = 0  # times it was moved back
        # Jobs checked as possible victims, all time: what scheduling under pressure costs
        # (a returning job that scanned the whole queue for victims made this grow with it).
        self.num_victim_checks = 0

    def take(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """The iteration's (swap_out, swap_in) copies, for its plan; the next one starts."""
        out, into = self.swap_out, self.swap_in
        self.swap_out, self.swap_in = [], []
        self._offloaded_ids, self._uploaded_ids = set(), set()
        return out, into

    def recompute(self, req: Request) -> None:
        """Drop a request's KV; it prefills its prompt and generated tokens again later."""
        self.kv.free(req.request_id)
        req.num_computed_tokens = 0
        req.status = RequestStatus.WAITING
        req.num_preemptions += 1
        self.num_recomputes += 1
        self._on_recompute(req)

    def offload(self, req: Request, release_now: bool = True) -> bool:
        """Move a request's KV to host memory (the copies go in this plan); False when the
        host pool is short. `release_now=False`: its device blocks serve no allocation before
        the next iteration (see `KVCacheManager`), so no computation waits for the copy."""
        rid = req.request_id
        if rid in self._uploaded_ids:
            raise ValueError(f"request {rid!r} was uploaded this iteration; it cannot go back")
        pairs = self.kv.offload(rid, req.num_computed_tokens, release_now)
        if pairs is None:
            return False
        self.swap_out += pairs
        self._offloaded_ids.add(rid)
        req.status = RequestStatus.SWAPPED
        self.num_offloads += 1
        return True

    def upload(self, req: Request, num_tokens: int = 0) -> bool:
        """Move a swapped request's KV back to the device, leaving room to grow to
        `num_tokens` tokens this iteration; False when the device is short."""
        rid = req.request_id
        if rid in self._offloaded_ids:
            raise ValueError(f"request {rid!r} was offloaded this iteration; it cannot come back")
        pairs = self.kv.upload(rid, num_tokens)
        if pairs is None:
            return False
        self.swap_in += pairs
        self._uploaded_ids.add(rid)
        req.status = RequestStatus.PREEMPTED
        self.num_uploads += 1
        return True

    def can_offload(self, req: Request) -> bool:
        """Whether the request could be a victim: its started KV is on the device, it did
        not just come back, and its batch is not in flight."""
        self.num_victim_checks += 1
        rid = req.request_id
        return (
            req.num_computed_tokens > 0
            and self.kv.has_blocks(rid)
            and rid not in self._uploaded_ids
            and rid not in self._in_flight
        )

    def reclaim_parked(self, goal: int) -> None:
        """Drop parked KV (beam search's finished steps, `KVCacheManager.park`), the longest
        parked first, until `goal` blocks are free soon or none is left: it goes before any
        job's KV moves, since losing it costs a fork only its partial block's computation."""
        while self.kv.num_free_soon < goal and self.kv.drop_parked():
            pass

    def prefetch_prefix(self, hashes: Sequence[int], max_blocks: int, room: int) -> int:
        """Upload host-tier prefix copies ahead of the job that will share them
        (`KVCacheManager.prefetch_prefix`); returns how many blocks."""
        return self.kv.prefetch_prefix(hashes, max_blocks, room)

    def can_upload(self, req: Request) -> bool:
        rid = req.request_id
        return self.kv.is_swapped(rid) and rid not in self._offloaded_ids
