"""Grammar compiles in worker processes: killable, bounded in time, off the engine loop.

xgrammar compiles in C++ and cannot be interrupted from Python: a compile run on a thread
that outlives its request (a 30 KB EBNF ran for over 13 minutes) burns a core until it ends,
and every compile queued behind it waits. So each grammar is first compiled in a worker process
(`python -m fastserve.executor.grammar_workers`), which is killed when its compile runs past
the time limit or when every request waiting for it has gone; the next compile starts a fresh
one. A grammar the worker compiled in time is then compiled again on the parent's feeder
thread (xgrammar releases the GIL there: the engine thread keeps running), which takes about
as long, so no compile in the server process runs past the limit.

NOTE: compiled twice rather than sent back: a compiled grammar's masks serialize to JSON 800
times the size of its spec (a 300-property schema: 110 MB, 17 s to write and 7 s to read on a
CPU where its compile took 0.13 s).

Frames on the pipes: an 8-byte big-endian length, then the bytes. The parent sends the
TokenizerInfo's JSON once, then one `[kind, spec]` JSON per compile; the worker answers each
with b"ok", or b"er" + an error message.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import ctypes
import json
import os
import queue
import re
import select
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from typing import IO, Any

from fastserve.request import InvalidRequestError, StructuredOutputParams

# xgrammar's messages start with "[hh:mm:ss] /path/file.cc:123: ": not the client's business.
_LOG_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: ")
_HEADER = 8
# How long a worker process may take to start (import xgrammar, load the vocabulary).
_START_LIMIT_S = 120.0
# A worker process with no compile for this long exits; the next compile starts another.
_IDLE_EXIT_S = 60.0


def load_xgrammar() -> Any:
    import xgrammar  # NOTE: optional: imported where the first structured request needs it

    return xgrammar


def error_message(exc: BaseException) -> str:
    """An xgrammar error's first line, without its source location."""
    return _LOG_PREFIX.sub("", str(exc).strip().splitlines()[0] if str(exc).strip() else repr(exc))


def build_grammar(params: StructuredOutputParams) -> Any:
    """The xgrammar `Grammar` of `params` (cheap: no vocabulary involved). Raises
    InvalidRequestError naming `params.param` when the spec is not a valid grammar."""
    xgr = load_xgrammar()
    try:
        if params.kind == "json":
            json.loads(str(params.spec))  # a clearer message than the converter's for bad JSON
            # NOTE: compact JSON (no free whitespace): a model cannot pad it forever.
            return xgr.Grammar.from_json_schema(str(params.spec), any_whitespace=False,
                                                strict_mode=True)
        if params.kind == "json_object":
            return xgr.Grammar.from_json_schema('{"type": "object"}', any_whitespace=False,
                                                strict_mode=False)
        if params.kind == "regex":
            return xgr.Grammar.from_regex(str(params.spec))
        if params.kind == "grammar":
            return xgr.Grammar.from_ebnf(str(params.spec))
        if params.kind == "structural_tag":
            return xgr.Grammar.from_structural_tag(str(params.spec))
        # choice: EBNF literals take JSON's escapes
        alternatives = " | ".join(json.dumps(c, ensure_ascii=False) for c in params.spec)
        return xgr.Grammar.from_ebnf(f"root ::= {alternatives}")
    except (RuntimeError, ValueError, TypeError) as exc:
        raise InvalidRequestError(f"{params.param}: not a valid {_KIND_NAMES[params.kind]}: "
                                  f"{error_message(exc)}", params.param) from None


_KIND_NAMES = {"json": "JSON schema", "json_object": "JSON object grammar", "regex": "regex",
               "choice": "list of choices", "grammar": "EBNF grammar",
               "structural_tag": "structural tag"}


class GrammarCompileError(RuntimeError):
    """A compile that did not finish: over the time limit, stopped, or its worker died."""


def _write(pipe: IO[bytes], data: bytes) -> None:
    pipe.write(len(data).to_bytes(_HEADER, "big") + data)
    pipe.flush()


def _read(pipe: IO[bytes]) -> bytes | None:
    """One frame, or None at the end of the stream."""
    header = pipe.read(_HEADER)
    if len(header) < _HEADER:
        return None
    size = int.from_bytes(header, "big")
    data = pipe.read(size)
    return data if len(data) == size else None


@dataclass
class CompileJob:
    """One grammar's compile, shared by the requests that wait for it."""

    params: StructuredOutputParams
    future: concurrent.futures.Future[Any] = field(default_factory=concurrent.futures.Future)
    num_waiters: int = 1  # requests waiting for it; at 0 it is stopped (`release`)
    is_stopped: bool = False  # released by all: a queued job is skipped, a running one killed


