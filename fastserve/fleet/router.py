"""The fleet router's interface: what a replica reports, what a request brings, and `choose`.

One router object decides for a fleet of replicas that each run the production scheduler. It
is pure Python over ints and floats: no torch, no Ray, no clock (`now` is passed in), so the
multi-replica simulator (`fastserve.sim.fleet`) and the Ray Serve `RequestRouter` run the same
code, and a recorded trace of its inputs replays to the same placements
(`fastserve.fleet.trace`).

The calls, in the order a host makes them:

- `update(stats)`: a replica's new `ReplicaStats` (built by `Scheduler.replica_stats`; Ray:
  its routing stats, periodically; simulator: every stats period).
- `choose(req, now, candidates)` -> replica id: rank the candidates and note the request as
  sent to the first. A host that may send elsewhere (Ray when the first is full) calls
  `rank(...)` and then `note_sent(...)` with the replica it actually used; `choose` is exactly
  those two calls.
- `forget(request_id, replica_id)`: a request sent there never reached its engine.
- `remove(replica_id)`: a replica left the fleet.

Staleness: a snapshot is as old as its period. Between two, the router keeps its own
optimistic bookkeeping of what it sent each replica (one more request, the work of the level it
was predicted to join, its prefix blocks as cached there, its blocks as used) until a snapshot
counts the request. A router with a `source` (a fleet's ingress) drops its oldest requests sent
to a replica as that replica's count of requests taken in from the source
(`ReplicaStats.admitted`) grows: a request on its way (the network, the replica's HTTP server,
the wait for the engine's next iteration) is in neither the snapshot nor a time stamp's past,
and a burst sent within one period would otherwise be forgotten before it arrives. A host that
learns a request never reached a replica's engine (refused, or the connection failed) calls
`forget`. Without counts (the simulator, whose sends arrive at once), the requests sent before
a newer snapshot's `time_s` are dropped.

Determinism: the candidates are taken in sorted order whatever order the host passes them,
and the only randomness (power of two choices) comes from a `random.Random(seed)` the router
owns, so the same calls give the same placements in any process.
"""

from __future__ import annotations

import bisect
from abc import ABC, abstractmethod
from collections import Counter, deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from fastserve.core.kv import chain_block_hashes, num_blocks_for
from fastserve.core.policies.mlfq_settings import ChargeModel
from fastserve.core.replica_stats import ReplicaModel, ReplicaStats

__all__ = ["ReplicaModel", "ReplicaStats", "RouteRequest", "Router", "ReplicaView"]


# A send that no snapshot has counted as taken in (`ReplicaStats.admitted`) is dropped after
# this long: a replica takes a request in within a second of its arrival, before it queues.
UNACKED_SEND_S = 60.0


@dataclass(frozen=True)
class RouteRequest:
    """What the router knows of a request: its prompt's size and its blocks' chained hashes.
    The output length is unknown (as it is to MLFQ)."""

    request_id: str
    num_prompt_tokens: int
    # Chained hashes of the prompt's full blocks at the fleet's block size
    # (`fastserve.core.kv.prefix_cache.chain_block_hashes`, the prefix cache's own hash).
    block_hashes: tuple[int, ...] = ()

    @classmethod
    def from_tokens(cls, request_id: str, token_ids: Sequence[int], block_size: int,
                    cache_salt: str | None = None) -> RouteRequest:
        """From the prompt's token ids, hashed as the replicas' prefix caches hash them."""
        return cls(request_id, len(token_ids),
                   tuple(chain_block_hashes(token_ids, block_size, cache_salt)))

    def __post_init__(self) -> None:
        if self.num_prompt_tokens < 1:
            raise ValueError(f"num_prompt_tokens must be >= 1, got {self.num_prompt_tokens}")


@dataclass(frozen=True)
class _Sent:
    """A request the router sent a replica since that replica's last snapshot."""

    request_id: str
    sent_s: float
    level: int  # the level it was predicted to join there
    num_blocks: int  # KV blocks its prompt needs there, less its hit
    block_hashes: tuple[int, ...]


