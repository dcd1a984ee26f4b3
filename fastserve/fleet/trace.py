"""Recorded fleet traces: every input a router got and every placement it made, as JSON.

A host (the simulator, the Ray Serve router) wraps its router in `RecordingRouter`, which
forwards each call and writes it down; `replay` feeds a recorded trace to a fresh router of the
same spec and seed and reports where its placements differ. The router is deterministic in its
inputs (see `fastserve.fleet.router`), so a trace recorded anywhere replays to the same
placements: the simulator's decisions are the ones the Ray deployment would make for the same
replica states.

Format (one JSON object; version 1):

    {"format": "fastserve-fleet-trace", "version": 1,
     "router": "fastserve:max-imbalance-s=8", "seed": 0,
     "events": [
       {"event": "stats", "stats": {...ReplicaStats.to_json()...}},
       {"event": "rank", "time_s": 1.25, "candidates": ["r0", "r1"] | null,
        "request": {"request_id": "a", "num_prompt_tokens": 900, "block_hashes": [...]},
        "ranked": ["r1", "r0"]},
       {"event": "sent", "time_s": 1.25, "request_id": "a", "replica_id": "r1"},
       {"event": "forget", "request_id": "a", "replica_id": "r1"},
       {"event": "remove", "replica_id": "r0"}],
     "source": "ingress-id" | null}

To keep traces small, a stats event after a replica's first may give its prefix hashes as a
change from its previous snapshot (`"prefix_added"`, `"prefix_removed"` instead of
`"prefix_hashes"`) and leave out `"model"` when it is unchanged. `choose` appears as a rank
event followed by a sent event to the first ranked replica.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fastserve.core.replica_stats import ReplicaModel, ReplicaStats
from fastserve.fleet.policies import make_router
from fastserve.fleet.router import Router, RouteRequest

TRACE_FORMAT = "fastserve-fleet-trace"
TRACE_VERSION = 1


class RecordingRouter(Router):
    """A router that writes down what it is asked and answers as `inner` does."""

    def __init__(self, inner: Router, spec: str) -> None:
        super().__init__(inner.seed)
        self.inner = inner
        self.spec = spec
        self.events: list[dict[str, Any]] = []
        self.views = inner.views  # one set of views: the inner router's
        self._last_hashes: dict[str, frozenset[int]] = {}
        self._last_model: dict[str, ReplicaModel] = {}

    def update(self, stats: ReplicaStats) -> None:
        self.events.append({"event": "stats", "stats": self._stats_json(stats)})
        self.inner.update(stats)

    def remove(self, replica_id: str) -> None:
        self.events.append({"event": "remove", "replica_id": replica_id})
        self.inner.remove(replica_id)

    def forget(self, request_id: str, replica_id: str) -> None:
        self.events.append({"event": "forget", "request_id": request_id,
                            "replica_id": replica_id})
        self.inner.forget(request_id, replica_id)

    def rank(self, req: RouteRequest, now: float,
             candidates: Iterable[str] | None = None) -> list[str]:
        cands = None if candidates is None else sorted(set(candidates))
        ranked = self.inner.rank(req, now, cands)
        self.events.append({
            "event": "rank", "time_s": now, "candidates": cands,
            "request": {"request_id": req.request_id,
                        "num_prompt_tokens": req.num_prompt_tokens,
                        "block_hashes": list(req.block_hashes)},
            "ranked": ranked})
        return ranked

    def note_sent(self, req: RouteRequest, replica_id: str, now: float) -> None:
        self.events.append({"event": "sent", "time_s": now, "request_id": req.request_id,
                            "replica_id": replica_id})
        self.inner.note_sent(req, replica_id, now)

    def _rank(self, req: RouteRequest, ids: list[str], now: float) -> list[str]:
        raise AssertionError("RecordingRouter.rank forwards to the inner router")

    def to_json(self) -> dict[str, Any]:
        return {"format": TRACE_FORMAT, "version": TRACE_VERSION, "router": self.spec,
                "seed": self.seed, "events": self.events, "source": self.inner.source}

    def write(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json()))

    def _stats_json(self, stats: ReplicaStats) -> dict[str, Any]:
        d = stats.to_json()
        rid = stats.replica_id
        last = self._last_hashes.get(rid)
        if last is not None:
            del d["prefix_hashes"]
            d["prefix_added"] = sorted(stats.prefix_hashes - last)
            d["prefix_removed"] = sorted(last - stats.prefix_hashes)
        if self._last_model.get(rid) == stats.model:
            del d["model"]
        self._last_hashes[rid] = stats.prefix_hashes
        self._last_model[rid] = stats.model
        return d


@dataclass(frozen=True)
class Mismatch:
    """A placement that replay did not reproduce."""

    index: int  # the event's place in the trace
    request_id: str
    recorded: list[str]
    replayed: list[str]


def load_trace(path: str | Path) -> dict[str, Any]:
    try:
        data = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise ValueError(f"fleet trace not found: {path}") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"fleet trace {path} is not valid JSON: {e}") from None
    if not isinstance(data, dict) or data.get("format") != TRACE_FORMAT:
        raise ValueError(f"fleet trace {path}: format must be {TRACE_FORMAT!r}")
    if data.get("version") != TRACE_VERSION:
        raise ValueError(f"fleet trace {path}: version must be {TRACE_VERSION}, "
                         f"got {data.get('version')!r}")
    return data


def replay(trace: dict[str, Any], router: Router | None = None) -> list[Mismatch]:
    """Feed a recorded trace to `router` (default: a fresh one of the trace's spec and seed);
    returns the rank events whose ranking differs from the recorded one (empty: all match)."""
    router = router or make_router(trace["router"], seed=int(trace["seed"]))
    router.source = trace.get("source")
    hashes: dict[str, frozenset[int]] = {}
    models: dict[str, ReplicaModel] = {}
    requests: dict[str, RouteRequest] = {}
    mismatches = []
    for i, ev in enumerate(trace["events"]):
        kind = ev["event"]
        if kind == "stats":
            router.update(_stats_from_json(ev["stats"], hashes, models))
        elif kind == "rank":
            r = ev["request"]
            req = RouteRequest(r["request_id"], int(r["num_prompt_tokens"]),
                               tuple(int(h) for h in r["block_hashes"]))
            requests[req.request_id] = req
            got = router.rank(req, float(ev["time_s"]), ev["candidates"])
            if got != ev["ranked"]:
                mismatches.append(Mismatch(i, req.request_id, list(ev["ranked"]), got))
        elif kind == "sent":
            router.note_sent(requests.pop(ev["request_id"]), ev["replica_id"],
                             float(ev["time_s"]))
        elif kind == "forget":
            router.forget(ev["request_id"], ev["replica_id"])
        elif kind == "remove":
            router.remove(ev["replica_id"])
        else:
            raise ValueError(f"fleet trace: event {i}: unknown event {kind!r}")
    return mismatches


def _stats_from_json(d: dict[str, Any], hashes: dict[str, frozenset[int]],
                     models: dict[str, ReplicaModel]) -> ReplicaStats:
    d = dict(d)
    rid = d["replica_id"]
    if "prefix_hashes" not in d:
        added = {int(h) for h in d.pop("prefix_added")}
        removed = {int(h) for h in d.pop("prefix_removed")}
        d["prefix_hashes"] = sorted((hashes[rid] - removed) | added)
    if "model" in d:
        models[rid] = ReplicaModel.from_json(d["model"])
    d["model"] = models[rid].to_json()
    stats = ReplicaStats.from_json(d)
    hashes[rid] = stats.prefix_hashes
    return stats
