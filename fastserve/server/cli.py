"""`fastserve serve [MODEL]`: start-up, the uvicorn main loop, and a graceful shutdown.

Start-up binds the address (so a taken port fails at once), loads the model, then listens and
prints the URL. SIGTERM or Ctrl-C starts a drain: the listener stays open, `/health` and new
requests get 503 (code `shutdown`, so a load balancer routes elsewhere), running requests
finish within `--grace-period-s` (then the engine ends them); then the server closes its
connections, stops the engine and exits. A second signal stops listening at once.

The exit status: 0 when every request drained; `EXIT_ABANDONED` (3) when the grace period ran
out with requests still running, or the engine loop was stuck in an iteration (the process
exits anyway, within about `_STUCK_EXIT_S` of the grace period's end). A signal during
start-up stops the processes it started (the CPU kernels' build) and ends with 128 + signal.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import errno
import math
import os
import signal
import socket
import sys
import threading
from collections.abc import Coroutine
from dataclasses import dataclass, field
from types import FrameType
from typing import TYPE_CHECKING, Any

from fastserve.args import add_engine_args, engine_config_from_args
from fastserve.children import stop_children_on_signal
from fastserve.logs import configure_logging
from fastserve.server import reasoning
from fastserve.server.http_limits import (
    DEFAULT_HEADER_TIMEOUT_S,
    DEFAULT_MAX_CONNECTIONS,
    DEFAULT_READ_TIMEOUT_S,
    HTTPLimits,
    fit_open_files,
    limited_protocol,
)
from fastserve.server.tools import AUTO, FORMATS

if TYPE_CHECKING:  # the web stack is imported only when serving (keeps `fastserve -h` fast)
    import uvicorn
    from fastapi import FastAPI

    from fastserve.engine.async_llm import AsyncLLM

DEFAULT_HOST = "127.0.0.1"  # NOTE: never all interfaces unless asked (`--host 0.0.0.0`)
DEFAULT_PORT = 8000
API_KEY_ENV = "FASTSERVE_API_KEY"
_BACKLOG = 2048  # uvicorn's default
# How long uvicorn waits, after the drain, for the streams the engine has just ended.
_CLOSE_MARGIN_S = 5.0
# The exit status of a shutdown that had to end running requests or leave a stuck engine.
EXIT_ABANDONED = 3
# After the grace period: how long the engine loop's iteration may take to end, and when the
# process exits whatever it is doing (a backstop timer; SIGALRM's default action a moment
# later, should a thread hold the interpreter's lock).
_ENGINE_JOIN_S = 2.0
_STUCK_EXIT_S = 4.5


@dataclass(frozen=True)
class ServeOptions:
    """The HTTP side of `fastserve serve` (the engine has its own EngineConfig)."""

    host: str = DEFAULT_HOST
    port: int = DEFAULT_PORT  # 0 = any free port (the printed URL shows which)
    served_model_name: str | None = None  # None = the model directory, or "tiny"
    api_key: str | None = None
    max_body_bytes: int = 1 << 20
    grace_period_s: float = 30.0
    log_level: str = "info"
    access_log: bool = True
    tool_call_parser: str = "auto"  # the format of the model's tool calls (server/tools)
    responses_store_mib: float = 64.0  # the Responses API's stored responses (0: none)
    reasoning_parser: str = "auto"  # split <think> blocks from the answer (server/reasoning)
    trust_request_chat_template: bool = False  # chat requests may bring their own template
    metrics_require_key: bool = False  # /metrics and the API's documents need the key too
    # What a client may hold before its request is read: read deadlines, open connections.
    http_limits: HTTPLimits = field(default_factory=HTTPLimits)

    def __post_init__(self) -> None:
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.max_body_bytes <= 0:
            raise ValueError(f"max_body_bytes must be > 0, got {self.max_body_bytes}")
        if self.responses_store_mib < 0:
            raise ValueError(f"responses_store_mib must be >= 0, got {self.responses_store_mib}")
        if self.grace_period_s < 0:
            raise ValueError(f"grace_period_s must be >= 0, got {self.grace_period_s}")
        if self.api_key is not None and not self.api_key.strip():
            raise ValueError("api_key must not be empty (omit it to serve without a key)")
        if self.metrics_require_key and self.api_key is None:
            raise ValueError(f"--metrics-require-key needs a key: --api-key or ${API_KEY_ENV}")


def add_serve_parser(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = subparsers.add_parser(
        "serve",
        help="serve the OpenAI-compatible HTTP API",
        description="Serve /v1/completions, /v1/chat/completions, /v1/models, /health, /metrics.",
    )
    p.add_argument(
        "model", nargs="?", default=None,
        help="Hugging Face model directory (default: the built-in tiny preset)",
    )
    p.add_argument("--host", default=DEFAULT_HOST, help=f"address to bind (default: {DEFAULT_HOST})")
    p.add_argument("--port", type=int, default=DEFAULT_PORT,
                   help=f"port to listen on; 0 = any free port (default: {DEFAULT_PORT})")
    p.add_argument(
        "--served-model-name", default=None,
        help="the model name clients send (default: MODEL as given, or 'tiny')",
    )
    p.add_argument(
        "--api-key", default=os.environ.get(API_KEY_ENV) or None,
        help=f"require 'Authorization: Bearer KEY' on /v1 routes (default: ${API_KEY_ENV})",
    )
    p.add_argument("--metrics-require-key", action="store_true",
                   help="put /metrics, /docs, /redoc and /openapi.json behind --api-key too: "
                   "they show the served model and adapters, its vocabulary size and context "
                   "length, the queues and KV cache, the dtype and CPU kernels chosen "
                   "(default: open)")
    p.add_argument("--max-body-bytes", type=int, default=1 << 20,
                   help="refuse larger request bodies with 413 (default: 1 MiB)")
    p.add_argument("--grace-period-s", type=float, default=30.0,
                   help="on SIGTERM, how long running requests may take to finish (default: 30)")
    p.add_argument("--log-level", default="info",
                   choices=["critical", "error", "warning", "info", "debug"],
                   help="the least severe log lines shown (default: info)")
    p.add_argument("--access-log", action=argparse.BooleanOptionalAction, default=True,
                   help="log one line per HTTP request (default: on)")
    p.add_argument("--tool-call-parser", default="auto", choices=[AUTO, *FORMATS],
                   help="how the model writes tool calls: hermes (<tool_call> blocks: Hermes, "
                   "Qwen 2.5/3), llama3_json (Llama 3.1-3.3), mistral (Mistral 7B v0.3, Nemo, "
                   "Small; the v11 name[ARGS] form where the template writes it), pythonic (Llama 3.2's pythonic template, Llama 4), or auto: read off the chat "
                   "template (default)")
    p.add_argument("--responses-store-mib", type=float, default=64.0,
                   help="memory for the Responses API's stored responses (previous_response_id, "
                   "GET /v1/responses/ID), least recently used dropped first; 0 stores none "
                   "(default: 64)")
    p.add_argument("--reasoning-parser", default="auto", choices=reasoning.NAMES,
                   help="reasoning models: return the <think> block as reasoning_content "
                   "(deepseek_r1 and qwen3 read the same blocks); auto: when the chat template "
                   "has them (default); none: the thinking stays in the content")
    p.add_argument("--trust-request-chat-template", action="store_true",
                   help="let chat requests bring their own Jinja chat template (chat_template); "
                   "rendering runs a client's template, sandboxed but unbounded in time "
                   "(default: refused with a 400)")
    p.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="accepted for vLLM's command lines; changes nothing here: requests with "
                   "tools may always leave tool_choice at auto and get the calls the model "
                   "writes parsed into tool_calls (by --tool-call-parser) (default: off, the "
                   "same)")
    _add_http_limit_args(p)
    # A server runs the faster dtype for its machine unless told (measured on a CPU:
    # executor/dtype_choice.py); the Python API stays float32 unless asked.
    add_engine_args(p, skip=("model",), defaults={"dtype": "auto"})
    p.set_defaults(func=_serve)


def _add_http_limit_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("slow or many clients")
    g.add_argument("--http-header-timeout-s", type=float, default=DEFAULT_HEADER_TIMEOUT_S,
                   help="a request's headers must arrive within this many seconds of the "
                   "connection opening (or, kept alive, of the request's first byte); else "
                   f"408 and the connection is closed (default: {DEFAULT_HEADER_TIMEOUT_S:g})")
    g.add_argument("--http-read-timeout-s", type=float, default=DEFAULT_READ_TIMEOUT_S,
                   help="the whole request, body included, must arrive within this many "
                   "seconds of the same start; else 408 and the connection is closed (the "
                   f"response may take as long as it needs) (default: {DEFAULT_READ_TIMEOUT_S:g})")
    g.add_argument("--max-connections", type=int, default=DEFAULT_MAX_CONNECTIONS,
                   help="most connections open at once; the next one gets a 503 and is closed "
                   "(the open-file limit is raised to fit, up to its hard limit) "
                   f"(default: {DEFAULT_MAX_CONNECTIONS})")


def _serve(args: argparse.Namespace) -> int:
    opts = ServeOptions(
        host=args.host,
        port=args.port,
        served_model_name=args.served_model_name,
        api_key=args.api_key,
        max_body_bytes=args.max_body_bytes,
        grace_period_s=args.grace_period_s,
        log_level=args.log_level,
        access_log=args.access_log,
        tool_call_parser=args.tool_call_parser,
        responses_store_mib=args.responses_store_mib,
        reasoning_parser=args.reasoning_parser,
        trust_request_chat_template=args.trust_request_chat_template,
        metrics_require_key=args.metrics_require_key,
        http_limits=HTTPLimits(header_timeout_s=args.http_header_timeout_s,
                               read_timeout_s=args.http_read_timeout_s,
                               max_connections=args.max_connections),
    )
    return serve(opts, args)


def serve(opts: ServeOptions, engine_args: argparse.Namespace) -> int:
    """Start-up, main loop, shutdown. Returns the process exit code."""
    from fastserve.engine.async_llm import AsyncLLM
    from fastserve.server.app import build_app

    configure_logging(opts.log_level)
    config = engine_config_from_args(engine_args)
    name = opts.served_model_name or config.model.model or "tiny"
    sock = _bind(opts.host, opts.port)  # before the slow part: a taken port fails at once
    fit_open_files(opts.http_limits.max_connections)
    try:
        print(f"fastserve: loading {config.model.model or 'the built-in tiny model'} ...", flush=True)
        with stop_children_on_signal():  # e.g. the CPU kernels' first build (ninja, the compiler)
            llm = AsyncLLM(config)
        app = build_app(llm, name, api_key=opts.api_key, max_body_bytes=opts.max_body_bytes,
                        tool_call_parser=opts.tool_call_parser,
                        responses_store_mib=opts.responses_store_mib,
                        reasoning_parser=opts.reasoning_parser,
                        trust_request_chat_template=opts.trust_request_chat_template,
                        metrics_require_key=opts.metrics_require_key)
        code = _run(_main_loop(app, llm, sock, name, opts))
    finally:
        sock.close()
    if code == EXIT_ABANDONED:  # NOTE: a stuck thread (the engine's, a worker's) must not hold the exit
        _exit_now(code)
    return code


def _run(main: Coroutine[Any, Any, int]) -> int:
    """Run the server's event loop, on uvloop when it is installed (it comes with
    `uvicorn[standard]`): streaming costs the loop CPU per token, which the engine shares."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    return uvloop.run(main)


