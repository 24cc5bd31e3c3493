"""The web console `/ui` in a real browser (Debian's Chromium driven by Playwright) against
a real enforcing server with the real engine (ajet-tiny on CPU).

Sign in as an approver, read the diff of a change that hides a line with escape
sequences, approve, start the engine on it, watch its reward curve on the runs page; a
denial; a post without the CSRF token (refused); a control-token session that looks but
cannot approve; sign-out. Screenshots land in `<tmp>/shots/*.png` (ATTACH them when a
test fails: `pytest --basetemp=/tmp/console` keeps them).

The review of the console's look, at 1280 and 420 px, runs against a second server in
this process (uvicorn in a thread, seeded through the API and the ledger; no engine):
Approve and Deny told apart, notices of each kind styled apart, pending rows that tell
requests apart, nothing wider than the page at 420 px, no red boxes on plain text,
round chart ticks, and axe-core's accessibility check on every page (serious or critical
violations fail). Its screenshots land in `$AJET_CONSOLE_SCREENSHOTS` when set, else in
a temporary folder the test prints.

Skipped, with the reason, when Playwright or `/usr/bin/chromium` is missing (`make test`
installs Chromium as root with apt-get; so does `make browser`).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from ajet.client import SwarmClient
from ajet.copilot.job import AgentJetJob
from ajet.errors import ApprovalPending
from ajet.protocol import ApprovalState, EngineState
from ajet.rollout import RolloutRunner, load_workflow
from swarm_server.ledger import RunRecord
from swarm_server.main import create_app
from swarm_server.settings import Settings
from swarm_server.ui.render import PYGMENTS_CSS, nice_ticks, svg_chart
from swarm_server.ui.sessions import SessionStore
from tests.support import (
    APPROVER_NAME,
    APPROVER_TOKEN,
    CONTROL_TOKEN,
    ENFORCING_ENV,
    PROJECT_ROOT,
    WORKER_TOKEN,
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
        return ("browser tests skipped: /usr/bin/chromium is missing (`make browser`, which "
                "`make test` runs, installs it as root with `apt-get install -y chromium`; "
                "elsewhere install Debian's chromium package)")
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
    named = os.environ.get("AJET_CONSOLE_SCREENSHOTS")
    folder = Path(named) if named else tmp_path_factory.mktemp("shots")
    folder.mkdir(parents=True, exist_ok=True)
    print(f"\nconsole screenshots: {folder}")
    return folder


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
        # episodes until two steps trained, not a fixed count: which task each worker
        # draws decides how many groups a fixed count of episodes completes
        runner = RolloutRunner(c, fn, tasks, n_workers=2, num_repeat=2)
        runner.start()
        try:
            run_id = status.run_id
            deadline = time.monotonic() + 120
            while c.get_metrics(run_id or "current").total_steps < 2:
                assert time.monotonic() < deadline, "no two steps of metrics"
                time.sleep(0.5)
        finally:
            runner.stop()

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

    # revoking the code the engine runs: recorded, and the stop is a warning to read
    page.goto(f"/ui/snapshots/{snapshot_id}")
    page.fill("#confirm", snapshot_id[:12])
    page.click("#revoke")
    assert "notice-warning" in (page.get_attribute("#message", "class") or "")
    assert "revoked" in page.inner_text("#message") and "stopped" in page.inner_text("#message")
    page.screenshot(path=str(shots / "4b-revoked-warning.png"))
    with SwarmClient(srv.url, token=CONTROL_TOKEN) as c:
        assert c.engine_status().state is EngineState.OFFLINE

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



# ---------------------------------------------------------------------------- the look

WIDTHS = (1280, 420)
#: A docstring's middle line: highlighted alone, its backticks are Pygments `Error` tokens.
DOCSTRING = ('def explained():\n    """Return the reward.\n\n'
             '    Uses `score` from the task, like ``this``.\n    """\n    return 1\n')
REWARD_MEAN = (0.312, 0.401, 0.47, 0.538)


@dataclass
class Live:
    """An enforcing server in this process, on a real socket, with what the pages show."""
    url: str
    app: Any
    pending: list[str]  # newest first, as the approvals page lists them
    reviewed: str  # pending, its diff holds a docstring with backticks
    run_id: str


