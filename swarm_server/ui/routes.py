"""The console's pages: server-rendered from the same ledger and snapshot store as the API.

    GET  /ui/login, POST /ui/login (form: token), POST /ui/logout
    GET  /ui/approvals                  pending snapshots, recent decisions
    GET  /ui/snapshots                  every snapshot: approval state, the runs that used it
    GET  /ui/snapshots/{ref}?offset=    the review (the server-side diff, highlighted and
                                        escaped, paged), flags, the claimed provenance, and
                                        Approve / Deny / Revoke for an approver
    POST /ui/snapshots/{id}/decide      form: csrf, action, snapshot_id (the full id),
                                        confirm (the id's first 12 characters, typed),
                                        note; an approver session only; the full id in
                                        the address too, never a prefix
    GET  /ui/runs?run=&metric=          runs (state, snapshot, config changes from the previous
                                        run, start/end, exit reason), curves per run, log tail

Every page needs a session (`deps.ConsoleAuth`); tokens travel only in the sign-in form's
body. Sign-in is throttled per source and overall, refused from another origin, and
every failure is audited; its body is read under the anonymous bound
(`limits.ANONYMOUS_BODY_BYTES`). Notices come from the session, never the URL. Decisions go through `routes.approvals.decide`, like the API, so they show at once
in the API, the CLI and the bridge's next answer. Pages run no JavaScript.
"""

from __future__ import annotations

import logging
import re
import time
from dataclasses import dataclass
from importlib import resources
from typing import Annotated, Any, Literal

import yaml
from fastapi import APIRouter, Depends, Form, Query, Request
from fastapi.responses import HTMLResponse, RedirectResponse, Response
from jinja2 import Environment, PackageLoader, select_autoescape
from starlette.datastructures import Headers

from ajet.code_review import escape_text
from ajet.protocol import SERVER_CODE, EngineState
from ajet.errors import SwarmAuthError, SwarmHTTPError, SwarmNotFound
from swarm_server.auth import approver_of, bearer_token, role_of
from swarm_server.context import ServerContext
from swarm_server.deps import ConsoleAuth, Ctx
from swarm_server.limits import ANONYMOUS_BODY_BYTES, AnonymousGate, BodyLimit
from swarm_server.ledger import ACTIVE_RUN_STATUSES, RunRecord, SnapshotRecord
from swarm_server.routes.approvals import decide
from swarm_server.run_files import read_log_lines, read_metrics
from swarm_server.ui.render import PYGMENTS_CSS, diff_line_html, svg_chart
from swarm_server.ui.sessions import COOKIE, ConsoleSession

__all__ = ["router"]

log = logging.getLogger(__name__)

router = APIRouter(prefix="/ui", include_in_schema=False)

_env = Environment(loader=PackageLoader("swarm_server.ui", "templates"),
                   autoescape=select_autoescape(["html"]), trim_blocks=True, lstrip_blocks=True)
_env.filters["esc"] = escape_text
_env.filters["datetime"] = lambda ts: time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ts))
_PAGE_LINES = 400
_CONFIRM_CHARS = 12
#: Pending rows shown, each with its review's files (reviews are cached, but bounded here).
_PENDING_ROWS = 20
_PENDING_FILES = 4
_FULL_ID = re.compile(r"[0-9a-f]{64}")
#: The sign-in form is read before anyone is known: a token field and little else.
SIGN_IN_BODY = BodyLimit(bound=lambda ctx: ANONYMOUS_BODY_BYTES, knob="(fixed)")
_SECURITY_HEADERS = {
    "Content-Security-Policy": "default-src 'none'; style-src 'self'; img-src 'self'; "
                               "form-action 'self'; frame-ancestors 'none'; base-uri 'none'",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
    "X-Content-Type-Options": "nosniff",
}
_METRICS = ("reward_mean", "success_rate", "loss", "response_length", "kl", "entropy")


