"""Limits on what a client may hold of the server before its request is even read: how long
its request's headers and whole body may take to arrive, and how many connections may be open
at once. uvicorn has neither: a connection that never finishes its headers (or sends a body
shorter than its Content-Length) holds its socket and file descriptor forever, and it accepts
every connection it is offered.

Both are enforced in uvicorn's HTTP protocol object (`limited_protocol` subclasses the one it
would pick), the one place that sees a connection open, its bytes arrive and its request
complete, with no task per connection: a timer per request being read, cancelled once it is.
"""

from __future__ import annotations

import asyncio
import json
import logging
import resource
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)

DEFAULT_HEADER_TIMEOUT_S = 10.0
DEFAULT_READ_TIMEOUT_S = 60.0
DEFAULT_MAX_CONNECTIONS = 4096
# File descriptors the process needs besides its connections (checkpoint files, the
# listening socket, logs, the kernels' libraries).
_SPARE_FDS = 256


@dataclass(frozen=True)
class HTTPLimits:
    """What one client may hold: the times its request may take to arrive, and the open
    connections of all clients together."""

    # From a connection's opening (or the first byte of its next request) to the end of the
    # request's headers: a client that stalls there holds a socket and sends nothing usable.
    header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S
    # From the same start to the last byte of its body (the body limit, 1 MiB by default,
    # takes 17 KiB/s to send in time); the response may then take as long as it needs.
    read_timeout_s: float = DEFAULT_READ_TIMEOUT_S
    # Connections open at once; the next one gets a 503 and is closed.
    max_connections: int = DEFAULT_MAX_CONNECTIONS

    def __post_init__(self) -> None:
        if not self.header_timeout_s > 0:
            raise ValueError(f"http_header_timeout_s must be > 0, got {self.header_timeout_s}")
        if not self.read_timeout_s >= self.header_timeout_s:
            raise ValueError(f"http_read_timeout_s ({self.read_timeout_s}) must be >= "
                             f"http_header_timeout_s ({self.header_timeout_s})")
        if self.max_connections < 1:
            raise ValueError(f"max_connections must be >= 1, got {self.max_connections}")


def limited_protocol(limits: HTTPLimits) -> type[asyncio.Protocol]:
    """uvicorn's HTTP protocol class (httptools, else h11) with `limits` enforced: pass it
    as `uvicorn.Config(http=...)`."""
    from uvicorn.protocols.http.auto import AutoHTTPProtocol

    class LimitedProtocol(AutoHTTPProtocol):  # type: ignore[misc,valid-type]
        """NOTE: reads uvicorn's `cycle` (the request being served; a new one once a
        request's headers are parsed; `more_body` False once its body is) and `connections`,
        in both its HTTP implementations alike."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self._deadline: asyncio.TimerHandle | None = None
            self._started_s = 0.0  # when the request being read began
            self._before: Any = None  # the cycle before it: a new one means headers are in
            self._in_body = False  # its headers are in, its body is not

        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            super().connection_made(transport)
            if len(self.connections) > limits.max_connections:
                self._refuse(503, f"the server has {limits.max_connections} connections open, "
                             "its limit (--max-connections): retry later", "too_many_connections")
                return
            self._arm()

        def data_received(self, data: bytes) -> None:
            if self._deadline is None and (self.cycle is None or self.cycle.response_complete):
                self._arm()  # the first bytes of a kept-alive connection's next request
            super().data_received(data)
            self._advance()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _arm(self) -> None:
            self._disarm()
            self._started_s = self.loop.time()
            self._before, self._in_body = self.cycle, False
            self._deadline = self.loop.call_at(self._started_s + limits.header_timeout_s,
                                               self._expire)

        def _disarm(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None

        def _advance(self) -> None:
            """After parsing: once the headers are in, the deadline is the whole request's;
            once the body is, there is none."""
            if self._deadline is None:
                return
            if not self._in_body and self.cycle is self._before:
                return  # the headers are still coming
            if self.cycle.more_body and not self._in_body:
                self._disarm()
                self._in_body = True
                self._deadline = self.loop.call_at(self._started_s + limits.read_timeout_s,
                                                   self._expire)
            elif not self.cycle.more_body:
                self._disarm()

        def _expire(self) -> None:
            self._deadline = None
            if self.transport.is_closing():
                return
            what, limit, flag = (("body", limits.read_timeout_s, "--http-read-timeout-s")
                                 if self._in_body else
                                 ("headers", limits.header_timeout_s, "--http-header-timeout-s"))
            logger.debug("closing a connection from %s: its request's %s did not arrive within "
                        "%g s (%s)", _peer(self.client), what, limit, flag)
            if self._in_body and self.cycle.response_started:
                self.transport.close()  # too late for a response of our own
                return
            self._refuse(408, f"the request's {what} did not arrive within {limit:g} s ({flag})",
                         "request_timeout")

        def _refuse(self, status: int, message: str, code: str) -> None:
            """Answer `status` with an OpenAI error body, and close the connection."""
            body = json.dumps({"error": {"message": message, "type": "invalid_request_error"
                                         if status < 500 else "server_error",
                                         "param": None, "code": code}}).encode()
            reason = {408: "Request Timeout", 503: "Service Unavailable"}[status]
            head = (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\n"
                    f"content-length: {len(body)}\r\nconnection: close\r\n"
                    + ("retry-after: 1\r\n" if status == 503 else "") + "\r\n")
            self.transport.write(head.encode() + body)
            self.transport.close()

    return LimitedProtocol


def fit_open_files(max_connections: int) -> None:
    """Raise the process's open-file limit (up to its hard limit) so that `max_connections`
    sockets fit; warn if they cannot, since accept() then fails instead of the polite 503."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = max_connections + _SPARE_FDS
    if soft != resource.RLIM_INFINITY and soft < need:
        target = need if hard == resource.RLIM_INFINITY else min(need, hard)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass
    if soft != resource.RLIM_INFINITY and soft < need:
        logger.warning("the open-file limit (ulimit -n) is %d: fewer than --max-connections "
                       "%d connections fit", soft, max_connections)


def _peer(client: tuple[str, int] | None) -> str:
    return f"{client[0]}:{client[1]}" if client else "a client"
