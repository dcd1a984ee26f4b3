"""Importing fastserve gives OpenMP's idle threads a short spin (GOMP_SPINCOUNT=10000) before
torch loads it, unless the caller chose a wait policy or a spin count; it records what it set
(`fastserve.OPENMP_DEFAULTS`), so that a benchmark can start a peer engine without it."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

PROBE = ("import json, os, fastserve; "
         "print(json.dumps([os.environ.get('GOMP_SPINCOUNT'), os.environ.get('OMP_WAIT_POLICY'), "
         "fastserve.OPENMP_DEFAULTS]))")


def _after_import(**env: str) -> list[object]:
    base = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
    out = subprocess.run([sys.executable, "-c", PROBE], env={**base, **env}, capture_output=True,
                         text=True, check=True, timeout=60)
    return list(json.loads(out.stdout))


@pytest.mark.parametrize("env,want", [
    ({}, ["10000", None, {"GOMP_SPINCOUNT": "10000"}]),
    ({"OMP_WAIT_POLICY": "PASSIVE"}, [None, "PASSIVE", {}]),
    ({"GOMP_SPINCOUNT": "5"}, ["5", None, {}]),
], ids=["unset", "policy-chosen", "spin-chosen"])
def test_openmp_spins_briefly_unless_the_caller_chose(env: dict[str, str], want: list[object]) -> None:
    assert _after_import(**env) == want


RELEASE = """
import os, time, torch
from fastserve.executor.openmp import release_thread_team
torch.set_num_threads(2)
x = torch.randn(1 << 22)
def threads():
    return len(os.listdir("/proc/self/task"))
def settled(want):
    for _ in range(100):
        if threads() == want:
            return want
        time.sleep(0.01)
    return threads()
(x + x).sum()  # a parallel op: this thread now has a team (one worker at 2 threads)
with_team = threads()
released = release_thread_team()
after = settled(with_team - 1)
again = (x + x).sum().item() == (2 * x).sum().item()  # a new team, the same sums
print(released, with_team - after, again, threads() - after)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="counts threads in /proc")
def test_a_thread_hands_its_openmp_workers_back() -> None:
    """`release_thread_team` ends the calling thread's OpenMP worker, and the next parallel op
    starts one again and computes as before."""
    out = subprocess.run([sys.executable, "-c", RELEASE], capture_output=True, text=True,
                         check=True, timeout=120)
    assert out.stdout.split() == ["True", "1", "True", "1"]
