"""Results where researchers look: the job's trackers, and the trained model out.

One LoRA run on the tiny model with `logging: [tensorboard, mlflow, wandb, swanlab]` and
`lora_save_merged`, two steps, through a real server and engine. Then:

- TensorBoard's event reader, the MLflow client, W&B's own protobuf records (its offline
  `run-*.wandb` file; wandb ships no offline reader, so the file's record framing is read
  here) and SwanLab's local files each show the reward curve and the snapshot id;
- the final checkpoint is listed, downloaded (whole, resumed, and by the CLI), verified
  against the server's hashes, and loaded with `from_pretrained` (adapter and merged).
"""

from __future__ import annotations

import glob
import json
import sqlite3
import struct
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ajet.client import SwarmClient
from ajet.copilot.job import AgentJetJob
from ajet.engine.tracking.trackers import TrackerSet
from ajet.protocol import EngineState
from tests.support import CONTROL_TOKEN, WORKER_TOKEN, ServerHandle, rolling_server

pytestmark = pytest.mark.slow

TRACKERS = ["tensorboard", "mlflow", "wandb", "swanlab"]


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServerHandle, str]]:
    job = AgentJetJob(experiment_name="tracked", model="ajet-tiny", n_gpu=0, batch_size=1,
                      num_repeat=2, max_steps=2, logging=TRACKERS, lora_rank=4, lora_alpha=8,
                      lora_save_merged=True)
    with rolling_server(tmp_path_factory.mktemp("trackers"), job) as server:
        with SwarmClient(server.url, token=CONTROL_TOKEN) as control:
            run_id = control.engine_status().run_id
            assert run_id
            deadline = time.monotonic() + 120
            while (control.engine_status().step or 0) < 2:
                assert time.monotonic() < deadline, "the run did not finish two steps"
                for reward in (0.25, 0.75):
                    try:
                        episode = control.open_episode(task_id="t")
                    except Exception:
                        time.sleep(0.2)
                        continue
                    control.report_episode(episode.episode_uuid, "t", reward)
            # max_steps: the engine stops itself, closing its trackers
            control.wait_for_state(EngineState.OFFLINE, timeout=120)
        yield server, run_id


def _run_dir(server: ServerHandle, run_id: str) -> Path:
    return server.workdir / "runs" / run_id


def _snapshot_id(server: ServerHandle, run_id: str) -> str:
    with SwarmClient(server.url, token=CONTROL_TOKEN) as control:
        return control.get_run(run_id).snapshot_id


def test_the_run_record_says_where_each_tracker_writes(finished_run: Any) -> None:
    server, run_id = finished_run
    with SwarmClient(server.url, token=CONTROL_TOKEN) as control:
        run = control.get_run(run_id)
    assert set(run.trackers) == set(TRACKERS)
    assert run.trackers["tensorboard"] == f"tensorboard --logdir {_run_dir(server, run_id)}/tensorboard"
    assert run.trackers["mlflow"].startswith("sqlite:///") and run.trackers["mlflow"].endswith("mlflow.db")


def test_tensorboard_event_files(finished_run: Any) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    server, run_id = finished_run
    events = EventAccumulator(str(_run_dir(server, run_id) / "tensorboard"))
    events.Reload()
    rewards = [(e.step, e.value) for e in events.Scalars("reward_mean")]
    assert [step for step, _ in rewards] == [1, 2]
    text = events.Tensors("run/snapshot_id/text_summary")[0].tensor_proto.string_val[0]
    assert text.decode() == _snapshot_id(server, run_id)


def test_mlflow_run(finished_run: Any) -> None:
    from mlflow.tracking import MlflowClient

    server, run_id = finished_run
    with SwarmClient(server.url, token=CONTROL_TOKEN) as control:
        uri = control.get_run(run_id).trackers["mlflow"]
    client = MlflowClient(tracking_uri=uri)
    experiment = client.get_experiment_by_name("tracked")
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.info.run_name == run_id
    history = client.get_metric_history(run.info.run_id, "reward_mean")
    assert sorted(m.step for m in history) == [1, 2]
    assert run.data.params["code.snapshot_id"] == _snapshot_id(server, run_id)
    assert run.data.params["config.experiment_name"] == "tracked"


