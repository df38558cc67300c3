"""A minimal HTTP/1.0 server and client on asyncio, for ``/metrics`` and ``/health``.

Requests are ``GET PATH``; each answer closes its connection. The server runs on the
process's own event loop: a loop that is stuck answers nothing, which is what a liveness
probe is for. A request that does not arrive whole within ``REQUEST_TIMEOUT_S`` is dropped.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Mapping

log = logging.getLogger("echo2.observe")

REQUEST_TIMEOUT_S = 2.0
"""Seconds a client gets to send its request line and headers."""
_MAX_REQUEST_BYTES = 8192

Response = tuple[int, str, bytes]
"""``(status, content type, body)``."""
Route = Callable[[], Response]


class ServeError(OSError):
    """The port cannot be listened on (in use, not permitted)."""


_REASONS = {
    200: "OK",
    404: "Not Found",
    405: "Method Not Allowed",
    500: "Internal Server Error",
    503: "Service Unavailable",
}


async def serve(port: int, routes: Mapping[str, Route], *, host: str = "0.0.0.0") -> asyncio.Server:
    """Listen on ``port`` (0: any free one; read ``server.sockets``); ``routes`` map a path to its answer."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), REQUEST_TIMEOUT_S)
            status, content_type, body = _answer(head[:_MAX_REQUEST_BYTES], routes)
            writer.write(
                f"HTTP/1.0 {status} {_REASONS.get(status, '')}\r\nContent-Type: {content_type}\r\n"
                f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode()
                + body
            )
            await writer.drain()
        except (TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError):
            pass  # a client that went away or never asked: nothing to answer
        finally:
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()

    try:
        return await asyncio.start_server(handle, host, port, reuse_address=True)
    except OSError as exc:
        raise ServeError(exc.errno, f"cannot serve /metrics and /health on port {port}: {exc.strerror}") from exc


def _answer(head: bytes, routes: Mapping[str, Route]) -> Response:
    method, _, rest = head.partition(b" ")
    path = rest.partition(b" ")[0].decode("latin-1").partition("?")[0]
    if method != b"GET":
        return 405, "text/plain", b"GET only\n"
    route = routes.get(path)
    if route is None:
        return 404, "text/plain", f"no {path}; try {', '.join(sorted(routes))}\n".encode()
    try:
        return route()
    except Exception as exc:  # a bug in one answer must not take the server (or the process) down
        log.exception("GET %s failed", path)
        return 500, "text/plain", f"{type(exc).__name__}: {exc}\n".encode()


async def get(port: int, path: str, timeout_s: float, *, host: str = "127.0.0.1") -> tuple[int, bytes]:
    """``GET path``: ``(status, body)``. Raises ``OSError`` or ``TimeoutError`` when no answer
    comes within ``timeout_s`` (a stopped or stuck process)."""

    async def request() -> tuple[int, bytes]:
        reader, writer = await asyncio.open_connection(host, port)
        try:
            writer.write(f"GET {path} HTTP/1.0\r\nHost: {host}\r\n\r\n".encode())
            await writer.drain()
            response = await reader.read()
        finally:
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()
        status_line, _, rest = response.partition(b"\r\n")
        parts = status_line.split(b" ")
        if len(parts) < 2 or not parts[1].isdigit():
            raise ConnectionError(f"not an HTTP answer from port {port}: {status_line[:80]!r}")
        return int(parts[1]), rest.partition(b"\r\n\r\n")[2]

    return await asyncio.wait_for(request(), timeout_s)
