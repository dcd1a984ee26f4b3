"""What the fleet's ingress costs: one server, N plain servers and the fleet of N, side by side.

The burst: `--num-requests` (256) streamed completions of `--output-len` (200) tokens, prompts
of 64-127 random token ids, all sent at the same moment after `--warmup` (8) requests. Every
server runs the `tiny` model with `OMP_NUM_THREADS=1 --max-batch-size 16` and a measured
cost-model profile. Each repetition:

1. starts one plain `fastserve serve` and sends it the whole burst ("one");
2. starts N fresh plain `fastserve serve` processes and sends them the burst split evenly, all
   at the same moment ("N plain");
3. stops them, starts `fastserve serve --replicas N` (a local Ray cluster) and sends it the
   whole burst ("fleet").

Printed per setup (medians over `--reps`): output tokens/s, mean TTFT, and the ratios
fleet / N plain and fleet / one; then where the fleet's CPU went during its burst: the
ingress process (the `fastserve serve` process itself: HTTP, routing, Ray's handle and its
threads), the replicas, and the rest of Ray (GCS, raylet, controller), per request and per
streamed token, against what a plain server spends per token; and the engine processes' CPU
per streamed token by thread (each process's busiest thread, the engine's; its other Python
threads; natively named threads such as gRPC's), the plain servers' beside the replicas'.
With `--py-spy` the ingress is sampled by py-spy during one more burst in the last
repetition, and its hottest functions are printed. With `--compare-tree DIR` the fleet is also run from another source tree (a
`git worktree` of an older commit) in each repetition: before and after, side by side.

    flock /tmp/fastserve-heavy.lock .venv/bin/python benchmarks/fleet/fleet_overhead.py [--reps 3]
    .venv/bin/python benchmarks/fleet/fleet_overhead.py --num-requests 64 --output-len 50 --reps 1
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))  # the repo root: benchmarks.*
from benchmarks.fleet.fleet_real import (  # noqa: E402
    Server,
    is_under,
    processes,
    stop,
    wait_started,
)

PROFILE = REPO / "profiles" / "cpu-tiny-2threads-quiet.json"
_NON_EMPTY_TEXT = re.compile(rb'"text":"[^"]')
_REPLICA_CMD = "ServeReplica:fastserve:engine"


# -- servers ----------------------------------------------------------------------------------


def start(name: str, extra: list[str], args: argparse.Namespace, tree: Path = REPO,
          timeout_s: float = 600.0) -> Server:
    """`fastserve serve` from the source tree `tree` (this checkout, or `--compare-tree`)."""
    log = Path(tempfile.mkstemp(prefix=f"fleet-overhead-{name}-", suffix=".log")[1])
    cmd = [sys.executable, "-m", "fastserve.cli", "serve", "--port", "0", "--dtype", "float32",
           "--max-batch-size", str(args.max_batch_size), "--no-access-log",
           "--log-level", "warning", "--no-warmup", "--profile", str(PROFILE), *extra]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "RAY_DEDUP_LOGS": "0", "PYTHONPATH": str(tree)}
    with log.open("wb") as out:
        # NOTE: a session of its own: a fleet's Ray processes and their signals stay out of
        # this script's process group.
        proc = subprocess.Popen(cmd, cwd=tree, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    return wait_started(Server(name, proc, log), timeout_s)


# -- /proc ------------------------------------------------------------------------------------


def cpu_by_role(root: int) -> dict[str, float]:
    """CPU seconds so far of `root` itself ("ingress"), the Serve replicas under it
    ("replicas") and everything else under it ("ray": GCS, raylet, controller, ...)."""
    parent, cpu, cmd = processes()
    out = {"ingress": cpu.get(root, 0.0), "replicas": 0.0, "ray": 0.0}
    for pid, seconds in cpu.items():
        if pid != root and is_under(pid, root, parent):
            out["replicas" if _REPLICA_CMD in cmd.get(pid, "") else "ray"] += seconds
    return out


# -- the client -------------------------------------------------------------------------------


@dataclass
class Result:
    sent_s: float
    first_s: float
    done_s: float
    num_tokens: int


async def one_request(url: str, prompt: list[int], output_len: int) -> Result:
    """One streamed completion over a raw HTTP/1.1 connection.

    NOTE: not httpx: on a small machine the client's CPU is the servers' CPU. This one scans
    bytes for the first non-empty text and decodes only the final usage chunk.
    """
    host, port = url.removeprefix("http://").split(":")
    body = json.dumps({"model": "tiny", "prompt": prompt, "max_tokens": output_len,
                       "temperature": 0, "ignore_eos": True, "stream": True,
                       "stream_options": {"include_usage": True}}).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: {host}:{port}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
            "Connection: close\r\n\r\n").encode()
    sent = time.monotonic()
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(head + body)
    first: float | None = None
    received = b""
    while piece := await reader.read(1 << 16):
        if first is None and _NON_EMPTY_TEXT.search(piece):
            first = time.monotonic()
        received = (received + piece)[-(1 << 14):] if first is not None else received + piece
    done = time.monotonic()
    writer.close()
    start = received.rfind(b"data: {")
    if start < 0 or b"data: [DONE]" not in received[-64:]:
        raise RuntimeError(f"request failed: {received[:300]!r} ... {received[-300:]!r}")
    final = json.loads(received[start + len(b"data: "):received.index(b"\n\n", start)])
    if "error" in final:
        raise RuntimeError(f"stream error: {final['error']}")
    return Result(sent, first or done, done, final["usage"]["completion_tokens"])


def burst(urls: list[str], prompts: list[list[int]], output_len: int) -> list[Result]:
    """All prompts at once, dealt round-robin over `urls`."""
    async def run() -> list[Result]:
        return await asyncio.gather(*(one_request(urls[i % len(urls)], p, output_len)
                                      for i, p in enumerate(prompts)))
    return asyncio.run(run())


@dataclass
class Measured:
    tok_per_s: float
    mean_ttft_s: float
    num_tokens: int
    cpu_s: dict[str, float] = field(default_factory=dict)
    # Server-side histograms over the burst (`_metric_sums`): the engines' TTFT from a
    # request's arrival there, and the fleet ingress's time to the replica's first answer.
    seconds: dict[str, float] = field(default_factory=dict)
    # CPU seconds over the burst of the engine processes' threads (the plain servers, or the
    # fleet's replicas), by kind (`thread_kinds`).
    threads: dict[str, float] = field(default_factory=dict)
    # Each engine's (a plain server's, or a replica's) output tokens and iterations over the
    # burst (`_engine_counts`): how the requests were split, and its tokens per iteration.
    engines: dict[str, tuple[float, float]] = field(default_factory=dict)

    def mean_s(self, histogram: str) -> float:
        count = self.seconds.get(histogram + "_count", 0.0)
        return self.seconds.get(histogram + "_sum", 0.0) / count if count else float("nan")


def measure(urls: list[str], prompts: list[list[int]], args: argparse.Namespace,
            cpu_roots: list[int], fleet_root: int | None = None) -> Measured:
    burst(urls, prompts[:args.warmup], args.output_len)
    if fleet_root is not None:
        time.sleep(1.5)  # the replicas' counters after the warm-up reach the ingress
    engine_pids = cpu_roots if fleet_root is None else _replica_pids(fleet_root)
    threads_before = thread_cpu(engine_pids)
    before = _cpu(cpu_roots, fleet_root)
    seconds_before = _metric_sums(urls)
    engines_before = _engine_counts(urls)
    results = burst(urls, prompts[args.warmup:], args.output_len)
    after = _cpu(cpu_roots, fleet_root)
    threads = thread_kinds(threads_before, thread_cpu(engine_pids))
    span = max(r.done_s for r in results) - min(r.sent_s for r in results)
    num_tokens = sum(r.num_tokens for r in results)
    if fleet_root is not None:
        time.sleep(1.5)  # the replicas' metrics reach the ingress with their routing stats
    seconds = {k: v - seconds_before.get(k, 0.0) for k, v in _metric_sums(urls).items()}
    engines = {k: (tokens - engines_before.get(k, (0.0, 0.0))[0],
                   iterations - engines_before.get(k, (0.0, 0.0))[1])
               for k, (tokens, iterations) in _engine_counts(urls).items()}
    return Measured(num_tokens / span, statistics.fmean(r.first_s - r.sent_s for r in results),
                    num_tokens, {k: after[k] - before[k] for k in after}, seconds, threads,
                    engines)


# Server-side latencies, summed over replicas: (sum, count) of each histogram.
_HISTOGRAMS = ("fastserve_ttft_seconds", "fastserve_fleet_first_byte_seconds")


def _metric_sums(urls: list[str]) -> dict[str, float]:
    """The `_sum` and `_count` of `_HISTOGRAMS` on the servers' /metrics, added up."""
    out: dict[str, float] = {}
    for url in urls:
        with urllib.request.urlopen(url + "/metrics", timeout=30) as resp:
            text = resp.read().decode()
        for line in text.splitlines():
            name = line.split("{", 1)[0].split(" ", 1)[0]
            if name.removesuffix("_sum").removesuffix("_count") in _HISTOGRAMS:
                out[name] = out.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


