"""The ingress's HTTP client to the replicas: the client's request passed on as it came, and
the replica's answer read back as raw body bytes (SSE streams are not decoded).

One aiohttp session per ingress keeps connections to every replica alive between requests
(a stream holds its own connection while it runs). Header names and values pass unchanged
but for the hop-by-hop ones, which belong to each connection.
"""

from __future__ import annotations

from dataclasses import dataclass

import aiohttp
from yarl import URL

# The ingress names itself to the replicas in this header; each counts the requests it takes in
# per sender (`ReplicaStats.admitted`), so the ingress's router knows which have arrived. A
# client's own is replaced.
SENDER_HEADER = b"x-fastserve-ingress"
# Headers of one connection, not of the request or response (RFC 9110 7.6.1); `host` and
# `content-length` are set by the client again, `date` and `server` by the ingress's uvicorn
# (and the sender's by the ingress).
_HOP_BY_HOP = frozenset({b"connection", b"keep-alive", b"proxy-connection", b"te", b"trailer",
                         b"transfer-encoding", b"upgrade", b"proxy-authorization",
                         b"proxy-authenticate", b"host", b"content-length", SENDER_HEADER})
_NOT_FROM_REPLICA = frozenset({b"connection", b"keep-alive", b"transfer-encoding", b"trailer",
                               b"upgrade", b"date", b"server"})
# An idle connection to a replica is closed after this long (before the replica's own limit,
# `replica._KEEP_ALIVE_S`: a connection the ingress reuses is never one the replica closes).
_KEEP_ALIVE_S = 60.0
_CONNECT_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class ForwardedRequest:
    """What the replica's app needs of the client's request."""

    method: str
    path: str  # decoded, as ASGI gives it (what the ingress routes by)
    raw_path: bytes  # as the client sent it (what the replica is sent)
    query_string: bytes
    headers: tuple[tuple[bytes, bytes], ...]  # raw, lower-case names as the client sent them
    body: bytes


class ReplicaClient:
    """Opens each forwarded request on a replica; made on the ingress's event loop."""

    def __init__(self, sender: str | None = None) -> None:
        self._session: aiohttp.ClientSession | None = None
        self.sender = sender  # sent as `SENDER_HEADER` with every request (None: not sent)

    @property
    def session(self) -> aiohttp.ClientSession:
        """Made at first use, on the loop that serves the ingress (a session is bound to its
        loop)."""
        if self._session is None:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=_KEEP_ALIVE_S),
                # No overall limit: a stream lasts as long as its tokens take.
                timeout=aiohttp.ClientTimeout(total=None, sock_connect=_CONNECT_TIMEOUT_S),
                cookie_jar=aiohttp.DummyCookieJar(),
                auto_decompress=False,  # the body goes to the client as the replica encoded it
                skip_auto_headers=("Accept", "Accept-Encoding", "User-Agent"))
        return self._session

    async def open(self, url: str, req: ForwardedRequest) -> aiohttp.ClientResponse:
        """Send `req` to the replica at `url`; the response once its headers are in.
        Raises aiohttp.ClientError or OSError when the replica cannot be reached or fails."""
        target = url + (req.raw_path or req.path.encode()).decode("latin-1")
        if req.query_string:
            target += "?" + req.query_string.decode("latin-1")
        headers = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in req.headers
                   if k.lower() not in _HOP_BY_HOP]
        if self.sender is not None:
            headers.append((SENDER_HEADER.decode(), self.sender))
        return await self.session.request(req.method, URL(target, encoded=True),
                                          headers=headers, data=req.body or None,
                                          allow_redirects=False)

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()


def response_headers(resp: aiohttp.ClientResponse) -> list[tuple[bytes, bytes]]:
    """The replica's response headers, for the ingress's response to its client."""
    return [(k.lower(), v) for k, v in resp.raw_headers if k.lower() not in _NOT_FROM_REPLICA]
