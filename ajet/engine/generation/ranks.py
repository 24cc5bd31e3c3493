"""Every rank generates: rank 0 routes each episode to one rank's generator.

Under torchrun every rank holds the full weights (DDP), so every rank runs its own
`Generator` (docs/distributed.md, "Every rank generates"). The episode plane stays on
rank 0: it alone claims episodes, renders prompts, records completions and runs the step
loop, so nothing about an episode's bookkeeping crosses processes. What crosses is the
generation call: rank 0's `RankRouter` sends each request to one rank, sticky per
episode (its `session`), so the later turns of a multi-turn episode find their prefix in
that rank's KV cache. A new episode goes to the rank with the fewest requests in flight,
ties taken in turn.

    rank 0:   chat route -> RankRouter -> local generator
                                       -> RemoteGenerator(rank r) --HTTP--> rank r
    rank r:   RankService (POST /generate, NDJSON stream) -> local generator

The link is the engine's own transport (`channel.ChannelServer`): a 0600 Unix socket in
the run directory for ranks on rank 0's node, a TCP port on the interface that reaches
the rendezvous host for ranks on other nodes. Either way each request carries the
rank's random bearer token, which reaches rank 0 only through the process group's own
gather at boot. A client going away (the worker's connection closed, the episode
aborted) closes the HTTP stream, and rank r cancels the request and frees its cache.

Why not let the swarm server route to each rank's socket instead: the server sees one
engine and one socket (docs/internals.md), it cannot reach sockets on other nodes, and
claims, timeouts and trajectories would then be split across processes.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import dataclasses
import hmac
import json
import logging
import os
import secrets
import socket
import tempfile
import threading
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Annotated, Any

import httpx
from fastapi import Depends, FastAPI, Header, HTTPException
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, Field

from ajet.engine.transport.unix_server import MAX_SOCKET_PATH, ChannelServer
from ajet.engine.parallel.distributed import Dist
from ajet.engine.generation.interface import (
    GenerationCancelled,
    GenerationHandle,
    GenerationInterrupted,
    GenerationRefused,
    GenerationRequest,
    GenerationResult,
    Generator,
)

__all__ = ["RankEndpoint", "RankRouter", "RankService", "RemoteGenerator", "connect_ranks",
           "tcp_host_for_rendezvous"]

log = logging.getLogger(__name__)

#: Sessions (episodes) remembered for sticky routing; older ones are forgotten.
_SESSIONS = 65_536


@dataclasses.dataclass(frozen=True)
class RankEndpoint:
    """Where rank `rank`'s generation service listens (gathered to rank 0 at boot)."""

    rank: int
    token: str
    uds: str | None = None
    url: str | None = None


class GenerateBody(BaseModel):
    prompt_ids: list[int] = Field(min_length=1, max_length=2_000_000)
    max_new_tokens: int = Field(ge=1)
    stop: list[str] = Field(default_factory=list, max_length=16)
    temperature: float | None = None
    top_p: float | None = None
    session: str | None = Field(default=None, max_length=200)


# ---------------------------------------------------------------------------- rank r


