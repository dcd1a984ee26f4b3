"""The README's multi-machine command, run as two "nodes" on this machine: two `torchrun
--nnodes 2` invocations with one process each, serving the tiny model with tensor parallelism
over gloo. Rank 0 serves HTTP; rank 1 runs the worker loop. SIGTERM to the server stops both
nodes cleanly (exit code 0 everywhere)."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

from fastserve import LLM, SamplingParams

REPO = Path(__file__).resolve().parents[2]
TORCHRUN = str(Path(sys.executable).with_name("torchrun"))
START_TIMEOUT_S = 120.0
PROMPT = [17, 230, 4001, 58, 999, 3]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _node(rank: int, port: int, log: Path) -> subprocess.Popen[bytes]:
    # The README's command, with this machine as both nodes and test-friendly server flags.
    cmd = [TORCHRUN, "--nnodes", "2", "--nproc-per-node", "1", "--node-rank", str(rank),
           "--master-addr", "127.0.0.1", "--master-port", str(port),
           "-m", "fastserve.cli", "serve", "--tensor-parallel-size", "2",
           "--port", "0", "--dtype", "float32", "--no-warmup", "--no-access-log"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    with log.open("wb") as out:
        # Its own session, so a failed test can kill torchrun's server child too, not orphan it.
        return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)


def _wait_for(pattern: str, log: Path, procs: list[subprocess.Popen[bytes]]) -> re.Match[str]:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        match = re.search(pattern, log.read_text(errors="replace"))
        if match:
            return match
        assert all(p.poll() is None for p in procs), log.read_text(errors="replace")
        time.sleep(0.1)
    raise AssertionError(f"{pattern!r} not seen:\n{log.read_text(errors='replace')}")


def test_readme_torchrun_command_on_two_local_nodes(tmp_path: Path) -> None:
    # float32 in every test variant: the launch is what this checks, and its text is compared
    # exactly (test_tokens compares tensor-parallel tokens in the variant's dtype).
    expected = LLM(dtype="float32", warmup=False).generate(
        [PROMPT], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True), use_tqdm=False
    )[0].text
    port = _free_port()
    logs = [tmp_path / "node0.log", tmp_path / "node1.log"]
    nodes = [_node(1, port, logs[1]), _node(0, port, logs[0])]
    try:
        url = _wait_for(r"serving .* at (http://127\.0\.0\.1:\d+)/v1", logs[0], nodes).group(1)
        pid = int(_wait_for(r"Started server process \[(\d+)\]", logs[0], nodes).group(1))
        assert httpx.get(url + "/health", timeout=10).status_code == 200
        resp = httpx.post(url + "/v1/completions", timeout=60, json={
            "model": "tiny", "prompt": PROMPT, "max_tokens": 12, "temperature": 0, "ignore_eos": True})
        assert resp.status_code == 200, resp.text
        assert resp.json()["choices"][0]["text"] == expected
        os.kill(pid, signal.SIGTERM)  # the server's graceful shutdown stops the worker too
        codes = [p.wait(60) for p in nodes]
        assert codes == [0, 0], "\n".join(log.read_text(errors="replace")[-3000:] for log in logs)
    finally:
        for p in nodes:
            with contextlib.suppress(ProcessLookupError):  # a group left over only on failure
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()
