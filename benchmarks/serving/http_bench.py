"""HTTP serving benchmark: a bursty workload replayed against `fastserve serve`, per scheduler.

For each scheduler in `--schedulers`, starts a server (`python -m fastserve.cli serve`), replays
the workload over HTTP with streaming (one request per job at its arrival time), and prints
TTFT, JCT (mean / p50 / p99) and output throughput. The same jobs also run offline with
`LLM.generate` (in a fresh process, engine on a worker thread as in the server), and each
server's throughput is printed as a ratio of that. `--reps` repetitions interleave the HTTP and
offline runs so that drifting machine load hits both; medians are reported.

Workload: Gamma arrivals (`--rate`, `--cv`; cv > 1 is burstier than Poisson) and Zipf-mixed
input/output lengths (`fastserve.bench.workloads.zipf_workload`). Prompts are random token ids
of the drawn lengths. Every job generates exactly its drawn output length: the request sets
`ignore_eos: true`, a fastserve extension of the OpenAI API (vLLM accepts the same field).

NOTE: the throughput ratio compares like with like only when the server is saturated (the
default rate overloads the tiny model on 2 CPU cores); an arrival-bound run measures the rate.
The client shares the machine with the server, so it is a minimal raw-socket one.

    .venv/bin/python benchmarks/serving/http_bench.py [--schedulers fcfs,skip-join-mlfq] [--reps 3]
        [--num-requests 200] [--rate 200] [--cv 4] [--preset tiny|small | --model DIR]

On a GPU (issue 24's served line: heavy-tailed bursty, 0.9 of the measured capacity):

    python benchmarks/serving/http_bench.py --preset llama-2-7b --device cuda --dtype bfloat16 \
        --load 0.9 --theta 1.2 --cv 4 --max-output-len 512 --max-batch-size 128 --reps 1
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
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np

from fastserve.bench.workloads import WorkItem, zipf_workload

REPO = Path(__file__).resolve().parents[2]
_URL_RE = re.compile(r"serving .* at (http://127\.0\.0\.1:\d+)/v1")
_NON_EMPTY_TEXT = re.compile(rb'"text":"[^"]')


@dataclass(frozen=True)
class JobResult:
    """One request as the client saw it (seconds on the client's monotonic clock)."""

    sent_s: float
    first_token_s: float
    done_s: float
    num_output_tokens: int

    @property
    def ttft_s(self) -> float:
        return self.first_token_s - self.sent_s

    @property
    def jct_s(self) -> float:
        return self.done_s - self.sent_s


@dataclass(frozen=True)
class RunSummary:
    name: str
    results: list[JobResult]
    makespan_s: float  # first send to last finish
    num_preemptions: int = 0
    num_recomputes: int = 0

    @property
    def output_tok_per_s(self) -> float:
        return sum(r.num_output_tokens for r in self.results) / self.makespan_s


# -- workload -------------------------------------------------------------------------------


def make_jobs(args: argparse.Namespace, vocab_size: int) -> tuple[list[WorkItem], list[list[int]]]:
    items = zipf_workload(args.num_requests, args.rate, args.cv, args.theta, args.max_input_len,
                          args.max_output_len, seed=args.seed)
    rng = np.random.default_rng(args.seed + 1)
    # NOTE: ids from 10 up skip the special tokens at the bottom of the vocabulary.
    prompts = [rng.integers(10, vocab_size, size=w.input_len).tolist() for w in items]
    return items, prompts


# -- HTTP replay ----------------------------------------------------------------------------


# What every benchmark request sends to choose its tokens unless told otherwise: greedy.
GREEDY = {"temperature": 0}


async def _one(url: str, model: str, item: WorkItem, prompt: list[int], start_s: float,
               sampling: dict) -> JobResult:
    """One streamed request over a raw HTTP/1.1 connection.

    NOTE: not httpx: on a small machine the client's CPU is the server's CPU, and a client
    that parses every event would slow the server it measures. This one only scans bytes for
    the first non-empty text and decodes the final usage chunk.
    """
    host, port = url.removeprefix("http://").split(":")
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": item.output_len,
                       **sampling, "ignore_eos": True, "stream": True,
                       "stream_options": {"include_usage": True}}).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: {host}:{port}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
            "Connection: close\r\n\r\n").encode()
    await asyncio.sleep(max(0.0, start_s + item.arrival_s - time.monotonic()))
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
    if not received.startswith(b"HTTP/1.1 200") and first is None:
        raise RuntimeError(f"request failed: {received[:300]!r}")
    start = received.rfind(b"data: {")
    final = json.loads(received[start + len(b"data: "):received.index(b"\n\n", start)])
    if "error" in final:
        raise RuntimeError(f"stream error: {final['error']}")
    return JobResult(sent, first or done, done, final["usage"]["completion_tokens"])


