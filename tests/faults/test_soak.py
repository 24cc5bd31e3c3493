"""The soak: mixed traffic on loopback against a real server and engine
(ajet-tiny on CPU), and proof that nothing is lost.

16 workers with random aborts and hangs past the episode timeout, status/metrics/log
polling, a one-file code sync with `force_restart` in the middle (a second run), and the
hostile requests of the adversarial review (`bench/soak.py` drives all of it; `make
bench` runs the same soak for its latency and memory row). Afterwards:

- every episode is accounted for: each one a worker began has exactly one outcome
  (ended, aborted, re-queued, refused with a reason), and per run those counts agree
  with the engine's own (`episodes at stop` in its log) and its metrics: every ended
  episode trained in exactly one step or still waiting for its group when its run
  stopped, every claim closed exactly once;
- no thread was wedged: every `/health` poll was answered within 5 s, no 5xx anywhere;
- each hostile request got the answer it must get;
- the ledger is consistent: OFFLINE, no open run, no orphan, the store whole, both runs
  ended with their metrics, the sync in the audit log.
"""

from __future__ import annotations

import math
from pathlib import Path

import httpx
import psutil
import pytest

from ajet.client import SwarmClient
from ajet.copilot.job import AgentJetJob
from ajet.protocol import EngineState
from bench.soak import SoakConfig, SoakTarget, account, run_soak
from tests.support import CONTROL_TOKEN, WORKER_TOKEN, make_ajet_repo, start_server
from tests.support.environ import leaked
from tests.support.invariants import assert_consistent

pytestmark = pytest.mark.slow

CONFIG = SoakConfig(workers=16, duration_s=20.0, sync_at_s=7.0, after_sync_ended=16,
                    max_s=45.0, episode_timeout_s=2.0, header_timeout_s=2.0)
JOB = AgentJetJob(experiment_name="soak", batch_size=4, num_repeat=2, max_new_tokens=4,
                  episode_timeout_s=CONFIG.episode_timeout_s)
CTL = {"Authorization": f"Bearer {CONTROL_TOKEN}"}


def test_soak_loses_no_episode_and_wedges_nothing(tmp_path: Path) -> None:
    workdir = tmp_path / "swarm"
    repo = make_ajet_repo(tmp_path / "repo")
    server = start_server(workdir, env={
        "AJET_SWARM_TOKEN": CONTROL_TOKEN, "AJET_SWARM_WORKER_TOKEN": WORKER_TOKEN,
        "AJET_SWARM_HEADER_TIMEOUT_S": str(CONFIG.header_timeout_s),
        "AJET_SWARM_LOG_REGEX_TIMEOUT_S": "0.3", "AJET_SWARM_STOP_GRACE_S": "60",
        "AJET_SWARM_STATUS_POLL_S": "0.05",
        # the default: the restart in the middle takes the warm standby (about 1 s)
        "AJET_SWARM_WARM_STANDBY": "1"})
    try:
        with SwarmClient(server.url, token=CONTROL_TOKEN, timeout=120) as control:
            control.push_code(repo)
            status = control.configure_and_start(JOB, wait_timeout=180)
        assert status.pid is not None and not leaked(status.pid)  # the real engine: no token

        report = run_soak(SoakTarget(url=server.url, port=server.port, pid=server.proc.pid,
                                     workdir=workdir, control_token=CONTROL_TOKEN,
                                     worker_token=WORKER_TOKEN, repo=repo), CONFIG)

        # nor the warm standby waiting for the next start
        tree = [p.pid for p in psutil.Process(server.proc.pid).children(recursive=True)]
        assert tree, "the warm standby should be waiting"
        for pid in tree:
            assert not leaked(pid), (pid, leaked(pid))

        # nothing wedged, nothing failed
        assert len(report.health_s) > 100 and max(report.health_s) < 5.0, max(report.health_s)
        assert not report.errors, report.errors[:10]
        assert report.polls and all(code < 500 for code in report.polls), report.polls
        for attack in report.hostile:
            assert attack.ok, attack
        assert len(report.hostile) == 9, [a.name for a in report.hostile]
        assert report.tool_chats > 10, report.tool_chats  # chats that offered a tool
        assert report.sync is not None and report.sync.restarted

        # every episode accounted for, per run, against the engine's own counts
        outcomes = report.outcomes()
        assert outcomes["ended"] > 50 and outcomes["aborted"] > 20, outcomes
        assert outcomes["requeued"] >= 1, outcomes  # the hangs
        assert set(outcomes) <= {"ended", "aborted", "requeued", "refused"}, outcomes
        assert all(e.reason for e in report.episodes if e.outcome in ("refused", "requeued"))
        accounts = account(report, workdir)
        assert len([a for a in accounts if sum(a.client.values())]) == 2  # both runs served
        for acc in accounts:
            engine, client = acc.engine, acc.client
            assert engine is not None, f"run {acc.run_id} left no account of its episodes"
            began = sum(client.values())
            assert began <= engine["episodes_claimed"] <= began + acc.ambiguous_begins, acc
            assert client["ended"] <= engine["episodes_ended"] <= (
                client["ended"] + acc.ambiguous_ends), acc
            assert client["aborted"] <= engine["episodes_aborted"] <= (
                client["aborted"] + acc.ambiguous_ends), acc
            assert engine["episodes_claimed"] == (
                engine["episodes_ended"] + engine["episodes_aborted"]
                + engine["episodes_timed_out"] + engine["episodes_in_flight"]), acc
            assert engine["episodes_ended"] == (engine["episodes_trained"]
                                                + engine["episodes_waiting"]), acc
            assert sum(acc.trained_per_step) == engine["episodes_trained"], acc
            assert client["requeued"] <= engine["episodes_timed_out"], acc
        assert sum(sum(a.trained_per_step) for a in accounts) > 0

        # the ledger: both runs ended, their metrics whole, the sync audited
        assert_consistent(server.url, workdir, headers=CTL)
        with SwarmClient(server.url, token=CONTROL_TOKEN) as control:
            for acc in accounts:
                run = control.get_run(acc.run_id)
                assert run.status == "ended" and run.reason, run
                steps = [p["step"] for p in control.get_metrics(acc.run_id).points]
                assert steps == list(range(1, len(steps) + 1))
            assert control.engine_status().state is EngineState.OFFLINE
        audit = httpx.get(f"{server.url}/audit", headers=CTL, params={"limit": 1000}).json()
        syncs = [e for e in audit["entries"] if e["action"] == "sync_code"]
        assert syncs[-1]["outcome"] == "ok" and syncs[-1]["detail"]["force_restart"]
        assert math.isfinite(max(report.rss_mb))
    finally:
        server.stop()
