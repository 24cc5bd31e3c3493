"""Profile the swarm server on the episode plane with py-spy.

    python -m bench.profile_episodes [--seconds 20] [--workers 1] [--out profile.txt]

Starts a real server and engine (ajet-tiny) as `bench_episodes` does, drives the bench's
proxied episode cycle (begin, chat, end) for `--seconds`, and samples the server process
with `py-spy record` meanwhile (idle threads are not sampled, so the counts are where
the server spends CPU). Prints the top functions by own samples and by inclusive
samples, and writes py-spy's collapsed stacks to `--out` (load it in speedscope or
flamegraph.pl). py-spy is in the `dev` extra; attaching needs ptrace rights over the
server (root, or `kernel.yama.ptrace_scope` 0).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import psutil

from bench.bench_episodes import _Samples, _Way
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
        way = _Way(client, proxied=True)
        samples = _Samples()
        deadline = time.monotonic() + seconds

        async def worker() -> None:
            while time.monotonic() < deadline:
                await way.cycle(samples)

        await asyncio.gather(*(worker() for _ in range(workers)))
        return len(samples.cycle)


def _per_call(seconds: float, cycles: int) -> str:
    return f"{seconds / max(1, 3 * cycles) * 1000:.3f} ms"


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
    args = p.parse_args(argv)
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
