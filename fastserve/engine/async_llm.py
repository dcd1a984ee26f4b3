"""AsyncLLM: the engine stepping in a background thread, streaming tokens to asyncio callers.

The engine is not thread-safe, so every mutation (add, abort) is a command the engine thread
runs between iterations; callers await a future for its result. Outputs travel back through a
per-request asyncio queue filled with `call_soon_threadsafe`.

NOTE: a caller may be cancelled at any await (a client that hangs up). A command whose caller
has gone is skipped, a request added for a caller that has gone is aborted, and nothing one
command or one request raises may stop the engine loop: it fails that command or request only.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import gc
import logging
import threading
import time
from collections import OrderedDict, deque
from collections.abc import AsyncGenerator, Callable
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

from fastserve.config import EngineConfig
from fastserve.engine.llm_engine import LLMEngine
from fastserve.engine.loras import ServedAdapter
from fastserve.engine.stats import EngineStats
from fastserve.executor.grammar import is_available
from fastserve.executor.openmp import release_thread_team
from fastserve.model.lora import Adapter
from fastserve.request import RequestOutput, SamplingParams

logger = logging.getLogger(__name__)


# Metrics read a snapshot of the engine's counts; counting every request after every
# iteration would cost O(requests) per token.
_STATS_PERIOD_S = 0.05
# How often a loop with nothing to run but requests waiting for their grammars looks again.
_PREPARATION_POLL_S = 0.01
# Who sent the request being handled, when a fleet's ingress did (its `X-Fastserve-Ingress`
# header, set by the replica's HTTP server): `generate` counts its requests taken in, for the
# ingress's router (`admitted`).
SENDER: ContextVar[str | None] = ContextVar("fastserve_sender", default=None)
# Senders counted at most (the oldest forgotten first): a fleet has one ingress or a few.
_MAX_SENDERS = 64


def _put_all(items: list[tuple[asyncio.Queue[Any], RequestOutput]]) -> None:
    for queue, out in items:
        queue.put_nowait(out)


def _call_soon(loop: asyncio.AbstractEventLoop, fn: Callable[..., Any], *args: Any) -> bool:
    """Schedule `fn` on `loop` from another thread; False when the loop has closed."""
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:  # closed between any check and the call: the caller has gone
        return False
    return True


def _merged(a: RequestOutput, b: RequestOutput) -> RequestOutput:
    """The later output `b` carrying the new tokens and text of both."""
    return dataclasses.replace(
        b, new_token_ids=a.new_token_ids + b.new_token_ids, new_text=a.new_text + b.new_text
    )


class QueueFullError(RuntimeError):
    """The waiting queue is at `max_waiting`; the caller should retry later (HTTP 429)."""


class EngineDeadError(RuntimeError):
    """The engine loop stopped (a fatal error or shutdown); no new requests are taken."""


class EngineShutdownError(EngineDeadError):
    """The engine is shutting down: it refuses new requests while running ones drain, and
    ends those still running when the grace period runs out."""


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[RequestOutput | BaseException]


class AsyncLLM:
    def __init__(self, config: EngineConfig) -> None:
        """Builds the engine on the engine thread (see `_start`); raises what building it
        raised."""
        self.config = config
        self._commands: deque[tuple[Callable[[], Any], concurrent.futures.Future[Any]]] = deque()
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._streams: dict[str, _Stream] = {}
        # Per sender (`SENDER`): requests taken in; changed and read on the engine thread.
        self._admitted: OrderedDict[str, int] = OrderedDict()
        self._stopping = False
        self._closed = False  # set by the engine thread once it takes no more commands
        self._is_released = False  # set by `shutdown` once the engine (model, KV pool) is freed
        self.dead_reason: str | None = None
        self._stats: EngineStats  # set by the engine thread once the engine is built
        self._stats_s = time.monotonic()
        # When the engine loop last came round (an iteration, a command, an idle wait): the
        # watchdog's reading (`seconds_since_progress`). A float written by one thread.
        self._progress_s = time.monotonic()
        self.abandoned = False  # a shutdown ended requests, or left the engine thread running
        # Callbacks run on the engine thread for every finished output (metrics).
        self.on_finish: list[Callable[[RequestOutput], None]] = []
        # The caller's OpenMP workers, if it ran parallel ops (a model made or loaded), would
        # slow every op of the engine thread's (fastserve/executor/openmp.py).
        release_thread_team()
        built: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._thread = threading.Thread(target=self._start, args=(built,), name="fastserve-engine",
                                        daemon=True)
        self._thread.start()
        built.result()  # raises what building the engine raised
        self.tokenizer = self.engine.tokenizer

    # -- public API -------------------------------------------------------------------------

    @property
    def is_healthy(self) -> bool:
        return self.dead_reason is None and self._thread.is_alive()

    @property
    def seconds_since_progress(self) -> float:
        """Seconds since the engine loop last came round. An idle loop comes round at least
        every half second, so a large value means an iteration (or a command) is stuck."""
        return max(0.0, time.monotonic() - self._progress_s)

    @property
    def is_stalled(self) -> bool:
        """Whether the loop has made no progress for `engine_stall_timeout_s` (`/health`
        answers 503 then)."""
        limit = self.config.limits.engine_stall_timeout_s
        return bool(limit) and self._thread.is_alive() and self.seconds_since_progress > limit

    @property
    def is_draining(self) -> bool:
        """True once `shutdown` has begun: no new requests, running ones may finish."""
        return self._stopping

    def stats(self) -> EngineStats:
        """A snapshot taken by the engine thread after its latest iteration (up to 50 ms old)."""
        return self._stats

    async def current_stats(self) -> EngineStats:
        """The engine's counts now, read on the engine thread between iterations."""
        return await self._call(self._stats_now)

    async def generate(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        oracle_output_len: int | None = None,
        coalesce: bool = False,
        priority: int = 0,
        lora: str | None = None,
        cache_salt: str | None = None,
        stream_interval: int = 1,
    ) -> AsyncGenerator[RequestOutput, None]:
        """Yield the request's outputs as tokens come; the last has `finished=True`. With
        `n` or `best_of` > 1 the sequences' outputs interleave, each with its `index` and its
        own `finished`; the request's last output has `ends_request`.

        With `coalesce`, outputs that queued up while the caller was busy come as one output
        carrying all their new tokens and text (what a saturated server wants: one chunk and
        one socket write instead of several); a caller that keeps up still gets one per token.
        `stream_interval` (vLLM's): after a sequence's first output, each of its outputs
        carries at least this many new tokens (its last may carry fewer).

        `priority`: lower runs first, over the scheduling policy's order (vLLM's). `lora`: the
        LoRA adapter it runs with (a name of `lora_modules`). `cache_salt`: it shares cached
        prefix blocks only with requests of the same salt (vLLM's).

        Raises ValueError for bad input and QueueFullError when the queue is full. Closing the
        iterator early (a client that went away) aborts the request and frees its blocks.
        """
        loop = asyncio.get_running_loop()
        stream = _Stream(loop, asyncio.Queue())
        sender = SENDER.get()
        if params is not None and (params.bad_words or params.prediction):
            # NOTE: tokenized here, off the engine thread: a long prediction takes a while
            params = await asyncio.to_thread(self.engine.tokenize_texts, params)
        if params is not None and params.structured_output is not None and is_available():
            # NOTE: off the engine thread: xgrammar's first import takes a second or more, and
            # building (checking) a large grammar seconds
            await asyncio.to_thread(self.engine.grammars.check, params.structured_output)

        def add() -> str:
            limit = self.config.scheduler.max_waiting
            if limit and self._stats_now().scheduler.num_waiting >= limit:
                raise QueueFullError(f"{limit} requests are already waiting (max_waiting)")
            req = self.engine.add_request(prompt, params, request_id,
                                          oracle_output_len=oracle_output_len, priority=priority,
                                          lora=lora, cache_salt=cache_salt)
            self._streams[req.request_id] = stream
            if sender is not None:
                self._count_admitted(sender)
            return req.request_id

        added = self._submit_checked(add)
        try:
            rid = await asyncio.wrap_future(added)
        except asyncio.CancelledError:
            # The caller went away. Not yet run, `add` is skipped; already running, the request
            # it adds has nobody to read it: abort it once `add` returns.
            added.add_done_callback(self._abort_added)
            raise
        finished = False
        held: RequestOutput | BaseException | None = None  # read while coalescing, not merged
        started: set[int] = set()  # the sequences that have had an output
        short: dict[int, RequestOutput] = {}  # a sequence's output held for stream_interval
        try:
            while True:
                item, held = (held, None) if held is not None else (await stream.queue.get(), None)
                while coalesce and isinstance(item, RequestOutput) and not item.finished:
                    if stream.queue.empty():
                        break
                    nxt = stream.queue.get_nowait()
                    if isinstance(nxt, BaseException) or nxt.index != item.index or nxt.is_failure:
                        # NOTE: another sequence's output (`n` > 1) is not merged, nor is a
                        # failure: tokens before it still come first, as they would have to
                        # a fast reader (a stream that began is not turned into an error)
                        held = nxt
                        break
                    item = _merged(item, nxt)
                if isinstance(item, BaseException):
                    raise item
                before = short.pop(item.index, None)
                if before is not None and item.is_failure:
                    yield before  # its tokens first, as a fast reader would have had them
                elif before is not None:
                    item = _merged(before, item)
                if (stream_interval > 1 and item.index in started and not item.finished
                        and len(item.new_token_ids) < stream_interval):
                    short[item.index] = item
                    continue
                finished = item.ends_request
                started.add(item.index)
                yield item
                if finished:
                    return
        finally:
            if not finished:
                self.abort(rid)

    async def load_lora(self, name: str, path: str, replace: bool = False) -> ServedAdapter:
        """Serve the PEFT adapter at `path` as `name` from now on (read off the engine thread,
        put in place between iterations). Raises LoRAError naming what is wrong."""
        def read() -> Adapter:
            try:
                return self.engine.loras.read(name, path)
            finally:  # the worker thread lives on: its OpenMP workers would slow the engine's
                release_thread_team()

        adapter = await asyncio.to_thread(read)
        return await self._call(lambda: self.engine.add_lora(adapter, path, replace=replace))

    async def unload_lora(self, name: str) -> ServedAdapter:
        """Stop serving adapter `name` (running requests finish with it). Raises
        LoRANotFoundError."""
        return await self._call(lambda: self.engine.remove_lora(name))

    def abort(self, request_id: str) -> None:
        """Abort without waiting (safe from any thread)."""

        def run() -> None:
            self._streams.pop(request_id, None)
            self.engine.abort(request_id)

        self._submit(run)

    async def shutdown(self, grace_s: float = 30.0, join_s: float = 10.0) -> bool:
        """Stop taking requests, let running ones finish within `grace_s`, then stop the
        engine loop (waiting up to `join_s` for its iteration to end). Returns whether all
        drained: False (and `abandoned`) when running requests had to be ended, or the loop
        is stuck in an iteration (its thread is left behind: the process may exit)."""
        if self._is_released:  # shut down before: the engine is gone
            return not self.abandoned
        self._stopping = True
        deadline = asyncio.get_running_loop().time() + grace_s
        while self._streams and asyncio.get_running_loop().time() < deadline and self.is_healthy:
            await asyncio.sleep(0.05)
        if self._streams:
            self.abandoned = True
        self._fail_all(EngineShutdownError(
            f"the server is shutting down: the grace period of {grace_s:g} s ran out"))
        self.dead_reason = self.dead_reason or "shut down"
        self._wake.set()
        await asyncio.to_thread(self._thread.join, join_s)
        if self._thread.is_alive():
            logger.error("the engine loop is stuck in an iteration (%.0f s without progress); "
                         "leaving it behind", self.seconds_since_progress)
            self.abandoned = True
            self.engine.grammars.shutdown()  # NOTE: not the rest: the stuck thread may hold it
            return False
        await asyncio.to_thread(self.engine.shutdown)  # compile and distributed workers
        # NOTE: the model and the KV pool go with the engine, even while something outside
        # keeps this object (FastAPI caches every app's route functions, which hold it).
        del self.engine
        self._is_released = True
        gc.collect()  # the engine's parts hold its bound methods: a reference cycle
        return not self.abandoned

    # -- engine thread ------------------------------------------------------------------------

    async def _call(self, fn: Callable[[], Any]) -> Any:
        """`fn()` run on the engine thread; cancelling the caller before it runs skips it."""
        return await asyncio.wrap_future(self._submit_checked(fn))

    def _submit_checked(self, fn: Callable[[], Any]) -> concurrent.futures.Future[Any]:
        if not self.is_healthy:
            raise EngineDeadError(self.dead_reason or "the engine is shutting down")
        if self._stopping:
            raise EngineShutdownError("the server is shutting down: it takes no new requests")
        return self._submit(fn)

    def _abort_added(self, added: concurrent.futures.Future[Any]) -> None:
        """Abort the request an `add` command made (runs on whichever thread settles it)."""
        if not added.cancelled() and added.exception() is None:
            self.abort(added.result())

    def _submit(self, fn: Callable[[], Any]) -> concurrent.futures.Future[Any]:
        fut: concurrent.futures.Future[Any] = concurrent.futures.Future()
        with self._lock:
            if self._closed:  # the engine thread has gone: answer now rather than never
                fut.set_exception(EngineDeadError(self.dead_reason or "the engine is shutting down"))
                return fut
            self._commands.append((fn, fut))
        self._wake.set()
        return fut

    def _run_commands(self) -> None:
        """Run the queued commands in order, one at a time: those left if the loop dies are
        answered by `_close`, not lost."""
        while True:
            with self._lock:
                if not self._commands:
                    return
                fn, fut = self._commands.popleft()
            # NOTE: False once the caller has cancelled; from here on it cannot, so the
            # result below always finds the future open.
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                result = fn()
            except Exception as exc:  # reported to the caller that sent it
                fut.set_exception(exc)
            else:
                fut.set_result(result)

    def _close(self) -> None:
        """Take no more commands, and answer those still queued (not run: the loop has ended)."""
        with self._lock:
            self._closed = True
            left, self._commands = self._commands, deque()
        error = EngineDeadError(self.dead_reason or "the engine is shutting down")
        for _, fut in left:
            if fut.set_running_or_notify_cancel():
                fut.set_exception(error)

    def _start(self, built: concurrent.futures.Future[None]) -> None:
        """Build the engine, then run it, on this one thread.

        NOTE: every forward pass (the warm-up and the start-up profile too) runs on the thread
        that built the engine: a second thread running torch's parallel ops keeps a second
        team of OpenMP workers alive, which slowed every op of the decode step 1.5x
        (fastserve/executor/openmp.py).
        """
        try:
            self.engine = LLMEngine(self.config)
            self._stats = self.engine.stats()
        except BaseException as exc:
            built.set_exception(exc)
            self._close()
            return
        built.set_result(None)
        self._run()

    def _run(self) -> None:
        try:
            while self.dead_reason is None:
                self._progress_s = time.monotonic()
                self.engine.check_health()  # a distributed rank lost while idle stops the loop
                self._run_commands()
                if not self.engine.has_unfinished:
                    self._stats = self.engine.stats()
                    self._wake.wait(0.5)
                    self._wake.clear()
                    continue
                if self.engine.is_waiting_on_preparation:  # nothing to run until a grammar compiles
                    self._wake.wait(_PREPARATION_POLL_S)
                    self._wake.clear()
                self._deliver(self.engine.step())
                if time.monotonic() - self._stats_s > _STATS_PERIOD_S:
                    self._stats_now()
        except BaseException as exc:  # NOTE: a dead loop must not leave callers hanging
            logger.exception("engine loop died")
            self.dead_reason = f"engine loop died: {type(exc).__name__}: {exc}"
            self._fail_all(EngineDeadError(self.dead_reason))
        if self._streams:  # added as a shutdown ended the others: end them too
            reason = self.dead_reason or "the engine has stopped"
            self._fail_all(EngineShutdownError(reason) if self._stopping else EngineDeadError(reason))
        self._close()

    def admitted(self) -> dict[str, int]:
        """Per sender (`SENDER`), the requests the engine has taken in from it.
        NOTE: call it on the engine thread (`_call`), with what it must agree with."""
        return dict(self._admitted)

    def _count_admitted(self, sender: str) -> None:
        self._admitted[sender] = self._admitted.get(sender, 0) + 1
        self._admitted.move_to_end(sender)
        if len(self._admitted) > _MAX_SENDERS:
            self._admitted.popitem(last=False)

    def _stats_now(self) -> EngineStats:
        self._stats = self.engine.stats()
        self._stats_s = time.monotonic()
        return self._stats

    def _deliver(self, outs: list[RequestOutput]) -> None:
        """Hand an iteration's outputs over with one wake-up per event loop, not per token."""
        batches: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue[Any], RequestOutput]]] = {}
        for out in outs:
            stream = self._streams.get(out.request_id)
            if out.finished:  # a sequence: the metrics count each one's tokens
                if out.ends_request:
                    self._streams.pop(out.request_id, None)
                for cb in self.on_finish:
                    try:
                        cb(out)
                    except Exception:  # NOTE: metrics failing one request must not stop the loop
                        logger.exception("on_finish callback failed for %s", out.request_id)
            if stream is not None:
                batches.setdefault(stream.loop, []).append((stream.queue, out))
        for loop, items in batches.items():
            if not _call_soon(loop, _put_all, items):
                self._drop_streams_of(loop)

    def _drop_streams_of(self, loop: asyncio.AbstractEventLoop) -> None:
        """A caller's event loop closed without closing its streams: abort what it was reading."""
        gone = [rid for rid, stream in self._streams.items() if stream.loop is loop]
        for rid in gone:
            del self._streams[rid]
            self.engine.abort(rid)
        logger.warning("event loop closed with %d open streams; aborted them", len(gone))

    def _fail_all(self, exc: BaseException) -> None:
        streams, self._streams = self._streams, {}
        for stream in streams.values():
            _call_soon(stream.loop, stream.queue.put_nowait, exc)
