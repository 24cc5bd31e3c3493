"""The approval rules of a sync as plain functions: `decide` and `approval_question`."""

from __future__ import annotations

from pathlib import Path

import pytest
from mcp.server.mcpserver.resolve import (
    AcceptedElicitation,
    CancelledElicitation,
    DeclinedElicitation,
    Elicit,
)

from ajet.packaging import package_tree
from ajet.protocol import EngineState
from mcp_bridge.approvals import ApprovalStore
from mcp_bridge.bridge import Bridge, BridgeConfig
from mcp_bridge.models import ApprovalMode
from mcp_bridge.sync import ApproveSync, SyncPlan, Verdict, approval_question, decide

URL = "http://127.0.0.1:10086"


def _plan(repo: Path, *, state: EngineState = EngineState.OFFLINE, running: str = "server",
          url: str = URL) -> SyncPlan:
    return SyncPlan(package=package_tree(repo), running_snapshot_id=running,
                    changes=[], missing=[], bytes_to_upload=0, engine_state=state,
                    server_url=url, diff="+x = 1\n")


def _decide(store: ApprovalStore, plan: SyncPlan, mode: ApprovalMode = ApprovalMode.ASK,
            elicited=None):
    return decide(mode=mode, store=store, plan=plan, elicited=elicited, repo="/repo")


def test_only_an_explicit_accept_in_the_client_proceeds(repo: Path, tmp_path: Path) -> None:
    store, plan = ApprovalStore(tmp_path / "a"), _plan(repo)
    yes = _decide(store, plan, elicited=AcceptedElicitation(data=ApproveSync(approve=True)))
    assert yes.verdict is Verdict.PROCEED and "via MCP elicitation" in yes.approved_by
    for answer in (AcceptedElicitation(data=ApproveSync(approve=False)), DeclinedElicitation(),
                   CancelledElicitation()):
        no = _decide(store, plan, ApprovalMode.AUTO, elicited=answer)  # even in auto mode
        assert no.verdict is Verdict.DENIED and no.status == "declined"
    assert store.all() == []  # answering in the client files nothing


def test_pending_then_approved_for_that_content_and_server_only(repo: Path, tmp_path: Path
                                                                ) -> None:
    store, plan = ApprovalStore(tmp_path / "a"), _plan(repo)
    pending = _decide(store, plan)
    assert pending.verdict is Verdict.PENDING and pending.approval is not None
    assert _decide(store, plan).approval.id == pending.approval.id
    store.approve(pending.approval.id, by="bob@desk")
    go = _decide(store, plan)
    assert go.verdict is Verdict.PROCEED
    assert go.approved_by == f"bob@desk (approval {pending.approval.id})"
    other_server = _decide(store, _plan(repo, url="http://10.0.0.9:10086"))
    assert other_server.verdict is Verdict.PENDING

    (repo / "ajet" / "engine" / "rewards.py").write_text("# edited\n", encoding="utf-8")
    edited = _decide(store, _plan(repo))
    assert edited.verdict is Verdict.PENDING and edited.approval.id != pending.approval.id


def test_a_denial_stands_and_auto_needs_no_human(repo: Path, tmp_path: Path) -> None:
    store, plan = ApprovalStore(tmp_path / "a"), _plan(repo)
    filed = _decide(store, plan).approval
    store.deny(filed.id)
    denied = _decide(store, plan)
    assert denied.verdict is Verdict.DENIED and denied.status == "denied"
    auto = _decide(ApprovalStore(tmp_path / "b"), plan, ApprovalMode.AUTO)
    assert auto.verdict is Verdict.PROCEED and auto.status == "auto_approved"
    assert "auto" in auto.approved_by


@pytest.mark.parametrize(("mode", "can_elicit", "dry_run", "state", "force", "asks"), [
    (ApprovalMode.ASK, True, False, EngineState.OFFLINE, False, True),
    (ApprovalMode.ASK, True, False, EngineState.ROLLING, True, True),
    (ApprovalMode.ASK, True, False, EngineState.ROLLING, False, False),  # refused first
    (ApprovalMode.ASK, True, True, EngineState.OFFLINE, False, False),  # preview
    (ApprovalMode.ASK, False, False, EngineState.OFFLINE, False, False),  # files instead
    (ApprovalMode.QUEUE, True, False, EngineState.OFFLINE, False, False),
    (ApprovalMode.AUTO, True, False, EngineState.OFFLINE, False, False),
])
def test_when_the_human_is_asked_in_the_client(repo: Path, tmp_path: Path, mode: ApprovalMode,
                                               can_elicit: bool, dry_run: bool,
                                               state: EngineState, force: bool, asks: bool) -> None:
    bridge = Bridge(BridgeConfig(swarm_url=URL, repo=repo, approval=mode,
                                 approvals_dir=tmp_path / "a"))
    try:
        plan = _plan(repo, state=state)
        question = approval_question(bridge, plan, can_elicit=can_elicit, dry_run=dry_run,
                                     force_restart=force)
        assert (question is not None) is asks
        if isinstance(question, Elicit):
            assert plan.snapshot_id in question.message and "+x = 1" in question.message
            assert question.schema is ApproveSync
        unchanged = _plan(repo, running=plan.snapshot_id)
        assert approval_question(bridge, unchanged, can_elicit=True, dry_run=False,
                                 force_restart=True) is None
    finally:
        bridge.close()
