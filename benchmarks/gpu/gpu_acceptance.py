"""The GPU acceptance checks in one call under one deadline (`gpu_acceptance.sh` runs this).

A lent GPU comes with minutes in all, so the steps run in priority order under a global
deadline (`--budget-s`): each step's time limit is trimmed to what is left of it, and a step
that cannot finish in what is left (less than its `min_s`) is skipped, not started. Each
step's output goes to its own log; `summary.txt` gets a line per step as it ends (so a call cut
short still says how far it got) and, at the end, the tail of every log. The logs travel back
as one archive (`logs.tgz`): the device tool returns a few files only.

    python benchmarks/gpu/gpu_acceptance.py --budget-s 450 [--steps kernels,decode] [--out DIR]
    python benchmarks/gpu/gpu_acceptance.py --dry-run       # the plan: steps, limits, commands
"""

from __future__ import annotations

import argparse
import os
import shlex
import signal
import subprocess
import sys
import tarfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

PY = sys.executable
MODEL = ("--preset", "llama-2-7b")  # bf16, dummy weights (the preset writes none)


@dataclass(frozen=True)
class Step:
    """One check: its command, the longest it may run, and the least it needs to finish."""

    name: str
    limit_s: int
    min_s: int
    argv: tuple[str, ...]
    is_default: bool = True  # in the default list (an optional step is asked for by name)


# Priority order: what was changed without a GPU is checked first (the kernels' numbers), then
# the decode step against the floor, the offline targets, the CUDA tests, the served run.
STEPS = [
    Step("kernels", 75, 40, (PY, "-m", "pytest", "-q", "-x", "--timeout", "60", "-p",
                             "no:cacheprovider", "tests/executor/interpreted/test_triton_kernels.py")),
    Step("decode", 90, 45, (PY, "benchmarks/gpu/gpu_decode.py", *MODEL, "--batches", "32,128",
                            "--contexts", "128,2048", "--reps", "10",
                            "--profile", "32:128,128:128")),
    Step("fp8", 75, 40, (PY, "benchmarks/gpu/gpu_decode.py", *MODEL, "--batches", "32,128",
                         "--contexts", "128,2048", "--reps", "10",
                         "--engine-arg", "kv_cache_dtype=fp8")),
    Step("thr32", 120, 80, (PY, "benchmarks/engine/engine_throughput.py", *MODEL, "--batch", "32",
                            "--reps", "1", "--kv-cache-gib", "20", "--async-scheduling", "on")),
    Step("thr128-fp8", 75, 45, (PY, "benchmarks/engine/engine_throughput.py", *MODEL, "--batch", "128",
                                "--reps", "1", "--kv-cache-gib", "24", "--async-scheduling", "on",
                                "--no-hf", "--engine-arg", "kv_cache_dtype=fp8")),
    Step("tests", 100, 60, (PY, "-m", "pytest", "-q", "-n", "4", "--timeout", "90", "-p",
                            "no:cacheprovider", "tests/executor/test_cuda_engine.py",
                            "tests/executor/test_kv_sizing.py", "tests/executor/test_attention.py",
                            "tests/executor/test_cuda_graphs.py", "tests/executor/test_swap.py",
                            "tests/test_llm.py", "tests/model/test_dummy_load.py",
                            "tests/engine/test_async_scheduling.py", "tests/distributed/test_nccl.py",
                            "-k", "cuda or Cuda or replayed or dummy or nccl")),
    # The pool is the server's own: no --kv-cache-gib, so --gpu-memory-utilization sizes it.
    Step("served", 150, 100, (PY, "benchmarks/serving/http_bench.py", *MODEL, "--device", "cuda",
                              "--dtype", "bfloat16", "--load", "0.9", "--theta", "1.2",
                              "--cv", "4", "--max-output-len", "512", "--max-batch-size", "128",
                              "--reps", "1", "--num-requests", "150",
                              "--server-arg=--gpu-memory-utilization=0.9")),
    # Optional: tune the decode kernel's configs for this GPU (written into the output folder
    # too, to be shipped in fastserve/executor/backends/configs/).
    Step("sweep", 150, 90, (PY, "benchmarks/gpu/triton_decode_sweep.py", "--quick", "--reps", "10",
                            "--out", "{out}"), is_default=False),
    Step("sweep8", 120, 60, (PY, "benchmarks/gpu/triton_decode_sweep.py", "--quick", "--reps", "10",
                             "--kv-cache-dtype", "fp8", "--out", "{out}"), is_default=False),
]


@dataclass(frozen=True)
class Outcome:
    name: str
    status: str  # ok, failed, timeout, skipped
    rc: int | None
    seconds: float
    limit_s: float  # the trimmed limit it ran under (0: skipped)
    at_s: float  # seconds since the start when it ended

    def line(self) -> str:
        if self.status == "skipped":
            return f"{self.name}: SKIPPED (budget: needs {self.limit_s:.0f} s) at +{self.at_s:.0f} s"
        return (f"{self.name}: {self.status.upper()} rc={self.rc} in {self.seconds:.0f} s "
                f"(limit {self.limit_s:.0f} s) at +{self.at_s:.0f} s")