async def _main_loop(app: FastAPI, llm: AsyncLLM, sock: socket.socket, name: str, opts: ServeOptions) -> int:
    import uvicorn

    drain = _Drain()
    server = _draining_server(
        uvicorn.Config(
            app,
            log_level=opts.log_level,
            # None: uvicorn's loggers write through the root's handler (timestamped lines)
            # instead of its own format.
            log_config=None,
            access_log=opts.access_log,
            lifespan="off",
            http=limited_protocol(opts.http_limits),
            # NOTE: a float works (it feeds asyncio.wait_for); None would mean "wait forever".
            # A backstop only: uvicorn stops after the drain, when the engine has ended the
            # open streams itself (each with an error event and [DONE]).
            timeout_graceful_shutdown=_CLOSE_MARGIN_S,  # type: ignore[arg-type]
        ),
        drain,
    )
    # uvicorn handles SIGTERM/SIGINT while serving and re-raises the signal afterwards so the
    # previous handler runs; make that handler a no-op so a graceful shutdown exits 0.
    previous = {sig: signal.signal(sig, _ignore) for sig in (signal.SIGTERM, signal.SIGINT)}
    draining = asyncio.create_task(_shutdown_on_exit(server, drain, llm, opts.grace_period_s))
    try:
        serving, url = await start_serving(server, sock)
        if url is not None:
            print(f"fastserve: serving {name!r} at {url}/v1 "
                  f"(health: /health, metrics: /metrics, docs: /docs)", flush=True)
        await serving  # returns once a signal has stopped the server and requests drained
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    drained = True
    if server.should_exit:
        drained = await draining
    else:  # the server never ran
        draining.cancel()
        await llm.shutdown(grace_s=0, join_s=_ENGINE_JOIN_S)
    if not drained:
        print(f"fastserve: shut down, abandoning running work (exit status {EXIT_ABANDONED})",
              flush=True)
        return EXIT_ABANDONED
    print("fastserve: shut down", flush=True)
    return 0 if server.started else 1