_REPLICA_LABEL = re.compile(r'replica="([^"]*)"')


def _engine_counts(urls: list[str]) -> dict[str, tuple[float, float]]:
    """Each engine's output tokens and iterations so far, from /metrics: a plain server's
    under its URL, a fleet's replicas under their `replica` label."""
    out: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0.0])
    for url in urls:
        with urllib.request.urlopen(url + "/metrics", timeout=30) as resp:
            text = resp.read().decode()
        for line in text.splitlines():
            name = line.split("{", 1)[0].split(" ", 1)[0]
            if name in ("fastserve_output_tokens_total", "fastserve_iterations_total"):
                label = _REPLICA_LABEL.search(line)
                key = label.group(1) if label else url
                out[key][name == "fastserve_iterations_total"] += float(line.rsplit(" ", 1)[1])
    return {k: (v[0], v[1]) for k, v in out.items()}


def _replica_pids(root: int) -> list[int]:
    parent, _, cmd = processes()
    return [p for p, c in cmd.items() if _REPLICA_CMD in c and is_under(p, root, parent)]


def thread_cpu(pids: list[int]) -> dict[tuple[int, int], tuple[str, float]]:
    """(pid, tid) -> (the thread's name, its CPU seconds so far) for every thread of `pids`."""
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[tuple[int, int], tuple[str, float]] = {}
    for pid in pids:
        try:
            tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
        except OSError:
            continue
        for tid in tids:
            try:
                stat = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
            except OSError:
                continue
            name = stat[stat.index("(") + 1:stat.rindex(")")]
            fields = stat.rsplit(")", 1)[1].split()
            out[pid, tid] = (name, (int(fields[11]) + int(fields[12])) / tick)
    return out


