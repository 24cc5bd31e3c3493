"""The engine process over its private channel: a real subprocess on a Unix socket."""

from __future__ import annotations

import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoModelForCausalLM

from ajet.copilot.job import AgentJetJob
from ajet.engine.metrics import REQUIRED_FIELDS
from tests.support import PROJECT_ROOT
from tests.support.engine import EngineHandle, spawn_engine, wait_for_state

JOB = AgentJetJob(batch_size=1, num_repeat=2, max_new_tokens=8, save_every=1,
                  episode_timeout_s=60.0)


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineHandle]:
    handle = spawn_engine(tmp_path_factory.mktemp("engine"), JOB)
    try:
        wait_for_state(handle, "ENGINE.ROLLING")
        yield handle
    finally:
        handle.stop()


def begin(engine: EngineHandle, **body: Any) -> str:
    r = engine.client.post("/begin_episode", json=body)
    assert r.status_code == 200, r.text
    return str(r.json()["episode_uuid"])


def chat(engine: EngineHandle, uuid: str | None, **body: Any) -> Any:
    payload = {"messages": [{"role": "user", "content": "hello"}], **body}
    headers = {"X-Episode-UUID": uuid} if uuid else {}
    return engine.client.post("/v1/chat/completions", json=payload, headers=headers)


def end(engine: EngineHandle, uuid: str, task: str, reward: float = 0.5) -> Any:
    return engine.client.post("/end_episode",
                              json={"episode_uuid": uuid, "task_id": task, "reward": reward})


def test_status_reports_state_pid_and_ajet_file(engine: EngineHandle) -> None:
    report = engine.client.get("/status").json()
    assert report["state"] == "ENGINE.ROLLING"
    assert report["pid"] == engine.proc.pid
    assert report["run_id"] == "test-run"
    assert Path(report["ajet_file"]) == PROJECT_ROOT / "ajet" / "__init__.py"
    assert report["info"]["model"] == "ajet-tiny"


def test_socket_is_private(engine: EngineHandle) -> None:
    assert stat.S_IMODE(engine.socket.stat().st_mode) == 0o600


