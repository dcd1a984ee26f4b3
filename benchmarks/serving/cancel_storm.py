"""Clients that give up at the wrong moment: does the server survive them?

Issue 25's reproducer. Each attempt keeps the engine busy with four long-prompt requests
(their prefills take most of a second on the tiny model), then sends a fifth request and
cancels it `--cancel-after-ms` later (50 ms: while it is queued for the engine thread, behind
the busy ones). Attempts alternate streaming and non-streaming fifth requests unless `--mode`
picks one. After every attempt `/health` must be 200 and the four busy requests must have been
served; at the end `/metrics` must show no request running or waiting and no KV block in use,
and a new request must complete.

Prints one line per failed check and a summary; exits 1 when any check failed.

    .venv/bin/python benchmarks/serving/cancel_storm.py [--attempts 40] [--cancel-after-ms 50]
        [--mode both|stream|plain] [--prompt-tokens 800] [--url http://127.0.0.1:8000]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[2]
_URL_RE = re.compile(r"serving .* at (http://127\.0\.0\.1:\d+)/v1")
NUM_BUSY = 4
KV_USED = 'fastserve_kv_blocks_used{tier="device"}'


@dataclass
class Tally:
    attempts: int = 0
    health_failures: int = 0
    first_failed_attempt: int | None = None
    busy_served: int = 0
    busy_failed: int = 0
    cancelled_before_answer: int = 0  # the fifth request was cut before its response ended
    problems: list[str] = field(default_factory=list)

    def fail(self, attempt: int, what: str) -> None:
        self.problems.append(f"attempt {attempt}: {what}")
        if self.first_failed_attempt is None:
            self.first_failed_attempt = attempt


async def _busy(http: httpx.AsyncClient, model: str, prompt: list[int]) -> int:
    body = {"model": model, "prompt": prompt, "max_tokens": 4, "ignore_eos": True}
    try:
        return (await http.post("/v1/completions", json=body)).status_code
    except httpx.HTTPError:
        return -1


async def _victim(http: httpx.AsyncClient, model: str, stream: bool) -> None:
    body = {"model": model, "prompt": "Cancel me", "max_tokens": 64, "ignore_eos": True, "stream": stream}
    if stream:
        async with http.stream("POST", "/v1/completions", json=body) as resp:
            async for _ in resp.aiter_lines():
                pass
    else:
        await http.post("/v1/completions", json=body)


async def attempt(url: str, model: str, n: int, args: argparse.Namespace, rng: random.Random,
                  tally: Tally) -> None:
    stream = {"stream": True, "plain": False}.get(args.mode, n % 2 == 0)
    prompts = [[rng.randrange(3, 4000) for _ in range(args.prompt_tokens)] for _ in range(NUM_BUSY)]
    async with httpx.AsyncClient(base_url=url, timeout=120) as http:
        busy = [asyncio.create_task(_busy(http, model, p)) for p in prompts]
        await asyncio.sleep(0.02)  # the busy prefills reach the engine first
        victim = asyncio.create_task(_victim(http, model, stream))
        await asyncio.sleep(args.cancel_after_ms / 1000)
        if not victim.done():
            tally.cancelled_before_answer += 1
        victim.cancel()  # closes the victim's connection: the server sees a disconnect
        await asyncio.gather(victim, return_exceptions=True)
        codes = await asyncio.gather(*busy)
        tally.busy_served += sum(c == 200 for c in codes)
        if any(c != 200 for c in codes):
            tally.busy_failed += sum(c != 200 for c in codes)
            tally.fail(n, f"busy requests answered {codes}")
        health = await _health(http)
        if health != 200:
            tally.health_failures += 1
            tally.fail(n, f"/health answered {health} ({'stream' if stream else 'plain'} victim)")


async def _health(http: httpx.AsyncClient) -> int:
    try:
        return (await http.get("/health", timeout=10)).status_code
    except httpx.HTTPError:
        return -1


def _metrics(url: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


def check_after(url: str, model: str, tally: Tally) -> dict[str, float]:
    """Nothing running, waiting or holding KV once the engine has caught up; a new request runs."""
    deadline = time.monotonic() + 30
    while True:
        m = _metrics(url)
        idle = (m["fastserve_requests_running"] == 0 and m["fastserve_requests_waiting"] == 0
                and m[KV_USED] == 0)
        if idle or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    if not idle:
        tally.fail(tally.attempts, f"leak: running {m['fastserve_requests_running']:g}, waiting "
                   f"{m['fastserve_requests_waiting']:g}, KV used {m[KV_USED]:g}")
    try:
        resp = httpx.post(url + "/v1/completions", timeout=60,
                          json={"model": model, "prompt": "Still there?", "max_tokens": 8, "ignore_eos": True})
        ok = resp.status_code == 200 and resp.json()["usage"]["completion_tokens"] == 8
    except httpx.HTTPError as exc:
        ok, resp = False, exc  # type: ignore[assignment]
    if not ok:
        tally.fail(tally.attempts, f"a new request after the storm failed: {resp}")
    return m


def start_server(log_dir: Path) -> tuple[subprocess.Popen[bytes], str, Path]:
    log_path = log_dir / "server.log"
    cmd = [sys.executable, "-m", "fastserve.cli", "serve", "--port", "0", "--dtype", "float32",
           "--no-warmup", "--no-access-log", "--log-level", "warning"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    with log_path.open("wb") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}:\n{log_path.read_text()}")
        match = _URL_RE.search(log_path.read_text(errors="replace"))
        if match:
            return proc, match.group(1), log_path
        time.sleep(0.1)
    proc.kill()
    raise RuntimeError(f"server did not start:\n{log_path.read_text()}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--attempts", type=int, default=40)
    p.add_argument("--cancel-after-ms", type=float, default=50.0)
    p.add_argument("--mode", choices=["both", "stream", "plain"], default="both")
    p.add_argument("--prompt-tokens", type=int, default=800, help="each busy request's prompt")
    p.add_argument("--url", default=None, help="a running server (default: start one)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        proc, url, log_path = (None, args.url, None) if args.url else start_server(Path(tmp))
        try:
            model = httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]
            rng, tally = random.Random(args.seed), Tally()
            start = time.perf_counter()
            for n in range(1, args.attempts + 1):
                tally.attempts = n
                asyncio.run(attempt(url, model, n, args, rng, tally))
            m = check_after(url, model, tally)
            took_s = time.perf_counter() - start
        finally:
            if proc is not None:
                proc.send_signal(signal.SIGTERM)
                code = proc.wait(120)
                if code != 0:
                    print(f"server exited with {code}")
                if log_path is not None and "engine loop died" in log_path.read_text(errors="replace"):
                    print("server log: the engine loop died")
    for line in tally.problems[:20]:
        print(line)
    print(f"cancel storm: {tally.attempts} attempts in {took_s:.1f} s ({args.mode} victims, "
          f"cancelled {args.cancel_after_ms:g} ms after sending, {tally.cancelled_before_answer} "
          f"before their answer ended)")
    print(f"  /health not 200 after {tally.health_failures} attempts "
          f"(first: {tally.first_failed_attempt or 'none'}); busy requests served "
          f"{tally.busy_served}/{tally.busy_served + tally.busy_failed}")
    print(f"  at the end: running {m['fastserve_requests_running']:g}, waiting "
          f"{m['fastserve_requests_waiting']:g}, device KV blocks used "
          f"{m[KV_USED]:g}")
    print("PASS" if not tally.problems else f"FAIL ({len(tally.problems)} problems)")
    return 1 if tally.problems else 0


if __name__ == "__main__":
    sys.exit(main())
