"""fastserve against vLLM's CPU build, side by side on one machine, one checkpoint, one client.

Starts a vLLM OpenAI server (from the virtualenv of `../shared/peers/install_vllm_cpu.sh`, given
as `--vllm-python`) and one `fastserve serve` per policy in `--policies`, all on the same
checkpoint (default: the `small` preset), dtype and maximum batch; warms every server with
requests of many prompt lengths (vLLM's first requests of a new shape are slow); then replays
each workload with one client (`http_bench.replay`: streaming /v1/completions, token-id
prompts, `max_tokens` = the target length, `ignore_eos`, greedy), the servers taking turns
within each repetition (the order rotates per repetition) so that drifting machine load hits
all of them. Prints, per workload and server, served output tok/s and JCT / TTFT (mean, p50,
p99), each the median over repetitions, and fastserve's ratios to vLLM (medians of per-rep
ratios).

Workloads (`--workloads`, comma-separated, each its own table):
  a        capacity: a burst of `--num-a` (200) requests at once, Zipf 1.0 lengths, inputs
           <= 256, outputs <= 128 (http_bench's defaults).
  b        heavy-tailed bursty: `--num-b` (250) requests, Zipf 1.2 outputs <= 512 and inputs
           <= 256, Gamma arrivals with CV 4, at `--load-b` (0.85) of vLLM's capacity.
  c        the Azure conversation trace (`--trace`): the first `--num-c` (200) requests, lengths
           x `--trace-length-scale` (0.25), inputs capped at 1024, arrivals rescaled to
           `--load-c` (0.8) of vLLM's capacity.
  d        light-tailed: `--num-d` (100) requests, Poisson arrivals, outputs uniform in
           [64, 128], inputs uniform in [16, 256], at `--load-d` (0.8) of vLLM's capacity.
  offline  `LLM.generate` against vLLM's `LLM.generate`, batch 32, 128 in / 128 out (each
           engine in its own process, `benchmarks/peers/vs_vllm_offline.py`, taking turns).

Every request is greedy unless `--sampling` gives other fields (temperature, top_p, ...).

vLLM's capacity on a workload is its output tok/s on the workload's own jobs sent at once
(measured once per invocation, before the timed runs; `--capacity b=TOK_S,...` reuses a
figure printed by an earlier invocation). A load L then sets the mean arrival rate to
L x capacity / mean output length, keeping the workload's own gap pattern.

Default dtype: bfloat16 where the CPU has AVX-512 BF16, else float32 (bf16 is emulated and slow
there for every engine). vLLM runs with VLLM_CPU_OMP_THREADS_BIND=0-<cores-1>,
VLLM_CPU_NUM_OF_RESERVED_CPU=0 and VLLM_CPU_KVCACHE_SPACE=1 (GiB, fastserve's default KV pool)
unless the environment sets them.
vLLM is a yardstick only: nothing in fastserve imports it.

    flock /tmp/fastserve-bench.lock .venv/bin/python benchmarks/peers/vs_vllm.py \\
        --vllm-python /work/vllm-venv/bin/python --workloads a --reps 3
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Protocol

import httpx
import numpy as np

from fastserve.bench.workloads import WorkItem, gamma_arrivals, trace_workload, zipf_workload

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: benchmarks.*
from benchmarks.serving.http_bench import GREEDY, RunSummary, replay, start_server  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
DEFAULT_TRACE = REPO.parent / "shared" / "traces" / "azure_conv_2023.csv"
SERVED_WORKLOADS = ("a", "b", "c", "d")
VLLM = "vllm"


# -- workloads ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Workload:
    name: str
    description: str
    items: list[WorkItem]
    load: float | None  # fraction of vLLM's capacity; None = the items' own arrival times


def add_workload_args(ap: argparse.ArgumentParser) -> None:
    """The options `build_workloads` reads (shared with iteration_breakdown.py)."""
    ap.add_argument("--num-a", type=int, default=200)
    ap.add_argument("--num-b", type=int, default=250)
    ap.add_argument("--num-c", type=int, default=200)
    ap.add_argument("--num-d", type=int, default=100)
    ap.add_argument("--load-b", type=float, default=0.85)
    ap.add_argument("--load-c", type=float, default=0.8)
    ap.add_argument("--load-d", type=float, default=0.8)
    ap.add_argument("--trace", default=str(DEFAULT_TRACE))
    ap.add_argument("--trace-length-scale", type=float, default=0.25)
    ap.add_argument("--seed", type=int, default=0)


def build_workloads(args: argparse.Namespace, names: list[str]) -> list[Workload]:
    out = []
    for name in names:
        if name == "a":
            items = zipf_workload(args.num_a, 1.0, 1.0, 1.0, 256, 128, seed=args.seed)
            items = [replace(w, arrival_s=0.0) for w in items]
            out.append(Workload("a", f"burst of {args.num_a} at once, Zipf 1.0, in <= 256, "
                                     "out <= 128", items, None))
        elif name == "b":
            items = zipf_workload(args.num_b, 1.0, 4.0, 1.2, 256, 512, seed=args.seed)
            out.append(Workload("b", f"{args.num_b} requests, Zipf 1.2, in <= 256, out <= 512, "
                                     f"CV 4, load {args.load_b} of vLLM", items, args.load_b))
        elif name == "c":
            items = trace_workload(args.trace, num_requests=args.num_c,
                                   length_scale=args.trace_length_scale, max_input_len=1024)
            out.append(Workload("c", f"Azure conversation, first {args.num_c}, lengths x "
                                     f"{args.trace_length_scale}, in <= 1024, load {args.load_c} "
                                     "of vLLM", items, args.load_c))
        elif name == "d":
            rng = np.random.default_rng(args.seed)
            arrivals = gamma_arrivals(rng, args.num_d, 1.0, 1.0)
            inputs = rng.integers(16, 257, size=args.num_d)
            outputs = rng.integers(64, 129, size=args.num_d)
            items = [WorkItem(float(t), int(i), int(o))
                     for t, i, o in zip(arrivals, inputs, outputs, strict=True)]
            out.append(Workload("d", f"{args.num_d} requests, Poisson, in 16-256, out 64-128, "
                                     f"load {args.load_d} of vLLM", items, args.load_d))
        else:
            raise ValueError(f"unknown workload {name!r}; choose from a,b,c,d,offline")
    return out


def at_load(items: list[WorkItem], load: float, capacity_tok_s: float) -> list[WorkItem]:
    """The same jobs with arrivals stretched so output tokens arrive at `load` x capacity."""
    mean_out = statistics.mean(w.output_len for w in items)
    target_gap_s = mean_out / (load * capacity_tok_s)
    span = items[-1].arrival_s - items[0].arrival_s
    factor = target_gap_s * (len(items) - 1) / span
    return [replace(w, arrival_s=(w.arrival_s - items[0].arrival_s) * factor) for w in items]


def burst(items: list[WorkItem]) -> list[WorkItem]:
    return [replace(w, arrival_s=0.0) for w in items]


def make_prompts(items: list[WorkItem], vocab_size: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed + 1)
    # NOTE: ids from 16 up skip the special tokens at the bottom of the vocabulary.
    return [rng.integers(16, vocab_size, size=w.input_len).tolist() for w in items]


# -- servers --------------------------------------------------------------------------------


class Endpoint(Protocol):
    name: str
    url: str

    def stop(self) -> None: ...


@dataclass
class VllmServer:
    name: str
    proc: subprocess.Popen[bytes] | None  # None: started by someone else (--vllm-url)
    url: str
    log_path: Path

    def stop(self) -> None:
        if self.proc is None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(30)


@dataclass
class FastserveServer:
    name: str
    url: str
    stop: Callable[[], None]


def vllm_env(num_threads: int | None = None) -> dict[str, str]:
    cores = num_threads or os.cpu_count() or 1
    env = dict(os.environ)
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{cores - 1}")
    env.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    # NOTE: 1 GiB, fastserve's default pool, not the 4 GiB the peers README used: on the shared
    # 24 GiB machine vLLM's worker, the largest process, got OOM-killed with 4 and with 2.
    # 1 GiB holds 14.5k tokens of the small preset, more than these workloads keep in flight
    # at batch 16 (or offline at batch 32: 8k).
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    env.pop("PYTHONPATH", None)  # the peer must not see this repo's packages
    # NOTE: the peer runs with its own OpenMP defaults: fastserve writes its short spin only
    # into the environment of its own engine processes (fastserve/openmp_env.py), not into
    # this one's (a peer that inherited OMP_WAIT_POLICY=PASSIVE ran 0.77-0.8x its offline
    # throughput on a 2-core Sapphire Rapids).
    return env


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_vllm(args: argparse.Namespace, log_dir: Path) -> VllmServer:
    port = free_port()
    log_path = log_dir / "server-vllm.log"
    cmd = [args.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", args.model,
           "--dtype", args.dtype, "--max-num-seqs", str(args.max_batch_size),
           "--host", "127.0.0.1", "--port", str(port), "--served-model-name", "model",
           "--seed", str(args.seed), *args.vllm_args.split()]
    with log_path.open("wb") as log:
        proc = subprocess.Popen(cmd, cwd=log_dir, env=vllm_env(), stdout=log,
                                stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + args.vllm_start_timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"vLLM exited with {proc.returncode}:\n"
                               f"{log_path.read_text(errors='replace')[-4000:]}")
        try:
            if httpx.get(url + "/v1/models", timeout=2).status_code == 200:
                return VllmServer(VLLM, proc, url, log_path)
        except httpx.HTTPError:
            pass
        time.sleep(1.0)
    proc.kill()
    raise RuntimeError(f"vLLM did not start in {args.vllm_start_timeout_s} s; see {log_path}")


def start_fastserve(policy: str, args: argparse.Namespace, log_dir: Path) -> FastserveServer:
    server = start_server(policy, args, log_dir)
    return FastserveServer(f"fastserve {policy}", server.url, server.stop)


def warm(server: Endpoint, vocab_size: int, max_input_len: int, sampling: dict | None = None
         ) -> None:
    """Requests of many prompt lengths and batch sizes, so no timed request meets a new shape."""
    lengths = sorted({int(x) for x in np.geomspace(1, max_input_len, 12)})
    items = [WorkItem(0.0, n, 8) for n in lengths]
    items += [WorkItem(0.0, 1 + (7 * i) % 64, 24) for i in range(32)]  # full decode batches
    run(server, items, make_prompts(items, vocab_size, seed=12345), sampling)


def run(server: Endpoint, items: list[WorkItem], prompts: list[list[int]],
        sampling: dict | None = None) -> RunSummary:
    model = httpx.get(server.url + "/v1/models").json()["data"][0]["id"]
    results = asyncio.run(replay(server.url, model, items, prompts, sampling))
    makespan = max(r.done_s for r in results) - min(r.sent_s for r in results)
    return RunSummary(server.name, results, makespan)


# -- report ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Stats:
    tok_s: float
    jct: tuple[float, float, float]  # mean, p50, p99
    ttft: tuple[float, float, float]

    @classmethod
    def of(cls, run: RunSummary) -> Stats:
        return cls(run.output_tok_per_s, _mpp([r.jct_s for r in run.results]),
                   _mpp([r.ttft_s for r in run.results]))


def _mpp(values: list[float]) -> tuple[float, float, float]:
    arr = np.asarray(values)
    return float(arr.mean()), float(np.percentile(arr, 50)), float(np.percentile(arr, 99))


def _median_stats(stats: list[Stats]) -> Stats:
    med = statistics.median
    return Stats(med(s.tok_s for s in stats),
                 tuple(med(s.jct[i] for s in stats) for i in range(3)),  # type: ignore[arg-type]
                 tuple(med(s.ttft[i] for s in stats) for i in range(3)))  # type: ignore[arg-type]


def print_table(workload: Workload, runs: dict[str, list[Stats]]) -> None:
    print(f"\n({workload.name}) {workload.description}")
    print(f"{'server':<26} {'out tok/s':>9}  {'JCT s: mean    p50     p99':>27}  "
          f"{'TTFT s: mean    p50     p99':>28}   {'vs vLLM: tok/s  JCT mean  JCT p99':>34}")
    base = runs.get(VLLM)
    for name, stats in runs.items():
        m = _median_stats(stats)
        line = (f"{name:<26} {m.tok_s:9.1f}  {m.jct[0]:9.2f} {m.jct[1]:7.2f} {m.jct[2]:7.2f}  "
                f"{m.ttft[0]:10.2f} {m.ttft[1]:7.2f} {m.ttft[2]:7.2f}")
        if base is not None and name != VLLM:
            med = statistics.median
            pairs = list(zip(stats, base, strict=True))
            line += (f"   {med(s.tok_s / b.tok_s for s, b in pairs):14.2f}x"
                     f" {med(s.jct[0] / b.jct[0] for s, b in pairs):8.2f}x"
                     f" {med(s.jct[2] / b.jct[2] for s, b in pairs):8.2f}x")
        print(line)


# -- served workloads -----------------------------------------------------------------------


def run_served(args: argparse.Namespace, workloads: list[Workload], vocab_size: int) -> None:
    capacities = dict(_parse_capacities(args.capacity))
    # NOTE: kept after the run: the servers' logs are where a failure is explained.
    tmp = tempfile.mkdtemp(prefix="vs_vllm_")
    print(f"server logs in {tmp}", flush=True)
    if True:
        servers: list[Endpoint] = []
        try:
            servers.append(VllmServer(VLLM, None, args.vllm_url, Path(tmp)) if args.vllm_url
                           else start_vllm(args, Path(tmp)))
            servers += [start_fastserve(p, args, Path(tmp)) for p in args.policies]
            max_in = max(w.input_len for wl in workloads for w in wl.items)
            for server in servers:
                t = time.monotonic()
                warm(server, vocab_size, max_in, args.sampling)
                print(f"warmed {server.name} in {time.monotonic() - t:.1f} s", flush=True)
            for wl in workloads:
                items = wl.items
                prompts = make_prompts(items, vocab_size, args.seed)
                if wl.load is not None:
                    if wl.name not in capacities:
                        cap_run = run(servers[0], burst(items), prompts, args.sampling)
                        capacities[wl.name] = cap_run.output_tok_per_s
                        print(f"({wl.name}) vLLM capacity: {capacities[wl.name]:.1f} output tok/s "
                              f"(all {len(items)} at once; reuse: --capacity "
                              f"{wl.name}={capacities[wl.name]:.1f})", flush=True)
                    items = at_load(items, wl.load, capacities[wl.name])
                _print_workload(wl, items)
                runs: dict[str, list[Stats]] = {s.name: [] for s in servers}
                for rep in range(args.reps):
                    order = servers[rep % len(servers):] + servers[:rep % len(servers)]
                    for server in order:
                        summary = run(server, items, prompts, args.sampling)
                        runs[server.name].append(Stats.of(summary))
                        s = runs[server.name][-1]
                        print(f"  rep {rep}: {server.name:<26} {summary.makespan_s:6.1f} s, "
                              f"{s.tok_s:6.1f} tok/s, JCT mean {s.jct[0]:.2f} p99 {s.jct[2]:.2f}, "
                              f"TTFT mean {s.ttft[0]:.2f}", flush=True)
                print_table(wl, runs)
        finally:
            for server in servers:
                server.stop()


def _print_workload(wl: Workload, items: list[WorkItem]) -> None:
    span = items[-1].arrival_s - items[0].arrival_s
    ins = [w.input_len for w in items]
    outs = [w.output_len for w in items]
    print(f"({wl.name}) {len(items)} requests over {span:.1f} s; input mean {statistics.mean(ins):.0f} "
          f"max {max(ins)}; output mean {statistics.mean(outs):.0f} max {max(outs)}, "
          f"{sum(outs)} tokens in all", flush=True)


def _parse_capacities(spec: str) -> list[tuple[str, float]]:
    pairs = []
    for part in filter(None, (p.strip() for p in spec.split(","))):
        name, _, value = part.partition("=")
        if name not in SERVED_WORKLOADS or not value:
            raise ValueError(f"--capacity: expected NAME=TOK_S with NAME in a,b,c,d, got {part!r}")
        pairs.append((name, float(value)))
    return pairs


# -- offline --------------------------------------------------------------------------------


class OfflineWorker:
    """One engine in its own process (`vs_vllm_offline.py`), timing `generate` on request."""

    def __init__(self, name: str, python: str, args: argparse.Namespace, env: dict[str, str]) -> None:
        self.name = name
        cmd = [python, str(Path(__file__).with_name("vs_vllm_offline.py")),
               "--engine", "vllm" if name == VLLM else "fastserve", "--model", args.model,
               "--dtype", args.dtype, "--batch", str(args.offline_batch),
               "--input-len", str(args.offline_input_len),
               "--output-len", str(args.offline_output_len), "--seed", str(args.seed),
               "--sampling", json.dumps(args.sampling)]
        self.proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)
        self._expect("ready")

    def run(self) -> float:
        assert self.proc.stdin is not None
        self.proc.stdin.write("run\n")
        self.proc.stdin.flush()
        return float(self._expect("tok_per_s="))

    def stop(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(120)
        except subprocess.TimeoutExpired:
            self.proc.kill()

    def _expect(self, prefix: str) -> str:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith(prefix):
                return line.removeprefix(prefix).strip()
        raise RuntimeError(f"{self.name} offline worker exited ({self.proc.wait()}) before {prefix!r}")


def run_offline(args: argparse.Namespace) -> None:
    fs_env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    workers = []
    try:
        # One at a time: each loads and warms up alone, then they take turns.
        workers.append(OfflineWorker(VLLM, args.vllm_python, args, vllm_env()))
        workers.append(OfflineWorker("fastserve", sys.executable, args, fs_env))
        results: dict[str, list[float]] = {w.name: [] for w in workers}
        for rep in range(args.reps):
            for w in workers[rep % 2:] + workers[:rep % 2]:
                results[w.name].append(w.run())
                print(f"  rep {rep}: offline {w.name:<10} {results[w.name][-1]:6.1f} output tok/s",
                      flush=True)
    finally:
        for w in workers:
            w.stop()
    fs, vl = results["fastserve"], results[VLLM]
    ratio = statistics.median(a / b for a, b in zip(fs, vl, strict=True))
    print(f"\n(offline) LLM.generate, batch {args.offline_batch}, {args.offline_input_len} in / "
          f"{args.offline_output_len} out, {args.dtype}, sampling {json.dumps(args.sampling)}")
    print(f"{'engine':<26} {'out tok/s':>9}")
    print(f"{'vllm':<26} {statistics.median(vl):9.1f}")
    print(f"{'fastserve':<26} {statistics.median(fs):9.1f}   vs vLLM {ratio:.2f}x (median of per-rep ratios)")


# -- main -----------------------------------------------------------------------------------


def default_dtype() -> str:
    """bfloat16 only where the CPU has it natively (AVX-512 BF16 / AMX); emulated it is slow."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "float32"
    return "bfloat16" if ("avx512_bf16" in flags or "amx_bf16" in flags) else "float32"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vllm-python", required=True,
                    help="python of the vLLM virtualenv (../shared/peers/install_vllm_cpu.sh VENV)")
    ap.add_argument("--workloads", default="a,b,c,d,offline")
    ap.add_argument("--policies", default="skip-join-mlfq,fcfs",
                    help="fastserve scheduling policies, one server each")
    ap.add_argument("--reps", type=int, default=3, help="interleaved repetitions (medians reported)")
    ap.add_argument("--model", default=None, help="HF checkpoint directory (default: small preset)")
    ap.add_argument("--dtype", default=None, help="default: bfloat16 with AVX-512 BF16, else float32")
    ap.add_argument("--max-batch-size", type=int, default=16)
    add_workload_args(ap)
    ap.add_argument("--capacity", default="",
                    help="vLLM capacities measured before, e.g. b=150.2,c=120 (skips measuring)")
    ap.add_argument("--offline-batch", type=int, default=32)
    ap.add_argument("--offline-input-len", type=int, default=128)
    ap.add_argument("--offline-output-len", type=int, default=128)
    ap.add_argument("--sampling", type=json.loads, default=GREEDY,
                    help="JSON of the sampling fields every request sends, served and offline "
                    "(default greedy: %(default)s), e.g. '{\"temperature\": 1, \"top_p\": 0.95}'")
    ap.add_argument("--vllm-args", default="", help="extra arguments for vLLM's server")
    ap.add_argument("--vllm-url", default=None,
                    help="use this running vLLM server (same model, dtype, --max-num-seqs and "
                    "env as start_vllm gives it) instead of starting one: saves its start-up "
                    "(minutes) in every invocation")
    ap.add_argument("--vllm-start-timeout-s", type=float, default=900.0)
    ap.add_argument("--server-arg", action="append", default=[],
                    help="extra `fastserve serve` argument (repeatable, e.g. --server-arg=--num-threads=2)")
    args = ap.parse_args()
    # vLLM here is its CPU build: fastserve serves on the CPU too, from the checkpoint's weights.
    args.device, args.load_format = "cpu", "auto"
    # A SIGTERM (someone stopping the run) unwinds like Ctrl-C, so the `finally` blocks stop
    # the servers this run started instead of leaving them serving, orphaned.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if args.model is None:
        from fastserve.model.make_model import cached_model_path

        args.model = str(cached_model_path("small"))
    args.dtype = args.dtype or default_dtype()
    args.policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    names = [n.strip() for n in args.workloads.split(",") if n.strip()]
    vocab = int(json.loads((Path(args.model) / "config.json").read_text())["vocab_size"])
    served = build_workloads(args, [n for n in names if n != "offline"])
    print(f"model {args.model}, {args.dtype}, max batch {args.max_batch_size}, {args.reps} rep(s); "
          f"vLLM from {args.vllm_python}; {os.cpu_count()} cores, load average "
          f"{', '.join(f'{x:.1f}' for x in os.getloadavg())}", flush=True)
    if served:
        run_served(args, served, vocab)
    if "offline" in names:
        run_offline(args)
    print(f"machine load average at the end: {', '.join(f'{x:.1f}' for x in os.getloadavg())} "
          "(the machine is shared)")


if __name__ == "__main__":
    main()
