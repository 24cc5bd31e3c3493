"""Rollout scripts in the style of AgentJet's tutorials, run as subprocesses against one
real server with the ajet-tiny engine (shared by the module, short
back-offs through AJET_SWARM_BACKOFF_SCALE), then the original client's failure paths."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import pytest

from ajet.compat.client import RetryPolicy
from ajet.copilot.job import AgentJetJob
from ajet.errors import SwarmServerOfflineError, SwarmStateError
from ajet.tuner_lib.experimental.swarm_client import SwarmClient
from tests.support import PROJECT_ROOT, ServerHandle, make_ajet_repo

pytestmark = pytest.mark.slow

SCRIPTS = Path(__file__).parent / "scripts"
FAST = RetryPolicy(status_poll_s=0.05, busy_retry_s=0.1, no_slot_retry_s=0.05,
                   throttle_retry_s=0.05, agree_retry_s=0.05, unreachable_retry_s=0.1,
                   engine_wait_s=120, begin_episode_wait_s=120)


def run_script(server: ServerHandle, name: str, *args: str, cwd: Path | None = None,
               env: dict[str, str] | None = None) -> str:
    child_env = {k: v for k, v in os.environ.items() if not k.startswith("AJET_SWARM_")}
    child_env.update({"AJET_SWARM_URL": server.url, "AJET_SWARM_BACKOFF_SCALE": "0.02",
                      "PYTHONPATH": str(PROJECT_ROOT), **(env or {})})
    proc = subprocess.run([sys.executable, str(SCRIPTS / name), *args], capture_output=True,
                          text=True, timeout=240, cwd=cwd or PROJECT_ROOT, env=child_env)
    assert proc.returncode == 0, f"{name} exited {proc.returncode}:\n{proc.stderr[-4000:]}"
    return proc.stdout


def status(server: ServerHandle) -> dict[str, object]:
    return httpx.get(f"{server.url}/get_engine_status", timeout=10).json()


def test_math_loop_from_the_skill_file(server: ServerHandle, tmp_path: Path) -> None:
    datasets = pytest.importorskip("datasets")
    rows = datasets.Dataset.from_dict({
        "question": [f"What is {i} + {i}?" for i in range(4)],
        "answer": [f"#### {2 * i}" for i in range(4)]})
    datasets.DatasetDict({"train": rows}).save_to_disk(str(tmp_path / "gsm8k"))
    out = run_script(server, "math_roll.py", env={"LOCAL_DATASET_PATH": str(tmp_path / "gsm8k")})
    # 4 tasks x 2 episodes = 2 steps of 2 groups of 2
    assert "global step: 2" in out or status(server)["global_step"] >= 2
    assert status(server)["engine_status"] == "ENGINE.ROLLING"


def test_batch_loop_on_a_rolling_engine(server: ServerHandle) -> None:
    with SwarmClient(server.url, retry=FAST) as watcher:
        entered_sync = threading.Event()
        watcher.add_entering_weight_sync_callback(entered_sync.set)
        data = json.loads(run_script(server, "batch_roll.py").splitlines()[-1])
        assert entered_sync.wait(10), "the weight-sync callback never fired"
        job = AgentJetJob(experiment_name="also_ignored", batch_size=2, num_repeat=2)
        SwarmClient.async_and_start_multi_engine([(watcher, job)])  # ROLLING: nothing to do
        with pytest.raises(ValueError, match="agree_sync_weight is only applicable"):
            watcher.agree_sync_weight()  # the job collects by tasks, not by agreement
    assert data["status"] == "ENGINE.ROLLING" and data["global_step_key"] and data["detail_key"]
    assert len(data["results"]) == 4 and data["step_before"] >= 2
    assert (data["can_before"], data["can_after"]) == (True, False)
    assert data["eval_task_in_pool"] is False  # eval episodes are never trained on
    assert data["experiment_dir"] and Path(data["experiment_dir"]).is_dir()
    experiment = httpx.get(f"{server.url}/runs?limit=1", timeout=10).json()["runs"][0]
    assert experiment["experiment_name"] == "test"  # auto_sync did nothing while rolling


def test_job_from_the_original_nested_yaml(server: ServerHandle) -> None:
    out = run_script(server, "nested_yaml_roll.py",
                     str(PROJECT_ROOT / "tests/compat/original_job.yaml"))
    data = json.loads(out.splitlines()[-1])
    assert data["success"] and data["experiment_name"] == "nested_yaml_job"
    assert data["max_in_flight_source"] == 4
    assert {"ajet.rollout.agent_madness_reward", "actor_rollout_ref.rollout.n",
            "defaults"} <= set(data["ignored"])
    assert status(server)["global_step"] == 1  # one batch of 2 groups on the new run


def test_sync_code_flow_from_the_blog(server: ServerHandle, tmp_path: Path) -> None:
    repo = make_ajet_repo(tmp_path / "checkout")
    out = run_script(server, "sync_code_roll.py", cwd=repo, env={"SYNC_CODE": "1"})
    assert "synced: True ajet_temp/" in out and "engine: ENGINE.ROLLING" in out
    now = status(server)
    assert now["snapshot_id"] != "server" and str(now["ajet_file"]).startswith(
        str(server.workdir / "ajet_temp"))
    assert "[start_engine] Using synced training code from ./ajet_temp/" in server.log()


def test_boot_failure_raises_the_original_offline_error(server: ServerHandle) -> None:
    with SwarmClient(server.url, retry=FAST) as client:
        with pytest.raises(SwarmStateError, match="NOT ENGINE.OFFLINE"):
            client.start_engine()
        client.stop_engine()
        assert client.get_engine_status()[0] == "ENGINE.OFFLINE"
        client.sync_train_config(AgentJetJob(experiment_name="broken", batch_size=1,
                                              num_repeat=2, model=str(server.workdir / "none")))
        with pytest.raises(SwarmServerOfflineError) as info:
            client.start_engine()
        assert "none" in str(info.value)  # the server's last_error names the model path
        # begin_episode waiting on a booting engine that fails raises the same error
        client.start_run()
        caught: list[BaseException] = []
        waiter = threading.Thread(target=lambda: _catch(client.begin_episode, caught))
        waiter.start()
        waiter.join(timeout=120)
        assert caught and isinstance(caught[0], SwarmServerOfflineError)


def _catch(call: object, into: list[BaseException]) -> None:
    try:
        call()  # type: ignore[operator]
    except BaseException as exc:  # noqa: BLE001 - handed to the test thread
        into.append(exc)
