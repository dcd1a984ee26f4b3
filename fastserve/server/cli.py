"""`fastserve serve [MODEL]`: start-up, the uvicorn main loop, and a graceful shutdown.

Start-up binds the address (so a taken port fails at once), loads the model, then listens and
prints the URL. SIGTERM or Ctrl-C starts a drain: the listener stays open, `/health` and new
requests get 503 (code `shutdown`, so a load balancer routes elsewhere), running requests
finish within `--grace-period-s` (then the engine ends them); then the server closes its
connections, stops the engine and exits 0. A second signal stops listening at once.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import socket
from collections.abc import Coroutine
from dataclasses import dataclass
from types import FrameType
from typing import TYPE_CHECKING, Any

from fastserve.args import add_engine_args, engine_config_from_args
from fastserve.logs import configure_logging
from fastserve.server import reasoning
from fastserve.server.tools import AUTO, FORMATS

if TYPE_CHECKING:  # the web stack is imported only when serving (keeps `fastserve -h` fast)
    import uvicorn
    from fastapi import FastAPI

    from fastserve.engine.async_llm import AsyncLLM

DEFAULT_HOST = "127.0.0.1"  # NOTE: never all interfaces unless asked (`--host 0.0.0.0`)
DEFAULT_PORT = 8000
API_KEY_ENV = "FASTSERVE_API_KEY"
# How long uvicorn waits, after the drain, for the streams the engine has just ended.
_CLOSE_MARGIN_S = 5.0


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
    # A server runs the faster dtype for its machine unless told (measured on a CPU:
    # executor/dtype_choice.py); the Python API stays float32 unless asked.
    add_engine_args(p, skip=("model",), defaults={"dtype": "auto"})
    p.set_defaults(func=_serve)


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
    try:
        print(f"fastserve: loading {config.model.model or 'the built-in tiny model'} ...", flush=True)
        llm = AsyncLLM(config)
        app = build_app(llm, name, api_key=opts.api_key, max_body_bytes=opts.max_body_bytes,
                        tool_call_parser=opts.tool_call_parser,
                        responses_store_mib=opts.responses_store_mib,
                        reasoning_parser=opts.reasoning_parser,
                        trust_request_chat_template=opts.trust_request_chat_template)
        return _run(_main_loop(app, llm, sock, name, opts))
    finally:
        sock.close()


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
    if server.should_exit:
        await draining
    else:  # the server never ran
        draining.cancel()
        await llm.shutdown(grace_s=0)
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


async def _shutdown_on_exit(server: uvicorn.Server, drain: _Drain, llm: AsyncLLM, grace_s: float) -> None:
    """Once a signal comes: drain (the listener stays open; `/health` and new requests get
    503), let running requests finish within `grace_s`, end the rest (each stream gets its
    finish and usage chunks, an error event with code `shutdown` and `[DONE]`), then stop
    the server."""
    while not (drain.requested or server.should_exit):
        await asyncio.sleep(0.05)
    print(f"fastserve: draining (up to {grace_s:g} s); /health answers 503", flush=True)
    await llm.shutdown(grace_s=grace_s)
    server.should_exit = True


def _bind(host: str, port: int) -> socket.socket:
    """The listening socket's address, bound now (uvicorn listens on it once the model is up)."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, kind, proto)
    except OSError as exc:
        raise ValueError(f"cannot listen on {host}:{port}: {exc}") from None
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError as exc:
        sock.close()
        raise ValueError(f"cannot listen on {host}:{port}: {exc.strerror}") from None
    return sock


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def _ignore(sig: int, frame: FrameType | None) -> None:
    """Stands in for the default handler while uvicorn owns the signals (see `_main_loop`)."""
