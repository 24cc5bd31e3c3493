"""Row 7: the soak of the hardening round (`bench/soak.py`), for its speed and memory.

    python -m bench --only soak

One soak against a real server and engine (ajet-tiny), as `tests/faults/test_soak.py`
runs it: 16 workers with random aborts and hangs, pollers, a code sync with
`force_restart` in the middle, the hostile requests. Reported, never asserted:

- `/health` latency during the soak, p99 of every poll (one every 0.1 s), against the
  same polls on the same server idle just before (goal <= 100 ms);
- the server's resident memory growth over the soak, last sample minus first (goal
  <= 50 MB), with the peak in the note;
- episodes lost: began but not accounted for by the engine's own counts (goal 0).
"""

from __future__ import annotations

import time

import httpx

from bench.context import BenchContext
from bench.harness import CONTROL_TOKEN, STANDBY_ON, WORKER_TOKEN, LocalServer, tiny_job
from bench.report import Row
from bench.soak import RunAccount, SoakConfig, SoakReport, SoakTarget, account, run_soak
from bench.tree import make_tree

__all__ = ["lost", "p99", "rows", "run"]

RERUN = "python -m bench --only soak"
HEALTH_P99_GOAL_MS = 100.0
RSS_GROWTH_GOAL_MB = 50.0
FULL = SoakConfig(workers=16, duration_s=30.0, sync_at_s=10.0, max_s=60.0)
QUICK = SoakConfig(workers=4, duration_s=6.0, sync_at_s=None, max_s=20.0)


def p99(samples: list[float]) -> float:
    """The 99th percentile (nearest rank) of `samples`."""
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, max(0, round(0.99 * len(ordered)) - 1))]


def lost(accounts: list[RunAccount]) -> int:
    """Episodes a worker began that the engine's counts do not account for, over all runs.

    Per run: the engine's claims not explained by the workers' outcomes (nor by begins
    whose answer was lost), and the workers' ended episodes the engine did not take.
    """
    missing = 0
    for acc in accounts:
        if acc.engine is None:
            missing += sum(acc.client.values())
            continue
        began = sum(acc.client.values())
        missing += max(0, began - acc.engine["episodes_claimed"])
        missing += max(0, acc.client["ended"] - acc.engine["episodes_ended"])
        missing += max(0, acc.engine["episodes_ended"] - acc.engine["episodes_trained"]
                       - acc.engine["episodes_waiting"])
    return missing


def _idle_health(url: str, n: int) -> list[float]:
    times = []
    with httpx.Client(timeout=5.0) as http:
        for _ in range(n):
            t0 = time.perf_counter()
            http.get(f"{url}/health")
            times.append(time.perf_counter() - t0)
            time.sleep(0.02)
    return times


def rows(report: SoakReport, accounts: list[RunAccount], idle: list[float]) -> list[Row]:
    health = report.health_s
    p99_ms = p99(health) * 1000 if health else float("nan")
    growth = report.rss_mb[-1] - report.rss_mb[0] if report.rss_mb else float("nan")
    missing = lost(accounts)
    episodes = len(report.episodes)
    note = (f"{len(health)} polls over {report.wall_s:.0f} s, max "
            f"{max(health) * 1000:.0f} ms; {episodes} episodes, {len(accounts)} runs"
            if health else "no polls")
    return [
        Row("soak: /health p99 latency during the soak", p99_ms, "ms",
            "same server idle, p99", p99(idle) * 1000 if idle else None,
            target=f"<= {HEALTH_P99_GOAL_MS:g} ms", rerun=RERUN, repetitions=1, note=note,
            met=p99_ms <= HEALTH_P99_GOAL_MS),
        Row("soak: server RSS growth over the soak", growth, "MB", target=(
            f"<= {RSS_GROWTH_GOAL_MB:g} MB"), rerun=RERUN, repetitions=1,
            note=(f"{report.rss_mb[0]:.0f} -> {report.rss_mb[-1]:.0f} MB, peak "
                  f"{max(report.rss_mb):.0f} MB") if report.rss_mb else "",
            met=growth <= RSS_GROWTH_GOAL_MB),
        Row("soak: episodes lost", float(missing), "episodes", target="0", rerun=RERUN,
            repetitions=1, note=f"{dict(report.outcomes())}; hostile answers "
                                f"{sum(h.ok for h in report.hostile)}/{len(report.hostile)} "
                                "as expected", met=missing == 0),
    ]


def run(ctx: BenchContext) -> list[Row]:
    config = QUICK if ctx.quick else FULL
    tree = make_tree(ctx.path("soak-tree"), files=100, total_bytes=1_000_000)
    env = {"AJET_SWARM_HEADER_TIMEOUT_S": str(config.header_timeout_s),
           "AJET_SWARM_LOG_REGEX_TIMEOUT_S": "0.3", "AJET_SWARM_STOP_GRACE_S": "60",
           **STANDBY_ON}
    with LocalServer(ctx.path("soak"), env=env) as server, server.client() as client:
        client.push_code(tree.root)
        client.configure_and_start(tiny_job(batch_size=4, num_repeat=2, max_new_tokens=4,
                                            episode_timeout_s=config.episode_timeout_s),
                                   wait_timeout=300)
        idle = _idle_health(server.url, 20 if ctx.quick else 200)
        assert server.pid is not None
        report = run_soak(SoakTarget(url=server.url, port=server.port, pid=server.pid,
                                     workdir=server.workdir, control_token=CONTROL_TOKEN,
                                     worker_token=WORKER_TOKEN, repo=tree.root), config)
        accounts = account(report, server.workdir)
    if report.errors:
        raise RuntimeError(f"the soak saw errors: {report.errors[:3]}")
    return rows(report, accounts, idle)
