"""The engine loop is never held by one request, and a stuck one is seen and left behind, on a
real server: grammars compile beside the loop (streams keep their pace, a compile over its
time limit fails its request naming the limit, one whose client left is stopped); a frozen
loop turns /health to 503, and SIGTERM still ends the process within the grace period + 5 s
with the status that says work was abandoned."""

from __future__ import annotations

import json
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from fastserve.children import descendants
from fastserve.server.cli import EXIT_ABANDONED
from tests.server.helpers import ServerProcess, start_server, validate
from tests.server.stallable import STALL_FILE_ENV

pytest.importorskip("xgrammar")

MODEL = "tiny"
COMPILE_LIMIT_S = 3.0
STALL_LIMIT_S = 2.0
GRACE_S = 2.0
# The grammar: 2,000 copies of ("a" | "b")* (compile time grows with its cube: this
# one ran for over 13 minutes).
EBNF_30KB = "root ::= " + " ".join(['("a" | "b")*'] * 2000)
SCHEMA_300 = {"type": "object", "properties": {f"field_{i}": {"type": "string", "maxLength": 4}
                                               for i in range(300)},
              "required": [f"field_{i}" for i in range(300)]}


@pytest.fixture(scope="module")
def guarded(server_tmp: Path, tiny_model_ready: Path) -> Iterator[tuple[ServerProcess, Path]]:
    """A server whose engine loop freezes while its stall file exists; the last test of
    this module ends it."""
    stall_file = server_tmp / f"stall-{time.monotonic_ns()}"
    server = start_server(
        server_tmp, "--no-warmup", "--no-startup-profile", "--max-batch-size", "8",
        "--grammar-compile-timeout-s", str(COMPILE_LIMIT_S),
        "--engine-stall-timeout-s", str(STALL_LIMIT_S), "--grace-period-s", str(GRACE_S),
        env={STALL_FILE_ENV: str(stall_file)}, module="tests.server.stallable")
    try:
        yield server, stall_file
    finally:
        stall_file.unlink(missing_ok=True)
        server.stop()


class _Streams:
    """Greedy streams read on threads, one after another on each, every chunk's arrival
    time kept (a gap is measured within one stream)."""

    def __init__(self, server: ServerProcess, num: int) -> None:
        self.server = server
        self.stop = threading.Event()
        self.arrivals: list[list[float]] = []
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._read, args=(i,)) for i in range(num)]
        for t in self._threads:
            t.start()

    def _read(self, i: int) -> None:
        body = {"model": MODEL, "prompt": f"Stream {i} goes on", "max_tokens": 1500,
                "temperature": 0, "ignore_eos": True, "stream": True}
        while not self.stop.is_set():
            times: list[float] = []
            with self._lock:
                self.arrivals.append(times)
            with httpx.stream("POST", self.server.v1 + "/completions", json=body, timeout=60) as resp:
                for line in resp.iter_lines():
                    if line.startswith("data: "):
                        times.append(time.monotonic())
                    if self.stop.is_set():
                        break

    def max_gap_s(self, start: float, end: float) -> float:
        gaps = [b - a for times in self.arrivals for a, b in zip(times, times[1:])
                if start <= a and b <= end]
        assert len(gaps) > 20, "the streams got too few tokens to measure"
        return max(gaps)

    def close(self) -> None:
        self.stop.set()
        for t in self._threads:
            t.join(60)


def _grammar_workers(pid: int) -> list[int]:
    return [p for p in descendants(pid) if b"grammar_workers" in _cmdline(p)]


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def _cpu_s(pid: int) -> float:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / 100  # utime + stime, in clock ticks


def _busy(pids: list[int], within_s: float = 0.5) -> list[int]:
    """Those of `pids` that ran over `within_s` (an idle worker, blocked on its pipe, does not
    run at all; a compiling one does, however busy the machine)."""
    before = {p: _cpu_s(p) for p in pids}
    time.sleep(within_s)
    return [p for p in pids if _cpu_s(p) - before[p] >= 0.03]


def _post_and_leave(server: ServerProcess, grammar: str, timeout_s: float) -> None:
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.v1 + "/completions", timeout=timeout_s, json={
            "model": MODEL, "prompt": "cd", "max_tokens": 8,
            "structured_outputs": {"grammar": grammar}})