def _wandb_records(path: Path) -> Iterator[bytes]:
    """The records of a W&B transaction log: a 7-byte header (":W&B", magic, version),
    then LevelDB-log framing in 32 KiB blocks (crc32, length, type: full/first/middle/last)."""
    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, block, parts = 7, 32768, b""
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if length == 0 and kind == 0:
            pos += left
            continue
        chunk = data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind == 1:
            yield chunk
        elif kind == 2:
            parts = chunk
        elif kind == 3:
            parts += chunk
        elif kind == 4:
            yield parts + chunk


def test_wandb_offline_run(finished_run: Any) -> None:
    from wandb.proto import wandb_internal_pb2

    server, run_id = finished_run
    (path,) = glob.glob(str(_run_dir(server, run_id) / "wandb" / "offline-run-*" / "run-*.wandb"))
    rewards, config, name = [], {}, None
    for raw in _wandb_records(Path(path)):
        record = wandb_internal_pb2.Record()
        record.ParseFromString(raw)
        kind = record.WhichOneof("record_type")
        if kind == "run":
            name = record.run.display_name
            config = {u.key: json.loads(u.value_json) for u in record.run.config.update}
        elif kind == "history":
            items = {(i.key or "/".join(i.nested_key)): json.loads(i.value_json)
                     for i in record.history.item}
            if "reward_mean" in items:
                rewards.append((items["_step"], items["reward_mean"]))
    assert name == run_id
    assert [step for step, _ in rewards] == [1, 2]
    assert config["code.snapshot_id"] == _snapshot_id(server, run_id)


def test_swanlab_local_files(finished_run: Any) -> None:
    import yaml

    server, run_id = finished_run
    logdir = _run_dir(server, run_id) / "swanlog"
    (run_folder,) = [p for p in logdir.glob("run-*") if p.is_dir()]
    db = sqlite3.connect(logdir / "runs.swanlab")
    (tag_id,) = db.execute("select id from tag where name = 'reward_mean'").fetchone()
    (experiment,) = db.execute("select name from experiment").fetchone()
    assert experiment == run_id
    lines = [json.loads(line) for line in
             (run_folder / "logs" / str(tag_id)).glob("*.log").__next__().read_text().splitlines()]
    assert [line["index"] for line in lines] == [1, 2]
    config = yaml.safe_load((run_folder / "files" / "config.yaml").read_text())
    assert config["code.snapshot_id"]["value"] == _snapshot_id(server, run_id)


class _Breaks:
    name = "flaky"

    def __init__(self) -> None:
        self.calls = 0

    def log(self, step: int, metrics: Any) -> None:
        self.calls += 1
        raise OSError("disk full")

    def close(self) -> None:
        pass


def test_a_tracker_that_fails_is_turned_off_and_the_rest_go_on() -> None:
    flaky, steady = _Breaks(), _Breaks()
    steady.name, steady.log = "steady", lambda step, metrics: None  # type: ignore[method-assign]
    trackers = TrackerSet([flaky, steady])
    trackers.log({"step": 1, "reward_mean": 0.5})
    trackers.log({"step": 2, "reward_mean": 0.6})
    assert flaky.calls == 1 and "disk full" in trackers.failed["flaky"]
    assert [t.name for t in trackers.trackers] == ["steady"]


