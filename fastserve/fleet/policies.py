"""The routing policies: FastServe's MLFQ-aware router and the baselines, one class each, all
over `Router`'s views and bookkeeping (the same code path in the simulator and on Ray)."""

from __future__ import annotations

import random
from typing import Any

from fastserve.core.kv import num_blocks_for
from fastserve.fleet.router import ReplicaView, Router, RouteRequest


class RoundRobin(Router):
    """Each request to the next candidate in turn (sorted ids)."""

    name = "round-robin"

    def __init__(self, seed: int = 0) -> None:
        super().__init__(seed)
        self._next = 0

    def _rank(self, req: RouteRequest, ids: list[str], now: float) -> list[str]:
        i = self._next % len(ids)
        self._next += 1
        return ids[i:] + ids[:i]


class PowerOfTwo(Router):
    """Ray Serve's default: two candidates drawn at random, the one with fewer ongoing
    requests first (a tie keeps the draw's order). Queue length = the replica's reported
    unfinished requests plus those sent it since."""

    name = "pow2"

    def __init__(self, seed: int = 0) -> None:
        super().__init__(seed)
        self.rng = random.Random(seed)

    def _rank(self, req: RouteRequest, ids: list[str], now: float) -> list[str]:
        return self.two_choices(ids)

    def two_choices(self, ids: list[str]) -> list[str]:
        picks = self.rng.sample(ids, min(2, len(ids)))
        return sorted(picks, key=lambda rid: self.views[rid].num_requests())  # stable


class PrefixAffinity(PowerOfTwo):
    """Prefix affinity alone: the replica caching the longest prefix of the prompt; among
    equal hits (no hit anywhere included), power of two choices."""

    name = "prefix-affinity"

    def _rank(self, req: RouteRequest, ids: list[str], now: float) -> list[str]:
        hits = {rid: self.hit_of(req, self.views[rid]) for rid in ids}
        best = max(hits.values())
        tied = [rid for rid in ids if hits[rid] == best]
        first = self.two_choices(tied)
        rest = sorted((r for r in ids if r not in first), key=lambda r: -hits[r])
        return first + rest


