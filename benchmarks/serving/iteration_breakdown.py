"""Where a served iteration's time goes: fastserve under a vs_vllm workload, phase by phase.

Serves one of `vs_vllm.py`'s workloads (default (b), heavy-tailed bursty) over HTTP the way
`fastserve serve` does (the same app, uvicorn and engine thread, in this process), with a
client in its own process (`http_bench.replay`), and times every engine iteration phase by
phase: schedule, input preparation, KV-copy wait, forward (model and logits), sampling,
scheduler update, detokenization (and the output objects), delivery to the streams
(`AsyncLLM._deliver`), and what is left of the cycle: the executor's own bookkeeping and the
time the engine thread spent off its step (GIL waits on the HTTP side, queued commands).
An iteration's cycle is, as in `IterationRecorder` (`--record-iterations`, kept on here and
checked against), from the start of one `LLMEngine.step` to the start of the next.

The phases are timed by wrapping the engine's collaborators on this one instance (the running
code is the engine's own; nothing is replaced); a phase whose method a newer engine no longer
has is reported as missing rather than guessed.

Prints mean milliseconds per iteration and share of the cycle, for all iterations, decode-only
ones and ones with a prefill; `--torch-profile` instead prints the top ops of the forward pass
(see `vs_vllm_offline.py --torch-profile` for the same on vLLM).

    flock /tmp/fastserve-bench.lock .venv/bin/python benchmarks/serving/iteration_breakdown.py \\
        --workload b --capacity 150 [--policy skip-join-mlfq] [--preset small]
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: benchmarks.*
from benchmarks.peers.vs_vllm import (  # noqa: E402
    add_workload_args,
    at_load,
    build_workloads,
    burst,
    make_prompts,
)

PHASES = ("schedule", "prepare", "swap wait", "forward", "sample", "update", "detokenize",
          "deliver")


@dataclass
class Row:
    """One iteration: its batch and the seconds of each phase."""

    num_prefill_tokens: int
    num_decodes: int
    step_s: float = 0.0
    cycle_s: float = 0.0
    phase_s: dict[str, float] = field(default_factory=dict)


class PhaseClock:
    """Accumulates wall time per phase for the iteration in progress."""

    def __init__(self) -> None:
        self.rows: list[Row] = []
        self.missing: list[str] = []
        self._current: dict[str, float] = dict.fromkeys(PHASES, 0.0)
        self._open: Row | None = None  # the iteration whose cycle the next step closes
        self._step_start = 0.0

    def wrap(self, obj: Any, attr: str, phase: str) -> None:
        fn = getattr(obj, attr, None)
        if fn is None:
            self.missing.append(f"{phase} ({type(obj).__name__}.{attr})")
            return
        current = self._current

        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                current[phase] += time.perf_counter() - t

        setattr(obj, attr, timed)

    def instrument(self, llm: Any) -> None:
        """Wrap the phases of a running `AsyncLLM` (before any request arrives)."""
        engine = llm.engine
        runner = engine.runner
        self.wrap(engine.scheduler, "schedule", "schedule")
        self.wrap(engine.scheduler, "update", "update")
        self.wrap(runner, "_prepare", "prepare")
        self.wrap(runner.swapper, "wait_for", "swap wait")
        self.wrap(runner.model, "forward", "forward")
        self.wrap(runner.model, "compute_logits", "forward")
        self.wrap(runner.sampler, "sample", "sample")
        self.wrap(engine.outputs, "detokenize", "detokenize")
        self.wrap(engine.outputs, "output", "detokenize")
        self.wrap(llm, "_deliver", "deliver")
        step = engine.step

        def timed_step() -> Any:
            start = time.perf_counter()
            self._close(start)
            outs = step()
            plan = engine.core.last_plan
            # NOTE: a step that leaves nothing to run is followed by the loop's idle wait for
            # the next request: its cycle would count that wait.
            if plan is not None and not plan.is_empty and engine.has_unfinished:
                self._open = Row(plan.shape.num_prefill_tokens, plan.shape.num_decodes,
                                 step_s=time.perf_counter() - start)
                self._step_start = start
            else:
                self._drop()
            return outs

        engine.step = timed_step

    def reset(self) -> None:
        self.rows.clear()
        self._drop()

    def finish(self) -> None:
        self._drop()  # the last iteration has no next step to close its cycle

    def _close(self, now: float) -> None:
        if self._open is not None:
            row = self._open
            row.cycle_s = now - self._step_start
            row.phase_s = dict(self._current)
            self.rows.append(row)
            self._open = None
        for k in self._current:
            self._current[k] = 0.0

    def _drop(self) -> None:
        self._open = None
        for k in self._current:
            self._current[k] = 0.0


def print_breakdown(rows: list[Row], title: str) -> None:
    if not rows:
        print(f"\n{title}: no iterations")
        return
    n = len(rows)
    cycle = statistics.mean(r.cycle_s for r in rows)
    step = statistics.mean(r.step_s for r in rows)
    print(f"\n{title}: {n} iterations, mean cycle {cycle * 1e3:.2f} ms (step {step * 1e3:.2f} ms), "
          f"mean {statistics.mean(r.num_decodes for r in rows):.1f} decodes + "
          f"{statistics.mean(r.num_prefill_tokens for r in rows):.1f} prefill tokens")
    print(f"  {'phase':<34} {'ms/iter':>8} {'share':>7}")
    accounted = 0.0
    for phase in PHASES:
        ms = statistics.mean(r.phase_s.get(phase, 0.0) for r in rows) * 1e3
        accounted += ms
        print(f"  {phase:<34} {ms:8.2f} {ms / (cycle * 1e3):6.1%}")
    in_step = step * 1e3 - sum(statistics.mean(r.phase_s.get(p, 0.0) for r in rows) * 1e3
                               for p in PHASES if p != "deliver")
    off_step = (cycle - step) * 1e3 - statistics.mean(r.phase_s.get("deliver", 0.0) for r in rows) * 1e3
    print(f"  {'other, in the step (executor etc.)':<34} {in_step:8.2f} {in_step / (cycle * 1e3):6.1%}")
    print(f"  {'other, off the step (GIL, commands)':<34} {off_step:8.2f} {off_step / (cycle * 1e3):6.1%}")


# -- the served run -------------------------------------------------------------------------


async def serve_and_replay(args: argparse.Namespace) -> None:
    import uvicorn

    from fastserve.args import engine_config
    from fastserve.engine.async_llm import AsyncLLM
    from fastserve.server.app import build_app

    config = engine_config(model=args.model, dtype=args.dtype, policy=args.policy,
                           max_batch_size=args.max_batch_size, record_iterations=1 << 16,
                           num_threads=args.num_threads)
    llm = AsyncLLM(config)
    clock = PhaseClock()
    clock.instrument(llm)
    app = build_app(llm, "model")
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False,
                                           lifespan="off"))
    serving = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started:
        await asyncio.sleep(0.02)
    try:
        await _client(args, url, "warm")
        clock.reset()
        assert llm.engine.recorder is not None
        llm.engine.recorder.clear()
        await _client(args, url, "run")
        clock.finish()
    finally:
        server.should_exit = True
        await serving
        await llm.shutdown()
    rows = clock.rows
    samples = llm.engine.recorder.samples()
    print(f"\nfastserve {args.policy}, {args.dtype}, max batch {args.max_batch_size}; "
          f"IterationRecorder: {len(samples)} iterations, mean cycle "
          f"{statistics.mean(s.duration_s for s in samples) * 1e3:.2f} ms (the check on the rows below)")
    if clock.missing:
        print(f"phases not timed (the engine no longer has these methods): {', '.join(clock.missing)}")
    print_breakdown(rows, "all iterations")
    print_breakdown([r for r in rows if r.num_prefill_tokens == 0], "decode-only iterations")
    print_breakdown([r for r in rows if r.num_prefill_tokens > 0], "iterations with a prefill")


async def _client(args: argparse.Namespace, url: str, mode: str) -> None:
    cmd = [sys.executable, __file__, "--client", mode, "--client-url", url, *sys.argv[1:]]
    proc = await asyncio.create_subprocess_exec(*cmd)
    if await proc.wait() != 0:
        raise RuntimeError(f"client ({mode}) failed")


def client_main(args: argparse.Namespace) -> None:
    """The client process: warm-up requests, or the workload (capacity first if not given)."""
    from vs_vllm import FastserveServer, run, warm

    vocab = int(json.loads((Path(args.model) / "config.json").read_text())["vocab_size"])
    (wl,) = build_workloads(args, [args.workload])
    server = FastserveServer(f"fastserve {args.policy}", args.client_url, lambda: None)
    if args.client == "warm":
        warm(server, vocab, max(w.input_len for w in wl.items))
        return
    prompts = make_prompts(wl.items, vocab, args.seed)
    items = wl.items
    if wl.load is not None:
        capacity = args.capacity
        if capacity is None:
            capacity = run(server, burst(items), prompts).output_tok_per_s
            print(f"capacity (this server, all at once): {capacity:.1f} tok/s", flush=True)
        items = at_load(items, wl.load, capacity)
    summary = run(server, items, prompts)
    jct = np.asarray([r.jct_s for r in summary.results])
    print(f"({wl.name}) {wl.description}: {summary.output_tok_per_s:.1f} tok/s, JCT mean "
          f"{jct.mean():.2f} s p99 {np.percentile(jct, 99):.2f} s", flush=True)


# -- forward profile --------------------------------------------------------------------------


def torch_profile(args: argparse.Namespace) -> None:
    """Top ops of our forward pass on the offline worker's workload (as vs_vllm_offline.py)."""
    cmd = [sys.executable, str(Path(__file__).parents[1] / "peers" / "vs_vllm_offline.py"), "--engine",
           "fastserve", "--model", args.model, "--dtype", args.dtype, "--batch",
           str(args.max_batch_size), "--torch-profile", "25"]
    subprocess.run(cmd, check=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workload", default="b", choices=["a", "b", "c", "d"])
    ap.add_argument("--policy", default="skip-join-mlfq")
    ap.add_argument("--model", default=None, help="HF checkpoint directory (default: small preset)")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--max-batch-size", type=int, default=16)
    ap.add_argument("--num-threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--capacity", type=float, default=None,
                    help="output tok/s that --load is a fraction of (vs_vllm.py prints vLLM's); "
                         "default: this server's own, measured first")
    ap.add_argument("--torch-profile", action="store_true",
                    help="print the forward pass's top ops instead (no server)")
    ap.add_argument("--client", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--client-url", default=None, help=argparse.SUPPRESS)
    add_workload_args(ap)
    args = ap.parse_args()
    if args.model is None:
        from fastserve.model.make_model import cached_model_path

        args.model = str(cached_model_path("small"))
    if args.client:
        client_main(args)
    elif args.torch_profile:
        torch_profile(args)
    else:
        run_loop(serve_and_replay(args))


def run_loop(main: Any) -> None:
    """As `fastserve serve` runs its loop: on uvloop when installed."""
    try:
        import uvloop
    except ImportError:
        asyncio.run(main)
        return
    uvloop.run(main)


if __name__ == "__main__":
    main()