def _commit(repo: Path, rel: str, text: str, message: str) -> None:
    path = repo / rel
    path.write_text(path.read_text(encoding="utf-8") + text, encoding="utf-8")
    git = ["git", "-c", "user.email=t@example.com", "-c", "user.name=test", "-C", str(repo)]
    subprocess.run([*git, "commit", "-qam", message], check=True)


def _push_pending(url: str, repo: Path) -> str:
    with SwarmClient(url, token=CONTROL_TOKEN) as c, pytest.raises(ApprovalPending) as caught:
        c.push_code(repo)
    return caught.value.snapshot_id


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory, browser: Browser) -> Iterator[Live]:
    import uvicorn

    root = tmp_path_factory.mktemp("live")
    settings = Settings(workdir=root / "swarm", token=CONTROL_TOKEN, worker_token=WORKER_TOKEN,
                        approver_tokens=f"{APPROVER_NAME}={APPROVER_TOKEN}",
                        warm_standby=False)
    app = create_app(settings)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.02)
    port = server.servers[0].sockets[0].getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    try:
        # two requests that differ in what they change, and in the commit they claim
        repo = make_ajet_repo(root / "repo")
        _commit(repo, REWARDS, "\n" + DOCSTRING, "explain the reward")
        reviewed = _push_pending(url, repo)
        _commit(repo, "ajet/__init__.py", "\nTWEAK_A = 1\nTWEAK_B = 2\n", "two tweaks")
        second = _push_pending(url, repo)
        # a finished run whose reward curve spans odd values
        ctx = app.state.ctx
        run_id = "run-look-1"
        run_dir = ctx.engine.run_dir(run_id)
        run_dir.mkdir(parents=True)
        (run_dir / "metrics.jsonl").write_text("".join(
            json.dumps({"step": i + 1, "reward_mean": v}) + "\n"
            for i, v in enumerate(REWARD_MEAN)), encoding="utf-8")
        (run_dir / "engine.log").write_text("step 1\nstep 2\n", encoding="utf-8")
        now = time.time()
        ctx.ledger.create_run(RunRecord(
            id=run_id, snapshot_id="server", config_yaml="batch_size: 2\n", config_hash="x",
            experiment_name="look", started_by="control", started_at=now - 60,
            run_dir=str(run_dir), status="ended", ended_at=now, final_state="OFFLINE",
            exit_code=0, reason="finished"))
        yield Live(url, app, [second, reviewed], reviewed, run_id)
    finally:
        server.should_exit = True
        thread.join(timeout=30)


def _console(browser: Browser, live: Live, width: int, token: str = APPROVER_TOKEN) -> Page:
    context = browser.new_context(base_url=live.url, viewport={"width": width, "height": 900},
                                  bypass_csp=True)  # axe's script is injected into the page
    page = context.new_page()
    page.goto("/ui/login")
    page.fill("#token", token)
    page.click("#sign-in")
    page.wait_for_url("**/ui/approvals")
    return page


def _pages(live: Live) -> dict[str, str]:
    return {"approvals": "/ui/approvals", "snapshot": f"/ui/snapshots/{live.reviewed}",
            "snapshots": "/ui/snapshots", "runs": f"/ui/runs?run={live.run_id}"}


@pytest.mark.parametrize("width", WIDTHS)
def test_every_page_fits_and_passes_axe(browser: Browser, live: Live, shots: Path,
                                        width: int) -> None:
    Axe = pytest.importorskip(
        "axe_playwright_python.sync_playwright",
        reason="accessibility check skipped: axe-playwright-python is not installed "
               "(pip install '.[dev]')").Axe

    axe = Axe()
    page = _console(browser, live, width)
    login = page.context.new_page()  # signed in, but the sign-in page still renders
    login.goto("/ui/login")
    found: dict[str, list[str]] = {}
    for name, path in {"login": "/ui/login", **_pages(live)}.items():
        view = login if name == "login" else page
        view.goto(path)
        view.screenshot(path=str(shots / f"look-{width}-{name}.png"), full_page=True)
        # nothing wider than the window: wide tables and code scroll inside their own box
        wide = view.evaluate("document.documentElement.scrollWidth - window.innerWidth")
        assert wide <= 0, f"{name} at {width} px is {wide} px wider than the window"
        results = axe.run(view).response
        bad = [f"{v['id']} ({v['impact']}): {v['help']} at "
               + "; ".join(" ".join(n["target"]) for n in v["nodes"][:3])
               for v in results["violations"] if v["impact"] in ("serious", "critical")]
        if bad:
            found[name] = bad
    assert not found, f"axe at {width} px: {found}"


