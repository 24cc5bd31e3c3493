"""The original AgentJet wire protocol: its JSON bodies sent with plain httpx to every
route its client uses, then the ORIGINAL client module itself (read from the reference
repository at test time) driving this server through every step, on one shared server
with the ajet-tiny engine."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import httpx
import pytest
import yaml

from ajet.copilot.job import AgentJetJob
from ajet.protocol import EngineState
from ajet.tuner_lib.experimental.swarm_client import SwarmClient
from tests.support import PROJECT_ROOT, ServerHandle, make_ajet_repo, wait_status

pytestmark = pytest.mark.slow

#: The reference: a bare clone of charlesHsuGG/AgentJet holding commit af6b611.
ORIGINAL_REPO = Path(os.environ.get("AJET_ORIGINAL_REPO",
                                    "/work/.mirror/charlesHsuGG+AgentJet/repo"))
ORIGINAL_COMMIT = "af6b611"
CLIENT = "c0ffee00-0000-4000-8000-000000000001"


def post(server: ServerHandle, path: str, body: object) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, timeout=120)


def nested_job_yaml(**ajet: object) -> str:
    """The original client's `yaml_as_string`: a nested tree with verl's keys too."""
    tree = AgentJetJob(experiment_name="wire", batch_size=1, num_repeat=2).nested()
    tree["ajet"].update(ajet)
    tree["actor_rollout_ref"] = {"rollout": {"n": 2}}
    tree["hydra"] = {"searchpath": ["pkg://ajet/default_config"]}
    return yaml.safe_dump(tree)


def original_end_body(episode_uuid: str, task_id: str, reward: object, *,
                      meta_task: str | None = None, client: str = CLIENT) -> dict[str, object]:
    return {"client_uuid": client, "episode_uuid": episode_uuid, "task_id": task_id,
            "declare_client_active": True,
            "workflow_output": {"reward": reward, "is_success": None,
                                "metadata": {"task_id": meta_task or task_id},
                                "log_metrics": {"turns": [1, 2]}}}


def test_original_bodies_on_every_route(server: ServerHandle) -> None:
    status = httpx.get(f"{server.url}/get_engine_status", timeout=10).json()
    assert {"engine_status", "engine_status_detail", "global_step", "state"} <= set(status)
    assert post(server, "/stop_engine", {}).json()["success"] is True
    assert httpx.get(f"{server.url}/get_server_experiment_dir",
                     timeout=10).json() == {"server_experiment_dir": None}

    # code: a zip of ajet/ as the original client uploads it
    data = io.BytesIO()
    tracked = subprocess.run(["git", "-C", str(PROJECT_ROOT), "ls-files", "--", "ajet"],
                             capture_output=True, text=True, check=True).stdout.split()
    with zipfile.ZipFile(data, "w") as zf:
        for name in tracked:
            zf.write(PROJECT_ROOT / name, name)
    synced = httpx.post(f"{server.url}/sync_train_code", content=data.getvalue(), timeout=120,
                        headers={"Content-Type": "application/zip"}).json()
    assert synced["success"] and synced["message"] and \
        synced["temp_ajet_code_path"].startswith("ajet_temp/") and synced["snapshot_id"]

    # config: the nested YAML as yaml_as_string, converted by the snapshot's validator
    accepted = post(server, "/sync_train_config", {"yaml_as_string": nested_job_yaml()})
    assert accepted.status_code == 200, accepted.text
    body = accepted.json()
    assert body["success"] and body["config"]["batch_size"] == 1
    assert {"actor_rollout_ref.rollout.n", "hydra.searchpath"} <= {
        n["field"] for n in body["notes"]}
    refused = post(server, "/sync_train_config",
                   {"yaml_as_string": nested_job_yaml(backbone="trinity")})
    assert refused.status_code == 422 and "Trinity" in refused.text

    started = post(server, "/start_engine", {})
    assert started.json()["success"] and started.json()["engine_status"] == "ENGINE.BOOTING"
    claim = {"client_uuid": CLIENT, "episode_type": "train", "discard_episode_timeout": 60,
             "throttle_policy": None}
    early = post(server, "/claim_episode", claim).json()
    assert early["success"] is False and early["client_uuid"] == CLIENT and \
        early["episode_uuid"] == "" and "Current status: [ENGINE.BOOTING]" in early["fail_cause"]
    wait_status(server.url, EngineState.ROLLING, timeout=120)

    claimed = post(server, "/claim_episode", claim).json()
    assert claimed["success"] and claimed["openai_base_url"].endswith("/v1")
    uuid = claimed["episode_uuid"]
    chat = httpx.post(f"{claimed['openai_base_url']}/chat/completions", timeout=120,
                      headers={"Authorization": f"Bearer {claimed['openai_api_key']}"},
                      json={"model": "m", "messages": [{"role": "user", "content": "hi"}]})
    assert chat.status_code == 200
    assert post(server, "/can_continue_episode",
                {"client_uuid": CLIENT, "episode_uuid": uuid}).json() == {"can_continue": True}
    assert post(server, "/can_continue_episode", {"client_uuid": "other", "episode_uuid": uuid}
                ).json() == {"can_continue": False}
    (entry,) = post(server, "/get_episode_buffer", {}).json()["buffer"]
    assert entry["episode_uuid"] == uuid and entry["client_uuid"] == CLIENT
    assert entry["llm_call_count"] == 1 and entry["openai_api_key"] == ""
    pool = httpx.get(f"{server.url}/get_current_batch_rollout_pool_information",
                     timeout=10).json()
    assert pool["running_episode_details"][uuid]["client_uuid"] == CLIENT
    assert (pool["completed_task_target"], pool["task_expected_num_repeat"],
            pool["engine_status"]) == (1, 2, "ENGINE.ROLLING")

    # ends: a mismatched task id, a list reward and another client are 4xx naming why
    mismatch = post(server, "/end_episode", original_end_body(uuid, "t0", 1.0, meta_task="t9"))
    assert mismatch.status_code == 422 and "metadata.task_id" in mismatch.text
    steps = post(server, "/end_episode", original_end_body(uuid, "t0", [1.0, 0.0]))
    assert steps.status_code == 422 and "step reward" in steps.text
    intruder = post(server, "/end_episode", original_end_body(uuid, "t0", 1.0, client="other"))
    assert intruder.status_code == 403
    ended = post(server, "/end_episode", original_end_body(uuid, "t0", 1.0))
    assert ended.status_code == 200 and ended.json()["success"] is True
    pool = httpx.get(f"{server.url}/get_current_batch_rollout_pool_information",
                     timeout=10).json()
    assert pool["completed_tasks_client_uuids"] == {"t0": [CLIENT]}
    assert pool["swarm_client_instruction"]["active_clients"][0]["client_uuid"] == CLIENT

    second = post(server, "/claim_episode", claim).json()
    aborted = post(server, "/abort_episode", original_end_body(second["episode_uuid"], "", 0.0))
    assert aborted.status_code == 200 and aborted.json()["success"] is True
    agreed = post(server, "/agree_sync_weight", {"client_uuid": CLIENT}).json()
    assert agreed["success"] is False and "only valid when" in agreed["failure_reason"]
    experiment = httpx.get(f"{server.url}/get_server_experiment_dir", timeout=10).json()
    assert Path(experiment["server_experiment_dir"]).is_dir()

    # malformed original bodies: 4xx naming the field, never a 500
    for path, bad, field in (
            ("/claim_episode", {"episode_type": "train", "discard_episode_timeout": 1},
             "client_uuid"),
            ("/claim_episode", {**claim, "episode_type": "debug"}, "episode_type"),
            ("/claim_episode", {**claim, "discard_episode_timeout": "soon"},
             "discard_episode_timeout"),
            ("/end_episode", {**original_end_body(uuid, "t0", 1.0), "workflow_output": 3},
             "workflow_output"),
            ("/can_continue_episode", {"client_uuid": CLIENT}, "episode_uuid"),
            ("/agree_sync_weight", {}, "client_uuid"),
            ("/sync_train_config", {"yaml_as_string": 5}, "yaml")):
        reply = post(server, path, bad)
        assert 400 <= reply.status_code < 500 and field in reply.text, (path, reply.text)
    assert post(server, "/stop_engine", {}).json()["success"] is True


def test_the_original_client_module_drives_this_server(server: ServerHandle,
                                                       tmp_path: Path) -> None:
    if not (ORIGINAL_REPO / "HEAD").exists():
        pytest.skip(f"the reference AgentJet repository is not at {ORIGINAL_REPO} "
                    "(set AJET_ORIGINAL_REPO)")
    checkout = make_ajet_repo(tmp_path / "checkout")
    env = {k: v for k, v in os.environ.items() if not k.startswith("AJET_SWARM_")}
    env.update({"PYTHONPATH": "", "AJET_IPC_DIR": str(tmp_path / "ipc")})
    proc = subprocess.run(
        [sys.executable, str(Path(__file__).parent / "original_client_driver.py"),
         str(ORIGINAL_REPO), ORIGINAL_COMMIT, server.url, str(checkout)],
        capture_output=True, text=True, timeout=400, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout.splitlines()[-1])
    assert result["client_file"].startswith("<AgentJet af6b611>")
    steps = result["steps"]
    assert steps["status"][0] in ("ENGINE.OFFLINE", "ENGINE.ROLLING")
    assert {"engine_status", "global_step"} <= set(steps["status"][1])
    assert steps["code_sync"][0] is True and steps["code_sync"][1].startswith("ajet_temp/")
    assert steps["start"] == steps["restart"] == "ENGINE.ROLLING"
    assert steps["episodes"] == ["t0", "t0"] and steps["can_continue"] is True
    assert steps["buffer"] == [True]
    assert steps["rollout_stat"][1:] == [1, 2] and steps["experiment_dir"]
    assert steps["stop"] == "ENGINE.OFFLINE"
    assert result["errors"] == []  # the original client logged no failed step
    with SwarmClient(server.url) as ours:
        runs = ours.list_runs(experiment_name="original_client").runs
        assert len(runs) == 2 and all(r.snapshot_id != "server" for r in runs)
