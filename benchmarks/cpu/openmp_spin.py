"""Whether OpenMP's short spin (GOMP_SPINCOUNT=10000, fastserve/openmp_env.py) takes effect, by
where it is set: before torch loads (as the `fastserve` command does), never, or after torch is
imported (as `import fastserve` did when a program imported torch first).

Each variant runs in a fresh process, in turn, `--reps` times: 2 threads, `--ops` small parallel
ops with a `--gap-ms` sleep after each, the gaps an engine's host work leaves between a forward
pass's ops. Prints the value libgomp read (OMP_DISPLAY_ENV=VERBOSE) and the process's CPU time
per wall second (median): idle workers that spin for libgomp's default 300,000 rounds burn a
core through every gap; a short spin sleeps after about half a millisecond.

    python benchmarks/cpu/openmp_spin.py [--reps 3] [--ops 200] [--gap-ms 2]
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys

VARIANTS = ("before", "unset", "after")

CHILD = """
import os, resource, sys, time
variant, ops, gap_s = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
if variant == "before":
    from fastserve.openmp_env import set_openmp_defaults
    set_openmp_defaults()
import torch
if variant == "after":
    os.environ["GOMP_SPINCOUNT"] = "10000"
torch.set_num_threads(2)
x = torch.randn(1 << 20)
(x + x).sum()
r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
for _ in range(ops):
    (x * 2).sum()
    time.sleep(gap_s)
r1, wall = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter() - t0
print("RESULT", (r1.ru_utime - r0.ru_utime + r1.ru_stime - r0.ru_stime) / wall)
"""


def run(variant: str, ops: int, gap_ms: float) -> tuple[str, float]:
    """(libgomp's GOMP_SPINCOUNT, CPU seconds per wall second) of one child."""
    env = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
    env["OMP_DISPLAY_ENV"] = "VERBOSE"
    out = subprocess.run([sys.executable, "-c", CHILD, variant, str(ops), str(gap_ms / 1000)],
                         env=env, capture_output=True, text=True, check=True, timeout=300)
    spin = re.findall(r"GOMP_SPINCOUNT = '(\d+)'", out.stderr)
    result = [line for line in out.stdout.splitlines() if line.startswith("RESULT ")]
    return (spin[0] if spin else "?"), float(result[-1].split()[1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--ops", type=int, default=200)
    ap.add_argument("--gap-ms", type=float, default=2.0)
    args = ap.parse_args()
    spins: dict[str, str] = {}
    cpu: dict[str, list[float]] = {v: [] for v in VARIANTS}
    for rep in range(args.reps):
        for variant in VARIANTS:
            spins[variant], ratio = run(variant, args.ops, args.gap_ms)
            cpu[variant].append(ratio)
            print(f"rep {rep}: {variant:6s} libgomp GOMP_SPINCOUNT={spins[variant]:>6s} "
                  f"CPU s per wall s {ratio:.2f}", flush=True)
    base = statistics.median(cpu["unset"])
    print("\nvariant  libgomp spin  CPU s / wall s (median)  vs unset")
    for variant in VARIANTS:
        med = statistics.median(cpu[variant])
        print(f"{variant:8s} {spins[variant]:>12s}  {med:23.2f}  {med / base:8.2f}x")


if __name__ == "__main__":
    main()
