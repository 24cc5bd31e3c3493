"""The web console `/ui` in a real browser (Debian's Chromium driven by Playwright) against
a real enforcing server with the real engine (ajet-tiny on CPU).

Sign in as an approver, read the diff of a change that hides a line with escape
sequences, approve, start the engine on it, watch its reward curve on the runs page; a
denial; a post without the CSRF token (refused); a control-token session that looks but
cannot approve; sign-out. Screenshots land in `<tmp>/shots/*.png` (ATTACH them when a
test fails: `pytest --basetemp=/tmp/console` keeps them).

Skipped, with the reason, when Playwright or `/usr/bin/chromium` is missing (`make test`
installs Chromium as root with apt-get).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from ajet.client import SwarmClient
from ajet.copilot.job import AgentJetJob
from ajet.errors import ApprovalPending
from ajet.protocol import ApprovalState, EngineState
from ajet.rollout import load_workflow, run_workflow
from swarm_server.ui.sessions import SessionStore
from tests.support import (
    APPROVER_TOKEN,
    CONTROL_TOKEN,
    ENFORCING_ENV,
    PROJECT_ROOT,
    make_ajet_repo,
)
from tests.support.factory import Server, ServerFactory

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = ["--no-sandbox", "--headless", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]
REWARDS = "ajet/engine/rewards.py"
HIDDEN = "import os  # harmless\x1b[2K\x1b[1G# nothing to see"
JOB = AgentJetJob(experiment_name="console", batch_size=2, num_repeat=2, max_new_tokens=8,
                  max_response_length=8)

try:
    from playwright.sync_api import Browser, Page, sync_playwright
except ImportError:  # pragma: no cover - the dev extra installs it
    sync_playwright = None  # type: ignore[assignment]

pytestmark = pytest.mark.slow


def _skip_reason() -> str | None:
    if sync_playwright is None:
        return "browser tests skipped: Playwright is not installed (pip install '.[dev]')"
    if not CHROMIUM.exists():
        return ("browser tests skipped: /usr/bin/chromium is missing (`make test` installs it "
                "as root with `apt-get install -y chromium`; elsewhere install Debian's "
                "chromium package)")
    return None


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    reason = _skip_reason()
    if reason:
        pytest.skip(reason)
    with sync_playwright() as p:  # type: ignore[misc]
        b = p.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        yield b
        b.close()


@pytest.fixture(scope="module")
def srv(server_factory: ServerFactory, browser: Browser) -> Iterator[Server]:
    handle = server_factory(env=ENFORCING_ENV, process=True)  # the browser needs a socket
    yield handle
    with handle.client(CONTROL_TOKEN) as c:
        c.stop_run(reason="test teardown")


@pytest.fixture(scope="module")
def shots(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("shots")


def _pending(srv: Server, repo: Path, text: str) -> str:
    path = repo / REWARDS
    path.write_text(path.read_text() + f"\n{text}\n", encoding="utf-8")
    with SwarmClient(srv.url, token=CONTROL_TOKEN) as c, pytest.raises(ApprovalPending) as caught:
        c.push_code(repo)
    return caught.value.snapshot_id


def _sign_in(browser: Browser, srv: Server, token: str) -> Page:
    page = browser.new_context(base_url=srv.url, viewport={"width": 1280, "height": 900}
                               ).new_page()
    page.goto("/ui/approvals")
    assert page.url.endswith("/ui/login")  # no session: to the sign-in page
    page.fill("#token", token)
    page.click("#sign-in")
    page.wait_for_url("**/ui/approvals")
    assert token not in page.url
    return page


def _state(srv: Server, snapshot_id: str) -> ApprovalState:
    with SwarmClient(srv.url, token=APPROVER_TOKEN) as a:
        return a.get_review(snapshot_id, limit=1).approval.state


def test_approve_in_the_browser_then_watch_the_reward_curve(
        browser: Browser, srv: Server, tmp_path: Path, shots: Path) -> None:
    repo = make_ajet_repo(tmp_path / "repo")
    snapshot_id = _pending(srv, repo, HIDDEN)
    page = _sign_in(browser, srv, APPROVER_TOKEN)
    assert page.inner_text("#who") == "alice"
    assert "enforced" in page.inner_text("#enforcement")
    page.screenshot(path=str(shots / "1-approvals.png"), full_page=True)

    page.click(f"a.snapshot[href='/ui/snapshots/{snapshot_id}']")
    diff = page.inner_text("#diff")
    # the hidden line is there, its escape sequences shown as visible, marked escapes
    assert "+import os  # harmless\\x1b[2K\\x1b[1G# nothing to see" in diff
    assert "\x1b" not in page.content()
    assert page.locator("#diff .ctl").count() == 2
    assert "control characters" in page.inner_text("#flagged")
    assert "not verified" in page.inner_text("body")
    page.screenshot(path=str(shots / "2-review.png"), full_page=True)

    # a post without the CSRF token is refused, and decides nothing
    forged = page.request.post(f"/ui/snapshots/{snapshot_id}/decide",
                               form={"action": "approve", "confirm": snapshot_id[:12]})
    assert forged.status == 403 and "CSRF" in forged.text()
    assert _state(srv, snapshot_id) is ApprovalState.PENDING
    # a wrong confirmation decides nothing either
    page.fill("#confirm", "000000000000")
    page.click("#approve")
    assert "did not match" in page.inner_text("#message")
    assert _state(srv, snapshot_id) is ApprovalState.PENDING

    page.fill("#confirm", snapshot_id[:12])
    page.fill("#note", "read every line")
    page.click("#approve")
    assert "approved by alice" in page.inner_text("#state")
    assert "The engine can start on it." in page.inner_text("#state")
    assert _state(srv, snapshot_id) is ApprovalState.APPROVED  # at once in the API
    page.screenshot(path=str(shots / "3-approved.png"), full_page=True)

    # the engine now starts on it; a short real run sends rewards
    with SwarmClient(srv.url, token=CONTROL_TOKEN, timeout=60) as c:
        assert c.push_code(repo).activated
        status = c.configure_and_start(JOB, wait_timeout=240)
        assert status.state in (EngineState.ROLLING, EngineState.ROLLING_POST,
                                EngineState.WEIGHT_SYNCING)
        assert status.snapshot_id == snapshot_id
        fn, tasks = load_workflow("examples/digits_workflow.py:workflow", PROJECT_ROOT)
        run_workflow(c, fn, tasks, n_workers=2, num_repeat=2, max_episodes=8)
        run_id = status.run_id
        deadline = time.monotonic() + 120
        while c.get_metrics(run_id or "current").total_steps < 2:
            assert time.monotonic() < deadline, "no two steps of metrics"
            time.sleep(0.5)

    page.goto("/ui/runs")
    curve = page.locator(f"#chart polyline.curve[data-run='{run_id}']")
    assert curve.count() == 1
    points = (curve.get_attribute("points") or "").split()
    assert len(points) >= 2
    assert run_id in page.inner_text("#runs") and snapshot_id[:12] in page.inner_text("#runs")
    assert page.inner_text("#log").strip()  # the engine log's tail
    page.screenshot(path=str(shots / "4-runs.png"), full_page=True)

    page.goto("/ui/snapshots")
    row = page.locator(f"tr[data-snapshot='{snapshot_id}']")
    assert "approved by alice" in row.inner_text() and run_id in row.inner_text()

    page.click("text=Sign out")
    page.wait_for_url("**/ui/login")
    page.goto("/ui/approvals")
    assert page.url.endswith("/ui/login")  # the session is gone


def test_deny_and_a_control_session_that_only_looks(
        browser: Browser, srv: Server, tmp_path: Path, shots: Path) -> None:
    repo = make_ajet_repo(tmp_path / "repo")
    snapshot_id = _pending(srv, repo, "DENY_ME = True")

    looker = _sign_in(browser, srv, CONTROL_TOKEN)
    assert "look, don't approve" in looker.inner_text("header")
    looker.goto(f"/ui/snapshots/{snapshot_id}")
    assert "+DENY_ME = True" in looker.inner_text("#diff")
    assert looker.locator("#approve").count() == 0 and looker.locator("#look-only").count() == 1
    csrf = looker.locator("input[name=csrf]").first.get_attribute("value")
    tried = looker.request.post(f"/ui/snapshots/{snapshot_id}/decide", form={
        "action": "approve", "confirm": snapshot_id[:12], "csrf": csrf or ""})
    assert tried.status == 403 and "not" in tried.text() and "approve" in tried.text()
    looker.screenshot(path=str(shots / "5-control-session.png"), full_page=True)
    assert _state(srv, snapshot_id) is ApprovalState.PENDING

    approver = _sign_in(browser, srv, APPROVER_TOKEN)
    approver.goto(f"/ui/snapshots/{snapshot_id}")
    approver.fill("#confirm", snapshot_id[:12])
    approver.click("#deny")
    assert "denied by alice" in approver.inner_text("#state")
    assert "cannot start" in approver.inner_text("#state")
    approver.screenshot(path=str(shots / "6-denied.png"), full_page=True)
    assert _state(srv, snapshot_id) is ApprovalState.DENIED
    with SwarmClient(srv.url, token=CONTROL_TOKEN) as c, \
            pytest.raises(ApprovalPending, match="denied by alice"):
        c.activate_snapshot(snapshot_id, force_restart=True)

    bad = httpx.post(f"{srv.url}/ui/login", data={"token": "wrong"})
    assert bad.status_code == 401 and "no approver token" in bad.text
    assert httpx.get(f"{srv.url}/ui/runs", follow_redirects=False).status_code == 303


def test_sessions_expire() -> None:
    now = [1000.0]
    store = SessionStore(60, clock=lambda: now[0])
    session = store.create("approver", "alice")
    assert store.get(session.sid) == session and not session.csrf_ok(None)
    now[0] += 61
    assert store.get(session.sid) is None

