"""`EngineChannel`: the server's lean HTTP/1.1 client for the engine's private channel.

The channel is the engine's Unix socket, or, where rank 0 runs on another machine (the
Ray launcher), a TCP port of rank 0 (`TcpEndpoint`): then every request carries the run's
bearer token, and everything else below is the same.

The episode gateway (`swarm_server.episodes`) forwards every begin, chat and end over
this channel. It was an `httpx.AsyncClient`; a profile of the server put httpx, httpcore,
h11 and anyio at a third of the server's CPU per proxied call (URL merging, cookies, auth
and redirect hooks, a pure-Python parser, a task group per read). The socket has one
peer, the engine's own uvicorn, so the channel needs a small part of HTTP:

- keep-alive connections, reused last-in first-out; an idle one is dropped after
  `idle_s` (below uvicorn's 5 s keep-alive, so the engine never closes one under a
  request), at most `max_connections` open (further requests wait for one);
- a request is written whole in one `write` (head and body; the body is bytes the
  caller already holds, forwarded as they are);
- the reply is parsed by httptools (llhttp, C; content-length and chunked bodies), read
  whole (`Reply.read`) or chunk by chunk as it arrives (`Reply.chunks`, for streamed
  chats), reading paused while more than `_HIGH_WATER` bytes wait for the consumer;
- every wait for the engine (connecting, the next bytes of a reply) is limited to
  `timeout_s`, like httpx's connect and read timeouts.

The engine may answer before it read the whole request (a chat over its size bound: 413
from `Content-Length`); the reply is read while the rest of the request is still being
written, so that answer arrives instead of a broken pipe.

Anything that keeps a reply from arriving (no socket, refused, reset, timeout, a reply
that is not HTTP) raises `ChannelError`; the gateway answers it with 409 "engine did not
answer". No redirects, cookies, proxies, TLS, compression or HTTP/2: the peer uses none.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httptools

__all__ = ["ChannelError", "ChannelTarget", "EngineChannel", "Reply", "TcpEndpoint"]

log = logging.getLogger(__name__)

#: A streamed reply's bytes waiting for the consumer before reading pauses.
_HIGH_WATER = 256 * 1024


@dataclass(frozen=True)
class TcpEndpoint:
    """Rank 0's private channel on TCP: every request must bear `token`."""

    host: str
    port: int
    token: str = field(repr=False)

    def __str__(self) -> str:
        return f"{self.host}:{self.port}"


#: Where the channel connects: the engine's Unix socket, or its TCP endpoint.
ChannelTarget = Path | TcpEndpoint