def _page(name: str, request: Request, ctx: ServerContext, session: ConsoleSession | None,
          status_code: int = 200, **values: Any) -> HTMLResponse:
    html = _env.get_template(name).render(
        session=session, enforced=ctx.approvals.enforced,
        approvers=len(ctx.settings.approvers), **values)
    return HTMLResponse(html, status_code=status_code, headers=_SECURITY_HEADERS)


def _redirect(to: str) -> RedirectResponse:
    return RedirectResponse(to, status_code=303, headers=_SECURITY_HEADERS)


# ---------------------------------------------------------------------------- sign in


def _source(scope: Any) -> str:
    client = scope.get("client")
    return str(client[0]) if client else "?"


def _foreign_origin(scope: Any) -> str | None:
    """The other site a sign-in form came from, or None when it came from this console.

    A browser says where a form was sent from (`Sec-Fetch-Site`, else `Origin`); without
    this check another site could sign a visitor in with a token of its own (login
    CSRF). A page cannot make the browser lie in either, nor add `X-Forwarded-Host` to a
    form post, so behind a reverse proxy the origin may match that header or `Host`
    (the scheme is not compared: TLS may end at the proxy). A client that sends neither
    header is no browser, and is let through.
    """
    headers = Headers(scope=scope)
    site = headers.get("sec-fetch-site")
    if site is not None:
        return None if site.lower() in ("same-origin", "none") else f"Sec-Fetch-Site: {site}"
    origin = headers.get("origin")
    if origin is None:
        return None
    netloc = origin.partition("://")[2].rstrip("/").lower()
    ours = {h.strip().lower() for h in (headers.get("host", ""),
                                        *headers.get("x-forwarded-host", "").split(",")) if h}
    return None if netloc in ours else origin


@dataclass(frozen=True)
class SignInGate(AnonymousGate):
    """Whether a sign-in may proceed, from its headers alone: the limits middleware asks
    before a byte of the form is read (and so before any `100 Continue`).

    Past the throttle (`SignInThrottle`, per source and overall): 429 with `Retry-After`.
    Another origin: 403. Both are audited (a throttled source once per window).
    """

    def admit(self, scope: Any) -> None:
        state = scope["app"].state
        ledger = state.ctx.ledger
        source = _source(scope)
        # the throttle first: every attempt counts, so audit entries are bounded too
        wait_s, first = state.sign_in_throttle.attempt(source)
        if wait_s:
            if first:  # one entry per source and window, not one per refused attempt
                ledger.audit("console_sign_in", "anonymous", "refused: rate limited",
                             {"source": source})
            raise SwarmHTTPError(429, f"too many sign-in attempts; wait {wait_s:.0f} s",
                                 "sign in again after the wait", retry_after_s=wait_s)
        foreign = _foreign_origin(scope)
        if foreign is not None:
            ledger.audit("console_sign_in", "anonymous", "refused: another origin",
                         {"source": source, "origin": foreign[:200]})
            raise SwarmAuthError(403, "this sign-in form was sent from another site",
                                 "open the console at its own address and sign in there")


@router.get("")
def home() -> Response:
    return _redirect("/ui/approvals")


@router.get("/login")
def login_page(request: Request, ctx: Ctx) -> Response:
    return _page("login.html", request, ctx, None, message=None)