def thread_kinds(before: dict[tuple[int, int], tuple[str, float]],
                 after: dict[tuple[int, int], tuple[str, float]]) -> dict[str, float]:
    """CPU seconds between `before` and `after`, by kind: in each process its busiest thread
    ("engine thread": the engine's step loop), the other threads named as the process is
    (Python threads: the HTTP server's event loop and the like; Python 3.11 names no thread),
    and the natively named ones (gRPC's, Ray's core worker's, OpenMP's) under their names."""
    out: collections.Counter[str] = collections.Counter()
    by_pid: dict[int, list[tuple[str, float]]] = collections.defaultdict(list)
    for (pid, tid), (name, seconds) in after.items():
        by_pid[pid].append((name, seconds - before.get((pid, tid), (name, 0.0))[1]))
    for pid, threads in by_pid.items():
        threads.sort(key=lambda t: -t[1])
        process_name = after.get((pid, pid), ("", 0.0))[0]
        out["engine thread (the busiest)"] += threads[0][1]
        for name, seconds in threads[1:]:
            key = "other Python threads" if name == process_name else re.sub(r"\d+$", "#", name)
            out[key] += seconds
    return dict(out)


def _cpu(roots: list[int], fleet_root: int | None) -> dict[str, float]:
    if fleet_root is not None:
        return cpu_by_role(fleet_root)
    _, cpu, _ = processes()
    return {"servers": sum(cpu.get(pid, 0.0) for pid in roots)}