@dataclass
class ReplicaView:
    """One replica as the router sees it: its latest snapshot plus what was sent since.

    Methods named as questions change nothing."""

    replica_id: str
    stats: ReplicaStats | None = None
    sent: deque[_Sent] = field(default_factory=deque)  # oldest first
    _sent_hashes: Counter[int] = field(default_factory=Counter)
    # The replica's count of requests taken in from the router's source, at the last snapshot
    # that had one: the sends it covers were dropped.
    num_admitted: int = 0

    def update(self, stats: ReplicaStats, source: str | None = None) -> None:
        self.stats = stats
        if source is not None and stats.admitted is not None:
            admitted = stats.admitted.get(source, 0)
            if admitted < self.num_admitted:  # a count begun again: the replica restarted
                self.num_admitted = 0
            # NOTE: a request forgotten here that the replica took in after all (it failed
            # after its intake) takes a later send with it: undercounted until a snapshot.
            for _ in range(min(admitted - self.num_admitted, len(self.sent))):
                self._drop(self.sent.popleft())
            self.num_admitted = max(self.num_admitted, admitted)
            # A send its host neither saw arrive nor forgot (lost) counts this long at most.
            while self.sent and self.sent[0].sent_s < stats.time_s - UNACKED_SEND_S:
                self._drop(self.sent.popleft())
            return
        kept = deque(s for s in self.sent if s.sent_s >= stats.time_s)
        if len(kept) != len(self.sent):
            self.sent = kept
            self._sent_hashes = Counter(h for s in kept for h in s.block_hashes)

    def note_sent(self, sent: _Sent) -> None:
        self.sent.append(sent)
        self._sent_hashes.update(sent.block_hashes)

    def forget(self, request_id: str) -> None:
        """A request sent here never reached the engine: stop counting it."""
        for s in self.sent:
            if s.request_id == request_id:
                self.sent.remove(s)
                self._drop(s)
                return

    def _drop(self, sent: _Sent) -> None:
        self._sent_hashes.subtract(sent.block_hashes)
        for h in sent.block_hashes:
            if self._sent_hashes[h] <= 0:
                del self._sent_hashes[h]

    def num_requests(self) -> int:
        """Unfinished requests, counting those sent since the snapshot."""
        return (self.stats.num_requests if self.stats else 0) + len(self.sent)

    def num_free_blocks(self) -> int:
        if self.stats is None:
            return 0
        return self.stats.num_free_blocks - sum(s.num_blocks for s in self.sent)

    def num_levels(self) -> int:
        return self.stats.num_levels if self.stats else 1

    def work_at_s(self, level: int, quanta_s: Sequence[float]) -> float:
        """Predicted service ahead of a job joining `level` now (`ReplicaStats.queued_work_s`
        plus, for each request sent since, the quantum of the level it joined and the quanta
        between that level and this one)."""
        lowest = self.num_levels() - 1
        level = min(level, lowest)
        work = self.stats.queued_work_s[level] if self.stats else 0.0
        for s in self.sent:
            if s.level < level:  # its quantum there and the quanta down to `level`
                work += sum(quanta_s[s.level : level])
            elif s.level == level:
                work += quanta_s[level]
        return work

    def hit_blocks(self, block_hashes: Sequence[int], max_blocks: int) -> int:
        """Leading blocks of a request cached here (or sent here since the snapshot)."""
        cached = self.stats.prefix_hashes if self.stats else frozenset()
        sent = self._sent_hashes
        n = 0
        for h in block_hashes:
            if n >= max_blocks or (h not in cached and h not in sent):
                break
            n += 1
        return n


