"""Row 3: the episode plane through the swarm server against the engine's private socket.

    python -m bench --only episodes

One cycle is what a rollout worker does per episode: `begin_episode`, one chat
completion (`max_tokens=1`, so generation is a single forward pass of ajet-tiny and
the proxy's share is visible), `end_episode`. The same cycle runs two ways with the
same raw `httpx.AsyncClient` code:

- through the server: `POST /begin_episode` and `/end_episode` with the worker token,
  `POST /v1/chat/completions` with the signed episode key (auth, key check, proxy);
- directly on the engine's Unix socket (docs/internals.md, "The engine process"), as the
  server's gateway itself calls it, with `X-Episode-UUID`.

The proxy overhead per call is (median proxied cycle - median direct cycle) / 3. With
1 worker the two ways alternate cycle by cycle; with 16 workers each way runs in turn,
several rounds. The job never completes a GRPO group (every episode gets its own
task id), so no training step interrupts the measurement.
"""

from __future__ import annotations

import asyncio
import statistics
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from bench.context import BenchContext
from bench.harness import WORKER_TOKEN, LocalServer, tiny_job, wait_rolling_on
from bench.report import Row

__all__ = ["run"]

RERUN = "python -m bench --only episodes"
OVERHEAD_TARGET_MS = 2.0
_CHAT = {"model": "ajet-tiny", "messages": [{"role": "user", "content": "1+1="}],
         "max_tokens": 1}


@dataclass
class _Samples:
    """Per-call latencies (seconds) of one way of calling."""

    begin: list[float] = field(default_factory=list)
    chat: list[float] = field(default_factory=list)
    end: list[float] = field(default_factory=list)
    cycle: list[float] = field(default_factory=list)
    busy_s: float = 0.0  # wall time of the concurrent phases, for throughput

    def cycles_per_s(self) -> float:
        return len(self.cycle) / self.busy_s if self.busy_s else float("nan")


Cycle = Callable[[_Samples], Awaitable[None]]


def _ok(response: httpx.Response) -> dict[str, object]:
    if response.status_code != 200:
        raise RuntimeError(f"{response.request.method} {response.request.url.path} answered "
                           f"{response.status_code}: {response.text[:500]}")
    body: dict[str, object] = response.json()
    return body


async def _timed(samples: list[float], call: Awaitable[httpx.Response]) -> dict[str, object]:
    t0 = time.perf_counter()
    response = await call
    samples.append(time.perf_counter() - t0)
    return _ok(response)


def _proxied(client: httpx.AsyncClient) -> Cycle:
    worker = {"Authorization": f"Bearer {WORKER_TOKEN}"}

    async def cycle(s: _Samples) -> None:
        t0 = time.perf_counter()
        begun = await _timed(s.begin, client.post("/begin_episode", json={}, headers=worker))
        key = {"Authorization": f"Bearer {begun['openai_api_key']}"}
        await _timed(s.chat, client.post("/v1/chat/completions", json=_CHAT, headers=key))
        await _timed(s.end, client.post("/end_episode", headers=worker, json={
            "episode_uuid": begun["episode_uuid"], "task_id": uuid.uuid4().hex, "reward": 0.0}))
        s.cycle.append(time.perf_counter() - t0)

    return cycle


def _direct(client: httpx.AsyncClient) -> Cycle:
    async def cycle(s: _Samples) -> None:
        t0 = time.perf_counter()
        begun = await _timed(s.begin, client.post("/begin_episode", json={}))
        episode = {"X-Episode-UUID": str(begun["episode_uuid"])}
        await _timed(s.chat, client.post("/v1/chat/completions", json=_CHAT, headers=episode))
        await _timed(s.end, client.post("/end_episode", json={
            "episode_uuid": begun["episode_uuid"], "task_id": uuid.uuid4().hex, "reward": 0.0}))
        s.cycle.append(time.perf_counter() - t0)

    return cycle


async def _concurrent(cycle: Cycle, samples: _Samples, *, workers: int, per_worker: int) -> None:
    async def worker() -> None:
        for _ in range(per_worker):
            await cycle(samples)

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(workers)))
    samples.busy_s += time.perf_counter() - t0


