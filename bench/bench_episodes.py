"""Row 3: the episode plane through the swarm server against the engine's private socket.

    python -m bench --only episodes

The workload (`WORKLOAD`, stated in every row): one cycle is what a rollout worker does
per episode, `begin_episode`, one chat completion of a 32-character prompt with
`max_tokens=16`, `end_episode`. The same cycle runs two ways with the same raw
`httpx.AsyncClient` code:

- through the server: `POST /begin_episode` and `/end_episode` with the worker token,
  `POST /v1/chat/completions` with the signed episode key (auth, key check, proxy);
- directly on the engine's Unix socket (docs/internals.md, "The engine process"), as the
  server's gateway itself calls it, with `X-Episode-UUID`.

Three figures (goals in docs/design.md, "Budgets"):

- **server CPU time per proxied call**, from the server process's own CPU counters
  (user + system, `psutil`), over `3 x calls_per_kind` calls run kind by kind (so each
  kind has its own figure), less the server's idle CPU over the same wall time (its
  engine status poll, measured just before): goal <= 0.5 ms;
- **added latency per call at 1 worker**: median proxied call minus median direct call,
  the two ways alternating cycle by cycle, per kind and over the three: goal <= 1 ms;
- **throughput at 16 workers**: proxied cycles/s against direct cycles/s, each way in
  turn, several rounds: goal >= 0.8x.

The job never completes a GRPO group (every episode gets its own task id), so no
training step interrupts the measurement.
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
import psutil

from bench.context import BenchContext
from bench.harness import WORKER_TOKEN, LocalServer, tiny_job, wait_rolling_on
from bench.report import Row

__all__ = ["KINDS", "Samples", "Way", "cpu_s", "engine_socket", "run", "server_cpu"]

RERUN = "python -m bench --only episodes"
#: Goals of the episode plane's CPU budget (docs/design.md, "Budgets", episode plane).
CPU_TARGET_MS = 0.5
LATENCY_TARGET_MS = 1.0
THROUGHPUT_TARGET = 0.8
PROMPT = "Add 17 and 25; answer in digits."  # 32 characters
MAX_TOKENS = 16
WORKLOAD = f"begin, chat of a {len(PROMPT)}-char prompt with max_tokens={MAX_TOKENS}, end"
_CHAT = {"model": "ajet-tiny", "messages": [{"role": "user", "content": PROMPT}],
         "max_tokens": MAX_TOKENS}
KINDS = ("begin", "chat", "end")


@dataclass
class Samples:
    """Per-call latencies (seconds) of one way of calling."""

    begin: list[float] = field(default_factory=list)
    chat: list[float] = field(default_factory=list)
    end: list[float] = field(default_factory=list)
    cycle: list[float] = field(default_factory=list)
    busy_s: float = 0.0  # wall time of the concurrent phases, for throughput
    cpu_s: float = 0.0  # the server's CPU time over those phases

    def cycles_per_s(self) -> float:
        return len(self.cycle) / self.busy_s if self.busy_s else float("nan")


@dataclass
class _Cpu:
    """The server's CPU time per call, kind by kind (seconds)."""

    per_call: dict[str, float] = field(default_factory=dict)
    calls: int = 0
    idle_per_s: float = 0.0  # background CPU (engine status poll), subtracted

    @property
    def mean(self) -> float:
        return statistics.fmean(self.per_call.values())


class Way:
    """One way of calling (through the server, or direct on the socket), call by call."""

    def __init__(self, client: httpx.AsyncClient, *, proxied: bool) -> None:
        self.client = client
        self.proxied = proxied
        self.worker = {"Authorization": f"Bearer {WORKER_TOKEN}"} if proxied else {}

    async def begin(self, s: list[float]) -> dict[str, object]:
        return await _timed(s, self.client.post("/begin_episode", json={}, headers=self.worker))

    async def chat(self, s: list[float], begun: dict[str, object]) -> None:
        key = ({"Authorization": f"Bearer {begun['openai_api_key']}"} if self.proxied
               else {"X-Episode-UUID": str(begun["episode_uuid"])})
        await _timed(s, self.client.post("/v1/chat/completions", json=_CHAT, headers=key))

    async def end(self, s: list[float], begun: dict[str, object]) -> None:
        await _timed(s, self.client.post("/end_episode", headers=self.worker, json={
            "episode_uuid": begun["episode_uuid"], "task_id": uuid.uuid4().hex, "reward": 0.0}))

    async def cycle(self, s: Samples) -> None:
        t0 = time.perf_counter()
        begun = await self.begin(s.begin)
        await self.chat(s.chat, begun)
        await self.end(s.end, begun)
        s.cycle.append(time.perf_counter() - t0)


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


