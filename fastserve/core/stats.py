"""The scheduler's and the KV cache's counters, typed: what the engine, `/metrics`, the
benchmarks and the simulator read (one projection, so a renamed counter fails type checks
instead of exporting 0)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class KVStats:
    """The KV blocks now, and their moves and prefix-cache hits since start."""

    num_total_blocks: int
    num_free_blocks: int
    num_total_host_blocks: int
    num_free_host_blocks: int
    peak_used_blocks: int  # most device blocks in use at once
    num_swap_out_blocks: int  # copied device -> host, all time
    num_swap_in_blocks: int  # copied host -> device, all time
    num_cached_blocks: int  # prefix cache: device blocks held for reuse
    num_cached_host_blocks: int  # prefix cache: host-tier blocks
    num_host_hit_tokens: int  # prefix hits uploaded from the host tier
    num_prefetched_tokens: int  # host-tier prefix tokens uploaded ahead of their job's turn
    num_offloads: int = 0  # times a request's KV was moved to host memory
    num_uploads: int = 0  # times it was moved back
    num_recomputes: int = 0  # times a request's KV was dropped for recompute
    num_prefix_query_tokens: int = 0  # tokens of the jobs (re)started
    num_prefix_hit_tokens: int = 0  # of those, found in the prefix cache
    block_size: int = 0  # tokens a block holds
    # A router's summary of the prefix cache (`ReplicaStats.prefix_hashes`), when asked for:
    # hashes of the blocks a new request could start from, and whether the list was cut.
    prefix_hashes: frozenset[int] = frozenset()
    is_prefix_truncated: bool = False


@dataclass(frozen=True, slots=True)
class SchedulerStats:
    """The queues now, and the scheduler's decisions since start."""

    kv: KVStats
    queue_lengths: dict[int, int] = field(default_factory=dict)  # jobs per MLFQ level
    num_running: int = 0
    num_waiting: int = 0
    num_preempted: int = 0
    num_swapped: int = 0
    num_preemptions: int = 0  # times a started request was taken out of the batch
    num_draft_tokens: int = 0  # speculative tokens verified
    num_accepted_tokens: int = 0  # of those, the ones the model kept
