"""OpenMP's idle threads spin briefly (GOMP_SPINCOUNT=10000) in the process of an engine the
`fastserve` command starts, unless the caller chose a wait policy or a spin count: written
before torch loads libgomp, which reads it once (fastserve/openmp_env.py). `import fastserve`
writes nothing into the environment.

What libgomp itself read is what it prints under OMP_DISPLAY_ENV=VERBOSE as it loads."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from fastserve.openmp_env import openmp_defaults

OPENMP_VARS = ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY", "OMP_DISPLAY_ENV")

IMPORTS = ("import json, os; before = dict(os.environ); "
           "import fastserve, fastserve.llm, fastserve.engine.llm_engine, fastserve.server.app; "
           "fastserve.LLM; "
           "print(json.dumps(sorted(k for k, v in os.environ.items() if before.get(k) != v)))")


def _env(**env: str) -> dict[str, str]:
    base = {k: v for k, v in os.environ.items() if k not in OPENMP_VARS}
    return {**base, "PYTHONPATH": os.pathsep.join(sys.path), **env}


def test_importing_fastserve_writes_no_environment_variable() -> None:
    out = subprocess.run([sys.executable, "-c", IMPORTS], env=_env(), capture_output=True,
                         text=True, check=True, timeout=120)
    assert json.loads(out.stdout) == []


@pytest.mark.parametrize("env,want", [
    ({}, {"GOMP_SPINCOUNT": "10000"}),
    ({"OMP_WAIT_POLICY": "PASSIVE"}, {}),
    ({"GOMP_SPINCOUNT": "5"}, {}),
], ids=["unset", "policy-chosen", "spin-chosen"])
def test_openmp_defaults_leave_a_callers_choice_alone(env: dict[str, str],
                                                     want: dict[str, str]) -> None:
    assert openmp_defaults(env) == want


@pytest.mark.parametrize("env,want", [({}, "10000"), ({"GOMP_SPINCOUNT": "5"}, "5")],
                         ids=["unset", "spin-chosen"])
def test_the_fastserve_commands_engine_spins_briefly(tiny_model_path: Path, env: dict[str, str],
                                                     want: str) -> None:
    """A CPU engine started by `fastserve generate`: its libgomp read the short spin."""
    out = subprocess.run(
        [sys.executable, "-m", "fastserve.cli", "generate", "--model", str(tiny_model_path),
         "--prompt", "hello", "--max-tokens", "2", "--device", "cpu", "--kv-cache-gib", "0.02",
         "--no-warmup", "--no-startup-profile"],
        env=_env(OMP_DISPLAY_ENV="VERBOSE", **env), capture_output=True, text=True,
        check=True, timeout=180)
    assert "[2 tokens" in out.stderr
    assert re.findall(r"GOMP_SPINCOUNT = '(\d+)'", out.stderr) == [want]


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
