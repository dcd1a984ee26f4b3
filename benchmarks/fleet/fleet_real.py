"""The fleet on Ray Serve against one server, on this machine, side by side.

Starts a plain `fastserve serve` (one engine, `--num-threads 1`) and a fleet
`fastserve serve --replicas 2 --num-threads 1` (a local Ray cluster), both the tiny model with
the same profile, and prints:

- greedy outputs: the same prompts to both, texts compared;
- added latency at low load: one streamed request at a time, alternating server and fleet;
  TTFT (to the first token's chunk) medians and the median of the paired differences;
- capacity: output tokens per second at saturation: a closed loop of `--concurrency` clients
  per replica (default 32, twice the engine's max_batch_size of 16: every batch stays full
  while a client turns its next request around, and the router's passing imbalance between
  two replicas does not leave one short of work; the server 32, the fleet 64) sending
  non-streamed requests of fixed prompt and output lengths (`--max-tokens`, default 128;
  `ignore_eos`), each side alone in turn after a warm-up round (`--reps` alternations;
  medians and each rep's ratio), and the fleet's ratio to the server; and the cores each side used meanwhile (CPU
  time of its whole process tree, Ray's processes included), as tokens per core used;
- with `--ceiling`: two plain servers (no Ray, no router) loaded at once against one alone,
  the most two engines make of this machine;
- with `--kill`: one replica's process killed under load: what its requests got, how long
  until a new request was answered, and until Ray had restarted the replica.

The machine is shared: the load average is printed before and after.

    .venv/bin/python benchmarks/fleet/fleet_real.py [--reps 3] [--concurrency 32] [--max-tokens 128] [--router NAME] [--kill]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[2]
PROFILE = REPO / "profiles" / "cpu-tiny-2threads-quiet.json"
_URL_RE = re.compile(r"serving .* at (http://127\.0\.0\.1:\d+)/v1")
_WORDS = "the quick brown fox jumps over a lazy dog while seven small birds sing".split()


@dataclass
class Server:
    name: str
    proc: subprocess.Popen[bytes]
    log: Path
    url: str = ""


def start(name: str, extra: list[str], timeout_s: float = 600.0) -> Server:
    log = Path(tempfile.mkstemp(prefix=f"fleet-real-{name}-", suffix=".log")[1])
    cmd = [sys.executable, "-m", "fastserve.cli", "serve", "--port", "0", "--dtype", "float32",
           "--num-threads", "1", "--no-access-log", "--log-level", "warning", "--no-warmup",
           "--profile", str(PROFILE), *extra]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        filter(None, [str(REPO), os.environ.get("PYTHONPATH")])), "RAY_DEDUP_LOGS": "0"}
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)
    return wait_started(Server(name, proc, log), timeout_s)


def wait_started(server: Server, timeout_s: float) -> Server:
    """`server` once its log names its URL; stopped, its log's tail raised, if it dies first
    or `timeout_s` passes."""
    deadline = time.monotonic() + timeout_s
    while not server.url:
        if server.proc.poll() is not None or time.monotonic() > deadline:
            stop(server)
            raise RuntimeError(f"{server.name} did not start:\n{server.log.read_text()[-3000:]}")
        match = _URL_RE.search(server.log.read_text(errors="replace"))
        if match:
            server.url = match.group(1)
        time.sleep(0.2)
    return server


def stop(server: Server) -> None:
    if server.proc.poll() is None:
        server.proc.send_signal(signal.SIGTERM)
        try:
            server.proc.wait(120)
        except subprocess.TimeoutExpired:
            server.proc.kill()
            server.proc.wait()


def prompt(i: int, num_words: int = 24) -> str:
    return " ".join(_WORDS[(i * 7 + k * 3) % len(_WORDS)] for k in range(num_words))


async def complete(client: httpx.AsyncClient, url: str, text: str, max_tokens: int) -> dict:
    body = {"model": "tiny", "prompt": text, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True}
    resp = await client.post(url + "/v1/completions", json=body)
    resp.raise_for_status()
    return resp.json()


async def ttft_s(client: httpx.AsyncClient, url: str, text: str) -> float:
    body = {"model": "tiny", "prompt": text, "max_tokens": 4, "temperature": 0, "stream": True}
    t0 = time.perf_counter()
    first = None
    async with client.stream("POST", url + "/v1/completions", json=body) as resp:
        async for line in resp.aiter_lines():
            if first is None and line.startswith("data: {"):
                first = time.perf_counter() - t0
    assert first is not None
    return first


async def greedy(a: Server, b: Server, n: int) -> tuple[int, int]:
    async with httpx.AsyncClient(timeout=300) as client:
        texts = []
        for server in (a, b):
            outs = await asyncio.gather(*(complete(client, server.url, prompt(i), 24)
                                          for i in range(n)))
            texts.append([o["choices"][0]["text"] for o in outs])
    return sum(x == y for x, y in zip(*texts)), n


async def added_latency(a: Server, b: Server, n: int) -> tuple[float, float, float]:
    """Median TTFT of `a`, of `b`, and the median paired difference b - a (seconds)."""
    ta, tb = [], []
    async with httpx.AsyncClient(timeout=120) as client:
        for server in (a, b):  # warm both (connections, first-request paths)
            for i in range(3):
                await ttft_s(client, server.url, prompt(i))
        for i in range(n):
            order = (a, b) if i % 2 == 0 else (b, a)
            for server in order:
                t = await ttft_s(client, server.url, prompt(1000 + i))
                (ta if server is a else tb).append(t)
    diffs = [y - x for x, y in zip(ta, tb)]
    return statistics.median(ta), statistics.median(tb), statistics.median(diffs)


async def throughput(server: Server, concurrency: int, num_requests: int, max_tokens: int) -> float:
    """Output tokens per second of a closed loop of `concurrency` clients."""
    queue = list(range(num_requests))
    tokens = 0

    async def client_loop(client: httpx.AsyncClient) -> None:
        nonlocal tokens
        while queue:
            i = queue.pop()
            out = await complete(client, server.url, prompt(i), max_tokens)
            tokens += out["usage"]["completion_tokens"]

    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=concurrency)) as client:
        t0 = time.perf_counter()
        await asyncio.gather(*(client_loop(client) for _ in range(concurrency)))
        return tokens / (time.perf_counter() - t0)


def processes() -> tuple[dict[int, int], dict[int, float], dict[int, str]]:
    """Every process's parent, CPU seconds so far (utime + stime, all threads) and command."""
    parent: dict[int, int] = {}
    cpu: dict[int, float] = {}
    cmd: dict[int, str] = {}
    tick = os.sysconf("SC_CLK_TCK")
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
            cmd[int(entry)] = Path(f"/proc/{entry}/cmdline").read_bytes().decode(errors="replace")
        except OSError:
            continue
        parent[int(entry)] = int(fields[1])
        cpu[int(entry)] = (int(fields[11]) + int(fields[12])) / tick
    return parent, cpu, cmd