async def _measure(url: str, socket: Path, *, cycles_1: int, rounds_16: int,
                   per_worker_16: int) -> dict[int, tuple[_Samples, _Samples]]:
    limits = httpx.Limits(max_connections=32, max_keepalive_connections=32)
    async with httpx.AsyncClient(base_url=url, timeout=60, limits=limits) as via, \
            httpx.AsyncClient(transport=httpx.AsyncHTTPTransport(uds=str(socket), limits=limits),
                              base_url="http://engine", timeout=60) as direct:
        proxied_cycle, direct_cycle = _proxied(via), _direct(direct)
        for cycle in (proxied_cycle, direct_cycle):  # warm up connections and code paths
            for _ in range(3):
                await cycle(_Samples())
        one = (_Samples(), _Samples())
        for _ in range(cycles_1):
            await proxied_cycle(one[0])
            await direct_cycle(one[1])
        many = (_Samples(), _Samples())
        for _ in range(rounds_16):
            await _concurrent(proxied_cycle, many[0], workers=16, per_worker=per_worker_16)
            await _concurrent(direct_cycle, many[1], workers=16, per_worker=per_worker_16)
    return {1: one, 16: many}


def _engine_socket(workdir: Path, run_id: str) -> Path:
    """Where the server told the engine to listen (docs/internals.md, socket path rule)."""
    path = workdir / "runs" / run_id / "engine.sock"
    if path.exists():
        return path
    for candidate in Path(tempfile.gettempdir()).glob(f"ajet-*/ajet-{run_id}.sock"):
        return candidate
    raise RuntimeError(f"no engine socket for run {run_id} under {path.parent} or the temp dir")


def _ms(xs: list[float]) -> float:
    return statistics.median(xs) * 1000


def run(ctx: BenchContext) -> list[Row]:
    cycles_1 = 10 if ctx.quick else max(200, 40 * ctx.reps)
    rounds_16 = 1 if ctx.quick else ctx.reps
    per_worker_16 = 2 if ctx.quick else 8
    with LocalServer(ctx.path("episodes")) as server, server.client() as client:
        # 64 tasks x 2 repeats: 128 episode slots, and no group ever completes
        client.submit_config(tiny_job(batch_size=64, num_repeat=2))
        client.start_run()
        status = wait_rolling_on(client, None, previous_run=None)
        if status.run_id is None:
            raise RuntimeError("the engine is ROLLING without a run id")
        socket = _engine_socket(server.workdir, status.run_id)
        results = asyncio.run(_measure(server.url, socket, cycles_1=cycles_1,
                                       rounds_16=rounds_16, per_worker_16=per_worker_16))

    rows: list[Row] = []
    for workers, (via, direct) in results.items():
        who = f"{workers} worker" + ("s" if workers > 1 else "")
        per_call = (_ms(via.cycle) - _ms(direct.cycle)) / 3
        split = ", ".join(f"{name} {_ms(getattr(via, name)) - _ms(getattr(direct, name)):+.2f}"
                          for name in ("begin", "chat", "end"))
        rows.append(Row(
            f"episode cycle (begin, chat, end) via server, {who}",
            _ms(via.cycle), "ms", "same calls on the engine's Unix socket", _ms(direct.cycle),
            rerun=RERUN, repetitions=len(via.cycle)))
        rows.append(Row(
            f"episode proxy overhead per call, {who}", per_call, "ms",
            target=f"<= {OVERHEAD_TARGET_MS:g} ms" if workers == 1 else "",
            met=per_call <= OVERHEAD_TARGET_MS if workers == 1 else None, rerun=RERUN,
            repetitions=len(via.cycle), note=f"per call ms: {split}"))
        if workers > 1:
            rows.append(Row(
                f"episode throughput via server, {who}", via.cycles_per_s(),
                "episodes/s", "direct on the socket", direct.cycles_per_s(), rerun=RERUN,
                repetitions=rounds_16))
    return rows
