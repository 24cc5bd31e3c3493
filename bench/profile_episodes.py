"""Profile the swarm server on the episode plane with py-spy, or count its Python calls
with cProfile.

    python -m bench.profile_episodes [--seconds 20] [--workers 1] [--out profile.txt]
    python -m bench.profile_episodes --cprofile 200 [--top 25]

Starts a real server and engine (ajet-tiny) as `bench_episodes` does, drives the bench's
proxied episode cycle (begin, chat, end) for `--seconds`, and samples the server process
with `py-spy record` meanwhile (idle threads are not sampled, so the counts are where
the server spends CPU). Prints the top functions by own samples and by inclusive
samples, and writes py-spy's collapsed stacks to `--out` (load it in speedscope or
flamegraph.pl). py-spy is in the `dev` extra; attaching needs ptrace rights over the
server (root, or `kernel.yama.ptrace_scope` 0).

`--cprofile N` runs the server under `bench.profiled_server` instead and profiles it with
cProfile over N calls of each kind (begin, chat, end, one at a time, as the bench's CPU
row does), less an idle window as long (the engine status poll). It prints, per kind,
the Python function calls per proxied call (a figure that does not depend on the
machine's load) and the functions with the most cumulative and own time per call, and
writes each kind's pstats next to `--out` (`python -m pstats FILE`).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import os
import pstats
import re
import signal
import shutil
import subprocess
import sys
import tempfile
import statistics
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
import psutil

from bench.bench_episodes import KINDS, Samples, Way
from bench.harness import LocalServer, tiny_job, wait_rolling_on

__all__ = ["main", "top"]

_LINE = re.compile(r" \(([^():]+):\d+\)$")  # "fn (file.py:12)" -> "fn (file.py)"


def top(collapsed: str, n: int = 25) -> tuple[list[tuple[str, int]], list[tuple[str, int]], int]:
    """(by own samples, by inclusive samples, total samples) of py-spy's raw output."""
    own: collections.Counter[str] = collections.Counter()
    incl: collections.Counter[str] = collections.Counter()
    total = 0
    for line in collapsed.splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        frames = [_LINE.sub(lambda m: f" ({Path(m.group(1)).name})", f)
                  for f in stack.split(";")[1:]]  # the first frame is the thread
        if not frames:
            continue
        total += int(count)
        own[frames[-1]] += int(count)
        for frame in set(frames):
            incl[frame] += int(count)
    return own.most_common(n), incl.most_common(n), total


async def _drive(url: str, seconds: float, workers: int) -> int:
    limits = httpx.Limits(max_connections=32, max_keepalive_connections=32)
    async with httpx.AsyncClient(base_url=url, timeout=60, limits=limits) as client:
        way = Way(client, proxied=True)
        samples = Samples()
        deadline = time.monotonic() + seconds

        async def worker() -> None:
            while time.monotonic() < deadline:
                await way.cycle(samples)

        await asyncio.gather(*(worker() for _ in range(workers)))
        return len(samples.cycle)


def _per_call(seconds: float, cycles: int) -> str:
    return f"{seconds / max(1, 3 * cycles) * 1000:.3f} ms"


class _Switch:
    """Starts and stops the cProfile of a `bench.profiled_server` process."""

    def __init__(self, pid: int, out: Path) -> None:
        self.pid = pid
        self.out = out

    async def profiled(self, calls: Callable[[], Awaitable[object]] | None, n: int,
                       seconds: float = 0.0) -> tuple[pstats.Stats, float]:
        """The stats over `n` awaited `calls` (or over `seconds` idle), and the wall time."""
        marker = self.out.with_suffix(".on")
        for stale in (self.out, marker):
            stale.unlink(missing_ok=True)
        os.kill(self.pid, signal.SIGUSR1)
        while not marker.exists():
            await asyncio.sleep(0.005)
        t0 = time.perf_counter()
        if calls is None:
            await asyncio.sleep(seconds)
        else:
            for _ in range(n):
                await calls()
        wall = time.perf_counter() - t0
        os.kill(self.pid, signal.SIGUSR2)
        while not self.out.exists():
            await asyncio.sleep(0.005)
        return pstats.Stats(str(self.out)), wall


def _per_call_rows(stats: pstats.Stats, idle: pstats.Stats, idle_scale: float, n: int,
                   key: int, top_n: int) -> list[tuple[float, float, str]]:
    """(calls, seconds) per proxied call of the top functions by `key` (2: own time,
    3: cumulative), the idle window's share removed."""
    raw: dict[Any, Any] = stats.stats  # type: ignore[attr-defined]
    idle_raw: dict[Any, Any] = idle.stats  # type: ignore[attr-defined]
    rows = []
    for func, (_, ncalls, tottime, cumtime, _) in raw.items():
        base = idle_raw.get(func, (0, 0, 0.0, 0.0, None))
        calls = (ncalls - base[1] * idle_scale) / n
        seconds = ((tottime if key == 2 else cumtime)
                   - (base[2] if key == 2 else base[3]) * idle_scale) / n
        rows.append((seconds, calls, pstats.func_std_string(func)))
    rows.sort(reverse=True)
    return [(calls, seconds, name) for seconds, calls, name in rows[:top_n]]