class _Worker:
    """One feeder thread and the worker process it feeds (started at its first compile)."""

    def __init__(self, index: int, pool: GrammarWorkers, prestart: bool = False) -> None:
        self.pool = pool
        self._prestart = prestart
        self.proc: subprocess.Popen[bytes] | None = None
        self.job: CompileJob | None = None  # the compile running now
        self.compiler: Any = None  # this thread's xgrammar GrammarCompiler, made at its first
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name=f"fastserve-grammar-{index}",
                                        daemon=True)
        self._thread.start()

    def _run(self) -> None:
        if self._prestart:  # NOTE: its start-up (seconds) overlaps the first request's check
            with contextlib.suppress(GrammarCompileError):
                self._process()
        while True:
            try:
                job = self.pool.jobs.get(timeout=_IDLE_EXIT_S)
            except queue.Empty:  # NOTE: an idle worker's process goes (it holds ~300 MB)
                self.kill()
                continue
            if job is None:  # shutdown
                return
            if job.is_stopped or not job.future.set_running_or_notify_cancel():
                continue
            with self._lock:
                self.job = job
            try:
                job.future.set_result(self._compile(job))
            except Exception as exc:
                job.future.set_exception(exc)
            finally:
                with self._lock:
                    self.job = None

    def _compile(self, job: CompileJob) -> Any:
        proc = self._process()
        assert proc.stdin is not None and proc.stdout is not None
        limit_s = self.pool.timeout_s
        try:
            _write(proc.stdin, json.dumps([job.params.kind, job.params.spec]).encode())
            ready, _, _ = select.select([proc.stdout], [], [], limit_s)
            reply = _read(proc.stdout) if ready else None
        except (OSError, ValueError):  # the process was killed under us (`stop`)
            reply = None
        if reply is None:
            self.kill()
            if job.is_stopped:
                raise GrammarCompileError("the compile was stopped: its requests went away")
            if not ready:
                raise GrammarCompileError(
                    f"the grammar did not compile within {limit_s:g} s "
                    f"(--grammar-compile-timeout-s); simplify it or raise the limit")
            raise GrammarCompileError("the grammar compile worker died")
        if reply[:2] != b"ok":
            raise GrammarCompileError(reply[2:].decode(errors="replace"))
        if job.is_stopped:
            raise GrammarCompileError("the compile was stopped: its requests went away")
        if self.compiler is None:
            self.compiler = self.pool.xgr.GrammarCompiler(self.pool.info, max_threads=1,
                                                          cache_enabled=False)
        return self.compiler.compile_grammar(build_grammar(job.params))

    def _process(self) -> subprocess.Popen[bytes]:
        """The worker process, started (and its "ready" read) if it is not running.
        NOTE: its start-up (importing xgrammar: seconds on a busy machine) is not the
        compile's: it does not count against the compile's time limit."""
        with self._lock:
            if self.proc is not None and self.proc.poll() is None:
                return self.proc
            proc = self.proc = subprocess.Popen(
                [sys.executable, "-m", "fastserve.executor.grammar_workers"],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        assert proc.stdin is not None and proc.stdout is not None
        try:
            _write(proc.stdin, self.pool.info_json)
            ready, _, _ = select.select([proc.stdout], [], [], _START_LIMIT_S)
            if not ready or _read(proc.stdout) != b"ready":
                raise OSError("no answer")
        except (OSError, ValueError) as exc:
            self.kill()
            raise GrammarCompileError(f"the grammar compile worker did not start: {exc}") from None
        return proc

    def stop(self, job: CompileJob) -> None:
        """Kill the worker if it is running `job` (its feeder fails the job)."""
        with self._lock:
            if self.job is job:
                self.kill()

    def kill(self) -> None:
        proc = self.proc
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()


class GrammarWorkers:
    """Compiles grammars in up to `num_workers` worker processes, each compile within
    `timeout_s` (else it fails with `GrammarCompileError` naming the limit)."""

    def __init__(self, info: Any, num_workers: int, timeout_s: float) -> None:
        self.xgr = load_xgrammar()
        self.info = info
        self.info_json = info.serialize_json().encode()
        self.timeout_s = timeout_s
        self.jobs: queue.Queue[CompileJob | None] = queue.Queue()
        self._workers = [_Worker(i, self, prestart=i == 0) for i in range(num_workers)]

    def submit(self, params: StructuredOutputParams) -> CompileJob:
        job = CompileJob(params)
        self.jobs.put(job)
        return job

    def stop(self, job: CompileJob) -> None:
        """Nobody waits for `job` any more: a queued one is never started, a running one is
        killed."""
        job.is_stopped = True
        job.future.cancel()  # (a queued job's; a running one is failed by its feeder)
        for worker in self._workers:
            worker.stop(job)

    @property
    def num_running(self) -> int:
        """Compiles running now (for tests and metrics)."""
        return sum(w.job is not None for w in self._workers)

    def worker_pids(self) -> list[int]:
        return [w.proc.pid for w in self._workers if w.proc is not None and w.proc.poll() is None]

    def shutdown(self) -> None:
        for _ in self._workers:
            self.jobs.put(None)
        for worker in self._workers:
            worker.kill()


# -- the worker process ----------------------------------------------------------------------


def _die_with_parent() -> None:
    """Linux: the kernel kills this process when its parent dies (even by SIGKILL), so a
    compile never outlives the server."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def main() -> None:
    _die_with_parent()
    parent = os.getppid()
    # The frames go on the original stdout; anything a library prints goes to stderr.
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    inp = sys.stdin.buffer
    info_json = _read(inp)
    if info_json is None or os.getppid() != parent:
        return
    import xgrammar

    info = xgrammar.TokenizerInfo.deserialize_json(info_json.decode())
    compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    _write(out, b"ready")
    while (frame := _read(inp)) is not None:
        kind, spec = json.loads(frame)
        try:
            params = StructuredOutputParams(kind, tuple(spec) if kind == "choice" else spec)
            compiler.compile_grammar(build_grammar(params))
            _write(out, b"ok")
        except Exception as exc:
            _write(out, b"er" + str(exc).encode())


if __name__ == "__main__":
    main()
