"""A start says what it does: timestamped log lines, each start-up step with its duration."""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
import time

import pytest

from fastserve.logs import startup_step

_STAMPED = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{3} (DEBUG|INFO|WARNING|ERROR) \S+: ")


def test_generate_logs_each_step_with_a_timestamp_and_its_duration() -> None:
    env = {k: v for k, v in os.environ.items() if k != "FASTSERVE_CPU_KERNELS"}
    done = subprocess.run(
        [sys.executable, "-m", "fastserve.cli", "generate", "--prompt", "Hello",
         "--max-tokens", "4", "--no-startup-profile"],
        capture_output=True, text=True, timeout=180, env=env, check=True)
    lines = done.stderr.splitlines()
    logged = [line for line in lines if not line.startswith(("fastserve:", "["))]
    assert logged and all(_STAMPED.match(line) for line in logged), done.stderr
    assert any(re.search(r"loading .*: done in \d+\.\d s$", line) for line in logged), done.stderr
    assert any(line.startswith("fastserve: engine ready in ") for line in lines), done.stderr
    assert re.search(r"\[4 tokens, finish_reason=length", done.stderr)


def test_a_step_logs_its_start_and_duration(caplog: pytest.LogCaptureFixture) -> None:
    log = logging.getLogger("fastserve.test")
    with caplog.at_level(logging.INFO, logger="fastserve.test"):
        with startup_step(log, "slow step"):
            time.sleep(0.05)
        with startup_step(log, "quick step", expect_slow=False):
            pass  # under a second: nothing at INFO
    messages = [r.getMessage() for r in caplog.records]
    assert messages[0] == "slow step ..." and re.fullmatch(r"slow step: done in 0\.\d s",
                                                           messages[1])
    assert len(messages) == 2