async def replay(url: str, model: str, items: list[WorkItem], prompts: list[list[int]],
                 sampling: dict | None = None) -> list[JobResult]:
    """Send every item at its arrival time; `sampling`: the fields that choose the tokens
    (`GREEDY` when None), the same for every request."""
    start = time.monotonic() + 0.2
    fields = GREEDY if sampling is None else sampling
    return await asyncio.gather(*(_one(url, model, w, p, start, fields)
                                  for w, p in zip(items, prompts, strict=True)))


@dataclass
class Server:
    """One `fastserve serve` process per scheduler, kept for every repetition."""

    scheduler: str
    proc: subprocess.Popen[bytes]
    url: str
    log_path: Path

    def counter(self, name: str) -> int:
        text = httpx.get(self.url + "/metrics").text
        match = re.search(rf"^fastserve_{name}_total (\S+)$", text, re.MULTILINE)
        return int(float(match.group(1))) if match else 0

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        code = self.proc.wait(120)
        if code != 0:
            print(f"warning: {self.scheduler} server exited with {code}; see {self.log_path}",
                  file=sys.stderr)


def start_server(scheduler: str, args: argparse.Namespace, log_dir: Path) -> Server:
    log_path = log_dir / f"server-{scheduler}.log"
    cmd = [sys.executable, "-m", "fastserve.cli", "serve", *([args.model] if args.model else []),
           "--port", "0", "--scheduler", scheduler, "--dtype", args.dtype,
           "--max-batch-size", str(args.max_batch_size), "--no-access-log", "--log-level", "warning",
           "--device", args.device, "--load-format", args.load_format, *args.server_arg]
    with log_path.open("wb") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, env=_env(), stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}:\n{log_path.read_text()}")
        match = _URL_RE.search(log_path.read_text(errors="replace"))
        if match:
            return Server(scheduler, proc, match.group(1), log_path)
        time.sleep(0.1)
    proc.kill()
    raise RuntimeError(f"server did not start:\n{log_path.read_text()}")


def run_http(server: Server, items: list[WorkItem], prompts: list[list[int]]) -> RunSummary:
    model = httpx.get(server.url + "/v1/models").json()["data"][0]["id"]
    before = server.counter("preemptions"), server.counter("recomputes")
    results = asyncio.run(replay(server.url, model, items, prompts))
    makespan = max(r.done_s for r in results) - min(r.sent_s for r in results)
    return RunSummary(f"http {server.scheduler}", results, makespan,
                      server.counter("preemptions") - before[0], server.counter("recomputes") - before[1])


def _env() -> dict[str, str]:
    path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": path}


# -- offline --------------------------------------------------------------------------------