@router.post("/login", dependencies=[Depends(SIGN_IN_BODY), Depends(SignInGate())])
def login(request: Request, ctx: Ctx, token: Annotated[str, Form(max_length=1024)] = ""
          ) -> Response:
    source = _source(request.scope)
    token = bearer_token(f"Bearer {token}") or ""
    name = approver_of(ctx.settings, token)
    role = role_of(ctx.settings, token) if name is None else None
    store = request.app.state.console_sessions
    if name is not None:
        session = store.create("approver", name)
    elif role in ("control", "open"):
        session = store.create("control", "control")
    else:
        why = ("the worker token cannot sign in" if role == "worker"
               else "that is no approver token and not the control token")
        ctx.ledger.audit("console_sign_in", "worker" if role == "worker" else "anonymous",
                         "refused: " + ("worker token" if role == "worker" else "wrong token"),
                         {"source": source})
        return _page("login.html", request, ctx, None, status_code=401, message=why)
    ctx.ledger.audit("console_sign_in", f"approver:{name}" if name else "control", "ok",
                     {"source": source})
    response = _redirect("/ui/approvals")
    response.set_cookie(COOKIE, session.sid, max_age=int(store.ttl_s), path="/ui",
                        httponly=True, samesite="strict",
                        secure=request.url.scheme == "https")
    return response


@router.post("/logout")
def logout(request: Request, session: ConsoleAuth,
           csrf: Annotated[str | None, Form(max_length=200)] = None) -> Response:
    _require_csrf(session, csrf)
    request.app.state.console_sessions.drop(session.sid)
    response = _redirect("/ui/login")
    response.delete_cookie(COOKIE, path="/ui")
    return response


# ---------------------------------------------------------------------------- approvals


@router.get("/approvals")
def approvals_page(request: Request, ctx: Ctx, session: ConsoleAuth) -> Response:
    pending = ctx.approvals.pending()
    shown = pending[:_PENDING_ROWS]
    uploaders = ctx.ledger.uploaders([p.snapshot_id for p in shown])
    rows = [{"p": p, "changes": _changes(ctx, p.snapshot_id),
             "uploaded": uploaders.get(p.snapshot_id)} for p in shown]
    return _page("approvals.html", request, ctx, session, rows=rows, pending_total=len(pending),
                 recent=ctx.approvals.recent(20))


@dataclass(frozen=True)
class _Changes:
    """What a pending row shows of its review: the first files, with +/- lines."""
    files: list[tuple[str, str, int, int]]  # (path, change kind, added, removed)
    more: int
    added: int
    removed: int
    flagged: int
    error: str | None = None


def _changes(ctx: ServerContext, snapshot_id: str) -> _Changes:
    # the same review the snapshot's page shows (against the same base), and cached there
    rec = ctx.snapshots.get(snapshot_id)
    if rec is None:
        return _Changes([], 0, 0, 0, 0, error="no longer stored")
    try:
        review, _, _ = ctx.approvals.review(rec)
    except (SwarmHTTPError, OSError) as exc:
        log.warning("review of snapshot %s failed: %s", snapshot_id[:12], exc)
        return _Changes([], 0, 0, 0, 0, error="review unavailable; open the snapshot")
    files = [(f.path, f.kind.value, f.added, f.removed) for f in review.files]
    return _Changes(files[:_PENDING_FILES], max(0, len(files) - _PENDING_FILES),
                    sum(f.added for f in review.files), sum(f.removed for f in review.files),
                    len(review.flagged))


@router.get("/snapshots")
def snapshots_page(request: Request, ctx: Ctx, session: ConsoleAuth) -> Response:
    records = ctx.snapshots.records()
    states = ctx.approvals.states([r.id for r in records])
    runs, _ = ctx.ledger.list_runs(limit=200)
    used: dict[str, list[RunRecord]] = {}
    for run in runs:
        used.setdefault(run.snapshot_id, []).append(run)
    rows = [{"rec": r, "approval": states[r.id], "runs": used.get(r.id, []),
             "active": r.id == ctx.snapshots.active_id()} for r in records]
    return _page("snapshots.html", request, ctx, session, rows=rows,
                 server_runs=used.get(SERVER_CODE, []),
                 server_active=ctx.snapshots.active_id() == SERVER_CODE)