async def _cprofile_kinds(url: str, switch: _Switch, n: int, top_n: int, *,
                          cpu_clock: bool) -> list[str]:
    limits = httpx.Limits(max_connections=32, max_keepalive_connections=32)
    out: list[str] = []
    async with httpx.AsyncClient(base_url=url, timeout=60, limits=limits) as client:
        way = Way(client, proxied=True)
        for _ in range(20):  # warm up connections, caches and code paths
            await way.cycle(Samples())
        unused: list[float] = []
        begun: list[dict[str, object]] = []
        chats = iter(())  # type: ignore[var-annotated]
        ends = iter(())  # type: ignore[var-annotated]

        async def begin() -> None:
            begun.append(await way.begin(unused))

        async def chat() -> None:
            await way.chat(unused, next(chats))

        async def end() -> None:
            await way.end(unused, next(ends))

        results: dict[str, tuple[pstats.Stats, float]] = {}
        results["begin"] = await switch.profiled(begin, n)
        chats, ends = iter(list(begun)), iter(list(begun))
        results["chat"] = await switch.profiled(chat, n)
        results["end"] = await switch.profiled(end, n)
        wall = statistics.fmean(w for _, w in results.values())
        idle, idle_wall = await switch.profiled(None, 0, seconds=wall)
        idle_calls = idle.total_calls  # type: ignore[attr-defined]
        total = 0.0
        for kind in KINDS:
            stats, kind_wall = results[kind]
            scale = kind_wall / idle_wall
            calls = (stats.total_calls - idle_calls * scale) / n  # type: ignore[attr-defined]
            total += calls
            stats.dump_stats(str(switch.out.with_name(f"{switch.out.stem}-{kind}.pstats")))
            out += [f"{kind}: {calls:.0f} Python function calls per call "
                    f"({stats.total_calls} in {n} calls, "  # type: ignore[attr-defined]
                    f"idle window's {idle_calls * scale:.0f} removed)",
                    f"  cumulative (calls/call, ms/call under the profiler, "
                    f"{'CPU' if cpu_clock else 'wall'} clock):"]
            out += [f"  {c:8.2f} {1000 * s:8.3f}  {name}"
                    for c, s, name in _per_call_rows(stats, idle, scale, n, 3, top_n)]
            out += ["  own time:"]
            out += [f"  {c:8.2f} {1000 * s:8.3f}  {name}"
                    for c, s, name in _per_call_rows(stats, idle, scale, n, 2, top_n)]
            out.append("")
        out.insert(0, f"Python function calls per proxied call, mean of begin, chat, end: "
                      f"{total / len(KINDS):.0f}\n")
    return out


def _cprofile(args: argparse.Namespace) -> int:
    root = Path(tempfile.mkdtemp(prefix="ajp-"))
    out = args.out.with_suffix(".pstats").resolve()
    try:
        env = {"AJET_BENCH_PSTATS": str(out)}
        if args.cpu_clock:
            env["AJET_BENCH_PSTATS_TIMER"] = "thread"
        with LocalServer(root / "server", module="bench.profiled_server", env=env) as server, \
                server.client() as client:
            client.submit_config(tiny_job(batch_size=64, num_repeat=2))
            client.start_run()
            wait_rolling_on(client, None, previous_run=None)
            assert server.pid is not None
            lines = asyncio.run(_cprofile_kinds(server.url, _Switch(server.pid, out),
                                                args.cprofile, args.top,
                                                cpu_clock=args.cpu_clock))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    sys.stdout.write("\n".join(lines) + "\n")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.profile_episodes",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--seconds", type=float, default=20.0)
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--rate", type=int, default=250, help="py-spy samples per second")
    p.add_argument("--out", type=Path, default=Path("episode-profile.txt"))
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--gil", action="store_true",
                   help="sample only the thread holding the GIL (Python work, no syscalls)")
    p.add_argument("--cprofile", type=int, metavar="N", default=0,
                   help="count Python calls with cProfile over N calls of each kind instead")
    p.add_argument("--cpu-clock", action="store_true",
                   help="with --cprofile: time functions by the thread's CPU time, not wall")
    args = p.parse_args(argv)
    if args.cprofile:
        return _cprofile(args)
    py_spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    root = Path(tempfile.mkdtemp(prefix="ajp-"))
    try:
        with LocalServer(root / "server") as server, server.client() as client:
            client.submit_config(tiny_job(batch_size=64, num_repeat=2))
            client.start_run()
            wait_rolling_on(client, None, previous_run=None)
            asyncio.run(_drive(server.url, 2.0, args.workers))  # warm up
            spy = subprocess.Popen(
                [py_spy, "record", "--pid", str(server.pid), "--format", "raw", "--nonblocking",
                 "--rate", str(args.rate), "--duration", str(int(args.seconds)),
                 "--output", str(args.out), *(["--gil"] if args.gil else [])],
                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
            proc = psutil.Process(server.pid)
            before = proc.cpu_times()
            cycles = asyncio.run(_drive(server.url, args.seconds, args.workers))
            after = proc.cpu_times()
            _, err = spy.communicate(timeout=args.seconds + 60)
            if spy.returncode != 0:
                sys.stderr.write(f"py-spy failed: {err}\n")
                return 1
    finally:
        shutil.rmtree(root, ignore_errors=True)
    own, incl, total = top(args.out.read_text(), args.top)
    head = (f"{cycles} proxied cycles ({3 * cycles} calls), {args.workers} worker(s), "
            f"{total} samples of the server at {args.rate}/s; server CPU per call "
            f"{_per_call(after.user - before.user, cycles)} user, "
            f"{_per_call(after.system - before.system, cycles)} system (status poll included)")
    out = [head, "", "own samples:"]
    out += [f"  {100 * c / total:5.1f}%  {name}" for name, c in own]
    out += ["", "inclusive samples:"]
    out += [f"  {100 * c / total:5.1f}%  {name}" for name, c in incl]
    sys.stdout.write("\n".join(out) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