def cpu_s(proc: psutil.Process) -> float:
    times = proc.cpu_times()
    return float(times.user + times.system)


async def _concurrent(cycle: Callable[[Samples], Awaitable[None]], samples: Samples,
                      proc: psutil.Process, *, workers: int, per_worker: int) -> None:
    async def worker() -> None:
        for _ in range(per_worker):
            await cycle(samples)

    t0, cpu0 = time.perf_counter(), cpu_s(proc)
    await asyncio.gather(*(worker() for _ in range(workers)))
    samples.busy_s += time.perf_counter() - t0
    samples.cpu_s += cpu_s(proc) - cpu0


async def server_cpu(way: Way, proc: psutil.Process, *, rounds: int, per_round: int,
                      idle_s: float) -> _Cpu:
    """CPU per call, kind by kind: `per_round` begins, then as many chats, then ends."""
    cpu0 = cpu_s(proc)
    await asyncio.sleep(idle_s)
    result = _Cpu(idle_per_s=(cpu_s(proc) - cpu0) / idle_s)
    spent = dict.fromkeys(KINDS, 0.0)

    async def phase(kind: str, calls: list[Callable[[], Awaitable[object]]]) -> list[object]:
        t0, c0 = time.perf_counter(), cpu_s(proc)
        out = [await call() for call in calls]
        spent[kind] += cpu_s(proc) - c0 - result.idle_per_s * (time.perf_counter() - t0)
        return out

    unused: list[float] = []
    for _ in range(rounds):
        begun = await phase("begin", [lambda: way.begin(unused)] * per_round)
        await phase("chat", [lambda b=b: way.chat(unused, b) for b in begun])  # type: ignore[misc]
        await phase("end", [lambda b=b: way.end(unused, b) for b in begun])  # type: ignore[misc]
    result.calls = rounds * per_round
    result.per_call = {kind: s / result.calls for kind, s in spent.items()}
    return result


async def _measure(url: str, socket: Path, proc: psutil.Process, *, cycles_1: int,
                   cpu_rounds: int, cpu_per_round: int, rounds_16: int, per_worker_16: int,
                   idle_s: float) -> tuple[_Cpu, dict[int, tuple[Samples, Samples]]]:
    limits = httpx.Limits(max_connections=32, max_keepalive_connections=32)
    async with httpx.AsyncClient(base_url=url, timeout=60, limits=limits) as via, \
            httpx.AsyncClient(transport=httpx.AsyncHTTPTransport(uds=str(socket), limits=limits),
                              base_url="http://engine", timeout=60) as direct:
        proxied, engine = Way(via, proxied=True), Way(direct, proxied=False)
        for way in (proxied, engine):  # warm up connections and code paths
            for _ in range(3):
                await way.cycle(Samples())
        cpu = await server_cpu(proxied, proc, rounds=cpu_rounds, per_round=cpu_per_round,
                                idle_s=idle_s)
        one = (Samples(), Samples())
        for _ in range(cycles_1):
            await proxied.cycle(one[0])
            await engine.cycle(one[1])
        many = (Samples(), Samples())
        for _ in range(rounds_16):
            await _concurrent(proxied.cycle, many[0], proc, workers=16, per_worker=per_worker_16)
            await _concurrent(engine.cycle, many[1], proc, workers=16, per_worker=per_worker_16)
    return cpu, {1: one, 16: many}


