"""The bridge through the official MCP client, in process, against a real swarm server.

Covers the interface the model sees (tools, annotations, prompts, instructions) and the
approval flow of `sync_train_code`: elicitation accepted / declined on both protocol
generations, pending approvals resolved by the human's `ajet-mcp approvals approve`, and
changed content needing a new approval.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from mcp import Client

from ajet.packaging import package_tree
from mcp_bridge.models import ApprovalMode, ToolName
from mcp_bridge.server import build_server, prompt_files
from tests.support.bridge import (
    Elicitor,
    assert_names_next,
    assert_small,
    patch_file,
    run_approvals_cli,
    snapshot_count,
    structured,
    text_of,
)

pytestmark = pytest.mark.anyio

REWARD_FILE = "ajet/engine/rewards.py"
# auto negotiates 2026-07-28 (elicitation inside InputRequiredResult); legacy 2025-11-25
PROTOCOLS = ["auto", "legacy"]


def _edit(repo: Path, marker: str) -> None:
    path = repo / REWARD_FILE
    path.write_text(path.read_text() + f"\n# experiment: {marker}\n", encoding="utf-8")


async def _sync(client: Client, **args: Any):
    return await client.call_tool(ToolName.SYNC_TRAIN_CODE.value, args)


async def test_tools_annotations_prompts_and_instructions(bridge_factory: Any) -> None:
    bridge = bridge_factory()
    async with Client(build_server(bridge)) as client:
        tools = {t.name: t for t in (await client.list_tools()).tools}
        assert set(tools) == {t.value for t in ToolName}
        for tool in tools.values():
            assert tool.description and len(tool.description) > 40, tool.name
            assert tool.annotations is not None, tool.name
            assert tool.output_schema is not None, tool.name
        read_only = {"engine_status", "read_metrics", "read_logs", "list_runs", "compare_runs",
                     "list_snapshots", "rollout_status", "list_checkpoints"}
        for name, tool in tools.items():
            assert tool.annotations.read_only_hint is (name in read_only), name
        assert tools["sync_train_code"].annotations.destructive_hint is True
        assert tools["stop_engine"].annotations.idempotent_hint is True
        sync_params = tools["sync_train_code"].input_schema["properties"]
        assert set(sync_params) == {"dry_run", "force_restart", "diff_offset"}
        assert "description" in sync_params["dry_run"]
        configure_params = tools["configure"].input_schema["properties"]
        assert {"experiment_name", "model", "batch_size", "num_repeat", "lr", "n_gpu",
                "max_prompt_length", "max_response_length", "extra",
                "reset"} <= set(configure_params)
        assert not any("approv" in name for name in tools)  # no tool lets the model approve

        prompts = {p.name: p for p in (await client.list_prompts()).prompts}
        files = prompt_files()
        assert set(prompts) == set(files)
        assert {"research_loop", "debugging", "sync_rules"} <= set(files)
        got = await client.get_prompt("sync_rules")
        assert got.messages[0].content.text == files["sync_rules"]

        instructions = client.instructions or ""
        for phrase in ("sync_train_code", "dry_run", "force_restart", "git add", "compare_runs",
                       "activate_snapshot", "one", bridge.config.swarm_url):
            assert phrase in instructions, phrase


@pytest.mark.parametrize("mode", PROTOCOLS)
async def test_sync_asks_the_human_and_uploads_only_after_accept(
        bridge_factory: Any, repo: Path, mode: str) -> None:
    bridge = bridge_factory()
    _edit(repo, "double the reward")
    human = Elicitor("accept")
    async with Client(build_server(bridge), elicitation_callback=human, mode=mode) as client:
        preview = structured(await _sync(client, dry_run=True))
        assert preview["status"] == "preview" and human.messages == []
        assert snapshot_count(bridge) == 0  # a preview uploads nothing
        # the cluster runs its own code: the diff is against the server's own files (never
        # git HEAD), so it shows exactly the edited file
        assert preview["changed"] == [REWARD_FILE] and preview["added"] == []
        assert preview["running_snapshot_id"] == "server"
        assert "+# experiment: double the reward" in preview["diff"]

        result = await _sync(client)
        assert_small(result)
        synced = structured(result)
    assert synced["status"] == "synced", synced["message"]
    assert synced["approval"]["status"] == "elicited"
    assert "via MCP elicitation" in synced["approval"]["approved_by"]
    # the human saw exactly this snapshot, its files and the patched line
    assert len(human.messages) == 1
    shown = human.messages[0]
    assert synced["snapshot_id"] in shown and "# experiment: double the reward" in shown
    assert package_tree(repo).snapshot_id == synced["snapshot_id"]
    active = bridge.client.get_active_code()
    assert active is not None and active.snapshot_id == synced["snapshot_id"]
    assert "via MCP elicitation" in (active.approved_by or "")


async def test_a_long_diff_is_paged(bridge_factory: Any, repo: Path) -> None:
    bridge = bridge_factory(ApprovalMode.AUTO)
    async with Client(build_server(bridge)) as client:
        assert structured(await _sync(client))["status"] == "synced"
        patch_file(repo, REWARD_FILE, "".join(f"LINE_{i} = {i}\n" for i in range(600)))
        pages: list[str] = []
        offset: int | None = 0
        while offset is not None:
            result = await _sync(client, dry_run=True, diff_offset=offset)
            assert_small(result)
            page = structured(result)
            assert page["changed"] == [REWARD_FILE]
            pages.append(page["diff"])
            offset = page["diff_next_offset"]
    whole = "".join(pages)
    assert len(pages) > 2
    assert "+LINE_0 = 0\n" in whole and "+LINE_599 = 599\n" in whole


@pytest.mark.parametrize(("action", "approve"), [("decline", True), ("cancel", True),
                                                  ("accept", False)])
async def test_a_declined_sync_uploads_nothing(bridge_factory: Any, repo: Path, action: str,
                                               approve: bool) -> None:
    bridge = bridge_factory()
    _edit(repo, "risky")
    package = package_tree(repo)
    missing_before = bridge.client.check_manifest(package.entries()).missing
    human = Elicitor(action, approve=approve)
    async with Client(build_server(bridge), elicitation_callback=human) as client:
        result = await _sync(client)
    assert_names_next(result)
    assert "declined" in text_of(result) and "nothing was uploaded" in text_of(result)
    assert len(human.messages) == 1
    assert snapshot_count(bridge) == 0
    assert bridge.client.get_active_code() is None
    assert bridge.client.check_manifest(package.entries()).missing == missing_before


async def test_without_elicitation_a_pending_approval_gates_the_sync(
        bridge_factory: Any, repo: Path, approvals_dir: Path) -> None:
    bridge = bridge_factory()
    _edit(repo, "v1")
    async with Client(build_server(bridge)) as client:  # declares no elicitation capability
        first = structured(await _sync(client))
        assert first["status"] == "pending_approval"
        approval_id = first["approval"]["approval_id"]
        command = first["approval"]["human_command"]
        assert command.startswith("ajet-mcp approvals")
        assert command.endswith(f"approve {approval_id}")
        assert str(approvals_dir) in command  # a non-default folder is named in the command
        assert command in first["message"] and "cannot approve" in first["message"]
        assert snapshot_count(bridge) == 0

        again = structured(await _sync(client))  # asking again files nothing new
        assert again["status"] == "pending_approval"
        assert again["approval"]["approval_id"] == approval_id

        listed = run_approvals_cli(approvals_dir, "list")
        assert listed.returncode == 0 and approval_id in listed.stdout
        shown = run_approvals_cli(approvals_dir, "show", approval_id)
        assert "# experiment: v1" in shown.stdout and first["snapshot_id"] in shown.stdout
        refused = run_approvals_cli(approvals_dir, "approve", approval_id)  # not a terminal
        assert refused.returncode == 1 and "terminal" in refused.stderr
        approved = run_approvals_cli(approvals_dir, "approve", approval_id,
                                     typed=first["snapshot_id"][:12])
        assert approved.returncode == 0, approved.stderr
        assert "Approved" in approved.stdout

        synced = structured(await _sync(client))
        assert synced["status"] == "synced", synced["message"]
        assert synced["approval"]["status"] == "approved"
        assert synced["approval"]["approval_id"] == approval_id
        assert bridge.client.get_active_code().snapshot_id == first["snapshot_id"]

        _edit(repo, "v2")  # changed content: the old approval does not cover it
        changed = structured(await _sync(client))
        assert changed["status"] == "pending_approval"
        assert changed["approval"]["approval_id"] != approval_id
        assert changed["changed"] == [REWARD_FILE]
        assert "+# experiment: v2" in changed["diff"]
        assert bridge.client.get_active_code().snapshot_id == first["snapshot_id"]

        run_approvals_cli(approvals_dir, "deny", changed["approval"]["approval_id"])
        denied = await _sync(client)
        assert_names_next(denied)
        assert "denied" in text_of(denied)
        assert bridge.client.get_active_code().snapshot_id == first["snapshot_id"]


async def test_queue_mode_never_elicits(bridge_factory: Any, repo: Path) -> None:
    bridge = bridge_factory(ApprovalMode.QUEUE)
    _edit(repo, "queued")
    human = Elicitor("accept")
    async with Client(build_server(bridge), elicitation_callback=human) as client:
        result = structured(await _sync(client))
    assert result["status"] == "pending_approval" and human.messages == []
    assert snapshot_count(bridge) == 0


async def test_auto_mode_says_so_in_every_result(bridge_factory: Any, repo: Path) -> None:
    bridge = bridge_factory(ApprovalMode.AUTO)
    async with Client(build_server(bridge)) as client:
        synced = structured(await _sync(client))
        assert synced["status"] == "synced"
        assert synced["approval"]["status"] == "auto_approved"
        assert "auto" in synced["message"] and synced["notice"]
        status = structured(await client.call_tool("engine_status", {}))
        assert status["notice"] and "--approval auto" in status["notice"]
        unchanged = structured(await _sync(client))
        assert unchanged["status"] == "no_changes" and unchanged["notice"]
    assert snapshot_count(bridge) == 1


async def test_untracked_files_are_named_and_not_shipped(bridge_factory: Any, repo: Path) -> None:
    bridge = bridge_factory(ApprovalMode.AUTO)
    patch_file(repo, "ajet/engine/new_reward.py", "X = 1\n")
    async with Client(build_server(bridge)) as client:
        synced = structured(await _sync(client))
    assert synced["untracked_left_out"] == ["ajet/engine/new_reward.py"]
    active = bridge.client.get_active_code()
    assert active is not None and "ajet/engine/new_reward.py" not in {f.path for f in active.files}


async def test_errors_name_the_next_call_and_outputs_stay_small(bridge_factory: Any) -> None:
    bridge = bridge_factory()
    async with Client(build_server(bridge)) as client:
        for name, args in [
            ("engine_status", {}), ("list_runs", {}), ("list_snapshots", {}),
            ("rollout_status", {}), ("stop_rollouts", {}), ("stop_engine", {}),
            ("sync_train_code", {"dry_run": True}),
            ("configure", {"batch_size": 2, "num_repeat": 2}),
        ]:
            result = await client.call_tool(name, args)
            assert not result.is_error, (name, text_of(result))
            assert_small(result)
        for name, args in [
            ("read_metrics", {}),
            ("read_logs", {"run_id": "no-such-run"}),
            ("compare_runs", {"run_ids": ["only-one"]}),
            ("compare_runs", {"run_ids": ["r-a", "r-b"]}),
            ("activate_snapshot", {"snapshot_id": "f" * 12}),
            ("rollout_status", {"handle": "ro-nope"}),
            ("stop_rollouts", {"handle": "ro-nope"}),
            ("start_rollouts", {"workflow": "not a spec"}),
            ("start_rollouts", {"workflow": "no_such_module:run"}),
            ("configure", {"lr": -1.0}),
            ("configure", {"extra": {"no_such_field": 1}}),
            ("read_logs", {"grep": "(unclosed", "regex": True}),
        ]:
            result = await client.call_tool(name, args)
            assert_names_next(result)
            assert_small(result)
        # reset starts over from the defaults: configure's result says what changed
        reset = structured(await client.call_tool("configure", {"reset": True}))
        assert {c["field"] for c in reset["changed"]} == {"batch_size", "num_repeat"}


async def test_an_unreachable_server_is_an_error_with_a_next_step(
        repo: Path, approvals_dir: Path) -> None:
    from mcp_bridge.bridge import Bridge, BridgeConfig
    from tests.support import free_port

    bridge = Bridge(BridgeConfig(swarm_url=f"http://127.0.0.1:{free_port()}", repo=repo,
                                 approvals_dir=approvals_dir))
    try:
        async with Client(build_server(bridge)) as client:
            for name in ("engine_status", "sync_train_code", "list_runs"):
                result = await client.call_tool(name, {})
                assert_names_next(result)
                assert "cannot reach the swarm server" in text_of(result)
    finally:
        bridge.close()
