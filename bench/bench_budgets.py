"""DESIGN "Budgets" that are cheap to show: client import time, server memory.

    python -m bench --only budgets

- Import time of `import ajet` + `SwarmClient` (compatibility path) + `AgentJetJob`, in
  a fresh interpreter, timed inside it; torch and transformers must not be imported.
  Reference: the same interpreter importing only the client's own dependencies
  (`httpx`, `pydantic`, `yaml`). Budget: well under 0.5 s.
- Server idle RSS: a fresh `ajet-swarm` server once `/health` answers and it has idled
  for half a second. Reference: the floor DESIGN names, a bare interpreter importing
  FastAPI + uvicorn + httpx (its RSS then). Budget: < 120 MB.
- Server RSS growth during a 64 MiB upload, sampled every 5 ms from another thread: the
  one-shot zip (`POST /sync_train_code`, spooled to disk, then extracted) and the blob
  stream (`POST /code/blobs`), each on a fresh server. The data is random, so nothing
  compresses. Budget: at most 32 MiB over the idle figure.
"""

from __future__ import annotations

import hashlib
import json
import os
import statistics
import subprocess
import sys
import threading
import time
import zipfile
from pathlib import Path

from bench.context import BenchContext
from bench.harness import LocalServer, child_env, rss_mb
from bench.report import Row

__all__ = ["run"]

RERUN = "python -m bench --only budgets"
IMPORT_BUDGET_S = 0.5
IDLE_RSS_BUDGET_MB = 120.0
UPLOAD_GROWTH_BUDGET_MB = 32.0
MiB = 1024 * 1024

_IMPORT_CODE = """
import json, sys, time
t0 = time.perf_counter()
{imports}
elapsed = time.perf_counter() - t0
heavy = sorted(m for m in ("torch", "transformers") if m in sys.modules)
print(json.dumps({{"seconds": elapsed, "heavy": heavy}}))
"""
_CLIENT_IMPORTS = ("import ajet\n"
                   "from ajet.tuner_lib.experimental.swarm_client import SwarmClient\n"
                   "from ajet.copilot.job import AgentJetJob")
_DEPS_IMPORTS = "import httpx, pydantic, yaml"
# RSS once imported; not ru_maxrss, which Linux carries over from the parent across exec
_SERVER_FLOOR = ("import fastapi, uvicorn, httpx, psutil\n"
                 "print(psutil.Process().memory_info().rss / 2**20)")


def _import_once(imports: str) -> tuple[float, list[str]]:
    out = subprocess.run([sys.executable, "-c", _IMPORT_CODE.format(imports=imports)],
                         capture_output=True, text=True, check=True, env=child_env(),
                         cwd=Path.home())
    data = json.loads(out.stdout.strip().splitlines()[-1])
    return float(data["seconds"]), list(data["heavy"])


def _server_floor_mb() -> float:
    out = subprocess.run([sys.executable, "-c", _SERVER_FLOOR], capture_output=True, text=True,
                         check=True, env=child_env())
    return float(out.stdout.strip().splitlines()[-1])


class _PeakRss:
    """Samples a process's RSS every `interval_s` in a thread; `peak` in MiB."""

    def __init__(self, pid: int, interval_s: float = 0.005) -> None:
        self.pid, self.interval_s, self.peak = pid, interval_s, 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, rss_mb(self.pid) or 0.0)
            time.sleep(self.interval_s)

    def __enter__(self) -> _PeakRss:
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stop.set()
        self._thread.join()