def is_under(pid: int, root: int, parent: dict[int, int]) -> bool:
    """Whether `pid` is `root` or in its process tree."""
    while pid > 1:
        if pid == root:
            return True
        pid = parent.get(pid, 0)
    return False


def tree_cpu_s(root: int) -> float:
    """CPU seconds used so far by `root` and the processes under it (Ray's included)."""
    parent, cpu, _ = processes()
    return sum(c for p, c in cpu.items() if is_under(p, root, parent))


def replica_pids(root: int) -> list[int]:
    """Ray Serve replica processes in `root`'s process tree."""
    parent, _, names = processes()
    return [p for p, cmd in names.items()
            if "ServeReplica:fastserve:engine" in cmd and is_under(p, root, parent)]


async def kill_one(fleet: Server, concurrency: int, max_tokens: int) -> None:
    pids = replica_pids(fleet.proc.pid)
    outcomes: dict[str, int] = {}

    started = [asyncio.Event() for _ in range(concurrency)]

    async def stream(client: httpx.AsyncClient, i: int) -> None:
        body = {"model": "tiny", "prompt": prompt(i), "max_tokens": max_tokens, "stream": True,
                "ignore_eos": True, "temperature": 0}
        try:
            async with client.stream("POST", fleet.url + "/v1/completions", json=body) as resp:
                lines = []
                async for ln in resp.aiter_lines():
                    if ln.startswith("data: "):
                        lines.append(ln)
                        started[i].set()
            last = json.loads(lines[-2][6:]) if len(lines) >= 2 else {}
            kind = ("error event + [DONE]" if "error" in last else "finished") \
                if lines and lines[-1] == "data: [DONE]" else f"HTTP {resp.status_code}, no [DONE]"
        except httpx.HTTPError as exc:
            kind = f"connection error {type(exc).__name__}"
        finally:
            started[i].set()  # (one that failed before its first token started too)
        outcomes[kind] = outcomes.get(kind, 0) + 1

    async with httpx.AsyncClient(timeout=600) as client:
        tasks = [asyncio.create_task(stream(client, i)) for i in range(concurrency)]
        for event in started:  # every stream under way
            await event.wait()
        t_kill = time.perf_counter()
        os.kill(pids[0], signal.SIGKILL)
        await complete(client, fleet.url, prompt(7), 4)
        serving_s = time.perf_counter() - t_kill
        await asyncio.gather(*tasks)
        restored_s = None
        while time.perf_counter() - t_kill < 300:
            text = (await client.get(fleet.url + "/metrics")).text
            if len(set(replica_pids(fleet.proc.pid)) - {pids[0]}) == 2 and \
                    "fastserve_fleet_replicas 2.0" in text:
                restored_s = time.perf_counter() - t_kill
                break
            await asyncio.sleep(0.5)
    print(f"kill: {concurrency} streams of {max_tokens} tokens, one replica SIGKILLed once all "
          "had their first token")
    for kind, count in sorted(outcomes.items()):
        print(f"  {count:3d} streams: {kind}")
    print(f"  a new request answered {serving_s:.2f} s after the kill")
    print("  Ray restarted the replica (2 reporting again) "
          + (f"{restored_s:.1f} s after the kill" if restored_s else "not within 300 s"))