def select(names: str | None, steps: Sequence[Step] = STEPS) -> list[Step]:
    """The steps named (comma-separated, run in priority order whatever the order given), or
    the default ones; an unknown name is an error naming the known ones."""
    if not names:
        return [s for s in steps if s.is_default]
    wanted = [n.strip() for n in names.split(",") if n.strip()]
    known = {s.name for s in steps}
    unknown = [n for n in wanted if n not in known]
    if unknown:
        raise SystemExit(f"unknown steps {unknown}; known: {', '.join(s.name for s in steps)}")
    return [s for s in steps if s.name in wanted]


def _run(argv: Sequence[str], log: Path, limit_s: float) -> tuple[str, int | None]:
    """Run `argv` with its output in `log`; past `limit_s` its whole process group (servers it
    started included) is stopped."""
    with log.open("w") as out:
        proc = subprocess.Popen(list(argv), stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            rc = proc.wait(timeout=limit_s)
        except subprocess.TimeoutExpired:
            _stop_group(proc)
            out.write(f"\n[gpu_acceptance] stopped at its limit of {limit_s:.0f} s\n")
            return "timeout", None
    return ("ok" if rc == 0 else "failed"), rc


def _stop_group(proc: subprocess.Popen[bytes]) -> None:
    for sig, wait_s in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait_s)
            return
        except subprocess.TimeoutExpired:
            continue


def run_steps(steps: Sequence[Step], budget_s: float, out: Path,
              clock: Callable[[], float] = time.monotonic) -> list[Outcome]:
    """Run `steps` in order under a deadline `budget_s` from now (see the module docstring);
    `summary.txt` in `out` gets each step's line as it ends."""
    logs = out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    start = clock()
    deadline = start + budget_s
    outcomes = []
    for step in steps:
        left = deadline - clock()
        if left < step.min_s:
            outcome = Outcome(step.name, "skipped", None, 0.0, step.min_s, clock() - start)
        else:
            limit = min(float(step.limit_s), left)
            argv = [a.replace("{out}", str(out)) for a in step.argv]
            t0 = clock()
            status, rc = _run(argv, logs / f"{step.name}.log", limit)
            outcome = Outcome(step.name, status, rc, clock() - t0, limit, clock() - start)
        outcomes.append(outcome)
        with (out / "summary.txt").open("a") as f:
            f.write(outcome.line() + "\n")
        print(outcome.line(), flush=True)
    return outcomes


def finish(out: Path, outcomes: Sequence[Outcome], tail_lines: int = 15) -> None:
    """The tail of every log into `summary.txt`, and the logs into one archive."""
    logs = out / "logs"
    with (out / "summary.txt").open("a") as f:
        for o in outcomes:
            log = logs / f"{o.name}.log"
            if log.is_file():
                lines = log.read_text(errors="replace").splitlines()[-tail_lines:]
                f.write(f"\n==> {o.name} ({o.status})\n" + "\n".join(lines) + "\n")
    with tarfile.open(out / "logs.tgz", "w:gz") as tar:
        tar.add(logs, arcname="logs")
    for log in logs.iterdir():
        log.unlink()
    logs.rmdir()


def _device_line() -> str:
    try:
        return subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,clocks.max.sm",
                               "--format=csv,noheader"], capture_output=True, text=True,
                              timeout=20).stdout.strip() or "no GPU listed"
    except (OSError, subprocess.TimeoutExpired):
        return "no nvidia-smi"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--budget-s", type=float, default=450.0,
                    help="the deadline for every step together, from the start (default 450: "
                         "one device call of at most 8 minutes with the machine's setup)")
    ap.add_argument("--steps", default=None,
                    help="comma-separated subset, run in priority order (default: every step "
                         "but the optional sweep and sweep8): " + ", ".join(s.name for s in STEPS))
    ap.add_argument("--out", default=os.environ.get("OUT", "gpu-logs"),
                    help="where summary.txt and logs.tgz go (default: $OUT, else ./gpu-logs)")
    ap.add_argument("--dry-run", action="store_true", help="print the plan and run nothing")
    args = ap.parse_args()
    steps = select(args.steps)
    out = Path(args.out)
    if args.dry_run:
        total = sum(s.limit_s for s in steps)
        print(f"budget {args.budget_s:.0f} s; these steps' limits add up to {total} s")
        for s in steps:
            print(f"{s.name:11s} limit {s.limit_s:4d} s, skipped under {s.min_s:3d} s left: "
                  + shlex.join(a.replace("{out}", str(out)) for a in s.argv))
        return
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.txt").write_text(f"device: {_device_line()}\nbudget: {args.budget_s:.0f} s, "
                                     f"steps: {','.join(s.name for s in steps)}\n")
    outcomes = run_steps(steps, args.budget_s, out)
    finish(out, outcomes)
    print((out / "summary.txt").read_text())


if __name__ == "__main__":
    main()
