"""`fastserve serve --replicas 2`: a real fleet on a local Ray cluster (one per module: Ray's
start-up costs tens of seconds on two shared cores), served through the real CLI.

What a user would notice: the fleet answers as one server does (greedy tokens, streams ending
with [DONE], the same 400s and 404s), `/metrics` shows each replica and the fleet, and a
replica killed under load costs no request silently: its streams end with an error event and
[DONE], the other requests are answered, and the fleet keeps serving.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from fastserve.model.loader import read_arch_config
from fastserve.model.lora import make_adapter

pytest.importorskip("ray.serve", reason="the fleet needs Ray Serve: pip install 'fastserve[cluster]'")
# The module's fleet starts with its first test: Ray and two engines, minutes when the machine
# is busy.
pytestmark = pytest.mark.timeout(900)

REPO = Path(__file__).resolve().parents[2]
_URL_RE = re.compile(r"serving .* at (http://127\.0\.0\.1:\d+)/v1")
START_TIMEOUT_S = 400.0  # Ray, two replicas' engines, on a busy two-core machine
# A measured profile: replicas skip the start-up profiling (each would measure the machine).
PROFILE = str(REPO / "profiles" / "cpu-tiny-2threads-quiet.json")


class Fleet:
    def __init__(self, proc: subprocess.Popen[bytes], log_path: Path) -> None:
        self.proc = proc
        self.log_path = log_path
        self.url = ""

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def metrics(self) -> str:
        return httpx.get(self.url + "/metrics", timeout=30).text


def _replica_pids(root: int) -> list[int]:
    """The Ray Serve replica processes started under `root` (the fleet's process tree)."""
    children: dict[int, list[int]] = {}
    names: dict[int, str] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            cmd = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry))
        names[int(entry)] = cmd
    found, todo = [], [root]
    while todo:
        pid = todo.pop()
        for child in children.get(pid, []):
            todo.append(child)
            if "ServeReplica:fastserve:engine" in names.get(child, ""):
                found.append(child)
    return found


@pytest.fixture(scope="module")
def fleet(tiny_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    log_path = tmp_path_factory.mktemp("fleet") / "fleet.log"
    # A LoRA adapter beside the model: each replica loads it; requests naming it run with it.
    make_adapter(read_arch_config(tiny_model_path), log_path.parent / "attn", seed=5)
    env = {**os.environ, "RAY_DEDUP_LOGS": "0", "RAY_USAGE_STATS_ENABLED": "0",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    cmd = [sys.executable, "-m", "fastserve.cli", "serve", "--replicas", "2", "--num-threads", "1",
           "--port", "0", "--dtype", "float32", "--no-access-log", "--no-warmup", "--profile", PROFILE,
           "--lora-modules", f"attn={log_path.parent / 'attn'}"]
    with log_path.open("wb") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    f = Fleet(proc, log_path)
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not f.url:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the fleet did not start:\n{f.log()[-4000:]}")
            match = _URL_RE.search(f.log())
            if match:
                f.url = match.group(1)
            time.sleep(0.2)
        yield f
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(120)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    assert proc.returncode == 0, f.log()[-4000:]
    assert "fastserve: shut down" in f.log()


def _complete(url: str, prompt: str, max_tokens: int, **extra: Any) -> httpx.Response:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, **extra}
    return httpx.post(url + "/v1/completions", json=body, timeout=120)


def _stream(url: str, prompt: str, max_tokens: int, started: threading.Event | None = None) -> list[str]:
    """The `data:` payloads of one streamed completion, in order; `started` is set once the
    first arrived."""
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "ignore_eos": True}
    events = []
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=180) as resp:
        assert resp.status_code == 200, resp.read()
        for line in resp.iter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
                if started is not None:
                    started.set()
    return events