@router.get("/snapshots/{snapshot_ref}")
def snapshot_page(request: Request, ctx: Ctx, session: ConsoleAuth, snapshot_ref: str,
                  offset: Annotated[int, Query(ge=0, le=100_000_000)] = 0) -> Response:
    rec = _resolve(ctx, snapshot_ref)
    # the notice comes from this session's own state, never from the URL: a link that
    # anyone can write must not put words where real decisions are announced
    message = request.app.state.console_sessions.take_notice(session.sid, rec.id)
    review, base_id, base_reason = ctx.approvals.review(rec)
    lines, next_offset = review.page(offset, _PAGE_LINES)
    files = review.files
    shown = [{"kind": ln.kind, "prefix": ln.prefix, "continued": ln.continued,
              "html": diff_line_html(ln, files[ln.file].path)} for ln in lines]
    page = ctx.approvals.review_page(rec, offset=offset, limit=1)
    return _page(
        "snapshot.html", request, ctx, session, rec=rec, page=page, review=review,
        lines=shown, offset=offset, next_offset=next_offset,
        prev_offset=max(0, offset - _PAGE_LINES) if offset else None,
        total=len(review.lines), base_id=base_id, base_reason=base_reason,
        approval=ctx.approvals.state(rec.id), runnable=ctx.approvals.runnable(rec.id),
        confirm_chars=_CONFIRM_CHARS, message=message)


@router.post("/snapshots/{snapshot_ref}/decide")
def decide_form(
    request: Request, ctx: Ctx, session: ConsoleAuth, snapshot_ref: str,
    action: Annotated[Literal["approve", "deny", "revoke"], Form()],
    csrf: Annotated[str | None, Form(max_length=200)] = None,
    confirm: Annotated[str, Form(max_length=64)] = "",
    note: Annotated[str, Form(max_length=2000)] = "",
    snapshot_id: Annotated[str, Form(max_length=64)] = "",
    base_id: Annotated[str | None, Form(max_length=64)] = None,
) -> Response:
    _require_csrf(session, csrf)
    if not session.can_approve:
        return _page("error.html", request, ctx, session, status_code=403,
                     title="Looking only",
                     text="This session signed in with the control token: it can look, not "
                          "approve. Sign in with your approver token to decide.")
    # the exact id, in the form's address and again in the form: never a prefix
    rec = ctx.snapshots.get(snapshot_ref) if _FULL_ID.fullmatch(snapshot_ref) else None
    if rec is None or snapshot_id != rec.id:
        return _page("error.html", request, ctx, session, status_code=400,
                     title="Not decided",
                     text="a decision names the full snapshot id it was shown for; open the "
                          "snapshot's page from /ui/approvals and decide there")
    store = request.app.state.console_sessions
    if confirm.strip().lower() != rec.id[:_CONFIRM_CHARS]:
        store.notify(session.sid, rec.id,
                     "the confirmation did not match the snapshot id; nothing was decided",
                     "error")
        return _redirect(f"/ui/snapshots/{rec.id}")
    decision = {"approve": "approved", "deny": "denied", "revoke": "revoked"}[action]
    before = ctx.engine.status()
    try:
        decide(ctx, rec, decision, approver=session.name, note=note, confirm=rec.id,
               base=base_id or None)
    except SwarmHTTPError as exc:
        detail = exc.detail.get("message", exc.detail) if isinstance(exc.detail, dict) \
            else exc.detail
        return _page("error.html", request, ctx, session, status_code=exc.status,
                     title="Not decided", text=str(detail))
    after = ctx.engine.status()
    if before.state is not EngineState.OFFLINE and after.state is EngineState.OFFLINE:
        # done, but with a consequence the approver should see: training stopped
        why = ("it ran this snapshot" if before.snapshot_id == rec.id else
               f"it ran snapshot {before.snapshot_id[:12]}, whose approval rested on this one")
        store.notify(session.sid, rec.id,
                     f"decision recorded: {decision}; the engine (run {before.run_id}) was "
                     f"stopped: {why}", "warning")
    else:
        store.notify(session.sid, rec.id, f"decision recorded: {decision}", "success")
    return _redirect(f"/ui/snapshots/{rec.id}")


