"""The fleet's `/metrics`: the ingress's own counters for the fleet, and each replica's
single-server metrics labelled with `replica`.

A replica ships its metrics' samples with its routing stats (`replica_samples`, every stats
period), so the ingress renders them without asking each replica at scrape time; they are as
old as one stats period. The fleet's totals are the ingress's counters plus, for any replica
metric, its sum over the `replica` label.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import Metric
from prometheus_client.registry import Collector

# (family name, type, help, [(sample name, labels, value), ...])
Family = tuple[str, str, str, list[tuple[str, dict[str, str], float]]]

_LATENCY_BUCKETS_S = (0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


def replica_samples(registry: CollectorRegistry) -> list[Family]:
    """Every sample of a replica's registry, in a form that pickles small."""
    out: list[Family] = []
    for metric in registry.collect():
        samples = [(s.name, dict(s.labels), float(s.value)) for s in metric.samples]
        out.append((metric.name, metric.type, metric.documentation, samples))
    return out


class _ReplicaCollector(Collector):
    """Each replica's families, every sample labelled with its replica id."""

    def __init__(self, samples_by_replica: Callable[[], dict[str, list[Family]]]) -> None:
        self.samples_by_replica = samples_by_replica

    def collect(self) -> Iterator[Metric]:
        merged: dict[str, Metric] = {}
        for replica, families in sorted(self.samples_by_replica().items()):
            for name, kind, doc, samples in families:
                metric = merged.get(name)
                if metric is None:
                    metric = merged[name] = Metric(name, doc, kind)
                for sample_name, labels, value in samples:
                    metric.add_sample(sample_name, {**labels, "replica": replica}, value)
        yield from merged.values()


class FleetMetrics:
    """Everything the fleet's `/metrics` shows."""

    def __init__(self, samples_by_replica: Callable[[], dict[str, list[Family]]]) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_ReplicaCollector(samples_by_replica))
        self.samples_by_replica = samples_by_replica
        self.requests = Counter(
            "fastserve_fleet_requests", "HTTP requests answered by the fleet, by status",
            ["status"], registry=self.registry)
        self.retries = Counter(
            "fastserve_fleet_retries",
            "requests sent again to another replica because theirs failed before answering",
            registry=self.registry)
        self.replica_failures = Counter(
            "fastserve_fleet_stream_failures",
            "responses cut by a replica failing mid-answer (the stream got an error event "
            "and [DONE])", registry=self.registry)
        self.unavailable = Counter(
            "fastserve_fleet_unavailable",
            "requests answered 503 because no replica could take them", registry=self.registry)
        self.first_byte = Histogram(
            "fastserve_fleet_first_byte_seconds",
            "ingress: from the request read to the replica's first answer bytes",
            buckets=_LATENCY_BUCKETS_S, registry=self.registry)
        replicas = Gauge("fastserve_fleet_replicas", "replicas the router can send to",
                         registry=self.registry)
        replicas.set_function(lambda: len(self.samples_by_replica()))

    def render(self) -> bytes:
        return generate_latest(self.registry)


def samples_of(stats: dict[str, Any], key: str) -> list[Family]:
    """The metrics families in one replica's routing stats (none before its first report)."""
    families = stats.get(key)
    return list(families) if families else []