def run_offline(scheduler: str, args: argparse.Namespace, items: list[WorkItem],
                prompts: list[list[int]]) -> float:
    """Output tokens per second of `LLM.generate` over all jobs at once (no arrival times)."""
    from fastserve import LLM, SamplingParams

    params = [SamplingParams(max_tokens=w.output_len, temperature=0.0, ignore_eos=True) for w in items]
    result: list[float] = []

    def generate() -> None:
        llm = LLM(model=args.model, dtype=args.dtype, policy=scheduler,
                  max_batch_size=args.max_batch_size, device=args.device,
                  load_format=args.load_format)
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        result.append(sum(len(o.token_ids) for o in outs) / elapsed)

    # NOTE: the server builds and steps its engine on a background thread (AsyncLLM); so does
    # this run. An engine stepped off the thread that built it runs slower on CPU (a second
    # team of OpenMP workers: fastserve/executor/openmp.py), so both happen on the worker.
    if args.offline_main_thread:
        generate()
    else:
        worker = threading.Thread(target=generate)
        worker.start()
        worker.join()
    return result[0]


def run_offline_process(scheduler: str) -> float:
    """`run_offline` in a fresh process, started like the servers (same imports, same env).

    NOTE: this process has run an HTTP client for minutes; a fresh one keeps the comparison fair.
    """
    cmd = [sys.executable, __file__, *sys.argv[1:], "--offline-worker", scheduler]
    out = subprocess.run(cmd, cwd=REPO, env=_env(), capture_output=True, text=True, check=False)
    match = re.search(r"^offline_tok_per_s=([0-9.]+)$", out.stdout, re.MULTILINE)
    if out.returncode != 0 or not match:
        raise RuntimeError(f"offline run failed ({out.returncode}):\n{out.stdout}\n{out.stderr}")
    return float(match.group(1))


# -- report ---------------------------------------------------------------------------------


