"""The floor under the episode plane's CPU budget: what uvicorn itself costs per call.

    python -m bench.proxy_floor [--calls 2000]

Measures the server CPU time per call (user + system of the serving process, `psutil`)
of three bare servers on this machine, each a `uvicorn.run` subprocess with httptools,
uvloop and no access log, called one request at a time by the same `httpx.AsyncClient`
code as `bench_episodes` with a chat-sized JSON body:

- `fixed`: a plain ASGI app that reads the body and answers a fixed 200-byte JSON body
  (no framework, no routing, no auth): uvicorn's own share of every call;
- `proxy`: the same app, but it forwards the body over the server's `EngineChannel` to a
  second such `fixed` server on a Unix socket and relays its answer (the CPU is the
  proxy's only): the least a proxying server can spend;
- `fastapi`: one FastAPI route (`Request` in, `Response` out), for scale;
- the `proxy` once more, its stand-in waiting 15 ms before it answers (a chat's time in
  ajet-tiny): the same work, but the proxy's thread sleeps between request and reply.
  On a small virtual machine that wake-up is charged to the thread's CPU time too.

`--engine` measures the `proxy` once more in front of a real engine (ajet-tiny, started
by a swarm server as `bench_episodes` does) with the bench's own workload and CPU phase
(begin, chat, end, kind by kind, the idle CPU subtracted; the chat sends the episode id
as `X-Episode-UUID`, as the gateway does): the floor of `bench_episodes`' CPU row under
the same conditions. A chat there costs more than a begin even with no gates at all: the
server waits for the engine's generation between request and reply, and is charged for
waking up (the last row of the stand-in shows the same without an engine).

The swarm server's own figure (`python -m bench --only episodes`) does the proxy's work
plus the gates (credential, episode key, body bound), JSON validation and the gateway's
table; the difference to `proxy` is what this project's code costs.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import psutil
from starlette.requests import Request
from starlette.responses import Response

from bench.bench_episodes import Samples, cpu_s
from bench.harness import free_port

__all__ = ["main"]

#: The stand-in's wait in the last row (ms): about a chat of the bench's workload.
_WAIT_MS = 15

_ANSWER = (b'{"id":"chatcmpl-0","object":"chat.completion","model":"ajet-tiny","choices":'
           b'[{"index":0,"message":{"role":"assistant","content":"42"},"finish_reason":'
           b'"stop"}],"usage":{"prompt_tokens":20,"completion_tokens":2,"total_tokens":22}}')
_BODY = {"model": "ajet-tiny", "max_tokens": 16,
         "messages": [{"role": "user", "content": "Add 17 and 25; answer in digits."}]}
_HEAD = [(b"content-type", b"application/json"),
         (b"content-length", str(len(_ANSWER)).encode())]


async def _read_body(receive: Any) -> bytes:
    chunks = []
    while True:
        message = await receive()
        chunks.append(message.get("body", b""))
        if not message.get("more_body"):
            return b"".join(chunks)


#: How long the `fixed` stand-in waits before it answers (`--serve fixed --delay-ms`).
_DELAY_S = 0.0


async def _fixed(scope: dict[str, Any], receive: Any, send: Any) -> None:
    if scope["type"] != "http":
        return
    await _read_body(receive)
    if _DELAY_S:
        await asyncio.sleep(_DELAY_S)
    await send({"type": "http.response.start", "status": 200, "headers": _HEAD})
    await send({"type": "http.response.body", "body": _ANSWER})


def _proxy_app(socket_path: str) -> Any:
    from swarm_server.engine_channel import EngineChannel

    channel = EngineChannel(Path(socket_path), timeout_s=30)

    async def proxy(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        body = await _read_body(receive)
        episode = [("x-episode-uuid", v.decode()) for k, v in scope["headers"]
                   if k == b"x-episode-uuid"]
        reply, content = await channel.request("POST", scope["path"], body, headers=episode)
        await send({"type": "http.response.start", "status": reply.status,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(content)).encode())]})
        await send({"type": "http.response.body", "body": content})

    return proxy


def _fastapi_app() -> Any:
    from fastapi import FastAPI

    app = FastAPI()

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        await request.body()
        return Response(_ANSWER, media_type="application/json")

    return app


def _serve(kind: str, port: int, uds: str | None, upstream: str | None) -> None:
    import uvicorn

    app = (_fixed if kind == "fixed" else _fastapi_app() if kind == "fastapi"
           else _proxy_app(str(upstream)))
    uvicorn.run(app, host="127.0.0.1", port=port, uds=uds, http="httptools", loop="uvloop",
                access_log=False, log_level="warning", lifespan="off")


def _start(kind: str, *, port: int = 0, uds: str | None = None,
           upstream: str | None = None, delay_ms: float = 0.0) -> subprocess.Popen[bytes]:
    argv = [sys.executable, "-m", "bench.proxy_floor", "--serve", kind, "--port", str(port),
            "--delay-ms", str(delay_ms)]
    if uds:
        argv += ["--uds", uds]
    if upstream:
        argv += ["--upstream", upstream]
    return subprocess.Popen(argv, stdin=subprocess.DEVNULL)


async def _measure(url: str, proc: psutil.Process, calls: int) -> float:
    """Server CPU seconds per call, one call at a time."""
    async with httpx.AsyncClient(base_url=url, timeout=30) as client:
        deadline = time.monotonic() + 30
        while True:
            try:
                await client.post("/v1/chat/completions", json=_BODY)
                break
            except httpx.TransportError:
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.05)
        for _ in range(200):  # warm up
            await client.post("/v1/chat/completions", json=_BODY)
        cpu0 = cpu_s(proc)
        for _ in range(calls):
            response = await client.post("/v1/chat/completions", json=_BODY)
            if response.status_code != 200:
                raise RuntimeError(f"answered {response.status_code}: {response.text[:200]}")
        return (cpu_s(proc) - cpu0) / calls


def _against_engine(calls: int) -> dict[str, float]:
    """The bare proxy's CPU per call, kind by kind, in front of a real engine."""
    import shutil

    from bench.bench_episodes import engine_socket, server_cpu, Way
    from bench.harness import LocalServer, tiny_job, wait_rolling_on

    root = Path(tempfile.mkdtemp(prefix="ajf-"))
    try:
        with LocalServer(root / "server") as server, server.client() as client:
            client.submit_config(tiny_job(batch_size=64, num_repeat=2))
            client.start_run()
            status = wait_rolling_on(client, None, previous_run=None)
            assert status.run_id is not None
            socket = engine_socket(server.workdir, status.run_id)
            port = free_port()
            proxy = _start("proxy", port=port, upstream=str(socket))
            try:
                async def measure() -> dict[str, float]:
                    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}",
                                                 timeout=60) as http:
                        way = Way(http, proxied=False)  # the engine's own headers
                        deadline = time.monotonic() + 30
                        while True:
                            try:
                                await way.cycle(Samples())
                                break
                            except httpx.TransportError:
                                if time.monotonic() > deadline:
                                    raise
                                await asyncio.sleep(0.05)
                        for _ in range(5):
                            await way.cycle(Samples())
                        # the bench's own phase: 100 of each kind per round (the engine
                        # has 128 slots), rounds enough for the process clock's 10 ms ticks
                        cpu = await server_cpu(way, psutil.Process(proxy.pid),
                                                rounds=max(1, calls // 100), per_round=100,
                                                idle_s=3.0)
                        return {**cpu.per_call, "mean": cpu.mean}

                return asyncio.run(measure())
            finally:
                proxy.terminate()
                proxy.wait(timeout=30)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.proxy_floor",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--calls", type=int, default=2000)
    p.add_argument("--engine", action="store_true",
                   help="also the bare proxy in front of a real engine, kind by kind")
    p.add_argument("--serve", choices=("fixed", "proxy", "fastapi"), help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--uds", help=argparse.SUPPRESS)
    p.add_argument("--upstream", help=argparse.SUPPRESS)
    p.add_argument("--delay-ms", type=float, default=0.0, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.serve:
        global _DELAY_S
        _DELAY_S = args.delay_ms / 1000
        _serve(args.serve, args.port, args.uds, args.upstream)
        return 0
    results: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix="ajf-") as tmp:
        for name, kind, delay_ms in (("fixed", "fixed", 0), ("proxy", "proxy", 0),
                                     ("fastapi", "fastapi", 0),
                                     (f"proxy, the stand-in waits {_WAIT_MS} ms", "proxy",
                                      _WAIT_MS)):
            upstream = os.path.join(tmp, f"engine-{delay_ms}.sock")
            engine = _start("fixed", uds=upstream, delay_ms=delay_ms)
            port = free_port()
            server = _start(kind, port=port, upstream=upstream)
            try:
                calls = args.calls if not delay_ms else min(args.calls, 300)
                results[name] = asyncio.run(_measure(f"http://127.0.0.1:{port}",
                                                     psutil.Process(server.pid), calls))
            finally:
                for proc in (server, engine):
                    proc.terminate()
                    proc.wait(timeout=30)
    for name, seconds in results.items():
        sys.stdout.write(f"{name}: {seconds * 1000:.3f} ms server CPU per call "
                         f"(one call at a time)\n")
    if args.engine:
        per_kind = _against_engine(min(args.calls, 500))
        sys.stdout.write("proxy in front of a real engine (ajet-tiny), ms server CPU per "
                         "call: " + ", ".join(f"{k} {v * 1000:.3f}" for k, v in
                                              per_kind.items()) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