# -- py-spy -----------------------------------------------------------------------------------


def py_spy_start(pid: int, out: Path) -> subprocess.Popen[bytes] | None:
    exe = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    if not Path(exe).exists():
        print("(py-spy not found: pip install py-spy)")
        return None
    return subprocess.Popen([exe, "record", "--pid", str(pid), "--format", "raw", "--rate", "200",
                             "--nonblocking", "--output", str(out)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def py_spy_report(proc: subprocess.Popen[bytes], out: Path, top: int = 25) -> None:
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    if not out.exists():
        print(f"(py-spy wrote nothing: {err.decode(errors='replace')[-500:]})")
        return
    inclusive: collections.Counter[str] = collections.Counter()
    leaf: collections.Counter[str] = collections.Counter()
    total = 0
    for line in out.read_text().splitlines():
        stack, _, count_text = line.rpartition(" ")
        count = int(count_text)
        frames = [f.split(" (")[0] + " " + f.split(" (")[-1].split(":")[0].rsplit("/", 1)[-1]
                  for f in stack.split(";")[1:]]  # [0] is the thread
        total += count
        leaf[frames[-1] if frames else "?"] += count
        for frame in set(frames):
            inclusive[frame] += count
    print(f"\ningress py-spy: {total} samples (200 Hz, active threads only)")
    print("  hottest functions, inclusive:")
    for name, count in inclusive.most_common(top):
        print(f"    {100 * count / total:5.1f}%  {name}")
    print("  hottest functions, self:")
    for name, count in leaf.most_common(top):
        print(f"    {100 * count / total:5.1f}%  {name}")
    out.unlink(missing_ok=True)


# -- main -------------------------------------------------------------------------------------


def make_prompts(args: argparse.Namespace) -> list[list[int]]:
    from fastserve.model.make_model import default_model_path

    vocab = int(json.loads((default_model_path() / "config.json").read_text())["vocab_size"])
    rng = np.random.default_rng(args.seed)
    # NOTE: ids from 10 up skip the special tokens at the bottom of the vocabulary.
    return [rng.integers(10, vocab, size=int(rng.integers(64, 128))).tolist()
            for _ in range(args.warmup + args.num_requests)]


def one_rep(args: argparse.Namespace, prompts: list[list[int]], rep: int,
            spy: bool) -> dict[str, Measured]:
    n = args.replicas
    out: dict[str, Measured] = {}
    # NOTE: every setup starts on fresh servers: a server that served the burst before has
    # its prompts in its prefix cache and would skip their prefills.
    one = start("one", [], args)
    try:
        out["one"] = measure([one.url], prompts, args, [one.proc.pid])
        print(f"  one: {out['one'].tok_per_s:,.0f} tok/s", flush=True)
    finally:
        stop(one)
    plain = [start(f"plain-{i}", [], args) for i in range(n)]
    try:
        out["plain"] = measure([s.url for s in plain], prompts, args, [s.proc.pid for s in plain])
        print(f"  {n} plain: {out['plain'].tok_per_s:,.0f} tok/s", flush=True)
    finally:
        for s in plain:
            stop(s)
    if args.compare_tree is not None:
        other = start("fleet-other", ["--replicas", str(n)], args, tree=args.compare_tree)
        try:
            out["other"] = measure([other.url], prompts, args, [], fleet_root=other.proc.pid)
            print(f"  the fleet from {args.compare_tree}: {out['other'].tok_per_s:,.0f} tok/s",
                  flush=True)
        finally:
            stop(other)
    fleet = start("fleet", ["--replicas", str(n), *args.fleet_args.split()], args)
    try:
        out["fleet"] = measure([fleet.url], prompts, args, [], fleet_root=fleet.proc.pid)
        if spy:  # one more burst, sampled (py-spy's own CPU stays out of the figures above)
            spy_out = Path(tempfile.mkstemp(prefix="fleet-overhead-spy-", suffix=".txt")[1])
            spy_proc = py_spy_start(fleet.proc.pid, spy_out)
            if spy_proc is not None:
                burst([fleet.url], prompts[args.warmup:], args.output_len)
                py_spy_report(spy_proc, spy_out)
    finally:
        stop(fleet)
    print(f"rep {rep + 1}: " + ", ".join(f"{k} {m.tok_per_s:,.0f} tok/s TTFT {m.mean_ttft_s:.2f} s"
                                         for k, m in out.items()), flush=True)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--num-requests", type=int, default=256)
    p.add_argument("--output-len", type=int, default=200)
    p.add_argument("--warmup", type=int, default=8)
    p.add_argument("--max-batch-size", type=int, default=16)
    p.add_argument("--reps", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--fleet-args", default="", help="more flags for the fleet, e.g. '--router pow2'")
    p.add_argument("--py-spy", action="store_true", help="profile the ingress in the last rep")
    p.add_argument("--compare-tree", type=Path, default=None,
                   help="also run the fleet from this source tree (e.g. a `git worktree` of an "
                        "older commit), in the same reps: before and after side by side")
    args = p.parse_args()
    prompts = make_prompts(args)
    print(f"burst: {args.num_requests} streams x {args.output_len} tokens, prompts 64-127 tokens, "
          f"after {args.warmup} warm-up; {args.replicas} replicas; OMP_NUM_THREADS=1 "
          f"--max-batch-size {args.max_batch_size}; load {os.getloadavg()[0]:.1f} on "
          f"{os.cpu_count()} cores", flush=True)
    reps = [one_rep(args, prompts, r, args.py_spy and r == args.reps - 1) for r in range(args.reps)]
    report(args, reps)


def report(args: argparse.Namespace, reps: list[dict[str, Measured]]) -> None:
    n = args.replicas

    def med(key: str, attr: str) -> float:
        return statistics.median(getattr(r[key], attr) for r in reps)

    names = {"one": "one `fastserve serve`", "plain": f"{n} plain `fastserve serve`",
             "fleet": f"`fastserve serve --replicas {n}`"}
    if args.compare_tree is not None:
        names["other"] = f"the fleet from {args.compare_tree}"
    print(f"\n| setup | output tok/s | mean TTFT | tok/s vs one | TTFT vs {n} plain |")
    print("|---|---|---|---|---|")
    for key, name in names.items():
        print(f"| {name} | {med(key, 'tok_per_s'):,.0f} | {med(key, 'mean_ttft_s'):.2f} s | "
              f"{med(key, 'tok_per_s') / med('one', 'tok_per_s'):.2f}x | "
              f"{med(key, 'mean_ttft_s') / med('plain', 'mean_ttft_s'):.2f}x |")
    ratio = statistics.median(r["fleet"].tok_per_s / r["plain"].tok_per_s for r in reps)
    ttft = statistics.median(r["fleet"].mean_ttft_s / r["plain"].mean_ttft_s for r in reps)
    one = statistics.median(r["fleet"].tok_per_s / r["one"].tok_per_s for r in reps)
    print(f"\nfleet / {n} plain: {ratio:.2f}x tok/s, mean TTFT {ttft:.2f}x; fleet / one: "
          f"{one:.2f}x tok/s (medians of per-rep ratios over {len(reps)} rep(s))")
    if args.compare_tree is not None:
        o_ratio = statistics.median(r["other"].tok_per_s / r["plain"].tok_per_s for r in reps)
        o_ttft = statistics.median(r["other"].mean_ttft_s / r["plain"].mean_ttft_s for r in reps)
        print(f"the fleet from {args.compare_tree} / {n} plain: {o_ratio:.2f}x tok/s, "
              f"mean TTFT {o_ttft:.2f}x")

    print("\nwhere the mean TTFT goes (client: sent -> first token; engine: arrival at the "
          "engine -> first token; ingress: the fleet's request read -> the replica's first "
          "answer):")
    for key, name in names.items():
        client = med(key, "mean_ttft_s")
        engine = statistics.median(r[key].mean_s("fastserve_ttft_seconds") for r in reps)
        line = f"  {name}: client {client:.2f} s, engine {engine:.2f} s"
        if key in ("fleet", "other"):
            ingress = statistics.median(r[key].mean_s("fastserve_fleet_first_byte_seconds")
                                        for r in reps)
            line += f", ingress {ingress:.2f} s"
        print(line + f"; client - engine {client - engine:.2f} s")

    def per(key: str, role: str, unit: str) -> float:
        scale = 1e6 if unit == "tok" else 1e3
        return statistics.median(
            scale * r[key].cpu_s[role] / (r[key].num_tokens if unit == "tok" else args.num_requests)
            for r in reps)

    print(f"\nCPU during the burst ({args.num_requests} requests, "
          f"{reps[-1]['fleet'].num_tokens:,} streamed tokens):")
    print(f"  {n} plain servers:  {per('plain', 'servers', 'tok'):6.0f} us/token "
          f"({per('plain', 'servers', 'req'):6.1f} ms/request)")
    for key in ("other", "fleet") if args.compare_tree is not None else ("fleet",):
        label = "fleet" if key == "fleet" else "other"
        for role in ("ingress", "replicas", "ray"):
            print(f"  {label} {role:<10}  {per(key, role, 'tok'):6.0f} us/token "
                  f"({per(key, role, 'req'):6.1f} ms/request)")
    print("\nthreads of the engine processes during the burst, us per streamed token "
          f"({n} plain servers | the fleet's {n} replicas; medians over reps):")
    kinds = sorted({k for r in reps for key in ("plain", "fleet") for k in r[key].threads},
                   key=lambda k: -statistics.median(r["fleet"].threads.get(k, 0.0) for r in reps))
    for kind in kinds:
        plain_us, fleet_us = (statistics.median(1e6 * r[key].threads.get(kind, 0.0)
                                                / r[key].num_tokens for r in reps)
                              for key in ("plain", "fleet"))
        if max(plain_us, fleet_us) >= 0.5:
            print(f"  {kind:<32} {plain_us:6.1f} | {fleet_us:6.1f}")
    print("\neach engine's share of the burst's output tokens and its tokens per iteration "
          "(per rep: plain servers | replicas):")
    for i, r in enumerate(reps):
        line = []
        for key in ("plain", "fleet"):
            counts = sorted(r[key].engines.values(), key=lambda c: -c[0])
            total = sum(tokens for tokens, _ in counts) or 1.0
            line.append(", ".join(f"{tokens / total:.0%} at {tokens / max(1.0, its):.1f}/it"
                                  for tokens, its in counts))
        print(f"  rep {i + 1}: {line[0]} | {line[1]}")
    ingress_us = per("fleet", "ingress", "tok")
    print(f"  one ingress core streams at most ~{1e6 / ingress_us:,.0f} tokens/s at this cost")


if __name__ == "__main__":
    main()
