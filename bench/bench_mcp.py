"""Row 4: an MCP tool call over stdio against the same `SwarmClient` call made directly.

    python -m bench --only mcp

The installed `ajet-mcp` console script runs as a subprocess of the official `mcp`
client (`mcp.Client` with `StdioServerParameters`), against a real swarm server with
tokens on loopback. `engine_status` is one `GET /get_engine_status` plus the bridge's
own bookkeeping; the reference is `SwarmClient.engine_status()` in this process.
Calls alternate one by one, after a warm-up. Target: at most 10 ms median overhead.

Also reported: the bridge's start, from spawning `ajet-mcp` to the first tool result,
against a bare interpreter importing the MCP server SDK (`from mcp.server import
MCPServer`, the floor DESIGN names at about 0.6 s).
"""

from __future__ import annotations

import asyncio
import statistics
import subprocess
import sys
import time
from pathlib import Path

from mcp import Client, StdioServerParameters

from ajet.client import SwarmClient
from bench.context import BenchContext
from bench.harness import CONTROL_TOKEN, LocalServer, child_env
from bench.report import Row

__all__ = ["run"]

RERUN = "python -m bench --only mcp"
OVERHEAD_TARGET_MS = 10.0
AJET_MCP = Path(sys.executable).with_name("ajet-mcp")


def _params(url: str, repo: Path, approvals: Path) -> StdioServerParameters:
    return StdioServerParameters(
        command=str(AJET_MCP),
        args=["--swarm-url", url, "--repo", str(repo), "--approvals-dir", str(approvals),
              "--approval", "queue", "--log-level", "WARNING"],
        env={"AJET_SWARM_TOKEN": CONTROL_TOKEN})


async def _engine_status(client: Client) -> None:
    result = await client.call_tool("engine_status", {})
    if result.is_error or not result.structured_content:
        raise RuntimeError(f"engine_status over MCP failed: {result.content}")


async def _alternate(params: StdioServerParameters, direct: SwarmClient, n: int
                     ) -> tuple[list[float], list[float]]:
    via_mcp: list[float] = []
    via_client: list[float] = []
    async with Client(params) as client:
        for _ in range(5):  # warm up both paths
            await _engine_status(client)
            direct.engine_status()
        for _ in range(n):
            t0 = time.perf_counter()
            await _engine_status(client)
            via_mcp.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            direct.engine_status()
            via_client.append(time.perf_counter() - t0)
    return via_mcp, via_client


async def _startup(params: StdioServerParameters) -> float:
    t0 = time.perf_counter()
    async with Client(params) as client:
        await _engine_status(client)
        return time.perf_counter() - t0


def _sdk_floor() -> float:
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-c", "from mcp.server import MCPServer"], check=True,
                   env=child_env())
    return time.perf_counter() - t0


def run(ctx: BenchContext) -> list[Row]:
    if not AJET_MCP.exists():
        raise RuntimeError(f"{AJET_MCP} is missing; install the project (`make setup`)")
    n = 20 if ctx.quick else max(100, 20 * ctx.reps)
    with LocalServer(ctx.path("mcp")) as server, server.client() as direct:
        params = _params(server.url, ctx.tree.root, ctx.path("approvals"))
        via_mcp, via_client = asyncio.run(_alternate(params, direct, n))
        starts: list[float] = []
        floors: list[float] = []
        for _ in range(ctx.reps):
            starts.append(asyncio.run(_startup(params)))
            floors.append(_sdk_floor())

    mcp_ms = statistics.median(via_mcp) * 1000
    client_ms = statistics.median(via_client) * 1000
    overhead = mcp_ms - client_ms
    return [
        Row("MCP engine_status over stdio (ajet-mcp)", mcp_ms, "ms",
            "SwarmClient.engine_status()", client_ms, rerun=RERUN, repetitions=n),
        Row("MCP tool overhead over the direct call", overhead, "ms",
            target=f"<= {OVERHEAD_TARGET_MS:g} ms", met=overhead <= OVERHEAD_TARGET_MS,
            rerun=RERUN, repetitions=n),
        Row("ajet-mcp start to first tool result", statistics.median(starts), "s",
            "python -c 'from mcp.server import MCPServer'", statistics.median(floors),
            rerun=RERUN, repetitions=ctx.reps),
    ]