def test_a_missing_tracker_package_is_refused_at_configure_time(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from ajet.copilot.validate import check

    monkeypatch.setitem(sys.modules, "swanlab", None)
    answer = check("experiment_name: x\nlogging: [tensorboard, swanlab]\n")
    assert answer["ok"] is False
    assert answer["errors"][0]["loc"] == ["logging"]
    assert "agentjet-swarm[swanlab]" in answer["hint"]


def test_an_unknown_tracker_is_refused_with_the_names_that_exist() -> None:
    with pytest.raises(ValueError, match="tensorboard, wandb, mlflow, swanlab"):
        AgentJetJob(logging="neptune")


# ---------------------------------------------------------------------------- checkpoints


def test_the_final_checkpoint_is_listed_complete(finished_run: Any) -> None:
    server, run_id = finished_run
    with SwarmClient(server.url, token=CONTROL_TOKEN) as control:
        page = control.list_checkpoints(run_id)
    final = [c for c in page.checkpoints if c.name == "final"]
    assert final and final[0].complete and final[0].lora and final[0].merged
    assert final[0].step == 2 and final[0].bytes > 0


def test_the_archive_is_the_same_bytes_every_time_and_ranges_resume(finished_run: Any) -> None:
    import httpx

    server, run_id = finished_run
    url = f"{server.url}/runs/{run_id}/checkpoints/final/archive"
    auth = {"Authorization": f"Bearer {CONTROL_TOKEN}"}
    first, second = httpx.get(url, headers=auth), httpx.get(url, headers=auth)
    assert first.status_code == second.status_code == 200
    assert first.content == second.content and first.headers["ETag"] == second.headers["ETag"]
    tail = httpx.get(url, headers={**auth, "Range": "bytes=1000-"})
    assert tail.status_code == 206 and tail.content == first.content[1000:]
    assert tail.headers["Content-Range"] == f"bytes 1000-{len(first.content) - 1}/{len(first.content)}"
    assert httpx.get(url, headers={**auth, "Range": f"bytes={len(first.content)}-"}).status_code == 416
    stale = httpx.get(url, headers={**auth, "Range": "bytes=1000-", "If-Range": '"other"'})
    assert stale.status_code == 200 and stale.content == first.content
    worker = httpx.get(url, headers={"Authorization": f"Bearer {WORKER_TOKEN}"})
    assert worker.status_code == 403
    missing = httpx.get(f"{server.url}/runs/{run_id}/checkpoints/step_99/archive", headers=auth)
    assert missing.status_code == 404 and "GET /runs/" in missing.json()["hint"]


def test_a_download_resumes_verifies_and_loads(finished_run: Any, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    server, run_id = finished_run
    with SwarmClient(server.url, token=CONTROL_TOKEN) as control:
        manifest = control.checkpoint_manifest(run_id, "final")
        # a download that broke off after 5000 bytes: the next call resumes it
        with control.open_checkpoint_archive(run_id, "final") as response:
            head = response.read()[:5000]
        (tmp_path / f".{run_id}-final.tar.part").write_bytes(head)
        (tmp_path / f".{run_id}-final.etag").write_text(manifest.etag)
        path = control.download_checkpoint(run_id, tmp_path)
    assert path == tmp_path / "final" and not list(tmp_path.glob(".*"))
    assert {p.relative_to(path).as_posix() for p in path.rglob("*") if p.is_file()} == \
        {f.path for f in manifest.files}
    adapter = AutoModelForCausalLM.from_pretrained(path)  # base + adapter (peft)
    merged = AutoModelForCausalLM.from_pretrained(path / "merged")
    assert adapter.config.vocab_size == merged.config.vocab_size


def test_a_tampered_archive_is_refused_and_nothing_looks_finished(
        finished_run: Any, tmp_path: Path) -> None:
    from ajet.checkpoint_download import DownloadError

    server, run_id = finished_run
    with SwarmClient(server.url, token=CONTROL_TOKEN) as control:
        manifest = control.checkpoint_manifest(run_id, "final")
        with control.open_checkpoint_archive(run_id, "final") as response:
            data = bytearray(response.read())
        data[600] ^= 0xFF  # inside the first file's content (after its 512-byte header)
        (tmp_path / f".{run_id}-final.tar.part").write_bytes(bytes(data))
        (tmp_path / f".{run_id}-final.etag").write_text(manifest.etag)
        with pytest.raises(DownloadError, match="sha256"):
            control.download_checkpoint(run_id, tmp_path)
        assert not (tmp_path / "final").exists() and not list(tmp_path.glob(".*"))
        # the bad bytes are gone: the next call downloads again, and succeeds
        assert control.download_checkpoint(run_id, tmp_path) == tmp_path / "final"


def test_the_cli_downloads_into_a_folder(finished_run: Any, tmp_path: Path) -> None:
    import os
    import subprocess

    server, run_id = finished_run
    env = {**os.environ, "AJET_SWARM_TOKEN": CONTROL_TOKEN}
    listed = subprocess.run([sys.executable, "-m", "swarm_server", "runs", "--swarm-url",
                             server.url, "checkpoints", run_id], capture_output=True, text=True,
                            env=env, timeout=60)
    assert listed.returncode == 0 and "final" in listed.stdout and "complete" in listed.stdout
    got = subprocess.run([sys.executable, "-m", "swarm_server", "runs", "--swarm-url",
                          server.url, "download", run_id, str(tmp_path), "--checkpoint", "final"],
                         capture_output=True, text=True, env=env, timeout=120)
    assert got.returncode == 0, got.stderr
    assert (tmp_path / "final" / "adapter_config.json").is_file()
