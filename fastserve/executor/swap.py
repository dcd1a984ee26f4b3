"""KV swaps between the device cache and a host cache, carried out beside the compute.

The scheduler's plan lists block copies (`swap_out`: device -> host, `swap_in`: host ->
device). A swapper queues them on a copy engine in plan order, swap-outs first, and
remembers which device blocks each queued task touches.
Before an iteration runs, it waits only for the tasks touching the blocks that iteration reads
or writes; everything else (uploads ahead of need, offloads of jobs not running) overlaps its
compute and later ones.

- CUDA (`CudaSwapper`): a separate copy stream, pinned host memory and one event per
  direction per iteration. The copy stream first waits for the compute stream, so a swap-out
  reads what the last iteration wrote. All of a plan's swap-outs are gathered by one kernel
  into a contiguous device staging buffer, moved by one DMA per run of consecutive host
  blocks (the reverse for uploads: DMAs into staging, one scatter kernel). An iteration that
  reads a block still in flight makes the compute stream wait on the copy's event: the host
  does not block.
- CPU (`ThreadSwapper`): the same plan carried out by a background copy worker thread (torch
  copies release the GIL), one task and `threading.Event` per plan. The plan's blocks move a
  run of consecutive blocks at a time, every layer at once (the device cache is one tensor,
  see `PagedAttention`): run by run and layer by layer cost ~44 us per 64 KiB block of the
  tiny model; one indexed gather and scatter for the whole plan, 2.5-5x these runs' time for
  the small preset's 0.6-1.1 MiB blocks (`benchmarks/kv/swap_copies.py`).
- CPU without a spare core (`InlineSwapper`): the plan's copies run on the compute thread when
  the plan is submitted, before the iteration. On a CPU the copies and the compute share the
  same cores and memory bus, so a worker overlaps nothing unless a core is idle; when the
  compute's threads fill every core, the worker's wake-ups preempt them instead. Measured on
  this 2-core machine (`benchmarks/kv/kv_policies.py --part real --variants robust --reps 3
  --copy-workers inline,thread`: 1,000 requests, proactive at 25% of peak KV, the two modes
  interleaved): iterations ran 1.06/1.24/1.13x the cost model's prediction for their shapes
  inline against 1.11/1.35/1.29x with the worker, and median average JCT was 2.53 s against
  2.97 s (decode iterations of 4-7 jobs: 3.0 ms inline, 4.0 ms with the worker, 3.0 ms with
  unlimited memory where nothing is copied). `cpu_copy_worker="auto"` (the default) takes the
  worker only when the compute leaves a core free.

Orderings the scheduler and the block pools guarantee, on which this relies: a device block is
reused only after the iteration that freed it; a host block read by an upload is not reused by
a swap-out of the same iteration (`KVCacheManager.end_iteration`); and within an iteration a
swap-in may target a block a swap-out of the same iteration reads, which the in-order copy
engine handles. NOTE: every iteration's compute has finished before the next plan's copies are
queued (sampling reads the logits back), so a swap-out never races the compute that wrote it.

Host layout: block-major, [num_host_blocks, num_layers, 2 (K, V), num_kv_heads, block_size,
head_dim], so that a run of host blocks is one contiguous (pinned) range: the device's
[num_kv_heads, slots, head_dim] layout would make every run a strided copy, which PyTorch
stages through pageable memory and so cannot overlap. A host block holds exactly what a device
block holds.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from fastserve.executor.attention import PagedAttention, as_bytes
from fastserve.executor.platform import platform_for

logger = logging.getLogger(__name__)


class HostKVCache:
    """Host copies of KV blocks, block-major (see the module docstring); pinned on CUDA."""

    def __init__(self, attn: PagedAttention, num_blocks: int, pin: bool) -> None:
        k0 = attn.k_caches[0]
        # NOTE: torch.empty, not zeros: pages are touched only when a block is offloaded.
        self.blocks = torch.empty(
            (num_blocks, len(attn.k_caches), 2, attn.num_kv_heads, attn.block_size, attn.head_dim),
            dtype=k0.dtype,
            pin_memory=pin,
        )

    @property
    def num_blocks(self) -> int:
        return self.blocks.shape[0]


# The device cache [layers, 2, heads, blocks, bs, dim] and the host's block-major layout
# [blocks, layers, 2, heads, bs, dim] are permutations of each other.
_TO_HOST = (3, 0, 1, 2, 4, 5)
_TO_DEVICE = (1, 2, 3, 0, 4, 5)


class KVSwapper(ABC):
    """Carries out a plan's KV copies beside the compute; one per rank, over its own shards."""

    def __init__(self, attn: PagedAttention, num_host_blocks: int) -> None:
        self.attn = attn
        self.host = HostKVCache(attn, num_host_blocks, pin=self._pin)
        self._pending: dict[int, _Task] = {}  # device block -> the last task touching it
        self._tasks: deque[_Task] = deque()  # queued tasks, in copy-engine order
        self.num_swap_out_blocks = 0
        self.num_swap_in_blocks = 0

    _pin = False
    # Whether the copies run beside the compute (a copy stream or a worker with a core of its
    # own) or hold it up (inline): the cost model's `copies_overlap`.
    overlaps_compute = True

    def submit(self, swap_out: list[tuple[int, int]], swap_in: list[tuple[int, int]]) -> None:
        """Queue one iteration's copies: (device, host) swap-outs, then (host, device) swap-ins."""
        self._prune()
        if not swap_out and not swap_in:
            return
        self._begin()
        for task in self._queue(swap_out, swap_in):
            for b in task.device_blocks:
                self._pending[b] = task
            self._tasks.append(task)
        self.num_swap_out_blocks += len(swap_out)
        self.num_swap_in_blocks += len(swap_in)

    def wait_for(self, block_tables: Iterable[list[int]]) -> float:
        """Block until every queued copy touching these device blocks has landed; returns the
        seconds spent waiting."""
        if not self._pending:
            return 0.0
        needed: dict[int, _Task] = {}
        for table in block_tables:
            for b in table:
                task = self._pending.get(b)
                if task is not None:
                    needed[id(task)] = task
        if not needed:
            return 0.0
        start = time.perf_counter()
        for task in needed.values():
            self._wait(task)
        return time.perf_counter() - start

    def synchronize(self) -> None:
        """Wait for every queued copy (shutdown, tests)."""
        for task in list(self._tasks):
            self._wait(task)
        self._prune()

    def close(self) -> None:
        self.synchronize()

    # -- engine-specific ----------------------------------------------------------------

    def _begin(self) -> None:
        """Before an iteration's copies are queued."""

    @abstractmethod
    def _queue(self, swap_out: list[tuple[int, int]], swap_in: list[tuple[int, int]]
               ) -> list[_Task]:
        """Queue the plan's copies, (device, host) out then (host, device) in; the tasks say
        which device blocks each covers."""

    @abstractmethod
    def _is_done(self, task: _Task) -> bool: ...

    @abstractmethod
    def _wait(self, task: _Task) -> None: ...

    # -- shared ---------------------------------------------------------------------------

    def _prune(self) -> None:
        """Forget tasks that have finished (they finish in queue order)."""
        while self._tasks and self._is_done(self._tasks[0]):
            task = self._tasks.popleft()
            for b in task.device_blocks:
                if self._pending.get(b) is task:
                    del self._pending[b]

    def _raw(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The device and host caches as the bytes the copies move (float8 as uint8)."""
        return as_bytes(self.attn.kv_cache), as_bytes(self.host.blocks)

    def _copy_out(self, dev: int, host_dst: torch.Tensor, n: int) -> None:
        """Device blocks [dev, dev + n) into `host_dst` ([n, layers, 2, heads, bs, dim])."""
        as_bytes(host_dst).copy_(as_bytes(self.attn.kv_cache)[:, :, :, dev : dev + n].permute(_TO_HOST))

    def _copy_in(self, src: torch.Tensor, dev: int, n: int) -> None:
        """`src` ([n, layers, 2, heads, bs, dim]) into device blocks [dev, dev + n)."""
        as_bytes(self.attn.kv_cache)[:, :, :, dev : dev + n].copy_(as_bytes(src).permute(_TO_DEVICE))

    def _copy_plan(self, swap_out: list[tuple[int, int]], swap_in: list[tuple[int, int]]
                   ) -> None:
        """A whole plan's copies on the CPU, swap-outs first, one copy per run of blocks
        consecutive on both sides (every layer at once). NOTE: not one indexed gather and
        scatter for the whole plan: over the device cache's block dimension (the fourth)
        those took 2.5-5x these copies' time for the small preset's 0.6-1.1 MiB blocks, in
        runs or scattered, and 2-5x for the tiny one's 64 KiB blocks in runs; only scattered
        tiny blocks were faster that way (1.3x, ~6 us a block). `benchmarks/kv/swap_copies.py`."""
        host = self.host.blocks
        for dev, hst, n in _pair_runs(swap_out):
            self._copy_out(dev, host[hst : hst + n], n)
        for hst, dev, n in _pair_runs(swap_in):
            self._copy_in(host[hst : hst + n], dev, n)


def _pair_runs(pairs: list[tuple[int, int]]) -> list[tuple[int, int, int]]:
    """(first source block, first destination block, length) of each run of pairs whose
    source and destination both go up by one (the pools hand out consecutive ids, so often a
    run per request)."""
    runs: list[tuple[int, int, int]] = []
    for src, dst in pairs:
        if runs and src == runs[-1][0] + runs[-1][2] and dst == runs[-1][1] + runs[-1][2]:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((src, dst, 1))
    return runs


@dataclass(eq=False)
class _Task:
    """One run's copy, queued on the copy engine."""

    event: torch.cuda.Event | threading.Event | None = None
    device_blocks: list[int] = field(default_factory=list)
    work: object = None  # the CPU worker's closure
    error: BaseException | None = field(default=None)


class CudaSwapper(KVSwapper):
    """Copies on a separate CUDA stream from/to pinned host memory: per iteration and
    direction, one gather (or scatter) kernel over every block of the plan, the DMAs between
    the device staging buffer and the host's runs of consecutive blocks, and one event. The
    compute stream waits on that event only when an iteration uses one of its blocks, and
    waits on the device: the host never blocks on a copy."""

    _pin = True

    def __init__(self, attn: PagedAttention, num_host_blocks: int) -> None:
        super().__init__(attn, num_host_blocks)
        device = attn.k_caches[0].device
        self.stream = torch.cuda.Stream(device=device)
        self.compute_stream = torch.cuda.current_stream(device)

    def _begin(self) -> None:
        # A swap-out must read what earlier compute wrote; a swap-in must not overwrite a
        # block before earlier compute is done reading it.
        self.stream.wait_stream(self.compute_stream)

    def _queue(self, swap_out: list[tuple[int, int]], swap_in: list[tuple[int, int]]
               ) -> list[_Task]:
        tasks = []
        kv, host = self._raw()
        device = self.stream.device
        with torch.cuda.stream(self.stream):
            if swap_out:
                dev_ids, host_ids = zip(*swap_out, strict=True)
                # Allocated on the copy stream: its memory is reused only after these copies.
                # [n, layers, 2, heads, bs, dim], contiguous in the host's block-major layout
                stage = kv.permute(_TO_HOST).index_select(0, _on_device(dev_ids, device))
                for pos, start, n in _runs(host_ids):
                    host[start : start + n].copy_(stage[pos : pos + n], non_blocking=True)
                tasks.append(self._record(list(dev_ids)))
            if swap_in:
                host_ids, dev_ids = zip(*swap_in, strict=True)
                stage = torch.empty((len(host_ids), *host.shape[1:]), dtype=host.dtype,
                                    device=device)
                for pos, start, n in _runs(host_ids):
                    stage[pos : pos + n].copy_(host[start : start + n], non_blocking=True)
                kv.index_copy_(3, _on_device(dev_ids, device), stage.permute(_TO_DEVICE))
                tasks.append(self._record(list(dev_ids)))
        return tasks

    def _record(self, device_blocks: list[int]) -> _Task:
        event = torch.cuda.Event()
        event.record(self.stream)
        return _Task(event=event, device_blocks=device_blocks)

    def _is_done(self, task: _Task) -> bool:
        assert isinstance(task.event, torch.cuda.Event)
        return bool(task.event.query())

    def _wait(self, task: _Task) -> None:
        # NOTE: the compute stream waits, not the host: the iteration's kernels queue behind
        # the copy while the host goes on preparing them.
        assert isinstance(task.event, torch.cuda.Event)
        self.compute_stream.wait_event(task.event)

    def synchronize(self) -> None:
        self.stream.synchronize()
        self._prune()


def _on_device(ids: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """Block ids as an index tensor on `device`, copied from pinned memory without a sync."""
    return torch.tensor(ids, dtype=torch.long).pin_memory().to(device, non_blocking=True)


def _runs(host_ids: tuple[int, ...]) -> list[tuple[int, int, int]]:
    """(position in the plan, first host block, length) of each run of consecutive host
    blocks in plan order: one DMA each (the pool hands out consecutive ids, so usually one
    run per request)."""
    runs: list[tuple[int, int, int]] = []
    for pos, h in enumerate(host_ids):
        if runs and h == runs[-1][1] + runs[-1][2]:
            p, start, n = runs[-1]
            runs[-1] = (p, start, n + 1)
        else:
            runs.append((pos, h, 1))
    return runs


class ThreadSwapper(KVSwapper):
    """Copies on a background worker thread, one `threading.Event` per run (CPU devices)."""

    def __init__(self, attn: PagedAttention, num_host_blocks: int) -> None:
        super().__init__(attn, num_host_blocks)
        self._work: queue.SimpleQueue[_Task | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None  # started by the first copy

    def _begin(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="fastserve-kv-copy", daemon=True)
            self._thread.start()

    def _queue(self, swap_out: list[tuple[int, int]], swap_in: list[tuple[int, int]]
               ) -> list[_Task]:
        # One task per plan: handing a task to the thread costs ~0.1 ms of this machine's
        # CPU, more than copying a small run; the copies are done in plan order within it.
        def work() -> None:
            self._copy_plan(swap_out, swap_in)

        blocks = [dev for dev, _ in swap_out] + [dev for _, dev in swap_in]
        task = _Task(event=threading.Event(), device_blocks=blocks, work=work)
        self._work.put(task)
        return [task]

    def _is_done(self, task: _Task) -> bool:
        assert isinstance(task.event, threading.Event)
        return task.event.is_set()

    def _wait(self, task: _Task) -> None:
        assert isinstance(task.event, threading.Event)
        task.event.wait()
        if task.error is not None:
            raise RuntimeError(f"KV copy failed: {task.error}") from task.error

    def close(self) -> None:
        super().close()
        if self._thread is not None:
            self._work.put(None)
            self._thread.join()
            self._thread = None

    def _run(self) -> None:
        # NOTE: one intra-op thread for this thread's copies (the setting is per thread: the
        # compute keeps its own). The copies are memory-bound, and a second OpenMP team here
        # competes with the compute's for the same cores: on a 2-core machine, interleaved
        # real runs (benchmarks/kv/kv_policies.py part 3) had median average JCT 0.87 s with a
        # full team here and 0.71 s with one thread.
        torch.set_num_threads(1)
        with torch.inference_mode():
            while (task := self._work.get()) is not None:
                assert isinstance(task.event, threading.Event) and callable(task.work)
                try:
                    task.work()
                except BaseException as exc:  # NOTE: reported to whoever waits on the task
                    logger.exception("KV copy failed")
                    task.error = exc
                task.work = None
                task.event.set()


class InlineSwapper(KVSwapper):
    """Copies on the calling (compute) thread, done by the time `submit` returns (CPU devices
    whose cores the compute already fills; see the module docstring)."""

    overlaps_compute = False

    def _queue(self, swap_out: list[tuple[int, int]], swap_in: list[tuple[int, int]]
               ) -> list[_Task]:
        with torch.inference_mode():
            self._copy_plan(swap_out, swap_in)
        return []  # nothing left in flight

    def _is_done(self, task: _Task) -> bool:
        return True

    def _wait(self, task: _Task) -> None:
        pass


def has_spare_core() -> bool:
    """Whether the compute's intra-op threads leave a core of this process's free."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    return torch.get_num_threads() < cores


def make_swapper(attn: PagedAttention, num_host_blocks: int, cpu_worker: str = "auto"
                 ) -> KVSwapper:
    """The swapper for the cache's device: a copy stream on CUDA; on a CPU a copy thread
    (`cpu_worker="thread"`), copies on the compute thread ("inline"), or ("auto") the thread
    only when a core is free for it."""
    if platform_for(attn.k_caches[0].device).has_copy_stream:
        return CudaSwapper(attn, num_host_blocks)
    if cpu_worker not in ("auto", "thread", "inline"):
        raise ValueError(f"cpu_copy_worker must be 'auto', 'thread' or 'inline', got {cpu_worker!r}")
    if cpu_worker == "thread" or (cpu_worker == "auto" and has_spare_core()):
        return ThreadSwapper(attn, num_host_blocks)
    return InlineSwapper(attn, num_host_blocks)