async def start_serving(server: uvicorn.Server, sock: socket.socket
                        ) -> tuple[asyncio.Task[None], str | None]:
    """Start `server` on `sock`: the task serving it, and its URL ("http://host:port") once it
    has started (None when it stopped before that)."""
    serving = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started and not serving.done():
        await asyncio.sleep(0.02)
    if not server.started:
        return serving, None
    host, port = sock.getsockname()[:2]
    return serving, f"http://{_url_host(host)}:{port}"


@dataclass
class _Drain:
    requested: bool = False  # set by the first SIGTERM/SIGINT (a signal handler sets a flag only)


def _draining_server(config: uvicorn.Config, drain: _Drain) -> uvicorn.Server:
    """A uvicorn server whose first SIGTERM/SIGINT requests a drain instead of closing the
    listener: `_shutdown_on_exit` stops it once running requests are done."""
    import uvicorn

    class DrainingServer(uvicorn.Server):
        def handle_exit(self, sig: int, frame: FrameType | None) -> None:
            if drain.requested:  # a second signal: stop listening now, as uvicorn does
                super().handle_exit(sig, frame)
            drain.requested = True

    return DrainingServer(config)


async def _shutdown_on_exit(server: uvicorn.Server, drain: _Drain, llm: AsyncLLM, grace_s: float) -> bool:
    """Once a signal comes: drain (the listener stays open; `/health` and new requests get
    503), let running requests finish within `grace_s`, end the rest (each stream gets its
    finish and usage chunks, an error event with code `shutdown` and `[DONE]`), then stop
    the server. Returns whether all drained. NOTE: from here the process exits within
    `grace_s + _STUCK_EXIT_S` whatever its threads do (`_exit_after`)."""
    while not (drain.requested or server.should_exit):
        await asyncio.sleep(0.05)
    print(f"fastserve: draining (up to {grace_s:g} s); /health answers 503", flush=True)
    _exit_after(grace_s + _STUCK_EXIT_S)
    drained = await llm.shutdown(grace_s=grace_s, join_s=_ENGINE_JOIN_S)
    server.should_exit = True
    return drained