def _random_parts(total: int, parts: int) -> list[bytes]:
    return [os.urandom(total // parts) for _ in range(parts)]


def _write_zip(dest: Path, data: list[bytes]) -> Path:
    with zipfile.ZipFile(dest, "w", compression=zipfile.ZIP_STORED) as zf:
        zf.writestr("ajet/__init__.py", '"""upload budget check"""\n')
        for i, blob in enumerate(data):
            zf.writestr(f"ajet/data/part_{i}.bin", blob)
    return dest


def _blob_body(data: list[bytes]) -> bytes:
    return b"".join(part for blob in data for part in (
        f"{hashlib.sha256(blob).hexdigest()} {len(blob)}\n".encode(), blob))


def _idle_rss(server: LocalServer) -> tuple[int, float]:
    """(pid, RSS MiB) of a server that has idled for half a second."""
    time.sleep(0.5)
    pid = server.pid
    rss = rss_mb(pid)
    if pid is None or rss is None:
        raise RuntimeError(f"the swarm server exited while idle; see {server.log_path}")
    return pid, rss


def run(ctx: BenchContext) -> list[Row]:
    reps = ctx.reps
    client_s: list[float] = []
    deps_s: list[float] = []
    heavy: set[str] = set()
    for _ in range(reps):
        seconds, loaded = _import_once(_CLIENT_IMPORTS)
        client_s.append(seconds)
        heavy.update(loaded)
        deps_s.append(_import_once(_DEPS_IMPORTS)[0])

    upload_bytes = 8 * MiB if ctx.quick else 64 * MiB
    data = _random_parts(upload_bytes, 4)  # 4 files of 16 MiB: under the 32 MiB file cap
    zip_path = _write_zip(ctx.path("upload").with_suffix(".zip"), data)
    body = _blob_body(data)
    idle: list[float] = []
    floor: list[float] = []
    zip_growth: list[float] = []
    blob_growth: list[float] = []
    for _ in range(reps):
        floor.append(_server_floor_mb())
        with LocalServer(ctx.path("budget-zip")) as server, server.client() as client:
            pid, base = _idle_rss(server)
            idle.append(base)
            with _PeakRss(pid) as peak:
                client.push_code_zip(zip_path)
            zip_growth.append(peak.peak - base)
        with LocalServer(ctx.path("budget-blobs")) as server, server.client() as client:
            pid, base = _idle_rss(server)
            with _PeakRss(pid) as peak:
                client.upload_blob_batch(body)
            blob_growth.append(peak.peak - base)
    zip_path.unlink()

    import_median = statistics.median(client_s)
    idle_median = statistics.median(idle)
    size = f"{upload_bytes // MiB} MiB"
    return [
        Row("import ajet + SwarmClient + AgentJetJob", import_median * 1000, "ms",
            "import httpx, pydantic, yaml", statistics.median(deps_s) * 1000,
            target=f"< {IMPORT_BUDGET_S * 1000:.0f} ms, no torch", rerun=RERUN,
            repetitions=reps, met=import_median < IMPORT_BUDGET_S and not heavy,
            note=f"heavy modules imported: {', '.join(sorted(heavy)) or 'none'}"),
        Row("swarm server idle RSS", idle_median, "MB", "python: import fastapi, uvicorn, httpx",
            statistics.median(floor), target=f"< {IDLE_RSS_BUDGET_MB:.0f} MB", rerun=RERUN,
            repetitions=reps, met=idle_median < IDLE_RSS_BUDGET_MB),
        Row(f"server RSS growth, {size} zip POST /sync_train_code", statistics.median(zip_growth),
            "MB", target=f"<= {UPLOAD_GROWTH_BUDGET_MB:.0f} MB", rerun=RERUN, repetitions=reps,
            met=max(zip_growth) <= UPLOAD_GROWTH_BUDGET_MB, note=f"max {max(zip_growth):.1f}"),
        Row(f"server RSS growth, {size} POST /code/blobs", statistics.median(blob_growth), "MB",
            target=f"<= {UPLOAD_GROWTH_BUDGET_MB:.0f} MB", rerun=RERUN, repetitions=reps,
            met=max(blob_growth) <= UPLOAD_GROWTH_BUDGET_MB, note=f"max {max(blob_growth):.1f}"),
    ]