class RankService:
    """Serves this rank's generator to rank 0 (`POST /generate`, `GET /status`)."""

    def __init__(self, generator: Generator, *, rank: int, run_dir: Path,
                 tcp_host: str | None = None) -> None:
        self.generator = generator
        self.rank = rank
        self.token = secrets.token_urlsafe(32)
        path = None
        if tcp_host is None:
            path = run_dir / f"rank{rank}.sock"
            if len(os.fsencode(str(path))) > MAX_SOCKET_PATH:
                path = Path(tempfile.mkdtemp(prefix="ajet-rank-")) / f"rank{rank}.sock"  # 0700
        self._channel = ChannelServer(self._app(), path, tcp_host=tcp_host)

    def start(self) -> RankEndpoint:
        self._channel.start()
        if self._channel.tcp_address is not None:
            host, port = self._channel.tcp_address
            return RankEndpoint(self.rank, self.token, url=f"http://{host}:{port}")
        return RankEndpoint(self.rank, self.token, uds=str(self._channel.socket_path))

    def stop(self) -> None:
        self._channel.stop()

    def _app(self) -> FastAPI:
        app = FastAPI(title=f"AgentJet rank {self.rank} generator", docs_url=None,
                      redoc_url=None, openapi_url=None)

        def authorized(authorization: Annotated[str | None, Header()] = None) -> None:
            expected = f"Bearer {self.token}"
            if not authorization or not hmac.compare_digest(authorization, expected):
                raise HTTPException(401, "this rank's generator answers rank 0 only")

        @app.get("/status", dependencies=[Depends(authorized)])
        async def status() -> dict[str, Any]:
            return {"rank": self.rank, **self.generator.stats()}

        @app.post("/generate", dependencies=[Depends(authorized)])
        async def generate(body: GenerateBody) -> StreamingResponse:
            loop = asyncio.get_running_loop()
            events: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()

            def post(kind: str, payload: Any) -> None:
                with contextlib.suppress(RuntimeError):  # loop closed: shutting down
                    loop.call_soon_threadsafe(events.put_nowait, (kind, payload))

            request = GenerationRequest(
                prompt_ids=body.prompt_ids, max_new_tokens=body.max_new_tokens,
                on_done=lambda outcome: post("done", outcome),
                on_delta=lambda text: post("delta", text), stop=tuple(body.stop),
                temperature=body.temperature, top_p=body.top_p, session=body.session)
            try:
                handle = self.generator.submit(request)
            except GenerationRefused as exc:
                return _lines([{"error": str(exc), "kind": "refused"}])
            return StreamingResponse(_relay(handle, events), media_type="application/x-ndjson")

        return app


async def _relay(handle: GenerationHandle, events: asyncio.Queue[tuple[str, Any]]
                 ) -> AsyncIterator[bytes]:
    """NDJSON lines for one request; cancels it if rank 0 hangs up first."""
    try:
        while True:
            kind, payload = await events.get()
            if kind == "delta":
                yield _line({"delta": payload})
                continue
            if isinstance(payload, GenerationResult):
                yield _line({"result": dataclasses.asdict(payload)})
            else:
                yield _line({"error": str(payload), "kind": _kind(payload)})
            return
    finally:
        handle.cancel()  # nothing if it finished; frees the KV cache if rank 0 went away


def _kind(exc: BaseException) -> str:
    if isinstance(exc, GenerationRefused):
        return "refused"
    if isinstance(exc, GenerationCancelled):
        return "cancelled"
    if isinstance(exc, GenerationInterrupted):
        return "interrupted"
    return "failed"


def _line(obj: dict[str, Any]) -> bytes:
    return (json.dumps(obj) + "\n").encode()


def _lines(objs: list[dict[str, Any]]) -> StreamingResponse:
    async def body() -> AsyncIterator[bytes]:
        for obj in objs:
            yield _line(obj)

    return StreamingResponse(body(), media_type="application/x-ndjson")


def tcp_host_for_rendezvous() -> str:
    """This node's address on the interface that reaches torchrun's rendezvous host."""
    master = os.environ.get("MASTER_ADDR", "127.0.0.1")
    port = int(os.environ.get("MASTER_PORT", "29500"))
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((master, port))  # UDP: no packet is sent, only a route is chosen
        return str(probe.getsockname()[0])


# ---------------------------------------------------------------------------- rank 0