# ---------------------------------------------------------------------------- runs


@router.get("/runs")
def runs_page(request: Request, ctx: Ctx, session: ConsoleAuth,
              run: Annotated[list[str] | None, Query(max_length=8)] = None,
              metric: Annotated[str, Query(max_length=100)] = "reward_mean") -> Response:
    records, total = ctx.ledger.list_runs(limit=50)
    by_id = {r.id: r for r in records}
    chosen = [r for r in (run or []) if r in by_id] or [r.id for r in records[:3]]
    series: dict[str, list[tuple[float, float]]] = {}
    names: set[str] = set()
    for run_id in chosen:
        points = read_metrics(ctx.engine.run_dir(run_id) / "metrics.jsonl")
        for p in points:
            names.update(k for k, v in p.items() if isinstance(v, (int, float)) and k != "step")
        series[run_id] = [(float(p["step"]), float(p[metric])) for p in points
                          if isinstance(p.get(metric), (int, float))]
    rows = []
    for i, rec in enumerate(records):
        previous = records[i + 1] if i + 1 < len(records) else None
        rows.append({"rec": rec, "changes": _config_changes(rec, previous),
                     "approval": ctx.approvals.state(rec.snapshot_id)})
    latest = ctx.engine.latest_run_id()
    tail: list[str] = []
    if latest:
        tail, _, _ = read_log_lines(ctx.engine.run_dir(latest) / "engine.log", tail=40,
                                    redact=ctx.settings.secret_values())
    metrics = sorted(names | set(_METRICS)) if names else list(_METRICS)
    active, _ = ctx.ledger.list_runs(statuses=ACTIVE_RUN_STATUSES, limit=200)
    live = [{"rec": rec, "state": ctx.runs.live_state(rec.id),
             "place": ctx.runs.queue_place(rec.id)} for rec in active]
    return _page("runs.html", request, ctx, session, status=ctx.engine.status(), rows=rows,
                 active=live, devices=ctx.runs.devices_status(),
                 total=total, chosen=chosen, metric=metric, metrics=metrics,
                 chart=svg_chart(series, metric=metric), latest=latest,
                 log_tail=[escape_text(line) for line in tail])


# ---------------------------------------------------------------------------- static


@router.get("/static/console.css")
def console_css() -> Response:
    text = resources.files("swarm_server.ui").joinpath("static/console.css").read_text("utf-8")
    return Response(text, media_type="text/css", headers={"Cache-Control": "max-age=300"})


@router.get("/static/pygments.css")
def pygments_css() -> Response:
    return Response(PYGMENTS_CSS, media_type="text/css", headers={"Cache-Control": "max-age=300"})


# ---------------------------------------------------------------------------- helpers


def _require_csrf(session: ConsoleSession, csrf: str | None) -> None:
    if not session.csrf_ok(csrf):
        raise SwarmAuthError(403, "missing or wrong CSRF token: the form was not sent by this "
                             "console page", "reload the page and submit its form again")


def _resolve(ctx: ServerContext, ref: str) -> SnapshotRecord:
    rec = ctx.snapshots.resolve(ref)
    if rec is None:
        raise SwarmNotFound(404, "the server's own code is not a snapshot", "open /ui/snapshots")
    return rec


def _config_changes(rec: RunRecord, previous: RunRecord | None) -> list[str]:
    if previous is None:
        return []
    try:
        now = yaml.safe_load(rec.config_yaml) or {}
        before = yaml.safe_load(previous.config_yaml) or {}
    except yaml.YAMLError:
        return ["(config unreadable)"]
    if not isinstance(now, dict) or not isinstance(before, dict):
        return []
    return [f"{k}: {before.get(k)!r} -> {now.get(k)!r}"
            for k in sorted(set(now) | set(before)) if now.get(k) != before.get(k)][:12]

