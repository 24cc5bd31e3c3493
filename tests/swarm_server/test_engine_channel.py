"""`EngineChannel` against a real uvicorn on a real Unix socket: connections
kept alive and reused, bounded in number; a streamed reply arrives chunk by chunk; an
answer the engine gives before it read the body (413) arrives instead of a broken pipe;
no socket, a stalled engine and a reply cut short are `ChannelError`s. And the engine's
own channel server (`ChannelServer`) writes each reply in one piece.
"""

from __future__ import annotations

import asyncio
import json
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
import uvicorn
from starlette.types import Receive, Scope, Send

from ajet.engine.transport.unix_server import ChannelServer
from swarm_server.engine_channel import ChannelError, EngineChannel

Engine = Callable[[Scope, Receive, Send], Awaitable[None]]


class StandIn:
    """A small ASGI engine: `/echo` (body and `x-episode-uuid` back), `/stream` (two
    chunks, the second once `release` is set), `/refuse` (413 unread), `/slow`, `/cut`."""

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.concurrent = 0
        self.most_concurrent = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        path = scope["path"]
        if path == "/refuse":  # answer from the headers, body unread (the chat bound)
            await _json(send, 413, {"detail": "over the bound", "hint": "shorter"})
            return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        if path == "/echo":
            self.concurrent += 1
            self.most_concurrent = max(self.most_concurrent, self.concurrent)
            await asyncio.sleep(0.01)
            self.concurrent -= 1
            episode = dict(scope["headers"]).get(b"x-episode-uuid", b"").decode()
            await _json(send, 200, {"size": len(body), "episode": episode})
        elif path == "/stream":
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", b"text/event-stream")]})
            await send({"type": "http.response.body", "body": b"data: 1\n\n",
                        "more_body": True})
            await self.release.wait()
            await send({"type": "http.response.body", "body": b"data: 2\n\n"})
        elif path == "/slow":
            await asyncio.sleep(1.0)  # past the channel's 0.5 s
            await _json(send, 200, {})
        elif path == "/cut":
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-length", b"100")]})
            await send({"type": "http.response.body", "body": b"partial", "more_body": True})
            raise RuntimeError("the engine died mid-reply")  # uvicorn drops the connection


async def _json(send: Send, status: int, body: object) -> None:
    data = json.dumps(body).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(data)).encode())]})
    await send({"type": "http.response.body", "body": data})


@asynccontextmanager
async def _serving(socket: Path, app: Engine) -> AsyncIterator[uvicorn.Server]:
    server = uvicorn.Server(uvicorn.Config(app, uds=str(socket), log_level="critical"))
    task = asyncio.create_task(server.serve())
    while not server.started:
        await asyncio.sleep(0.01)
    try:
        yield server
    finally:
        server.should_exit = True
        await task


def _run(tmp_path: Path, test: Callable[[EngineChannel, StandIn], Awaitable[None]], *,
         timeout_s: float = 10.0, max_connections: int = 64) -> None:
    async def main() -> None:
        engine = StandIn()
        socket = tmp_path / "engine.sock"
        async with _serving(socket, engine):
            channel = EngineChannel(socket, timeout_s=timeout_s,
                                    max_connections=max_connections)
            try:
                await test(channel, engine)
            finally:
                channel.close()

    asyncio.run(main())


def test_requests_reuse_one_kept_alive_connection(tmp_path: Path) -> None:
    async def test(channel: EngineChannel, _: StandIn) -> None:
        for i in range(20):
            body = json.dumps({"i": i, "pad": "x" * (i * 5000)}).encode()  # some > 64 KiB
            reply, content = await channel.request("POST", "/echo", body,
                                                   headers=(("x-episode-uuid", f"e{i}"),))
            assert reply.status == 200
            assert json.loads(content) == {"size": len(body), "episode": f"e{i}"}
        assert channel._open == 1 and len(channel._idle) == 1  # one connection, all along

    _run(tmp_path, test)


def test_concurrent_requests_are_bounded_by_max_connections(tmp_path: Path) -> None:
    async def test(channel: EngineChannel, engine: StandIn) -> None:
        replies = await asyncio.gather(*(channel.request("POST", "/echo", b"{}")
                                         for _ in range(12)))
        assert [r.status for r, _ in replies] == [200] * 12
        assert engine.most_concurrent <= 3 and channel._open <= 3

    _run(tmp_path, test, max_connections=3)


def test_a_streamed_reply_arrives_chunk_by_chunk(tmp_path: Path) -> None:
    async def test(channel: EngineChannel, engine: StandIn) -> None:
        reply = await channel.send("POST", "/stream", b"{}")
        assert reply.headers["content-type"] == "text/event-stream"
        chunks = reply.chunks()
        assert await chunks.__anext__() == b"data: 1\n\n"  # before the engine sent the rest
        engine.release.set()
        assert b"".join([c async for c in chunks]) == b"data: 2\n\n"
        reply2, _ = await channel.request("POST", "/echo", b"{}")  # connection reused
        assert reply2.status == 200 and channel._open == 1

    _run(tmp_path, test)


def test_an_answer_before_the_body_is_read_arrives(tmp_path: Path) -> None:
    async def test(channel: EngineChannel, _: StandIn) -> None:
        reply, content = await channel.request("POST", "/refuse", b"x" * (8 * 2**20))
        assert reply.status == 413 and json.loads(content)["detail"] == "over the bound"
        reply, _ = await channel.request("POST", "/echo", b"{}")  # a fresh connection works
        assert reply.status == 200

    _run(tmp_path, test)


def test_no_engine_a_stalled_one_and_a_cut_reply_are_channel_errors(tmp_path: Path) -> None:
    async def test(channel: EngineChannel, _: StandIn) -> None:
        with pytest.raises(ChannelError) as slow:
            await channel.request("POST", "/slow", b"{}")
        assert slow.value.reason == "TimeoutError"
        with pytest.raises(ChannelError):
            await channel.request("POST", "/cut", b"{}")
        reply, _ = await channel.request("POST", "/echo", b"{}")  # the channel recovers
        assert reply.status == 200

    _run(tmp_path, test, timeout_s=0.5)

    async def missing() -> None:
        channel = EngineChannel(tmp_path / "nothing.sock", timeout_s=1.0)
        with pytest.raises(ChannelError) as exc:
            await channel.request("GET", "/echo")
        assert exc.value.reason == "FileNotFoundError"

    asyncio.run(missing())


def test_the_engines_channel_server_writes_each_reply_in_one_piece(tmp_path: Path) -> None:
    # uvicorn writes a head and a body apart; the engine's thread may wait for the GIL in
    # between, and the server would wake twice for one reply
    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        await receive()
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-length", b"2")]})
        time.sleep(0.3)  # the event loop's thread held up between head and body
        await send({"type": "http.response.body", "body": b"ok"})

    socket_path = tmp_path / "engine.sock"
    server = ChannelServer(app, socket_path)
    server.start()
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(10)
            s.connect(str(socket_path))
            s.sendall(b"GET /x HTTP/1.1\r\nhost: engine\r\n\r\n")
            first = s.recv(65536)  # whatever the first write put on the socket
    finally:
        server.stop()
    assert first.startswith(b"HTTP/1.1 200") and first.endswith(b"\r\n\r\nok"), first