def test_grammars_compile_beside_the_running_streams(guarded: tuple[ServerProcess, Path]) -> None:
    server, _ = guarded
    streams = _Streams(server, 3)
    try:
        time.sleep(2.0)
        baseline_end = time.monotonic()
        usual_gap_s = streams.max_gap_s(baseline_end - 1.5, baseline_end)

        with httpx.Client(base_url=server.v1, timeout=120) as http:
            # A 300-property schema (seconds to compile): its answer, or a 400 naming the
            # limit where this machine compiles it slower.
            start = time.monotonic()
            resp = http.post("/completions", json={
                "model": MODEL, "prompt": "JSON:", "max_tokens": 16, "guided_json": SCHEMA_300})
            schema_s = time.monotonic() - start
            schema_status = resp.status_code
            if resp.status_code == 200:
                assert resp.json()["choices"][0]["text"].startswith('{"field_0"')
            else:
                assert resp.status_code == 400, resp.text
                assert "--grammar-compile-timeout-s" in resp.json()["error"]["message"]
                assert resp.json()["error"]["param"] == "guided_json"

            # The 30 KB EBNF: within the size limit, over the time limit: an error naming it.
            start = time.monotonic()
            resp = http.post("/completions", json={
                "model": MODEL, "prompt": "ab", "max_tokens": 8,
                "structured_outputs": {"grammar": EBNF_30KB}})
            ebnf_s = time.monotonic() - start
            assert resp.status_code == 400, resp.text
            validate(resp.json(), "ErrorResponse")
            assert "--grammar-compile-timeout-s" in resp.json()["error"]["message"]
            assert ebnf_s < COMPILE_LIMIT_S + 60  # (+ a worker process's start on a busy machine)

            # Twice the size limit: refused before it is queued.
            resp = http.post("/completions", json={
                "model": MODEL, "prompt": "ab", "max_tokens": 8,
                "structured_outputs": {"grammar": EBNF_30KB + " " * 70_000}})
            assert resp.status_code == 400 and "--max-grammar-bytes" in resp.json()["error"]["message"]

            # A compile whose client leaves is stopped: its worker goes, no core burns on.
            slow = "root ::= " + " ".join(['("c" | "d")*'] * 1500)  # (not the cached one)
            leaving = threading.Thread(target=_post_and_leave, args=(server, slow, 2.0))
            leaving.start()
            time.sleep(0.5)
            compiling = _busy(_grammar_workers(server.proc.pid), 0.8)
            leaving.join()
            assert compiling, "no worker was compiling the grammar"
        grammar_end = time.monotonic()
        deadline = time.monotonic() + 5
        while set(compiling) & set(_grammar_workers(server.proc.pid)) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not set(compiling) & set(_grammar_workers(server.proc.pid)), "the compile runs on"
        assert not _busy(_grammar_workers(server.proc.pid))

        gap_s = streams.max_gap_s(baseline_end, grammar_end)
        print(f"stream gaps: usual max {usual_gap_s * 1e3:.0f} ms, while grammars compiled "
              f"{gap_s * 1e3:.0f} ms (300-property schema: {schema_status} in {schema_s:.2f} s, the 30 KB EBNF "
              f"refused after {ebnf_s:.2f} s)")
        assert gap_s < usual_gap_s + 1.0
    finally:
        streams.close()
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200


def test_a_frozen_engine_loop_turns_health_503_and_sigterm_still_ends_it(
        guarded: tuple[ServerProcess, Path]) -> None:
    server, stall_file = guarded
    body = {"model": MODEL, "prompt": "Hold on", "max_tokens": 1500, "ignore_eos": True,
            "stream": True}
    lines: list[str] = []
    with httpx.stream("POST", server.v1 + "/completions", json=body, timeout=60) as resp:
        it = resp.iter_lines()
        assert next(line for line in it if line.startswith("data: "))
        stall_file.touch()  # the engine loop freezes inside its next iteration
        frozen = time.monotonic()
        while True:
            health = httpx.get(server.url + "/health", timeout=5)
            if health.status_code == 503 or time.monotonic() > frozen + STALL_LIMIT_S + 5:
                break
            time.sleep(0.1)
        seen_s = time.monotonic() - frozen
        assert health.status_code == 503, health.text
        validate(health.json(), "ErrorResponse")
        assert health.json()["error"]["code"] == "engine_stalled"
        assert seen_s < STALL_LIMIT_S + 1.5
        assert server.metrics()["fastserve_engine_seconds_since_progress"] > STALL_LIMIT_S

        server.proc.send_signal(signal.SIGTERM)
        sent = time.monotonic()
        lines = [line for line in it if line.startswith("data: ")]
    code = server.proc.wait(GRACE_S + 30)
    exit_s = time.monotonic() - sent
    print(f"/health 503 {seen_s:.2f} s after the freeze; exit {code} {exit_s:.2f} s after SIGTERM")
    assert code == EXIT_ABANDONED, server.log()[-3000:]
    assert exit_s < GRACE_S + 5
    assert lines[-1] == "data: [DONE]"
    assert json.loads(lines[-2].removeprefix("data: "))["error"]["code"] == "shutdown"
    assert "abandoning running work" in server.log()
