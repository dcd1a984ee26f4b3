"""`KVSpace`: the scheduler's one seam to KV memory.

The scheduler asks what a job can reuse (`lookup`), reserves the blocks a job needs this
iteration (`reserve`: room is made through the KV policy; success or not), frees them
(`free`), reads a job's block table (`block_table`), commits computed blocks to the prefix
cache (`commit`), and ends the iteration with every copy it needs (`end_iteration`); `stats`
is the typed snapshot. The pools (`KVCacheManager`), the moves and the KV policy stay inside:
the policy reads the scheduler's order through `OrderView` and the pools read-only, and moves
KV only through `KVMoves`.

Pure Python over ints, like the rest of `fastserve.core`; `now` is passed in.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from fastserve.config import SchedulerConfig
from fastserve.core.cost_model import CostModel
from fastserve.core.kv.manager import KVCacheManager, num_blocks_for
from fastserve.core.kv.moves import KVMoves
from fastserve.core.kv.policy import KVPolicy, SchedulerView, Tiers
from fastserve.core.kv.prefix_cache import extend_block_hashes
from fastserve.core.stats import KVStats
from fastserve.request import InvalidRequestError, Request

BlockCopies = list[tuple[int, int]]  # (source block, destination block)


class OrderView(Protocol):
    """What the KV space reads of its scheduler: this iteration's order and what the
    scheduler estimates of each job (the KV policies decide with these)."""

    @property
    def config(self) -> SchedulerConfig: ...

    @property
    def cost(self) -> CostModel: ...

    @property
    def order(self) -> Sequence[Request]: ...  # this iteration's, most urgent first

    def next_run_s(self, req: Request) -> float: ...  # ENST: seconds from now to its next turn

    def admit_tokens(self, req: Request) -> int: ...  # tokens of KV the job needs to start

    def level_of(self, request_id: str) -> int | None: ...  # its queue, 0 = the most urgent

    def num_in_top_queues(self, num_queues: int) -> int: ...  # jobs in the top queues


@dataclass(frozen=True, slots=True)
class KVCopies:
    """An iteration's block copies, for its plan (the executor runs them in this order)."""

    # (device, host): jobs' KV offloaded, and evicted prefix blocks kept on the host tier.
    swap_out: BlockCopies = field(default_factory=list)
    # (host, device): jobs' KV uploaded, and prefix hits and prefetches from the host tier.
    swap_in: BlockCopies = field(default_factory=list)
    # (device, device): a fork's copy of its parent's partial last block.
    copies: BlockCopies = field(default_factory=list)


class Reuse:
    """What a job would start from if it (re)started now (`KVSpace.lookup`): nothing for a
    started job (its KV is there); else the parked KV it forks, or the longest cached prefix.
    Worked out when first asked (a waiting job the walk passes by costs no hashing)."""

    __slots__ = ("_forked", "_prefix", "_req", "_space", "is_started")

    def __init__(self, space: KVSpace, req: Request | None, is_started: bool) -> None:
        self.is_started = is_started  # its KV is on the device or the host
        self._space, self._req = space, req
        self._forked: int | None = 0 if is_started else None
        self._prefix: Sequence[int] | None = () if is_started else None

    @property
    def num_forked(self) -> int:
        """Tokens computed by forking the parked KV it continues (`Request.fork_of`)."""
        if self._forked is None:
            assert self._req is not None  # (set for a job not started)
            self._forked = self._space._fork_tokens(self._req)
        return self._forked

    @property
    def prefix(self) -> Sequence[int]:
        """Hashes of the cached blocks it starts with (none when it forks)."""
        if self._prefix is None:
            assert self._req is not None  # (set for a job not started)
            self._prefix = () if self.num_forked else self._space._cached_prefix(self._req)
        return self._prefix

    @property
    def num_tokens(self) -> int:
        """Tokens it would not compute."""
        return self.num_forked or len(self.prefix) * self._space._kv.block_size


