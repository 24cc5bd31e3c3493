"""A snapshot of older code still runs on today's server.

A snapshot carries its own whole `ajet/`, so the server must keep only its seams with
the snapshot stable (docs/design.md, "Seams between the server and a snapshot"): the
engine's command line, the validator, the status report, the private socket and the
error bodies. This test takes `ajet/` from the commit before the engine was re-housed
into rooms, out of the repository's own history, syncs it to a server of today, starts
the engine on it and runs an episode through the public episode plane.
"""

from __future__ import annotations

import io
import subprocess
import tarfile
import time
from pathlib import Path

import httpx
import pytest

from ajet.client import SwarmClient
from tests.support import CONTROL_TOKEN, PROJECT_ROOT, WORKER_TOKEN, start_server

#: The last commit whose engine was one flat folder (ajet/engine/chat_api.py and friends).
BEFORE_REHOUSING = "93a6493"

pytestmark = pytest.mark.slow


def _old_ajet_repo(root: Path) -> Path:
    """A git repository at `root` whose `ajet/` is the one of `BEFORE_REHOUSING`."""
    probe = subprocess.run(["git", "-C", str(PROJECT_ROOT), "cat-file", "-e",
                            f"{BEFORE_REHOUSING}^{{commit}}"], capture_output=True)
    if probe.returncode != 0:
        pytest.skip(f"commit {BEFORE_REHOUSING} is not in this checkout's history "
                    "(a shallow clone?): fetch the full history to run this test")
    archive = subprocess.run(["git", "-C", str(PROJECT_ROOT), "archive", BEFORE_REHOUSING,
                              "ajet"], capture_output=True, check=True).stdout
    root.mkdir(parents=True)
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(root, filter="data")
    git = ["git", "-c", "user.email=t@example.com", "-c", "user.name=test", "-C", str(root)]
    subprocess.run(["git", "init", "-q", "-b", "main", str(root)], check=True)
    subprocess.run([*git, "add", "ajet"], check=True)
    subprocess.run([*git, "commit", "-q", "-m", "before re-housing"], check=True)
    return root


def test_snapshot_from_before_the_rehousing_serves_and_trains(tmp_path: Path) -> None:
    repo = _old_ajet_repo(tmp_path / "old")
    assert (repo / "ajet" / "engine" / "chat_api.py").is_file()  # really the old layout
    handle = start_server(tmp_path / "srv", env={"AJET_SWARM_TOKEN": CONTROL_TOKEN,
                                                 "AJET_SWARM_WORKER_TOKEN": WORKER_TOKEN})
    try:
        with SwarmClient(handle.url, token=CONTROL_TOKEN) as control:
            synced = control.push_code(repo)
            # the fields the old code knows, as a user of that code writes them
            control.submit_config("experiment_name: old-snapshot\nmodel: ajet-tiny\n"
                                  "batch_size: 1\nnum_repeat: 2\nn_gpu: 0\n")
            control.start_run(wait=True, wait_timeout=180)
            status = control.engine_status()
            # the engine runs the old code, from the snapshot's folder
            assert status.snapshot_id == synced.snapshot_id
            assert status.ajet_file and status.ajet_file.startswith(str(handle.workdir / synced.path))
            episodes = []
            for _ in range(2):
                episode = control.open_episode(task_id="t0")
                reply = httpx.post(
                    f"{episode.openai_base_url}/chat/completions",
                    headers={"Authorization": f"Bearer {episode.openai_api_key}"},
                    json={"model": "ajet-tiny", "max_tokens": 4,
                          "messages": [{"role": "user", "content": "say 7"}]},
                    timeout=60)
                assert reply.status_code == 200, reply.text
                assert reply.json()["choices"][0]["message"]["role"] == "assistant"
                episodes.append(control.report_episode(episode.episode_uuid, "t0", 1.0))
            assert all(e.accepted for e in episodes)
            deadline = time.monotonic() + 120
            while (control.engine_status().step or 0) < 1:  # the old engine trains too
                assert time.monotonic() < deadline, "the old engine never finished a step"
                time.sleep(0.2)
    finally:
        handle.stop()