def test_chat_completion_plain_and_streamed(engine: EngineHandle) -> None:
    uuid = begin(engine)
    r = chat(engine, uuid, max_tokens=5)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "chat.completion"
    assert body["choices"][0]["message"]["role"] == "assistant"
    assert body["usage"]["completion_tokens"] <= 5
    with engine.client.stream("POST", "/v1/chat/completions", headers={"X-Episode-UUID": uuid},
                              json={"messages": [{"role": "user", "content": "hi"}],
                                    "stream": True,
                                    "stream_options": {"include_usage": True}}) as s:
        assert s.headers["content-type"].startswith("text/event-stream")
        events = [line[6:] for line in s.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert chunks[-1]["usage"]["completion_tokens"] >= 1
    assert any(c["choices"] and c["choices"][0]["finish_reason"] for c in chunks)
    assert isinstance(text, str)
    assert end(engine, uuid, "chat-task").status_code == 200


def test_bad_chat_requests_are_4xx(engine: EngineHandle) -> None:
    uuid = begin(engine)
    assert chat(engine, None).status_code == 400
    assert chat(engine, uuid, n=2).status_code == 400
    too_long = "x" * (JOB.max_prompt_length + 1)
    long = chat(engine, uuid, messages=[{"role": "user", "content": too_long}])
    assert long.status_code == 400 and "max_prompt_length" in long.json()["detail"]
    assert chat(engine, uuid, messages=[]).status_code == 422
    assert chat(engine, uuid, stop=[""]).status_code == 400
    assert chat(engine, "no-such-episode").status_code == 404
    assert engine.client.post("/abort_episode", json={"episode_uuid": uuid}).json() == {
        "episode_uuid": uuid, "requeued": True}
    closed = chat(engine, uuid)
    assert closed.status_code == 409 and "aborted" in closed.json()["detail"]


def test_end_and_abort_errors_are_404_409_422_never_5xx(engine: EngineHandle) -> None:
    assert end(engine, "unknown", "t").status_code == 404
    uuid = begin(engine)
    nan = engine.client.post("/end_episode", content=json.dumps(
        {"episode_uuid": uuid, "task_id": "t", "reward": float("nan")}),
        headers={"Content-Type": "application/json"})
    assert nan.status_code == 422
    assert end(engine, uuid, "errors-task").status_code == 200
    again = end(engine, uuid, "errors-task")
    assert again.status_code == 409 and "already ended" in again.json()["detail"]
    assert engine.client.post("/abort_episode", json={"episode_uuid": uuid}).status_code == 409
    assert engine.client.post("/abort_episode", json={"episode_uuid": "x"}).status_code == 404


def test_idle_episode_times_out_and_its_slot_is_requeued(engine: EngineHandle) -> None:
    before = engine.client.get("/status").json()["info"]["episodes_timed_out"]
    uuid = begin(engine, discard_episode_timeout=0.3)
    time.sleep(1.0)
    late = end(engine, uuid, "timeout-task")
    assert late.status_code == 409 and "timed out" in late.json()["detail"]
    assert engine.client.get("/status").json()["info"]["episodes_timed_out"] == before + 1


def test_a_step_closes_claims_drains_trains_and_writes_metrics(engine: EngineHandle) -> None:
    a, b = begin(engine), begin(engine)
    chat(engine, a)
    assert end(engine, a, "step-x", 1.0).status_code == 200
    assert end(engine, b, "step-y", 0.0).status_code == 200  # no group is complete yet
    c, d = begin(engine), begin(engine)
    chat(engine, c)
    assert end(engine, c, "step-x", 0.0).status_code == 200  # group step-x is complete
    wait_for_state(engine, "ENGINE.ROLLING_POST", timeout=10)
    refused = engine.client.post("/begin_episode", json={})
    assert refused.status_code == 409
    assert "ENGINE.ROLLING_POST" in refused.json()["detail"]
    assert "retry" in refused.json()["hint"] and refused.headers["retry-after"] == "1"
    assert end(engine, d, "step-z", 0.0).status_code == 200  # the drain ends
    deadline = time.monotonic() + 30
    metrics = engine.run_dir / "metrics.jsonl"
    while not (metrics.exists() and metrics.read_text().strip()):
        assert time.monotonic() < deadline, engine.log()
        time.sleep(0.05)
    line = json.loads(metrics.read_text().splitlines()[-1])
    assert set(REQUIRED_FIELDS) <= set(line)
    assert line["episodes"] == 2 and line["reward_mean"] == 0.5
    # the measured peak above the loaded model, next to the planner's estimate of it,
    # which the engine logged at boot (docs/distributed.md, "How the planner counts")
    assert 0 < line["peak_memory_mb"] < 600 and line["planned_peak_mb"] > 0
    assert "memory plan: fits" in engine.log() and "AdamW moments (fp32)" in engine.log()
    report = wait_for_state(engine, "ENGINE.ROLLING", timeout=30)
    assert report["step"] >= 1
    assert (engine.run_dir / "checkpoints" / f"step_{line['step']}" / "config.json").is_file()


def test_resident_memory_stays_under_600_mb(engine: EngineHandle) -> None:
    status = Path(f"/proc/{engine.proc.pid}/status")
    if not status.exists():
        pytest.skip("needs /proc")
    rss_kb = next(int(line.split()[1]) for line in status.read_text().splitlines()
                  if line.startswith("VmRSS:"))
    assert rss_kb < 600 * 1024


def test_sigterm_exits_zero_with_a_loadable_final_checkpoint(tmp_path: Path) -> None:
    handle = spawn_engine(tmp_path, AgentJetJob(batch_size=1, num_repeat=1))
    try:
        wait_for_state(handle, "ENGINE.ROLLING")
        uuid = begin(handle)
        assert end(handle, uuid, "only", 1.0).status_code == 200  # one step trains
        os.kill(handle.proc.pid, signal.SIGTERM)
        assert handle.proc.wait(60) == 0, handle.log()
    finally:
        handle.stop()
    final = handle.run_dir / "final"
    assert json.loads((final / "ajet_checkpoint.json").read_text())["run_id"] == "test-run"
    assert AutoModelForCausalLM.from_pretrained(final) is not None
    assert not handle.socket.exists()
    assert "engine stopped cleanly" in handle.log()


def test_boot_error_leaves_a_traceback_and_a_nonzero_exit(tmp_path: Path) -> None:
    handle = spawn_engine(tmp_path, "batch_size: 0\nnot_a_field: 1\n")
    try:
        code = handle.proc.wait(120)
    finally:
        handle.stop()
    assert code != 0
    log = handle.log()
    assert "Traceback (most recent call last)" in log
    assert "JobValidationError" in log and "batch_size" in log and "not_a_field" in log


def test_the_snapshot_named_by_isolated_base_dir_is_imported_first(tmp_path: Path) -> None:
    base = tmp_path / "ajet_temp" / "20260101_000000"
    shutil.copytree(PROJECT_ROOT / "ajet", base / "ajet",
                    ignore=shutil.ignore_patterns("__pycache__"))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["ISOLATED_AGENTJET_BASE_DIR"] = str(base)
    (tmp_path / "job.yaml").write_text("batch_size: 0\n")  # fails fast, after the log line
    out = subprocess.run(
        [sys.executable, "-m", "ajet.engine", "--config", str(tmp_path / "job.yaml"),
         "--run-dir", str(tmp_path / "run")],
        cwd=PROJECT_ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode != 0
    assert f"ajet from {base / 'ajet' / '__init__.py'}" in out.stderr