class RemoteGenerator(Generator):
    """Rank 0's client of one other rank's `RankService`.

    Calls run on a private event loop thread, one HTTP stream per request. `pause` and
    `resume` do nothing here: every rank pauses its own generator around its update.
    """

    def __init__(self, endpoint: RankEndpoint, *, timeout_s: float = 3600.0) -> None:
        self.endpoint = endpoint
        self._timeout_s = timeout_s
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever,
                                        name=f"ajet-rank{endpoint.rank}-client", daemon=True)
        self._client: httpx.AsyncClient | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self.counters = {"requests": 0, "failed": 0}

    def start(self) -> None:
        self._thread.start()

        async def make() -> httpx.AsyncClient:
            transport = (httpx.AsyncHTTPTransport(uds=self.endpoint.uds) if self.endpoint.uds
                         else httpx.AsyncHTTPTransport())
            return httpx.AsyncClient(
                transport=transport, base_url=self.endpoint.url or "http://rank",
                headers={"Authorization": f"Bearer {self.endpoint.token}"},
                timeout=httpx.Timeout(self._timeout_s, connect=30.0))

        self._client = asyncio.run_coroutine_threadsafe(make(), self._loop).result()

    def stop(self, timeout: float = 10.0) -> None:
        if not self._thread.is_alive():
            return

        async def close() -> None:
            for task in list(self._tasks):
                task.cancel()
            if self._client is not None:
                await self._client.aclose()

        with contextlib.suppress(Exception):
            asyncio.run_coroutine_threadsafe(close(), self._loop).result(timeout)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout)

    def pause(self) -> None:
        """Nothing: rank r pauses its own generator when it runs its update."""

    def resume(self) -> None:
        """Nothing: see `pause`."""

    def stats(self) -> dict[str, Any]:
        return {"backend": "remote", "in_flight": len(self._tasks), **self.counters}

    def submit(self, request: GenerationRequest) -> GenerationHandle:
        if not self._thread.is_alive() or self._client is None:
            raise RuntimeError("the engine is shutting down")
        future: concurrent.futures.Future[None] | None = None

        def cancel(_handle: GenerationHandle) -> None:
            if future is not None:  # cancels the task: the stream closes and rank r
                future.cancel()  # cancels its request too

        handle = GenerationHandle(request, on_cancel=cancel)
        self.counters["requests"] += 1
        future = asyncio.run_coroutine_threadsafe(self._call(handle), self._loop)
        return handle

    async def _call(self, handle: GenerationHandle) -> None:
        if handle.done:  # cancelled before this coroutine ran
            return
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        request = handle.request
        body = {"prompt_ids": request.prompt_ids, "max_new_tokens": request.max_new_tokens,
                "stop": list(request.stop), "temperature": request.temperature,
                "top_p": request.top_p, "session": request.session}
        try:
            assert self._client is not None
            async with self._client.stream("POST", "/generate", json=body) as response:
                if response.status_code != 200:
                    detail = (await response.aread()).decode("utf-8", "replace")[:300]
                    raise RuntimeError(f"rank {self.endpoint.rank} answered "
                                       f"{response.status_code}: {detail}")
                async for line in response.aiter_lines():
                    if not line:
                        continue
                    message = json.loads(line)
                    if "delta" in message:
                        handle.delta(message["delta"])
                    elif "result" in message:
                        handle.finish(GenerationResult(**message["result"]))
                        return
                    else:
                        handle.finish(_error(message))
                        return
            raise RuntimeError(f"rank {self.endpoint.rank} ended the reply early")
        except asyncio.CancelledError:
            handle.finish(GenerationCancelled("the request was cancelled"))
        except Exception as exc:  # a transport error or a broken line: this request fails
            self.counters["failed"] += 1
            log.warning("generation on rank %d failed: %s", self.endpoint.rank, exc)
            handle.finish(RuntimeError(f"generation on rank {self.endpoint.rank} failed: {exc}"))
        finally:
            self._tasks.discard(task)


def _error(message: dict[str, Any]) -> BaseException:
    text, kind = str(message.get("error", "")), message.get("kind")
    if kind == "refused":
        return GenerationRefused(text)
    if kind == "cancelled":
        return GenerationCancelled(text)
    if kind == "interrupted":
        return GenerationInterrupted(text)
    return RuntimeError(text)