def engine_socket(workdir: Path, run_id: str) -> Path:
    """Where the server told the engine to listen (docs/internals.md, socket path rule)."""
    path = workdir / "runs" / run_id / "engine.sock"
    if path.exists():
        return path
    for candidate in Path(tempfile.gettempdir()).glob(f"ajet-*/ajet-{run_id}.sock"):
        return candidate
    raise RuntimeError(f"no engine socket for run {run_id} under {path.parent} or the temp dir")


def _ms(xs: list[float]) -> float:
    return statistics.median(xs) * 1000


def _rows(cpu: _Cpu, results: dict[int, tuple[Samples, Samples]]) -> list[Row]:
    cpu_ms = cpu.mean * 1000
    split = ", ".join(f"{k} {v * 1000:.3f}" for k, v in cpu.per_call.items())
    rows = [Row(
        f"episode proxy: server CPU time per proxied call ({WORKLOAD}; 1 worker)", cpu_ms,
        "ms", target=f"<= {CPU_TARGET_MS:g} ms", met=cpu_ms <= CPU_TARGET_MS, rerun=RERUN,
        repetitions=3 * cpu.calls,
        note=f"per call ms: {split}; server idle CPU {cpu.idle_per_s * 1000:.1f} ms/s "
             "subtracted")]
    for workers, (via, direct) in results.items():
        who = f"{workers} worker" + ("s" if workers > 1 else "")
        rows.append(Row(
            f"episode cycle via server ({WORKLOAD}), {who}", _ms(via.cycle), "ms",
            "same calls on the engine's Unix socket", _ms(direct.cycle), rerun=RERUN,
            repetitions=len(via.cycle)))
        added = {k: _ms(getattr(via, k)) - _ms(getattr(direct, k)) for k in KINDS}
        per_call = statistics.fmean(added.values())
        split = ", ".join(f"{k} {v:+.2f}" for k, v in added.items())
        if workers == 1:
            rows.append(Row(
                f"episode proxy: added latency per call, {who}", per_call, "ms",
                target=f"<= {LATENCY_TARGET_MS:g} ms", met=per_call <= LATENCY_TARGET_MS,
                rerun=RERUN, repetitions=len(via.cycle),
                note=f"median proxied - median direct, per call ms: {split}"))
            continue
        ratio = via.cycles_per_s() / direct.cycles_per_s()
        calls = 3 * len(via.cycle)
        rows.append(Row(
            f"episode proxy: throughput via server, {who}", via.cycles_per_s(), "episodes/s",
            "direct on the socket", direct.cycles_per_s(),
            target=f">= {THROUGHPUT_TARGET:g}x direct", met=ratio >= THROUGHPUT_TARGET,
            rerun=RERUN, repetitions=len(via.cycle),
            note=f"added latency per call ms: {split}; server CPU "
                 f"{via.cpu_s / calls * 1000:.3f} ms per call at {who}"))
    return rows


def run(ctx: BenchContext) -> list[Row]:
    cycles_1 = 10 if ctx.quick else max(200, 40 * ctx.reps)
    cpu_rounds = 1 if ctx.quick else ctx.reps
    rounds_16 = 1 if ctx.quick else ctx.reps
    per_worker_16 = 2 if ctx.quick else 8
    with LocalServer(ctx.path("episodes")) as server, server.client() as client:
        # 64 tasks x 2 repeats: 128 episode slots, and no group ever completes
        client.submit_config(tiny_job(batch_size=64, num_repeat=2))
        client.start_run()
        status = wait_rolling_on(client, None, previous_run=None)
        if status.run_id is None or server.pid is None:
            raise RuntimeError("the engine is ROLLING without a run id")
        socket = engine_socket(server.workdir, status.run_id)
        cpu, results = asyncio.run(_measure(
            server.url, socket, psutil.Process(server.pid), cycles_1=cycles_1,
            cpu_rounds=cpu_rounds, cpu_per_round=10 if ctx.quick else 100,
            rounds_16=rounds_16, per_worker_16=per_worker_16,
            idle_s=1.0 if ctx.quick else 3.0))
    return _rows(cpu, results)