def _stats(values: list[float]) -> str:
    arr = np.asarray(values)
    return f"{arr.mean():7.3f} {np.percentile(arr, 50):7.3f} {np.percentile(arr, 99):7.3f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--schedulers", default="fcfs,skip-join-mlfq",
                    help="comma-separated scheduling policies, one server each")
    ap.add_argument("--model", default=None, help="HF checkpoint directory (default: --preset)")
    ap.add_argument("--preset", choices=["tiny", "small", "llama-2-7b", "llama-3-8b"], default="tiny",
                    help="built-in random-weight preset when --model is not given")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--device", default="cpu", help="cpu or cuda")
    ap.add_argument("--load-format", choices=["auto", "dummy"], default=None,
                    help="default: dummy when the checkpoint has no weights (the 7B/8B presets)")
    ap.add_argument("--server-arg", action="append", default=[],
                    help="extra `fastserve serve` flag, e.g. --server-arg=--kv-cache-gib=40")
    ap.add_argument("--load", type=float, default=None,
                    help="set the rate to this fraction of the capacity measured first by the "
                    "offline run (jobs/s = offline tok/s / mean output tokens); overrides --rate")
    ap.add_argument("--max-batch-size", type=int, default=16)
    ap.add_argument("--num-requests", type=int, default=200)
    ap.add_argument("--rate", type=float, default=200.0,
                    help="mean arrivals per second (the default overloads the tiny model on 2 cores)")
    ap.add_argument("--cv", type=float, default=4.0, help="coefficient of variation of the gaps")
    ap.add_argument("--theta", type=float, default=1.0, help="Zipf skew of the lengths")
    ap.add_argument("--max-input-len", type=int, default=256)
    ap.add_argument("--max-output-len", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--reps", type=int, default=3, help="repetitions (medians are reported)")
    ap.add_argument("--offline-scheduler", default=None,
                    help="policy of the offline run (default: the first of --schedulers)")
    ap.add_argument("--offline-main-thread", action="store_true",
                    help="run the offline engine on the main thread (default: a worker thread, "
                    "as the server does)")
    ap.add_argument("--offline-worker", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.model is None and args.preset != "tiny":
        from fastserve.model.make_model import cached_model_path

        args.model = str(cached_model_path(args.preset))
    if args.load_format is None:
        path = Path(args.model) if args.model else None
        args.load_format = "dummy" if path and not any(path.glob("*.safetensors")) else "auto"
    schedulers = [s.strip() for s in args.schedulers.split(",") if s.strip()]

    vocab = _vocab_size(args.model)
    items, prompts = make_jobs(args, vocab)
    if args.offline_worker:
        print(f"offline_tok_per_s={run_offline(args.offline_worker, args, items, prompts):.3f}")
        return
    if args.load is not None:
        capacity_tok_s = run_offline_process(args.offline_scheduler or schedulers[0])
        capacity = capacity_tok_s / statistics.mean(w.output_len for w in items)
        args.rate = args.load * capacity
        print(f"capacity: {capacity_tok_s:.1f} output tok/s offline = {capacity:.2f} jobs/s; "
              f"rate {args.rate:.2f} jobs/s (load {args.load})")
        items, prompts = make_jobs(args, vocab)
    span = items[-1].arrival_s - items[0].arrival_s
    num_out = sum(w.output_len for w in items)
    print(f"workload: {len(items)} requests over {span:.2f} s (rate {args.rate}/s, cv {args.cv}), "
          f"input {statistics.mean(w.input_len for w in items):.0f} mean / {args.max_input_len} max, "
          f"output {num_out / len(items):.0f} mean / {args.max_output_len} max tokens; "
          f"batch {args.max_batch_size}, {args.dtype}")

    offline_policy = args.offline_scheduler or schedulers[0]
    runs: dict[str, list[RunSummary]] = {name: [] for name in schedulers}
    offline: list[float] = []
    with tempfile.TemporaryDirectory(prefix="http_bench_") as tmp:
        servers = [start_server(name, args, Path(tmp)) for name in schedulers]
        try:
            # Repetitions interleave HTTP and offline runs, so drifting machine load hits both.
            for rep in range(args.reps):
                for server in servers:
                    run = run_http(server, items, prompts)
                    runs[server.scheduler].append(run)
                    print(f"  rep {rep}: {run.name}: {run.makespan_s:.2f} s, "
                          f"{run.output_tok_per_s:.1f} tok/s, {run.num_preemptions} preemptions "
                          f"({run.num_recomputes} recomputed)")
                offline.append(run_offline_process(offline_policy))
                print(f"  rep {rep}: offline LLM.generate: {offline[-1]:.1f} tok/s")
        finally:
            for server in servers:
                server.stop()

    print()
    print(f"{'run':<24} {'TTFT s: mean     p50     p99':>30} {'JCT s: mean     p50     p99':>30} "
          f"{'out tok/s':>10} {'vs offline':>10}")
    for name, reps in runs.items():
        results = [r for run in reps for r in run.results]
        tput = statistics.median(run.output_tok_per_s for run in reps)
        ratio = statistics.median(run.output_tok_per_s / off for run, off in zip(reps, offline, strict=True))
        print(f"{'http ' + name:<24} {_stats([r.ttft_s for r in results]):>30} "
              f"{_stats([r.jct_s for r in results]):>30} {tput:10.1f} {ratio:9.2f}x")
    base = schedulers[0]
    base_jct = [r.jct_s for run in runs[base] for r in run.results]
    for name in schedulers[1:]:
        jct = [r.jct_s for run in runs[name] for r in run.results]
        print(f"{base} / {name}: mean JCT {np.mean(base_jct) / np.mean(jct):.2f}x, "
              f"p99 JCT {np.percentile(base_jct, 99) / np.percentile(jct, 99):.2f}x (> 1: {name} lower)")
    print(f"{'offline LLM.generate':<24} {'':>30} {'':>30} {statistics.median(offline):10.1f} "
          f"{1.0:9.2f}x   ({offline_policy}, all jobs at once)")
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    print(f"medians over {args.reps} repetition(s) (latencies pooled); ratio = median of per-rep "
          f"ratios. Machine load average {load} on {os.cpu_count()} cores.")


def _vocab_size(model: str | None) -> int:
    from fastserve.model.make_model import default_model_path

    path = Path(model) if model else default_model_path()
    return int(json.loads((path / "config.json").read_text())["vocab_size"])


if __name__ == "__main__":
    main()