def test_the_snapshot_id_wraps_at_420(browser: Browser, live: Live) -> None:
    page = _console(browser, live, 420)
    page.goto(f"/ui/snapshots/{live.reviewed}")
    box = page.locator("#snapshot-id").bounding_box()
    assert box is not None and box["x"] + box["width"] <= 420
    assert page.inner_text("#snapshot-id") == live.reviewed  # all of it, wrapped


def test_pending_rows_tell_requests_apart(browser: Browser, live: Live, shots: Path) -> None:
    page = _console(browser, live, 1280)
    newer, older = (page.locator(f"#pending tr[data-snapshot='{i}']") for i in live.pending)
    a, b = newer.inner_text(), older.inner_text()
    # the files each changed, with their own +/- lines (the server's review)
    assert re.search(r"ajet/__init__\.py\s+changed\s+\+3\s+−0", a), a
    assert re.search(r"ajet/engine/rewards\.py\s+changed\s+\+7\s+−0", b), b
    assert "rewards.py" not in a.split("ajet/__init__.py")[0]
    # the claimed commits differ, and who uploaded them is from the server's audit log
    commits = [row.locator("code.commit").inner_text() for row in (newer, older)]
    assert len(set(commits)) == 2 and all(re.fullmatch(r"[0-9a-f]{10}", c) for c in commits)
    assert newer.locator(".uploader").inner_text() == "control"
    assert "by the control token" in b
    page.screenshot(path=str(shots / "look-pending.png"), full_page=True)
    # on a phone each row's changes are in view, not scrolled off to the right
    phone = _console(browser, live, 420)
    files = phone.locator(f"#pending tr[data-snapshot='{live.pending[0]}'] ul.files").bounding_box()
    assert files is not None and files["x"] + files["width"] <= 420, files
    phone.screenshot(path=str(shots / "look-pending-420.png"), full_page=True)


def test_approve_and_deny_look_apart_and_so_do_notices(browser: Browser, live: Live,
                                                       shots: Path) -> None:
    page = _console(browser, live, 1280)
    snapshot_id = live.pending[0]
    page.goto(f"/ui/snapshots/{snapshot_id}")

    def background(selector: str) -> str:
        return str(page.eval_on_selector(selector, "e => getComputedStyle(e).backgroundColor"))

    approve, deny = background("#approve"), background("#deny")
    assert "primary" in (page.get_attribute("#approve", "class") or "")
    assert "danger" in (page.get_attribute("#deny", "class") or "")
    assert approve != deny
    assert page.eval_on_selector("#deny", "e => getComputedStyle(e).color") == "rgb(183, 28, 28)"

    # a wrong confirmation: an error, not the blue box of a success
    page.fill("#confirm", "000000000000")
    page.click("#approve")
    assert "notice-error" in (page.get_attribute("#message", "class") or "")
    assert page.get_attribute("#message", "role") == "alert"
    error_bg = background("#message")
    page.screenshot(path=str(shots / "look-notice-error.png"))

    # a warning: what the console says when a decision also stopped the engine
    store = live.app.state.console_sessions
    sid = page.context.cookies()[0]["value"]
    store.notify(sid, snapshot_id, "decision recorded: revoked; the engine was stopped",
                 "warning")
    page.goto(f"/ui/snapshots/{snapshot_id}")
    assert "notice-warning" in (page.get_attribute("#message", "class") or "")
    warning_bg = background("#message")

    page.fill("#confirm", snapshot_id[:12])
    page.click("#approve")
    assert "notice-success" in (page.get_attribute("#message", "class") or "")
    assert page.inner_text("#message").startswith("Done:")
    success_bg = background("#message")
    page.screenshot(path=str(shots / "look-notice-success.png"))
    assert len({error_bg, warning_bg, success_bg}) == 3, (error_bg, warning_bg, success_bg)
    # approved now: its Revoke button is a danger button too
    assert "danger" in (page.get_attribute("#revoke", "class") or "")
    live.pending.remove(snapshot_id)


def test_backticks_in_a_docstring_are_not_boxed(browser: Browser, live: Live) -> None:
    page = _console(browser, live, 1280)
    page.goto(f"/ui/snapshots/{live.reviewed}")
    marked = page.locator("#diff .err")
    assert marked.count() >= 1  # Pygments does tag them: the style must not show it
    style = marked.first.evaluate(
        "e => { const s = getComputedStyle(e), p = getComputedStyle(e.parentElement);"
        " return [s.borderTopStyle, s.borderTopWidth, s.color === p.color]; }")
    assert style == ["none", "0px", True]
    # real hazards are still marked
    assert page.locator("#diff .ctl").count() == 0