def machine_ceiling(single: Server, args: argparse.Namespace) -> None:
    """Two plain servers loaded at once against one alone: what two engines make of this
    machine with no Ray and no router (the fleet's ratio cannot beat it)."""
    other = start("server-2", [])
    try:
        asyncio.run(throughput(other, args.concurrency, args.concurrency, args.max_tokens))

        async def both() -> list[float]:
            return list(await asyncio.gather(*(
                throughput(s, args.concurrency, args.num_requests, args.max_tokens)
                for s in (single, other))))

        ratios = []
        for rep in range(args.reps):
            one = asyncio.run(throughput(single, args.concurrency, args.num_requests,
                                         args.max_tokens))
            two = sum(asyncio.run(both()))
            ratios.append(two / one)
            print(f"  ceiling rep {rep}: one server {one:7.1f} tok/s, two at once {two:7.1f} "
                  f"tok/s ({two / one:.2f}x)")
        print(f"ceiling (median of {args.reps}): two plain servers {statistics.median(ratios):.2f}x "
              "one")
    finally:
        stop(other)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--concurrency", type=int, default=32, help="clients per replica")
    ap.add_argument("--num-requests", type=int, default=128, help="requests per replica")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--latency-requests", type=int, default=40)
    ap.add_argument("--router", default="fastserve")
    ap.add_argument("--kill", action="store_true", help="also kill a replica under load")
    ap.add_argument("--ceiling", action="store_true",
                    help="also run two plain servers side by side (no Ray, no router): what "
                         "this machine allows two engines")
    args = ap.parse_args()

    print(f"load average before: {os.getloadavg()}")
    single = start("server", [])
    fleet = None
    try:
        fleet = start("fleet", ["--replicas", "2", "--router", args.router])
        same, n = asyncio.run(greedy(single, fleet, 8))
        print(f"greedy outputs identical: {same}/{n}")
        a, b, d = asyncio.run(added_latency(single, fleet, args.latency_requests))
        print(f"TTFT at low load (median of {args.latency_requests}): server {a * 1e3:.1f} ms, "
              f"fleet {b * 1e3:.1f} ms; added by the fleet (median paired difference) "
              f"{d * 1e3:.1f} ms")
        for server in (single, fleet):  # warm-up, not measured: every batch shape once
            k = 2 if server is fleet else 1
            asyncio.run(throughput(server, k * args.concurrency, k * args.concurrency,
                                   args.max_tokens))
        rates: dict[str, list[float]] = {"server": [], "fleet": []}
        per_core: dict[str, list[float]] = {"server": [], "fleet": []}
        for rep in range(args.reps):
            for server in (single, fleet) if rep % 2 == 0 else (fleet, single):
                k = 2 if server is fleet else 1  # replicas: the same load per replica
                cpu0, t0 = tree_cpu_s(server.proc.pid), time.perf_counter()
                rate = asyncio.run(throughput(server, k * args.concurrency,
                                              k * args.num_requests, args.max_tokens))
                cores = (tree_cpu_s(server.proc.pid) - cpu0) / (time.perf_counter() - t0)
                rates[server.name].append(rate)
                per_core[server.name].append(rate / cores)
                print(f"  rep {rep}: {server.name:6s} {rate:7.1f} output tok/s, using "
                      f"{cores:.2f} cores ({rate / cores:.0f} tok/s per core)")
        pairs = ", ".join(f"{f / s:.2f}" for s, f in zip(rates["server"], rates["fleet"]))
        print(f"fleet / server per rep: {pairs}")
        s, f = statistics.median(rates["server"]), statistics.median(rates["fleet"])
        print(f"capacity (median of {args.reps}; {args.concurrency} clients per replica, "
              f"{args.max_tokens} tokens each): server {s:.1f} tok/s, fleet of 2 {f:.1f} tok/s, "
              f"ratio {f / s:.2f}x")
        pc_s, pc_f = statistics.median(per_core["server"]), statistics.median(per_core["fleet"])
        print(f"per core used (server and Ray processes included): server {pc_s:.0f} tok/s, "
              f"fleet {pc_f:.0f} tok/s, ratio {pc_f / pc_s:.2f}x")
        if args.ceiling:
            stop(fleet)
            fleet = None
            machine_ceiling(single, args)
        if args.kill:
            stop(single)
            if fleet is None:
                fleet = start("fleet", ["--replicas", "2", "--router", args.router])
            asyncio.run(kill_one(fleet, args.concurrency, 600))
    finally:
        stop(single)
        if fleet is not None:
            stop(fleet)
    print(f"load average after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
