"""Real `fastserve serve` processes for the HTTP tests, and the OpenAI response schemas."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import jsonschema

from tests.conftest import TEST_DTYPE

REPO = Path(__file__).resolve().parents[2]
SCHEMAS = json.loads((Path(__file__).with_name("openai_schemas.json")).read_text())
_URL_RE = re.compile(r"serving .* at (http://127\.0\.0\.1:\d+)/v1")
START_TIMEOUT_S = 180.0


def chat_chunks(server: ServerProcess, body: dict[str, Any]) -> list[dict[str, Any]]:
    """A streamed chat completion's chunks (`body` whole: model, messages...), each checked
    against OpenAI's chunk schema."""
    chunks = []
    with httpx.stream("POST", server.v1 + "/chat/completions", timeout=120,
                      json={"stream": True, **body}) as resp:
        assert resp.status_code == 200, resp.read()
        for line in resp.iter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[len("data: "):])
                validate(chunk, "CreateChatCompletionStreamResponse")
                chunks.append(chunk)
    return chunks


def validate(instance: Any, schema_name: str) -> None:
    """Check `instance` against a schema of the OpenAI API reference (openai_schemas.json)."""
    schema = {"$ref": f"#/$defs/{schema_name}", "$defs": SCHEMAS["$defs"]}
    jsonschema.validate(instance, schema, cls=jsonschema.Draft202012Validator)


@dataclass
class ServerProcess:
    """A `fastserve serve --port 0` subprocess; `url` is read from its start-up line."""

    proc: subprocess.Popen[bytes]
    log_path: Path
    url: str = ""
    args: list[str] = field(default_factory=list)

    @property
    def v1(self) -> str:
        return self.url + "/v1"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def metrics(self) -> dict[str, float]:
        """`/metrics` as {sample name with labels: value}."""
        text = httpx.get(self.url + "/metrics", timeout=10).text
        out: dict[str, float] = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                name, _, value = line.rpartition(" ")
                out[name] = float(value)
        return out

    def wait_idle(self, timeout_s: float = 10.0) -> dict[str, float]:
        """`/metrics` once no request runs or waits and every KV block is free (or the
        deadline passed: the caller asserts what it needs)."""
        deadline = time.monotonic() + timeout_s
        while True:
            m = self.metrics()
            idle = (m["fastserve_requests_running"] == 0 and m["fastserve_requests_waiting"] == 0
                    and m["fastserve_kv_blocks_free"] == m["fastserve_kv_blocks_total"])
            if idle or time.monotonic() > deadline:
                return m
            time.sleep(0.05)

    def stop(self, timeout_s: float = 60.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def start_server(tmp_dir: Path, *args: str, env: dict[str, str] | None = None,
                 module: str = "fastserve.cli") -> ServerProcess:
    """Start `python -m fastserve.cli serve --port 0 --dtype TEST_DTYPE ARGS` and wait for
    /health (`module`: another entry point that runs the same command)."""
    log_path = tmp_dir / f"server-{time.monotonic_ns()}.log"
    cmd = [sys.executable, "-m", module, "serve", "--port", "0", "--dtype", TEST_DTYPE,
           "--no-access-log", *args]
    full_env = {**os.environ, **(env or {})}
    full_env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), full_env.get("PYTHONPATH")]))
    log = log_path.open("wb")
    proc = subprocess.Popen(cmd, cwd=REPO, env=full_env, stdout=log, stderr=subprocess.STDOUT)
    log.close()
    server = ServerProcess(proc, log_path, args=list(args))
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}:\n{server.log()}")
        match = _URL_RE.search(server.log())
        if match:
            server.url = match.group(1)
            if httpx.get(server.url + "/health", timeout=10).status_code == 200:
                return server
        time.sleep(0.1)
    server.stop()
    raise RuntimeError(f"server did not start within {START_TIMEOUT_S} s:\n{server.log()}")


def managed(server: ServerProcess) -> Iterator[ServerProcess]:
    try:
        yield server
    finally:
        code = server.stop()
        assert code == 0, f"server exited with {code}:\n{server.log()[-3000:]}"


def with_template(tmp_dir: Path, model: Path, name: str, chat_template: str) -> Path:
    """A checkpoint like `model` (its files linked, not copied) whose chat template is
    `chat_template`: what a model family's template does, on the tiny model."""
    out = tmp_dir / name
    out.mkdir(exist_ok=True)
    for f in model.iterdir():
        if f.name not in ("chat_template.jinja", "tokenizer_config.json") and not (out / f.name).exists():
            (out / f.name).symlink_to(f)
    config = json.loads((model / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    (out / "chat_template.jinja").write_text(chat_template)
    return out