class FastServeRouter(Router):
    """Earliest predicted completion, knowing each replica's MLFQ (FastServe's fleet router).

    On each candidate the request would skip-join the level that its prefill there covers
    (shorter where more of its prefix is cached); it then waits for the service queued at or
    above that level (jobs in lower levels give way to it) and runs its prefill, less what is
    cached. Should it run long, it meets the work queued deeper down too, as likely as the
    replica's finished jobs got there (`level_reach`). The score is that wait plus the prefill,
    in seconds of the replica's device time:

        score = (work ahead at its level + sum over deeper levels j of
                 P(reach j | its level) x work level j adds) / parallel
                + prefill there (+ a memory wait)

    `parallel` is the batch size under the `iteration` charge (every batched job is charged
    the whole iteration) and 1 under `own` (charges add up to device time). A replica whose
    free KV blocks cannot hold the prompt adds its whole queue (the job waits for memory).

    Bound on imbalance: only candidates with at most `max_imbalance` more unfinished
    requests than the least busy one are eligible, so affinity for a prefix or an empty top
    level never piles jobs onto one replica. Scores within `near_ratio` of the best count as
    equal, and among them the replica with fewer requests goes first (then the lower score,
    then the lower id): the score stands in the lowest level's quantum for each job's unknown
    rest, so where replicas differ by that little it is noise, while each job they hold takes
    a batch slot until it ends. Without this a burst of like requests was split by such noise
    up to the bound (130/134 of 264 in the simulator), and the replica given more ran its
    last jobs in a batch of a few (the burst of benchmarks/fleet/fleet_overhead.py: 0.88x
    the tokens/s of an even split).
    """

    name = "fastserve"

    # Defaults from benchmarks/fleet/fleet_sim.py (16 replicas, load 0.9): a bound of 8 requests
    # made mean JCT on the Zipf trace 1.6% worse than power of two's (4: even), and 4 costs
    # 1% of it on Mooncake against 8; weighting the deeper levels evened p99 on Zipf.
    # `near_ratio`: see docs/results/2026-12-07-fleet-ingress-overhead.md.
    def __init__(self, seed: int = 0, max_imbalance: float = 4, load_weight: float = 0.0,
                 deep_weight: float = 1.0, near_ratio: float = 0.2) -> None:
        super().__init__(seed)
        if max_imbalance < 0:
            raise ValueError(f"max_imbalance must be >= 0, got {max_imbalance}")
        if near_ratio < 0:
            raise ValueError(f"near_ratio must be >= 0, got {near_ratio}")
        self.max_imbalance = max_imbalance
        self.near_ratio = near_ratio
        self.load_weight = load_weight  # weight of the total queued work, beyond the job's level
        self.deep_weight = deep_weight  # weight of deeper levels' work (0: its join level's)

    def _rank(self, req: RouteRequest, ids: list[str], now: float) -> list[str]:
        scored = []  # (score, requests, id, prefix hit)
        for rid in ids:
            view = self.views[rid]
            hit = self.hit_of(req, view)
            scored.append((self.score_s(req, view, hit), view.num_requests(), rid, hit))
        least = min(s[1] for s in scored)
        eligible = sorted(s for s in scored if s[1] <= least + self.max_imbalance)
        rest = sorted(s for s in scored if s[1] > least + self.max_imbalance)
        # Near the best: as good a prefix hit, and a score within near_ratio of its.
        best_s, best_hit = eligible[0][0], eligible[0][3]
        is_near = [s[0] <= best_s * (1.0 + self.near_ratio) and s[3] == best_hit
                   for s in eligible]
        near = sorted((s for s, n in zip(eligible, is_near) if n),
                      key=lambda s: (s[1], s[0], s[2]))
        far = [s for s, n in zip(eligible, is_near) if not n]
        return [s[2] for s in near + far + rest]

    def score_s(self, req: RouteRequest, view: ReplicaView, hit: int | None = None) -> float:
        """Predicted wait plus prefill of `req` on that replica (see the class docstring);
        `hit`: its prefix hit there, when already known (`hit_of`)."""
        model = self._model_for(view)
        if model is None:  # nothing reported yet anywhere: the count decides
            return 0.0
        quanta = model.quanta_s
        parallel = model.max_batch_size if model.charge_mode == "iteration" else 1
        hit = self.hit_of(req, view) if hit is None else hit
        level = self.join_level(req, view, model, hit)
        score = self.work_ahead_s(view, level, quanta) / parallel + self.prefill_s(req, model, hit)
        if self.load_weight > 0 or view.stats is not None:
            load_s = view.work_at_s(view.num_levels() - 1, quanta) / parallel
            score += self.load_weight * load_s
            need = num_blocks_for(req.num_prompt_tokens, model.block_size) - hit
            if view.stats is not None and need > view.num_free_blocks():
                score += load_s  # it waits for memory: behind everything
        return round(score, 9)  # NOTE: equal up to float noise means equal (then the count)

    def work_ahead_s(self, view: ReplicaView, level: int, quanta_s: tuple[float, ...]) -> float:
        """Work a job joining `level` is expected to wait behind: that level's, plus the work
        each deeper level adds, weighted by the chance that the job gets down there (the
        replica's `level_reach`, given that it reached `level`)."""
        work = view.work_at_s(level, quanta_s)
        reach = view.stats.level_reach if view.stats else ()
        if self.deep_weight <= 0 or len(reach) <= level or reach[level] <= 0:
            return work
        above = work
        for j in range(level + 1, min(len(reach), view.num_levels())):
            at_j = view.work_at_s(j, quanta_s)
            work += self.deep_weight * min(1.0, reach[j] / reach[level]) * (at_j - above)
            above = at_j
        return work


ROUTERS: dict[str, type[Router]] = {
    "fastserve": FastServeRouter,
    "pow2": PowerOfTwo,
    "prefix-affinity": PrefixAffinity,
    "round-robin": RoundRobin,
}


def make_router(spec: str, seed: int = 0, **options: Any) -> Router:
    """The router `spec` names: a name from `ROUTERS`, optionally with options as
    `name:key=value:...` (e.g. `fastserve:max-imbalance-s=4`), plus `options`."""
    name, *items = spec.split(":")
    cls = ROUTERS.get(name)
    if cls is None:
        raise ValueError(f"router must be one of {sorted(ROUTERS)}, got {name!r}")
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"router option {item!r} in {spec!r} must be key=value")
        options[key.replace("-", "_")] = float(value)
    try:
        return cls(seed=seed, **options)
    except TypeError as exc:
        raise ValueError(f"router {name!r}: {exc}") from None
