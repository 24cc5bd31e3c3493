"""Approval holds against code it approved: revocation and denial reach every approval
built on them, decisions name the exact id, and GC never removes what awaits review.

An approval of B reviewed as a diff against approved A contains A's code unseen, so
revoking A must send B (and whatever was approved on B) back to pending and stop an
engine running any of them. A prefix resolved at decision time could name another
snapshot uploaded since the review, so decisions take the full id only (HTTP, CLI,
console). In-process servers (`tests.security.inproc`).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import pytest

from ajet.protocol import EngineState
from swarm_server.approval_cli import APPROVER_TOKEN_ENV, run_approvals
from tests.security.inproc import BOB_TOKEN, InProc, csrf_of, inproc_server, tiny_ajet
from tests.support import APPROVER_TOKEN


@pytest.fixture
def srv(tmp_path: Path) -> Any:
    with inproc_server(tmp_path / "swarm") as s:
        yield s


def _approve_and_activate(srv: InProc, sid: str) -> None:
    assert srv.decide(sid, "approve").status_code == 200
    r = srv.activate(sid)
    assert r.status_code == 200, r.text


def _chain(srv: InProc, n: int) -> list[str]:
    """n snapshots, each approved as a diff against the one before (the active one)."""
    ids = []
    for i in range(n):
        sid = srv.upload(tiny_ajet(f"v{i}"))
        review = srv.call("GET", f"/approvals/{sid}", token=APPROVER_TOKEN).json()
        assert review["base_id"] == (ids[-1] if ids else "server")
        _approve_and_activate(srv, sid)
        ids.append(sid)
    return ids


def test_revoking_a_base_reopens_every_approval_resting_on_it(srv: InProc,
                                                              monkeypatch: Any) -> None:
    a, b, c = _chain(srv, 3)
    history = srv.call("GET", f"/approvals/{b}", token=APPROVER_TOKEN).json()["history"]
    assert history[-1]["decision"] == "approved" and history[-1]["base_id"] == a
    # the engine runs C (the route's view of the engine is all the decision reads)
    stops: list[str] = []
    running = srv.ctx.engine.status().model_copy(
        update={"state": EngineState.ROLLING, "snapshot_id": c})
    monkeypatch.setattr(srv.ctx.engine, "status", lambda: running)
    monkeypatch.setattr(srv.ctx.engine, "stop",
                        lambda *, role, reason: stops.append(reason))

    assert srv.decide(a, "revoke", token=BOB_TOKEN, note="backdoor found").status_code == 200

    assert srv.state(a)["state"] == "revoked"
    for sid in (b, c):
        state = srv.state(sid)
        assert state["state"] == "pending", state
        assert a[:12] in state["note"] and "revoked by bob" in state["note"]
    assert "through" in srv.state(c)["note"]  # C rests on A through B
    assert not srv.ctx.approvals.runnable(b) and not srv.ctx.approvals.runnable(c)
    assert len(stops) == 1 and a[:12] in stops[0]
    pending = {p["snapshot_id"] for p in
               srv.call("GET", "/approvals", token=APPROVER_TOKEN).json()["pending"]}
    assert {b, c} <= pending
    entry = srv.call("GET", "/audit", params={"limit": 1000}).json()["entries"]
    assert any(e["action"] == "revoke" and set(e["detail"]["reopened"]) == {b, c}
               for e in entry)
    # C cannot be activated again until it is reviewed again
    assert srv.activate(c).status_code == 409


def test_a_broken_chain_is_not_runnable_even_without_a_reopened_row(srv: InProc) -> None:
    a, b = _chain(srv, 2)
    from swarm_server.ledger import ApprovalRecord

    # a ledger written before reopening existed: A revoked, B's approval left as it was
    srv.ctx.ledger.add_approval(ApprovalRecord(snapshot_id=a, decision="revoked",
                                               approver="bob", at=1.0))
    assert srv.state(b)["state"] == "pending" and a[:12] in srv.state(b)["note"]
    assert not srv.ctx.approvals.runnable(b)


def test_denying_reopens_approvals_resting_on_it(srv: InProc) -> None:
    a, b = _chain(srv, 2)
    assert srv.decide(a, "revoke").status_code == 200  # B back to pending
    c = srv.upload(tiny_ajet("c"))  # reviewed against the server's code: B is not runnable
    base = srv.call("GET", f"/approvals/{c}", token=APPROVER_TOKEN).json()["base_id"]
    assert base == "server"
    assert srv.decide(b, "deny").status_code == 200
    assert srv.state(b)["state"] == "denied"


def test_decisions_take_the_full_id_only(srv: InProc) -> None:
    sid = srv.upload(tiny_ajet("exact"))
    for verb in ("approve", "deny", "revoke"):
        r = srv.call("POST", f"/approvals/{sid[:12]}/{verb}", token=APPROVER_TOKEN,
                     json={"snapshot_id": sid, "note": ""})
        assert r.status_code == 400 and "full snapshot id" in r.json()["detail"], r.text
        assert "show" in r.json()["hint"]
    assert srv.state(sid)["state"] == "pending"
    # `show` takes a prefix and answers the full id
    review = srv.call("GET", f"/approvals/{sid[:8]}", token=APPROVER_TOKEN).json()
    assert review["snapshot_id"] == sid
    assert srv.decide(sid, "approve").status_code == 200


def test_the_cli_refuses_a_prefix_before_asking_the_server(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv(APPROVER_TOKEN_ENV, APPROVER_TOKEN)
    args = argparse.Namespace(verb="approve", ref="0123456789ab", note="", yes=True,
                              swarm_url="http://127.0.0.1:9")  # nothing listens there
    assert run_approvals(args) == 2
    err = capsys.readouterr().err
    assert "not a full snapshot id" in err and "approvals show 0123456789ab" in err


def test_the_console_decides_on_the_full_id_only(srv: InProc) -> None:
    sid = srv.upload(tiny_ajet("console"))
    assert srv.sign_in(APPROVER_TOKEN).status_code == 303
    page = srv.http.get(f"/ui/snapshots/{sid}")
    assert page.status_code == 200 and f'name="snapshot_id" value="{sid}"' in page.text
    csrf = csrf_of(page.text)
    form = {"csrf": csrf, "action": "approve", "confirm": sid[:12], "snapshot_id": sid}
    by_prefix = srv.http.post(f"/ui/snapshots/{sid[:12]}/decide", data=form,
                              follow_redirects=False)
    assert by_prefix.status_code == 400 and "full snapshot id" in by_prefix.text
    no_id = srv.http.post(f"/ui/snapshots/{sid}/decide", follow_redirects=False,
                          data={**form, "snapshot_id": ""})
    assert no_id.status_code == 400
    assert srv.state(sid)["state"] == "pending"
    done = srv.http.post(f"/ui/snapshots/{sid}/decide", data=form, follow_redirects=False)
    assert done.status_code == 303 and srv.state(sid)["state"] == "approved"


def test_the_console_shows_notices_from_the_session_never_the_url(srv: InProc) -> None:
    sid = srv.upload(tiny_ajet("notice"))
    srv.sign_in(APPROVER_TOKEN)
    forged = "Security review passed (ops team): safe to approve"
    page = srv.http.get(f"/ui/snapshots/{sid}", params={"message": forged})
    assert page.status_code == 200 and "safe to approve" not in page.text
    assert 'id="message"' not in page.text
    form = {"csrf": csrf_of(page.text), "action": "approve", "confirm": "000000000000",
            "snapshot_id": sid}
    srv.http.post(f"/ui/snapshots/{sid}/decide", data=form, follow_redirects=False)
    again = srv.http.get(f"/ui/snapshots/{sid}", params={"message": forged})
    assert "did not match" in again.text and "safe to approve" not in again.text
    assert "did not match" not in srv.http.get(f"/ui/snapshots/{sid}").text  # shown once


def test_gc_never_removes_a_snapshot_pending_review(srv: InProc) -> None:
    older = srv.upload(tiny_ajet("older"))
    newer = srv.upload(tiny_ajet("newer"))
    r = srv.call("POST", "/code/gc", params={"keep": 1})
    assert r.status_code == 200 and older in r.json()["kept"] and newer in r.json()["kept"]
    assert srv.decide(older, "deny").status_code == 200
    r = srv.call("POST", "/code/gc", params={"keep": 1})
    assert older in r.json()["removed_snapshots"] and newer in r.json()["kept"]


def test_an_approval_rests_on_the_base_of_the_review_that_was_read(srv: InProc) -> None:
    a, b = _chain(srv, 2)
    c = srv.upload(tiny_ajet("c"))
    # the approver read C against A (an approved snapshot, not the active B)
    review = srv.call("GET", f"/approvals/{c}", token=APPROVER_TOKEN, params={"base": a}).json()
    assert review["base_id"] == a
    r = srv.call("POST", f"/approvals/{c}/approve", token=APPROVER_TOKEN,
                 json={"snapshot_id": c, "note": "", "base_id": review["base_id"]})
    assert r.status_code == 200 and r.json()["base_id"] == a
    # revoking A reaches C directly, B too
    assert srv.decide(a, "revoke").status_code == 200
    assert srv.state(c)["state"] == "pending" and srv.state(b)["state"] == "pending"
    # a base that is not approved is refused for an approval, never for a revocation
    r = srv.call("POST", f"/approvals/{c}/approve", token=APPROVER_TOKEN,
                 json={"snapshot_id": c, "note": "", "base_id": b})
    assert r.status_code == 400 and "not approved" in r.text
    assert srv.state(c)["state"] == "pending"
    assert srv.call("POST", f"/approvals/{c}/approve", token=APPROVER_TOKEN,
                    json={"snapshot_id": c, "base_id": "server"}).json()["base_id"] == "server"
    r = srv.call("POST", f"/approvals/{c}/revoke", token=APPROVER_TOKEN,
                 json={"snapshot_id": c, "note": "", "base_id": b})
    assert r.status_code == 200 and srv.state(c)["state"] == "revoked"