class PrefixHold:
    """A reference, owned by no request, to the device-cached blocks of a prompt: nothing
    evicts them until `release`. A request's later sequences share its prompt this way
    (`fastserve.engine.group`); true while it holds blocks."""

    def __init__(self, kv: KVCacheManager) -> None:
        self._kv = kv
        self._block_ids: list[int] = []

    def __bool__(self) -> bool:
        return bool(self._block_ids)

    def take(self, req: Request) -> None:
        """Hold the cached blocks of `req`'s prompt a later sequence shares: those before its
        last token (`KVSpace.lookup` leaves that one to compute)."""
        self.release()
        hashes = req.block_hashes[: (req.num_prompt_tokens - 1) // self._kv.block_size]
        self._block_ids = self._kv.hold_prefix(hashes)

    def release(self) -> None:
        if self._block_ids:
            self._kv.release_prefix(self._block_ids)
            self._block_ids = []


class _PolicyView:
    """A KV policy's `SchedulerView`: the scheduler's order, the pools read-only, the moves."""

    def __init__(self, space: KVSpace, order: OrderView) -> None:
        self._space, self._order = space, order

    @property
    def config(self) -> SchedulerConfig:
        return self._order.config

    @property
    def cost(self) -> CostModel:
        return self._order.cost

    @property
    def kv(self) -> Tiers:
        return self._space._kv

    @property
    def moves(self) -> KVMoves:
        return self._space._moves

    @property
    def order(self) -> Sequence[Request]:
        return self._order.order

    def resident(self) -> list[tuple[int, Request]]:
        return self._space._resident()

    def next_run_s(self, req: Request) -> float:
        return self._order.next_run_s(req)

    def admit_tokens(self, req: Request) -> int:
        return self._order.admit_tokens(req)

    def level_of(self, request_id: str) -> int | None:
        return self._order.level_of(request_id)

    def num_in_top_queues(self, num_queues: int) -> int:
        return self._order.num_in_top_queues(num_queues)


class KVSpace:
    """The KV blocks of one scheduler's jobs, and what gives way when they run short."""

    def __init__(self, kv: KVCacheManager, policy: KVPolicy, view: OrderView,
                 in_flight: Collection[str], on_recompute: Callable[[Request], None],
                 reserve_tokens: Callable[[Request], int]) -> None:
        """`in_flight`: jobs of batches still in a pipeline (no victims), read live;
        `on_recompute`: called when a job's KV is dropped; `reserve_tokens`: tokens of KV a
        job reserves when it (re)starts beyond what its first iteration writes (Orca's)."""
        self._kv = kv
        self._policy = policy
        self._moves = KVMoves(kv, in_flight, on_recompute)  # every KV move goes here
        self._view: SchedulerView = _PolicyView(self, view)
        self._order_view = view
        self._reserve_tokens = reserve_tokens
        self._resident_now: list[tuple[int, Request]] | None = None  # see `_resident`
        # Every started job's `lookup` (NOTE: one object: most jobs walked are started).
        self._continuing = Reuse(self, None, True)
        # Prefix cache: tokens of the jobs started (or restarted after a recompute), and of
        # those the tokens found cached (/metrics: queries and hits).
        self._num_prefix_query_tokens = 0
        self._num_prefix_hit_tokens = 0
        # Times the walk asked the KV policy to defer a job's turn, all time: what scheduling
        # under pressure costs (looking at every swapped job of a long queue made it grow).
        self.num_defer_asks = 0

    # -- the seam ---------------------------------------------------------------------------

    def begin(self, now: float) -> tuple[Collection[str], int]:
        """A new iteration's walk starts (its order set): returns the started jobs the walk
        may pass without a look once the batch holds one (the KV policy's say), and how many
        other jobs hold KV."""
        self._moves.take()  # NOTE: a new iteration: nothing moved yet
        self._resident_now = None
        self._policy.begin(self._view, now)
        passable = self._policy.passable(self._view)
        return passable, self._kv.num_requests - len(passable)

    def lookup(self, req: Request) -> Reuse:
        """What the job can reuse if it starts now; changes nothing (but the request's block
        hashes, computed once)."""
        if self._kv.where(req.request_id) is not None:
            return self._continuing
        return Reuse(self, req, False)

    def reserve(self, req: Request, num_tokens: int, reuse: Reuse | None = None,
                start: int | None = None, batch_size: int = 0, now: float = 0.0
                ) -> list[int] | None:
        """Blocks for the job to hold `num_tokens` tokens after this iteration: its device
        block table (live: it grows with later reservations this iteration), or None when it
        cannot run now. With `start` (its place in the order, plus one), room is made if it
        must: parked KV goes first, then the jobs at place `start` on give way as the KV
        policy decides (`batch_size`: jobs already in the batch); a job holding no KV starts
        from `reuse` (its forked or cached tokens count as computed), a swapped one is
        uploaded first. Without `start` only free blocks are taken (a draft's growth)."""
        if start is None:
            ok = self._kv.allocate(req.request_id, num_tokens) is not None
        else:
            reuse = reuse or self.lookup(req)
            ok = self._allocate(req, num_tokens, start, batch_size, now, reuse.prefix,
                                reuse.num_forked)
        return self._kv.block_table(req.request_id) if ok else None

    def free(self, request_id: str, park: Request | None = None) -> None:
        """Release the job's blocks (and any KV parked under its id). `park`: the job
        finished and requests may continue its tokens (beam search): its computed KV is kept
        for them to fork."""
        if park is not None:
            # NOTE: its last token was never fed (and may be a placeholder's)
            n = min(park.num_computed_tokens, park.num_tokens - 1)
            self._kv.park(request_id, park.all_token_ids()[:n], park.cache_salt)
            return
        self._kv.free(request_id)
        self._kv.unpark([request_id])

    def block_table(self, request_id: str) -> list[int]:
        """The job's device blocks (empty when it has none there)."""
        return self._kv.block_table(request_id)

    def commit(self, req: Request) -> None:
        """Register the job's full blocks computed so far, for later requests to share."""
        kv = self._kv
        if kv.is_caching and req.num_computed_tokens >= kv.block_size:
            hashes = extend_block_hashes(req, kv.block_size)
            kv.cache_blocks(req.request_id, hashes, req.num_computed_tokens // kv.block_size)

    def end_iteration(self, batch: Sequence[Request], now: float) -> KVCopies:
        """The batch is chosen: the KV policy may move KV ahead of need; returns every copy
        the iteration's plan carries."""
        self._policy.plan_ahead(self._view, self._order_view.order, batch, now)
        swap_out, swap_in = self._moves.take()
        # The prefix cache's host tier: evicted blocks copied out, host hits copied in.
        demoted, from_host = self._kv.take_cache_copies()
        copies = self._kv.take_fork_copies()
        self._kv.end_iteration()
        return KVCopies(swap_out + demoted, swap_in + from_host, copies)

    def stats(self, num_prefix_hashes: int = 0) -> KVStats:
        """The blocks now and the moves and prefix hits since start; with
        `num_prefix_hashes`, a router's summary of the prefix cache (at most that many hashes
        of cached blocks, the most recently used first; none with caching off)."""
        return self._kv.stats(
            num_prefix_hashes,
            num_offloads=self._moves.num_offloads, num_uploads=self._moves.num_uploads,
            num_recomputes=self._moves.num_recomputes,
            num_prefix_query_tokens=self._num_prefix_query_tokens,
            num_prefix_hit_tokens=self._num_prefix_hit_tokens)

    def prefix_hold(self) -> PrefixHold | None:
        """A handle to hold a prompt's cached blocks for the sequences that will share it;
        None with prefix caching off (nothing to share)."""
        return PrefixHold(self._kv) if self._kv.is_caching else None

    # -- the allocation ---------------------------------------------------------------------

    def _allocate(self, req: Request, target: int, start: int, batch_size: int, now: float,
                  prefix: Sequence[int] = (), forked: int = 0) -> bool:
        rid = req.request_id
        kv = self._kv
        fork_of = req.fork_of if forked else None
        if self._policy.is_landing(self._view, req, batch_size, start):
            return False
        if kv.is_swapped(rid):
            if not self._moves.can_upload(req) or self._defer_turn(req, batch_size, start):
                return False
            if not self._make_room(req, kv.upload_shortfall(rid, target), start, now):
                return False
            self._moves.upload(req, target)
        started = kv.has_blocks(rid)
        num_tokens = target if started else max(target, self._reserve_tokens(req))
        if kv.allocate(rid, num_tokens, prefix, fork_of) is not None:
            return self._started(req, started, prefix, forked)
        # Parked KV goes first, the longest parked first; not for a shortfall it cannot cover.
        if kv.shortfall(rid, num_tokens, prefix, fork_of) <= kv.num_parked_blocks:
            while kv.drop_parked(keep=fork_of):
                if kv.allocate(rid, num_tokens, prefix, fork_of) is not None:
                    return self._started(req, started, prefix, forked)
        if self._defer_turn(req, batch_size, start):
            return False
        shortfall = kv.shortfall(rid, num_tokens, prefix, fork_of)
        if self._make_room(req, shortfall, start, now) \
                and kv.allocate(rid, num_tokens, prefix, fork_of) is not None:
            return self._started(req, started, prefix, forked)
        if started:  # nothing below it gives way: it gives up its own blocks
            self._policy.give_up(self._view, req)
        return False

    def _fork_tokens(self, req: Request) -> int:
        """Tokens the request would not compute by forking the parked KV it continues."""
        if req.fork_of is None or req.params.prompt_logprobs is not None:
            return 0
        tokens = req.all_token_ids() if req.output_token_ids else req.prompt_token_ids
        return self._kv.fork_tokens(req.fork_of, tokens, req.cache_salt)

    def _cached_prefix(self, req: Request) -> Sequence[int]:
        """Hashes of the request's longest cached run of leading blocks, leaving at least one
        token to compute (its logits give the next token)."""
        kv = self._kv
        if not kv.is_caching or req.params.prompt_logprobs is not None:
            return ()  # NOTE: prompt log-probabilities need every prompt position's logits
        hashes = extend_block_hashes(req, kv.block_size)
        n = kv.num_cached_prefix(hashes, (req.num_tokens - 1) // kv.block_size)
        return hashes[:n]

    def _started(self, req: Request, was_started: bool, prefix: Sequence[int],
                 forked: int = 0) -> bool:
        """A job got its blocks; one that was not started counts as a prefix-cache query
        (with caching off too: then nothing hits, and the queries are what prefills compute;
        a fork's `forked` tokens count as hits)."""
        if not was_started:
            cached = forked or len(prefix) * self._kv.block_size
            req.num_computed_tokens = cached
            self._num_prefix_query_tokens += req.num_tokens
            self._num_prefix_hit_tokens += cached
            if req.num_cached_tokens is None:
                req.num_cached_tokens = min(cached, req.num_prompt_tokens)
        return True

    def _defer_turn(self, req: Request, batch_size: int, start: int) -> bool:
        self.num_defer_asks += 1
        return self._policy.defer_turn(self._view, req, batch_size, start)

    def _make_room(self, req: Request, shortfall: int, start: int, now: float) -> bool:
        """Free `shortfall` more device blocks from the started requests at place `start` on
        (its victims), as the KV policy decides; takes nothing when they could not give
        enough."""
        if shortfall <= 0:
            return True
        # NOTE: from the short resident list, not by walking the rest of the order: every
        # swapped job in a long queue tries to come back, and scanning the queue for each made
        # scheduling O(queue x swapped jobs) per iteration (0.58 ms of a 4 ms CPU iteration).
        kv = self._kv
        can_offload = self._moves.can_offload
        victims = [r for i, r in self._resident() if i >= start and can_offload(r)]
        if sum(len(kv.block_table(r.request_id)) for r in victims) < shortfall:
            return False
        goal = kv.num_free_blocks + shortfall
        while kv.num_free_blocks < goal:
            if not self._policy.make_room(self._view, req, victims, now):
                return False
            victims = [r for r in victims if can_offload(r)]
        return True

    def _resident(self) -> list[tuple[int, Request]]:
        """(place in this iteration's order, job) of the jobs whose KV was on the device when
        the walk began, computed once per iteration: few jobs fit on the device, so this is
        short even when the queue is long. NOTE: a superset later in the walk (jobs are
        offloaded meanwhile); callers check residency. Jobs that gain blocks during the walk
        are in the batch or were uploaded this iteration, and neither may be a victim."""
        if self._resident_now is None:
            has_blocks = self._kv.has_blocks
            self._resident_now = [
                (i, r) for i, r in enumerate(self._order_view.order) if has_blocks(r.request_id)
            ]
        return self._resident_now


def check_fits(req: Request, kv: KVSpace) -> None:
    """Refuse a job larger than the whole device pool: it could never run (the walk would
    spin). The engine and the simulator both admit through `Scheduler.add_request`."""
    need = num_blocks_for(req.max_total_tokens, kv._kv.block_size)
    total = kv._kv.num_total_blocks
    if need > total:
        raise InvalidRequestError(
            f"max_tokens: the prompt ({req.num_prompt_tokens} tokens) plus max_tokens "
            f"({req.params.max_tokens}) needs {need} KV blocks but the cache has "
            f"{total}; lower max_tokens or raise kv_cache_gib", "max_tokens")