def _exit_after(delay_s: float) -> None:
    """End the process with EXIT_ABANDONED in `delay_s` if it has not ended by then; should
    no Python code run by then (a thread holding the interpreter's lock), SIGALRM ends it
    a few seconds later (status 128 + 14)."""
    timer = threading.Timer(delay_s, _exit_now, args=(EXIT_ABANDONED,))
    timer.daemon = True
    timer.start()
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGALRM, signal.SIG_DFL)
        signal.alarm(math.ceil(delay_s) + 3)


def _exit_now(code: int) -> None:
    """Exit at once with `code`, whatever other threads are doing (nothing waits for them)."""
    if code == EXIT_ABANDONED:
        print(f"fastserve: exiting with status {code}: work was abandoned", flush=True)
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


def _bind(host: str, port: int) -> socket.socket:
    """The listening socket, bound and listening now; uvicorn accepts on it once the model is
    up (connections made meanwhile wait in the backlog).

    NOTE: listen, not only bind: with SO_REUSEADDR two sockets may bind one port while
    neither listens, so a second server started at once would load its model and only then
    fail. Only one socket can listen on it."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, kind, proto)
    except OSError as exc:
        raise ValueError(f"cannot listen on {host}:{port} (--host, --port): {exc}") from None
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
        sock.listen(_BACKLOG)
    except OSError as exc:
        sock.close()
        taken = " (another server is listening there? pick another --port)" \
            if exc.errno == errno.EADDRINUSE else ""
        raise ValueError(f"cannot listen on {host}:{port} (--host, --port): "
                         f"{exc.strerror}{taken}") from None
    return sock


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def _ignore(sig: int, frame: FrameType | None) -> None:
    """Stands in for the default handler while uvicorn owns the signals (see `_main_loop`)."""