class ChannelError(Exception):
    """No reply from the engine. `reason` is short (e.g. `ConnectionRefusedError`)."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


class Reply:
    """One reply: `status` and `headers` (lower-case names) once the head arrived; then the
    body, read whole (`read`) or as it arrives (`chunks`). Read it to the end or `close` it:
    only a reply read to the end gives its connection back for the next request."""

    def __init__(self, conn: _Connection) -> None:
        self.status = 0
        self.headers: dict[str, str] = {}
        self._conn: _Connection | None = conn
        self._raw_headers: list[tuple[bytes, bytes]] = []
        self._chunks: deque[bytes] = deque()
        self._buffered = 0
        self._head_done = False
        self._complete = False
        self._keep_alive = False
        self._error: ChannelError | None = None
        self._waiter: asyncio.Future[None] | None = None

    async def read(self) -> bytes:
        """The whole body."""
        while not self._complete:
            await self._wait()
        body = b"".join(self._chunks)
        self._chunks.clear()
        self._finish()
        return body

    async def chunks(self) -> AsyncIterator[bytes]:
        """The body's chunks as they arrive (for a streamed reply); closes at the end."""
        try:
            while True:
                while self._chunks:
                    chunk = self._chunks.popleft()
                    self._buffered -= len(chunk)
                    self._conn_resume()
                    yield chunk
                if self._complete:
                    break
                await self._wait()
        finally:
            self._finish()

    def close(self) -> None:
        """Done with this reply; a body not read to the end costs the connection."""
        self._finish()

    # ------------------------------------------------------------------ the connection's side

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _fail(self, error: ChannelError) -> None:
        if self._error is None and not self._complete:
            self._error = error
            self._wake()

    async def _wait(self) -> None:
        if self._error is not None:
            raise self._error
        conn = self._conn
        if conn is None:
            raise ChannelError("closed", "the reply was closed before it was read")
        loop = conn.loop
        waiter = self._waiter = loop.create_future()
        timer = loop.call_later(conn.timeout_s, self._timed_out, waiter)
        try:
            await waiter
        finally:
            timer.cancel()
            self._waiter = None
        if self._error is not None:
            raise self._error

    def _timed_out(self, waiter: asyncio.Future[None]) -> None:
        if waiter is self._waiter and not waiter.done():
            conn = self._conn
            timeout = conn.timeout_s if conn is not None else 0.0
            self._fail(ChannelError("TimeoutError",
                                    f"no reply from the engine within {timeout:g} s"))
            if conn is not None:
                conn.abort()

    def _conn_resume(self) -> None:
        conn = self._conn
        if conn is not None and self._buffered <= _HIGH_WATER:
            conn.resume()

    def _finish(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.release(reusable=self._complete and self._keep_alive and self._error is None)


class _Connection(asyncio.Protocol):
    """One keep-alive connection to the engine; one request on it at a time."""

    def __init__(self, channel: EngineChannel, loop: asyncio.AbstractEventLoop) -> None:
        self.channel = channel
        self.loop = loop
        self.timeout_s = channel.timeout_s
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.closed = False
        self.idle_since = 0.0
        self.reply: Reply | None = None
        self._paused = False

    # ------------------------------------------------------------------ protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        reply = self.reply
        if reply is None:  # bytes nobody asked for: this connection cannot be trusted
            self.abort()
            return
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            reply._fail(ChannelError("RemoteProtocolError",
                                     f"the engine's reply is not HTTP/1.1: {exc}"))
            self.abort()

    def eof_received(self) -> bool:
        return False  # close our side too

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.closed:
            self.closed = True
            self.channel._lost(self)
        reply = self.reply
        if reply is not None:
            reason = type(exc).__name__ if exc is not None else "RemoteProtocolError"
            reply._fail(ChannelError(reason, "the engine closed the connection without a "
                                             "complete reply"))

    # ------------------------------------------------------------------ parser callbacks

    def on_header(self, name: bytes, value: bytes) -> None:
        if self.reply is not None:
            self.reply._raw_headers.append((name, value))

    def on_headers_complete(self) -> None:
        reply = self.reply
        if reply is not None:
            reply.status = self.parser.get_status_code()
            reply.headers = {k.decode("latin-1").lower(): v.decode("latin-1")
                             for k, v in reply._raw_headers}
            reply._keep_alive = self.parser.should_keep_alive()
            reply._head_done = True
            reply._wake()

    def on_body(self, body: bytes) -> None:
        reply = self.reply
        if reply is not None:
            reply._chunks.append(body)
            reply._buffered += len(body)
            if reply._buffered > _HIGH_WATER and not self._paused and self.transport:
                self._paused = True
                self.transport.pause_reading()
            reply._wake()

    def on_message_complete(self) -> None:
        reply = self.reply
        if reply is not None:
            reply._complete = True
            reply._wake()

    # ------------------------------------------------------------------ channel side

    async def send(self, head: bytes, body: bytes | None) -> Reply:
        """Write one request and wait for the reply's head."""
        reply = self.reply = Reply(self)
        transport = self.transport
        if transport is None or self.closed:
            raise ChannelError("ConnectionResetError", "the connection to the engine closed")
        if body is not None and len(body) > 65536:
            transport.write(head)  # no copy of a large body just to join it to its head
            transport.write(body)
        else:
            transport.write(head + body if body else head)
        try:
            while not reply._head_done:
                await reply._wait()
        except BaseException:
            reply._finish()
            raise
        return reply

    def resume(self) -> None:
        if self._paused and self.transport is not None and not self.closed:
            self._paused = False
            self.transport.resume_reading()

    def release(self, *, reusable: bool) -> None:
        self.reply = None
        if reusable and not self.closed:
            self.resume()
            self.channel._give_back(self)
        else:
            self.abort()

    def abort(self) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.close()


class EngineChannel:
    """Requests to one engine socket; see the module docstring."""

    def __init__(self, target: ChannelTarget, *, timeout_s: float, max_connections: int = 64,
                 idle_s: float = 2.0) -> None:
        self.target = target
        self.socket_path = str(target)
        # the bearer token goes on every request: the TCP port is reachable by others
        self._auth = (f"authorization: Bearer {target.token}\r\n"
                      if isinstance(target, TcpEndpoint) else "")
        self.timeout_s = timeout_s
        self.max_connections = max_connections
        self.idle_s = idle_s
        self._idle: list[_Connection] = []
        self._open = 0
        self._waiters: deque[asyncio.Future[None]] = deque()
        self._closed = False

    async def send(self, method: str, path: str, body: bytes | None = None, *,
                   headers: Sequence[tuple[str, str]] = ()) -> Reply:
        """Send a request; returns once the reply's head arrived (read or close the reply).

        `body` is sent as it is, with `content-type: application/json`.
        """
        head = f"{method} {path} HTTP/1.1\r\nhost: engine\r\n{self._auth}"
        for name, value in headers:
            head += f"{name}: {value}\r\n"
        if body is not None:
            head += f"content-type: application/json\r\ncontent-length: {len(body)}\r\n"
        # a kept-alive connection without a coroutine of its own: the usual case
        conn = self._reusable() or await self._acquire()
        return await conn.send((head + "\r\n").encode("latin-1"), body)

    async def request(self, method: str, path: str, body: bytes | None = None, *,
                      headers: Sequence[tuple[str, str]] = ()) -> tuple[Reply, bytes]:
        """`send`, then the whole body."""
        reply = await self.send(method, path, body, headers=headers)
        try:
            return reply, await reply.read()
        finally:
            reply.close()

    def close(self) -> None:
        """Close the idle connections; busy ones close when their reply is done."""
        self._closed = True
        idle, self._idle = self._idle, []
        for conn in idle:
            conn.abort()
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)

    # ------------------------------------------------------------------ pool

    def _reusable(self) -> _Connection | None:
        """The most recently used idle connection still fit to reuse, else None (the
        stale ones on the way are closed)."""
        if self._closed:
            return None  # `_acquire` says so
        idle = self._idle
        while idle:
            conn = idle.pop()
            if not conn.closed and conn.loop.time() - conn.idle_since < self.idle_s:
                return conn
            conn.abort()
        return None

    async def _acquire(self) -> _Connection:
        loop = asyncio.get_running_loop()
        while True:
            if self._closed:
                raise ChannelError("closed", "the channel to this engine run is closed")
            conn = self._reusable()
            if conn is not None:
                return conn
            if self._open < self.max_connections:
                break
            waiter = loop.create_future()
            self._waiters.append(waiter)
            await waiter  # a connection came back or closed
        self._open += 1
        try:
            target = self.target
            connect = (loop.create_connection(lambda: _Connection(self, loop), target.host,
                                              target.port)
                       if isinstance(target, TcpEndpoint) else
                       loop.create_unix_connection(lambda: _Connection(self, loop),
                                                   self.socket_path))
            _, conn = await asyncio.wait_for(connect, self.timeout_s)
        except (OSError, asyncio.TimeoutError) as exc:
            self._open -= 1
            self._wake_one()
            reason = "TimeoutError" if isinstance(exc, asyncio.TimeoutError) else \
                type(exc).__name__
            raise ChannelError(reason, f"cannot connect to the engine's channel: {exc}") from exc
        return conn

    def _give_back(self, conn: _Connection) -> None:
        if self._closed:
            conn.abort()
            return
        conn.idle_since = conn.loop.time()
        self._idle.append(conn)
        self._wake_one()

    def _lost(self, conn: _Connection) -> None:
        self._open -= 1
        if conn in self._idle:
            self._idle.remove(conn)
        self._wake_one()

    def _wake_one(self) -> None:
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return