def test_the_runs_chart_has_round_ticks(browser: Browser, live: Live, shots: Path) -> None:
    page = _console(browser, live, 1280)
    page.goto(f"/ui/runs?run={live.run_id}&metric=reward_mean")
    ticks = page.locator("#chart text.ytick").evaluate_all("ts => ts.map(t => t.textContent)")
    assert ticks == ["0.3", "0.4", "0.5", "0.6"], ticks
    chart = page.locator("#chart svg")
    assert chart.get_attribute("role") == "img"
    assert "reward_mean" in (chart.get_attribute("aria-label") or "")
    page.locator("#chart").screenshot(path=str(shots / "look-chart.png"))


def test_sign_in_and_deny_with_the_keyboard_alone(browser: Browser, live: Live,
                                                  shots: Path) -> None:
    page = browser.new_context(base_url=live.url, viewport={"width": 420, "height": 900}
                               ).new_page()
    page.goto("/ui/login")
    page.keyboard.press("Tab")
    assert page.evaluate("document.activeElement.id") == "token"
    page.keyboard.type(APPROVER_TOKEN)
    page.keyboard.press("Enter")
    page.wait_for_url("**/ui/approvals")
    page.goto(f"/ui/snapshots/{live.reviewed}")
    page.focus("#confirm")
    page.keyboard.type(live.reviewed[:12])
    for expected in ("note", "approve", "deny"):
        page.keyboard.press("Tab")
        assert page.evaluate("document.activeElement.id") == expected
    # the focused button shows it has the focus
    outline = page.evaluate("getComputedStyle(document.activeElement).outlineStyle")
    assert outline not in ("", "none"), outline
    page.screenshot(path=str(shots / "look-keyboard-focus.png"))
    page.keyboard.press("Enter")
    page.wait_for_selector("#message")
    assert "decision recorded: denied" in page.inner_text("#message")
    assert "notice-success" in (page.get_attribute("#message", "class") or "")


# ---------------------------------------------------------------------------- no browser


def test_nice_ticks_are_round() -> None:
    assert nice_ticks(0.312, 0.538) == [0.3, 0.4, 0.5, 0.6]
    assert nice_ticks(0, 1) == [0.0, 0.2, 0.4, 0.6, 0.8, 1.0]
    assert nice_ticks(-3.7, 12.2) == [-5, 0, 5, 10, 15]
    assert nice_ticks(100, 1000) == [0, 200, 400, 600, 800, 1000]
    assert nice_ticks(0.1, 0.3) == [0.1, 0.15, 0.2, 0.25, 0.3]
    flat = nice_ticks(5, 5)
    assert flat[0] < 5 < flat[-1] and all(round(t * 10) == t * 10 for t in flat)


def test_the_chart_legend_sits_above_the_plot() -> None:
    series = {f"run-{i}": [(1.0, 0.1 * i), (2.0, 0.2 * i + 0.05)] for i in range(3)}
    svg = str(svg_chart(series, metric="reward_mean"))
    plot_top = float(re.search(r'<rect x="56" y="([\d.]+)"', svg).group(1))  # type: ignore[union-attr]
    labels = [float(y) for y in re.findall(r'y="([\d.]+)" font-size="11">run-', svg)]
    assert len(labels) == 3 and max(labels) < plot_top, (labels, plot_top)
    assert 'role="img"' in svg and 'aria-label="reward_mean per step' in svg


def test_the_highlighter_style_draws_error_tokens_as_text() -> None:
    rules = re.findall(r"\.hl \.err \{([^}]*)\}", PYGMENTS_CSS)
    assert rules and "border: none" in rules[-1]  # the last rule wins


def test_a_zip_upload_records_its_uploader(tmp_path: Path) -> None:
    from tests.security.inproc import inproc_server, tiny_ajet

    with inproc_server(tmp_path / "swarm") as srv:
        sid = srv.upload(tiny_ajet("who"))  # stored, pending: its activation was refused
        role, at = srv.ctx.ledger.uploaders([sid])[sid]
        assert role == "control" and at <= time.time()
        assert srv.ctx.ledger.uploaders(["0" * 64]) == {}
