"""A signal during start-up stops the processes the server started (the CPU kernels' first
build runs ninja and the compiler for minutes): real processes, a real SIGTERM."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fastserve.children import descendants

REPO = Path(__file__).resolve().parents[1]
# A parent that, inside `stop_children_on_signal`, starts a shell that starts a sleeper (a
# build tool and its compiler), prints the tree's ids and waits as a start-up does.
PARENT = """
import subprocess, sys, time
from fastserve.children import descendants, stop_children_on_signal
with stop_children_on_signal():
    subprocess.Popen(["sh", "-c", "sleep 300 & sleep 300; wait"])
    while len(descendants()) < 3:
        time.sleep(0.02)
    print(" ".join(map(str, descendants())), flush=True)
    time.sleep(300)
"""


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc (Linux)")
def test_sigterm_during_start_up_stops_the_children_and_theirs() -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    parent = subprocess.Popen([sys.executable, "-c", PARENT], stdout=subprocess.PIPE, env=env)
    assert parent.stdout is not None
    tree = [int(pid) for pid in parent.stdout.readline().split()]
    assert len(tree) == 3 and set(tree) <= set(descendants(parent.pid))
    parent.send_signal(signal.SIGTERM)
    assert parent.wait(10) == -signal.SIGTERM  # ended as the signal would have ended it
    deadline = time.monotonic() + 5
    while any(_is_alive(pid) for pid in tree) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [pid for pid in tree if _is_alive(pid)]


def _is_alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"
