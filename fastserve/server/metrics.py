"""Prometheus metrics for one app: engine gauges read at scrape time, per-request histograms.

Each app gets its own `CollectorRegistry`, so several apps (tests) never share or clash.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily, Metric
from prometheus_client.registry import Collector

from fastserve.engine.async_llm import AsyncLLM
from fastserve.request import RequestOutput

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
# Seconds; from a tiny model on a CPU (ms) to a long job behind a full queue (minutes).
_LATENCY_BUCKETS_S = (
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0,
)


class _EngineCollector(Collector):
    """Gauges and engine-side counters from `llm.stats()` (`EngineStats`), read when
    Prometheus scrapes."""

    def __init__(self, llm: AsyncLLM) -> None:
        self.llm = llm

    def collect(self) -> Iterator[Metric]:
        stats = self.llm.stats()
        s, kv = stats.scheduler, stats.scheduler.kv
        for name, value, doc in (
            ("fastserve_requests_running", s.num_running, "requests in the current batch"),
            ("fastserve_requests_waiting", s.num_waiting, "requests queued with no KV cache"),
            ("fastserve_requests_preempted", s.num_preempted, "started requests paused, KV kept"),
            ("fastserve_requests_swapped", s.num_swapped, "requests whose KV is in host memory"),
            ("fastserve_kv_blocks_free", kv.num_free_blocks, "free device KV-cache blocks"),
            ("fastserve_kv_blocks_total", kv.num_total_blocks, "device KV-cache blocks"),
            ("fastserve_host_kv_blocks_free", kv.num_free_host_blocks, "free host KV-cache blocks"),
            ("fastserve_host_kv_blocks_total", kv.num_total_host_blocks, "host KV-cache blocks"),
        ):
            yield GaugeMetricFamily(name, doc, value=value)
        # NOTE: a leak in either tier shows as used blocks that stay up once requests end.
        used = GaugeMetricFamily("fastserve_kv_blocks_used", "KV-cache blocks in use per tier",
                                 labels=["tier"])
        used.add_metric(["device"], kv.num_total_blocks - kv.num_free_blocks)
        used.add_metric(["host"], kv.num_total_host_blocks - kv.num_free_host_blocks)
        yield used
        swapped = CounterMetricFamily("fastserve_swapped_blocks",
                                      "KV blocks copied between the tiers", labels=["direction"])
        swapped.add_metric(["out"], kv.num_swap_out_blocks)  # device -> host
        swapped.add_metric(["in"], kv.num_swap_in_blocks)  # host -> device
        yield swapped
        queues = GaugeMetricFamily(
            "fastserve_queue_length", "requests per scheduler queue level", labels=["level"]
        )
        for level, count in sorted(s.queue_lengths.items()):
            queues.add_metric([str(level)], count)
        yield queues
        yield GaugeMetricFamily(
            "fastserve_cost_model_ratio",
            "recent engine iterations: the start-up profile's predicted time over the measured "
            "time", value=stats.cost_model_ratio)
        yield GaugeMetricFamily(
            "fastserve_cost_model_scale",
            "the start-up profile's times are multiplied by this in the cost model the engine "
            "decides with (calibrated to the recent iterations; 1 = as profiled)",
            value=stats.cost_model_scale)
        if stats.executor:  # what runs, as chosen at start-up (CPU instruction set, dtype, kernels)
            yield InfoMetricFamily("fastserve_executor", "the executor's start-up choices",
                                   value={k: str(v) for k, v in sorted(stats.executor.items())})
        healthy = GaugeMetricFamily("fastserve_engine_healthy", "1 while the engine loop runs")
        healthy.add_metric([], 1.0 if self.llm.is_healthy else 0.0)
        yield healthy
        # The watchdog's reading: /health answers 503 past --engine-stall-timeout-s.
        yield GaugeMetricFamily(
            "fastserve_engine_seconds_since_progress",
            "seconds since the engine loop last came round (an iteration, or an idle wait of "
            "at most 0.5 s): a large value while requests run means the loop is stuck",
            value=self.llm.seconds_since_progress)
        for name, value, doc in (
            ("fastserve_preemptions", s.num_preemptions, "requests preempted by the scheduler"),
            ("fastserve_recomputes", kv.num_recomputes, "preemptions that dropped KV to recompute"),
            ("fastserve_iterations", stats.num_iterations, "engine iterations run"),
            ("fastserve_prefix_cache_queries", kv.num_prefix_query_tokens,
             "tokens of the requests started, looked up in the prefix cache"),
            ("fastserve_prefix_cache_hits", kv.num_prefix_hit_tokens,
             "of those, tokens whose KV was found cached"),
            ("fastserve_spec_decode_draft_tokens", s.num_draft_tokens,
             "speculative decoding: drafted tokens verified (predictions, ngram lookups)"),
            ("fastserve_spec_decode_accepted_tokens", s.num_accepted_tokens,
             "of those, tokens the model kept"),
        ):
            yield CounterMetricFamily(name, doc, value=value)
        cached = GaugeMetricFamily("fastserve_prefix_cache_blocks",
                                   "KV blocks held by the prefix cache, per memory tier",
                                   labels=["tier"])
        cached.add_metric(["device"], kv.num_cached_blocks)
        cached.add_metric(["host"], kv.num_cached_host_blocks)
        yield cached
        if stats.lora is not None:  # LoRA adapters served
            yield GaugeMetricFamily("fastserve_max_loras", "LoRA adapters that may be loaded "
                                    "at once (--max-loras)", value=stats.lora.max_loras)
            lora = GaugeMetricFamily(
                "fastserve_lora_requests", "requests per LoRA adapter loaded (every one listed, "
                "idle ones at 0) and state (running: in the batch; waiting: queued or paused)",
                labels=["adapter", "state"])
            for name, counts in stats.lora.requests.items():
                for state, count in counts.items():
                    lora.add_metric([name, state], count)
            yield lora


class ServerMetrics:
    """Everything `/metrics` shows. `observe_finished` runs on the engine thread (thread-safe)."""

    def __init__(self, llm: AsyncLLM) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(llm))
        self.finished = Counter(
            "fastserve_requests_finished",
            "finished requests by finish reason (stop, length, abort, error)",
            ["finish_reason"],
            registry=self.registry,
        )
        self.http_errors = Counter(
            "fastserve_http_errors",
            "error responses by HTTP status (429: queue full; a stream's error event is not one)",
            ["status"],
            registry=self.registry,
        )
        self.ttft = Histogram(
            "fastserve_ttft_seconds",
            "time from arrival to the first output token",
            buckets=_LATENCY_BUCKETS_S,
            registry=self.registry,
        )
        self.jct = Histogram(
            "fastserve_jct_seconds",
            "job completion time: arrival to the last token",
            buckets=_LATENCY_BUCKETS_S,
            registry=self.registry,
        )
        self.output_tokens = Counter(
            "fastserve_output_tokens", "tokens generated", registry=self.registry
        )
        self.prompt_tokens = Counter(
            "fastserve_prompt_tokens", "prompt tokens of finished requests", registry=self.registry
        )
        llm.on_finish.append(self.observe_finished)

    def observe_finished(self, out: RequestOutput) -> None:
        self.finished.labels(out.finish_reason or "unknown").inc()
        self.output_tokens.inc(len(out.token_ids))
        self.prompt_tokens.inc(len(out.prompt_token_ids))
        if out.ttft_s is not None:
            self.ttft.observe(out.ttft_s)
        # An aborted request's duration is the client's patience, not a completion time.
        if out.jct_s is not None and out.finish_reason in ("stop", "length"):
            self.jct.observe(out.jct_s)

    def render(self) -> bytes:
        return generate_latest(self.registry)