def test_answers_as_one_server(fleet: Fleet, tiny_model_path: Path) -> None:
    from fastserve.llm import LLM
    from fastserve.request import SamplingParams

    prompts = ["Once upon a time", "The capital of", "1 2 3 4", "Hello there, how"]
    with ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(lambda p: _complete(fleet.url, p, 12), prompts))
    assert all(r.status_code == 200 for r in answers), [r.text for r in answers]
    with LLM(dtype="float32", warmup=False, num_threads=1, profile=PROFILE) as llm:
        params = SamplingParams(max_tokens=12, temperature=0)
        want = [o.text for o in llm.generate(prompts, params, use_tqdm=False)]
    assert [r.json()["choices"][0]["text"] for r in answers] == want

    # A LoRA adapter's requests, spread over the replicas: its tokens, not the model's.
    adapter = str(fleet.log_path.parent / "attn")
    with ThreadPoolExecutor(4) as pool:
        adapted = list(pool.map(lambda p: _complete(fleet.url, p, 12, model="attn"), prompts))
    assert all(r.status_code == 200 and r.json()["model"] == "attn" for r in adapted)
    with LLM(dtype="float32", warmup=False, num_threads=1, profile=PROFILE,
             lora_modules=[f"attn={adapter}"]) as llm:
        want_attn = [o.text for o in llm.generate(prompts, params, use_tqdm=False, lora="attn")]
    assert [r.json()["choices"][0]["text"] for r in adapted] == want_attn != want

    events = _stream(fleet.url, "Once upon a time", 12)
    assert events[-1] == "[DONE]"
    assert "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1]
                   if json.loads(e)["choices"]) == want[0]

    # The replicas' own validation: the same status and `param` as one server.
    bad = _complete(fleet.url, "hi", 0)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "max_tokens"
    wrong = httpx.post(fleet.url + "/v1/completions", json={"model": "nope", "prompt": "hi"}, timeout=60)
    assert wrong.status_code == 404 and wrong.json()["error"]["param"] == "model"
    assert [m["id"] for m in httpx.get(fleet.url + "/v1/models", timeout=60).json()["data"]] == [
        "tiny", "attn"]
    # vLLM's /tokenize reaches a replica; the Responses API stores nothing on a fleet (a
    # follow-up could reach another replica), and says so.
    counted = httpx.post(fleet.url + "/tokenize", json={"prompt": prompts[0]}, timeout=60)
    assert counted.status_code == 200 and counted.json()["count"] == answers[0].json()["usage"]["prompt_tokens"]
    response = httpx.post(fleet.url + "/v1/responses", timeout=60, json={
        "model": "tiny", "input": "Hi", "max_output_tokens": 2})
    assert response.status_code == 200 and response.json()["store"] is False
    continued = httpx.post(fleet.url + "/v1/responses", timeout=60, json={
        "model": "tiny", "input": "Hi", "previous_response_id": response.json()["id"]})
    assert continued.status_code == 400 and continued.json()["error"]["param"] == "previous_response_id"


def test_metrics_per_replica_and_fleet(fleet: Fleet) -> None:
    assert _complete(fleet.url, "count the tokens", 5).status_code == 200
    deadline = time.monotonic() + 30  # replicas report with their routing stats
    while time.monotonic() < deadline:
        text = fleet.metrics()
        replicas = set(re.findall(r'fastserve_kv_blocks_free\{replica="([^"]+)"\}', text))
        if len(replicas) == 2 and "fastserve_output_tokens_total{replica=" in text:
            break
        time.sleep(0.5)
    assert len(replicas) == 2, text
    assert "fastserve_fleet_replicas 2.0" in text
    assert re.search(r'fastserve_fleet_requests_total\{status="200"\} [1-9]', text), text
    served = sum(float(v) for v in re.findall(r"fastserve_output_tokens_total\{replica=\"[^\"]+\"\} (\S+)", text))
    assert served >= 5


def test_a_shared_prefix_goes_to_the_replica_caching_it(fleet: Fleet) -> None:
    """The router reads each prompt (its blocks' hashes) and sends a conversation back to the
    replica holding its prefix: every follow-up finds its prefix cached (under a router blind
    to prompts, each of the three would have one chance in two)."""
    prefix = " ".join(f"turn{i % 37} said word{i}" for i in range(120))
    first = _complete(fleet.url, prefix, 2)
    assert first.status_code == 200, first.text
    prompt_tokens = first.json()["usage"]["prompt_tokens"]
    time.sleep(1.5)  # past a routing-stats period: the replicas' reports include it
    for k in range(3):
        follow = _complete(fleet.url, prefix + f" and then question {k}", 2)
        assert follow.status_code == 200, follow.text
        cached = follow.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert cached >= prompt_tokens - 32, (k, cached, prompt_tokens)  # all but its tail


def test_killed_replica_loses_nothing_silently(fleet: Fleet) -> None:
    pids = _replica_pids(fleet.proc.pid)
    assert len(pids) == 2, pids
    with ThreadPoolExecutor(8) as pool:
        # Long streams on both replicas (the router spreads them), then one replica dies.
        started = [threading.Event() for _ in range(6)]
        streams = [pool.submit(_stream, fleet.url, f"story number {i}", 600, started[i])
                   for i in range(6)]
        assert all(s.wait(120) for s in started)  # every stream under way: now one replica dies
        os.kill(pids[0], signal.SIGKILL)
        # Requests that arrive now go to the live replica (or wait for the restarted one).
        after = [pool.submit(_complete, fleet.url, f"after {i}", 8) for i in range(4)]
        results = [s.result() for s in streams]
        assert all(r.status_code == 200 for r in (a.result() for a in after))
    cut = 0
    for events in results:
        assert events[-1] == "[DONE]"
        last = json.loads(events[-2])
        if "error" in last:  # a stream the dead replica was serving: told, not dropped
            assert last["error"]["code"] == "replica_failed"
            cut += 1
        else:
            assert last["choices"][0]["finish_reason"] == "length"
    assert 1 <= cut < len(results)
    t0 = time.monotonic()
    assert _complete(fleet.url, "still serving", 4).status_code == 200
    assert time.monotonic() - t0 < 30
    text = fleet.metrics()
    assert re.search(r"fastserve_fleet_stream_failures_total (\d+)", text).group(1) == str(cut)  # type: ignore[union-attr]