class RankRouter(Generator):
    """Rank 0's generator when several ranks generate: sticky, least-loaded routing."""

    def __init__(self, local: Generator, remotes: Sequence[Generator]) -> None:
        #: index = rank: this rank's generator, then a `RemoteGenerator` per other rank
        self.targets: list[Generator] = [local, *remotes]
        self._lock = threading.Lock()
        self._sessions: collections.OrderedDict[str, int] = collections.OrderedDict()
        self._in_flight = [0] * len(self.targets)
        self._routed = [0] * len(self.targets)
        self._next = 0

    def start(self) -> None:
        for target in self.targets[1:]:  # the local generator is started by its owner
            target.start()

    def stop(self, timeout: float = 10.0) -> None:
        for target in self.targets[1:]:
            target.stop(timeout)

    def pause(self) -> None:
        self.targets[0].pause()

    def resume(self) -> None:
        self.targets[0].resume()

    def validate(self, request: GenerationRequest) -> None:
        self.targets[0].validate(request)

    def submit(self, request: GenerationRequest) -> GenerationHandle:
        self.targets[0].validate(request)  # every rank has the same limits: refuse here
        with self._lock:
            rank = self._pick(request.session)
            self._in_flight[rank] += 1
            self._routed[rank] += 1
        done = request.on_done

        def on_done(outcome: GenerationResult | BaseException) -> None:
            with self._lock:
                self._in_flight[rank] -= 1
            done(outcome)

        try:
            return self.targets[rank].submit(dataclasses.replace(request, on_done=on_done))
        except BaseException:
            with self._lock:
                self._in_flight[rank] -= 1
            raise

    def stats(self) -> dict[str, Any]:
        with self._lock:
            ranks = [{"rank": r, "routed": self._routed[r], "in_flight": self._in_flight[r]}
                     for r in range(len(self.targets))]
        return {**self.targets[0].stats(), "ranks": ranks}

    def routed(self) -> list[int]:
        """Requests sent to each rank so far (index = rank)."""
        with self._lock:
            return list(self._routed)

    def _pick(self, session: str | None) -> int:
        """The session's rank, else the least busy one (lock held)."""
        if session is not None and session in self._sessions:
            self._sessions.move_to_end(session)
            return self._sessions[session]
        n = len(self.targets)
        order = [(self._next + i) % n for i in range(n)]
        rank = min(order, key=lambda r: self._in_flight[r])
        self._next = (rank + 1) % n
        if session is not None:
            self._sessions[session] = rank
            while len(self._sessions) > _SESSIONS:
                self._sessions.popitem(last=False)
        return rank


def connect_ranks(local: Generator, dist: Dist, *, run_dir: Path
                  ) -> tuple[RankRouter | None, RankService | None]:
    """Link every rank's generator to rank 0; a collective, called by every rank at boot.

    Ranks > 0 serve `local` and get `(None, their service)`; rank 0 gets
    `(a started RankRouter over every rank, None)`. One process: `(None, None)`.
    """
    if not dist.active:
        return None, None
    service: RankService | None = None
    endpoint: RankEndpoint | None = None
    if dist.rank > 0:
        # torchrun's GROUP_RANK is the node's index; rank 0 runs on node 0
        other_node = int(os.environ.get("GROUP_RANK", "0")) != 0
        service = RankService(local, rank=dist.rank, run_dir=run_dir,
                              tcp_host=tcp_host_for_rendezvous() if other_node else None)
        endpoint = service.start()
    endpoints = dist.gather(endpoint)
    if dist.rank > 0:
        return None, service
    remotes = [RemoteGenerator(e) for e in endpoints[1:] if e is not None]
    router = RankRouter(local, remotes)
    router.start()
    log.info("every rank generates: rank 0 routes episodes to %d rank(s)", len(remotes) + 1)
    return router, None
