"""How long running streams stall while one structured request's grammar compiles.

Starts `fastserve serve` (the tiny model) from `--source` (a checkout; default this one),
runs greedy streams, sends one grammar request (the 30 KB EBNF of 2,000 `("a" | "b")*`, or a
300-property JSON schema), and prints the streams' longest gap between tokens before it and
while it is in flight (watched for at most `--watch-s`: a frozen engine shows as a gap of at
least that). Then SIGTERM, and how the server ended (killed if it does not exit in 30 s).

    python benchmarks/serving/grammar_stream_gaps.py --grammar ebnf
    python benchmarks/serving/grammar_stream_gaps.py --grammar json300 --source /tmp/old-checkout
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

EBNF_30KB = "root ::= " + " ".join(['("a" | "b")*'] * 2000)
SCHEMA_300 = {"type": "object", "properties": {f"field_{i}": {"type": "string", "maxLength": 4}
                                               for i in range(300)},
              "required": [f"field_{i}" for i in range(300)]}
_URL_RE = re.compile(r"serving .* at (http://127\.0\.0\.1:\d+)/v1")


def _start(source: Path, log: Path, extra: list[str]) -> tuple[subprocess.Popen[bytes], str]:
    env = {**os.environ, "PYTHONPATH": str(source)}
    with log.open("wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "fastserve.cli", "serve", "--port", "0",
                                 "--no-warmup", "--no-startup-profile", "--no-access-log",
                                 "--dtype", "float32", *extra],
                                cwd=source, env=env, stdout=out, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        match = _URL_RE.search(log.read_text(errors="replace"))
        if match:
            return proc, match.group(1)
        if proc.poll() is not None:
            raise SystemExit(f"the server exited:\n{log.read_text()}")
        time.sleep(0.1)
    raise SystemExit("the server did not start")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--grammar", choices=["ebnf", "json300"], default="ebnf")
    ap.add_argument("--source", type=Path, default=Path(__file__).resolve().parents[2])
    ap.add_argument("--streams", type=int, default=3)
    ap.add_argument("--watch-s", type=float, default=60.0)
    ap.add_argument("--server-arg", action="append", default=[],
                    help="extra `fastserve serve` flags (repeatable)")
    args = ap.parse_args()
    log = Path(tempfile.mkdtemp()) / "server.log"
    proc, url = _start(args.source, log, args.server_arg)
    arrivals: list[list[float]] = []
    stop = threading.Event()

    def read(i: int) -> None:
        body = {"model": "tiny", "prompt": f"Stream {i}", "max_tokens": 1500, "temperature": 0,
                "ignore_eos": True, "stream": True}
        while not stop.is_set():
            times: list[float] = []
            arrivals.append(times)
            try:
                with httpx.stream("POST", url + "/v1/completions", json=body, timeout=None) as resp:
                    for _line in resp.iter_lines():
                        times.append(time.monotonic())
                        if stop.is_set():
                            return
            except httpx.HTTPError:
                return

    def max_gap(start: float, end: float) -> float:
        gaps = [min(b, end) - max(a, start) for times in arrivals
                for a, b in zip(times, [*times[1:], end]) if a < end and b > start]
        return max(gaps, default=float("nan"))

    threads = [threading.Thread(target=read, args=(i,), daemon=True) for i in range(args.streams)]
    for t in threads:
        t.start()
    time.sleep(3.0)
    sent = time.monotonic()
    body: dict[str, object] = {"model": "tiny", "prompt": "Answer:", "max_tokens": 16}
    if args.grammar == "ebnf":
        body["structured_outputs"] = {"grammar": EBNF_30KB}
    else:
        body["guided_json"] = SCHEMA_300
    result: dict[str, object] = {}

    def ask() -> None:
        try:
            resp = httpx.post(url + "/v1/completions", json=body, timeout=args.watch_s)
            result.update(status=resp.status_code, body=resp.text[:200])
        except httpx.HTTPError as exc:
            result.update(status=type(exc).__name__)
        result["s"] = time.monotonic() - sent

    asker = threading.Thread(target=ask, daemon=True)
    asker.start()
    asker.join(args.watch_s)
    end = time.monotonic()
    print(json.dumps({
        "grammar": args.grammar, "source": str(args.source),
        "max_gap_before_s": round(max_gap(sent - 2.5, sent), 3),
        "max_gap_while_compiling_s": round(max_gap(sent, end), 3),
        "watched_s": round(end - sent, 1), "grammar_request": result}))
    stop.set()
    proc.send_signal(signal.SIGTERM)
    term = time.monotonic()
    try:
        code: int | str = proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        code = "still running 30 s after SIGTERM: killed"
    print(json.dumps({"exit": code, "exit_s": round(time.monotonic() - term, 1)}))


if __name__ == "__main__":
    main()