class Router(ABC):
    """Places each request on one replica of a fleet (see the module docstring).

    Subclasses supply `_rank`; the base keeps the views and the bookkeeping."""

    name = "router"

    def __init__(self, seed: int = 0) -> None:
        self.seed = seed
        # Who sends (a fleet ingress names itself to its replicas, which count its requests in
        # `ReplicaStats.admitted`); None: a host whose sends arrive at once (the simulator).
        self.source: str | None = None
        self.views: dict[str, ReplicaView] = {}
        self._charges: dict[ReplicaModel, ChargeModel] = {}  # per replica model, built once

    # -- the interface --------------------------------------------------------------------

    def update(self, stats: ReplicaStats) -> None:
        """Take a replica's new snapshot (a replica not seen before joins the fleet)."""
        self._view(stats.replica_id).update(stats, self.source)

    def forget(self, request_id: str, replica_id: str) -> None:
        """The request sent to `replica_id` never reached its engine (refused there, or the
        connection failed): stop counting it there."""
        view = self.views.get(replica_id)
        if view is not None:
            view.forget(request_id)

    def remove(self, replica_id: str) -> None:
        """A replica left the fleet: forget it."""
        self.views.pop(replica_id, None)

    def choose(self, req: RouteRequest, now: float,
               candidates: Iterable[str] | None = None) -> str:
        """The replica to send `req` to, among `candidates` (default: every replica known);
        notes it as sent there. Raises ValueError when there is no candidate."""
        replica_id = self.rank(req, now, candidates)[0]
        self.note_sent(req, replica_id, now)
        return replica_id

    def rank(self, req: RouteRequest, now: float,
             candidates: Iterable[str] | None = None) -> list[str]:
        """Candidates best first (a policy may rank only some of them, e.g. power of two
        choices ranks its two samples). Changes no bookkeeping; may draw from the router's
        random generator."""
        ids = sorted(set(self.views) if candidates is None else set(candidates))
        if not ids:
            raise ValueError("no replica to route to")
        for rid in ids:
            self._view(rid)
        return self._rank(req, ids, now)

    def note_sent(self, req: RouteRequest, replica_id: str, now: float) -> None:
        """The host sent `req` to `replica_id` at `now`: count it there until a snapshot
        taken after `now` does."""
        view = self._view(replica_id)
        model = self._model_for(view)
        hit = self.hit_of(req, view)
        level = 0 if model is None else self.join_level(req, view, model, hit)
        need = 0 if model is None else max(
            0, num_blocks_for(req.num_prompt_tokens, model.block_size) - hit)
        view.note_sent(_Sent(req.request_id, now, level, need, req.block_hashes))

    # -- shared predictions -----------------------------------------------------------------

    def hit_of(self, req: RouteRequest, view: ReplicaView) -> int:
        """Leading blocks of the request's prompt cached on that replica (0 while no replica
        has reported)."""
        model = self._model_for(view)
        return 0 if model is None else view.hit_blocks(req.block_hashes,
                                                        self.max_hit_blocks(req, model))

    def max_hit_blocks(self, req: RouteRequest, model: ReplicaModel) -> int:
        """A hit leaves at least one prompt token to compute (its logits give the first
        output token), as the scheduler's `_cached_prefix` does."""
        return (req.num_prompt_tokens - 1) // model.block_size

    def prefill_s(self, req: RouteRequest, model: ReplicaModel, hit_blocks: int) -> float:
        """Predicted charge of the request's prefill on a replica where `hit_blocks` of its
        leading blocks are cached (chunked as the replica chunks it)."""
        cached = hit_blocks * model.block_size
        return self._charge(model).prefill_s(req.num_prompt_tokens - cached, cached,
                                             model.max_num_batched_tokens)

    def join_level(self, req: RouteRequest, view: ReplicaView, model: ReplicaModel,
                   hit_blocks: int) -> int:
        """The MLFQ level the request would skip-join on that replica: the first whose
        quantum covers its prefill there, capped at the lowest level in use."""
        level = bisect.bisect_left(model.quanta_s, self.prefill_s(req, model, hit_blocks))
        return min(level, view.num_levels() - 1)

    # -- internals ------------------------------------------------------------------------

    @abstractmethod
    def _rank(self, req: RouteRequest, ids: list[str], now: float) -> list[str]:
        """`ids` (sorted, non-empty) best first."""

    def _view(self, replica_id: str) -> ReplicaView:
        view = self.views.get(replica_id)
        if view is None:
            view = self.views[replica_id] = ReplicaView(replica_id)
        return view

    def _model_for(self, view: ReplicaView) -> ReplicaModel | None:
        """The replica's model; one not yet reported borrows another's (a fleet shares one)."""
        if view.stats is not None:
            return view.stats.model
        for other in self.views.values():
            if other.stats is not None:
                return other.stats.model
        return None

    def _charge(self, model: ReplicaModel) -> ChargeModel:
        charge = self._charges.get(model)
        if charge is None:
            charge = self._charges[model] = ChargeModel(model.cost, model.charge_mode,
                                                            model.max_batch_size)
        return charge
