"""Rollout workflows run in a child process with no token and no approvals folder.

The episode plane here is a small stdlib HTTP server on a real loopback socket that
answers `begin_episode` / `end_episode` / `abort_episode` like the swarm server (the
real engine runs in test_end_to_end.py); what is under test is the bridge's process
isolation: the child's environment, which `ajet` it imports, who claims episodes, and
that a crashing or hanging workflow is stopped and reported without harming the bridge.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

import ajet
from mcp_bridge.rollouts import RolloutManager
from tests.support import make_ajet_repo

CONTROL = "bridge-control-token"
WORKER = "bridge-worker-token"

WORKFLOW = '''
import json, os, sys, time
from pathlib import Path
import ajet

REPORT = Path(__file__).with_name("report.json")
TASKS = [{"task_id": "t1"}]

def workflow(task, episode):
    REPORT.write_text(json.dumps({
        "env": sorted(k for k in os.environ if k.startswith("AJET")),
        "ajet": ajet.__file__, "cwd": os.getcwd(), "key": episode.openai_api_key}))
    mode = Path(__file__).with_name("mode.txt").read_text().strip()
    if mode == "crash":
        os._exit(7)
    if mode == "hang":
        time.sleep(1000)
    if mode == "noimport":
        import a_package_the_laptop_lacks  # noqa: F401
    print("a workflow print must not break the protocol")
    return 0.5
'''


class _Episodes(ThreadingHTTPServer):
    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.calls: list[tuple[str, str | None]] = []
        self.lock = threading.Lock()
        self.n = 0


class _Handler(BaseHTTPRequestHandler):
    server: _Episodes

    def log_message(self, *args: Any) -> None:
        pass

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        length = int(self.headers.get("Content-Length") or 0)
        self.rfile.read(length)
        auth = self.headers.get("Authorization", "").removeprefix("Bearer ") or None
        with self.server.lock:
            self.server.calls.append((self.path, auth))
            self.server.n += 1
            n = self.server.n
        body: dict[str, Any]
        if self.path == "/begin_episode":
            body = {"episode_uuid": f"ep-{n}", "openai_base_url": "http://127.0.0.1:1/v1",
                    "openai_api_key": f"key-{n}"}
        elif self.path == "/end_episode":
            body = {"episode_uuid": "x", "accepted": True}
        else:
            body = {"episode_uuid": "x", "requeued": True}
        data = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


@pytest.fixture
def episodes() -> Iterator[_Episodes]:
    server = _Episodes()
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server
    server.shutdown()
    server.server_close()


@pytest.fixture
def repo(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    repo = make_ajet_repo(tmp_path / "repo")
    (repo / "flows").mkdir()
    (repo / "flows" / "wf.py").write_text(WORKFLOW)
    # the bridge's own environment holds every secret; the child must see none of them
    monkeypatch.setenv("AJET_SWARM_TOKEN", CONTROL)
    monkeypatch.setenv("AJET_SWARM_APPROVER_TOKEN", "approver-secret")
    monkeypatch.setenv("AJET_MCP_APPROVALS_DIR", str(tmp_path / "approvals"))
    return repo


def _wait(predicate: Any, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


@pytest.mark.parametrize("worker_token", [WORKER, None], ids=["worker-mode", "relay-mode"])
def test_the_child_has_no_secrets_and_uses_the_right_token(
        episodes: _Episodes, repo: Path, worker_token: str | None) -> None:
    (repo / "flows" / "mode.txt").write_text("ok")
    url = f"http://127.0.0.1:{episodes.server_address[1]}"
    manager = RolloutManager(url, token=CONTROL, worker_token=worker_token, repo=repo)
    job = manager.start("flows/wf.py:workflow", n_workers=1, num_repeat=1, max_episodes=3)
    try:
        _wait(lambda: job.stats().get("episodes_ended", 0) >= 3)
    finally:
        manager.stop_all(timeout=10)
    report = json.loads((repo / "flows" / "report.json").read_text())
    assert report["env"] == []  # no AJET_SWARM_* / AJET_MCP_* variable at all
    assert report["ajet"] == ajet.__file__  # the bridge's installed ajet, not repo/ajet
    assert report["cwd"] == str(repo) and report["key"].startswith("key-")
    used = {token for path, token in episodes.calls if path == "/begin_episode"}
    assert used == {worker_token or CONTROL}  # relay: the bridge claimed with its own
    assert not job.running() and job.error is None


@pytest.mark.parametrize("mode", ["crash", "hang"])
def test_a_crashing_or_hanging_workflow_is_stopped_and_reported(
        episodes: _Episodes, repo: Path, mode: str) -> None:
    (repo / "flows" / "mode.txt").write_text(mode)
    url = f"http://127.0.0.1:{episodes.server_address[1]}"
    for worker_token in (WORKER, None):
        manager = RolloutManager(url, token=CONTROL, worker_token=worker_token, repo=repo,
                                 workflow_timeout_s=1.5)
        job = manager.start("flows/wf.py:workflow", n_workers=1, num_repeat=1)
        try:
            _wait(lambda: not job.running(), timeout=30)
            expected = "exited with code 7" if mode == "crash" else "ran over 1.5s"
            assert job.error is not None and expected in job.error, job.error
            assert job.child.proc.poll() is not None  # the child is gone
        finally:
            manager.stop_all(timeout=5)


def test_a_workflow_that_cannot_load_is_an_error(repo: Path) -> None:
    (repo / "flows" / "broken.py").write_text("raise RuntimeError('boom at import')\n")
    manager = RolloutManager("http://127.0.0.1:1", token=CONTROL, repo=repo)
    with pytest.raises(ValueError, match="boom at import"):
        manager.start("flows/broken.py:workflow", n_workers=1, num_repeat=1)
    assert manager.all() == []


def test_a_workflow_missing_a_package_stops_and_rollout_status_names_the_fix(
        episodes: _Episodes, repo: Path) -> None:
    from types import SimpleNamespace

    from mcp_bridge import tools

    (repo / "flows" / "mode.txt").write_text("noimport")
    url = f"http://127.0.0.1:{episodes.server_address[1]}"
    manager = RolloutManager(url, token=CONTROL, worker_token=WORKER, repo=repo)
    job = manager.start("flows/wf.py:workflow", n_workers=2, num_repeat=1)
    try:
        _wait(lambda: not job.running(), timeout=60)
        status = tools.rollout_status(SimpleNamespace(rollouts=manager))  # type: ignore[arg-type]
    finally:
        manager.stop_all(timeout=10)
    assert "a_package_the_laptop_lacks" in status.message
    assert "pip install a_package_the_laptop_lacks" in status.message
    assert "Next: read_metrics" not in status.message
    begun = sum(1 for path, _ in episodes.calls if path == "/begin_episode")
    assert begun < 40, f"{begun} episodes begun for a workflow that can never run"
