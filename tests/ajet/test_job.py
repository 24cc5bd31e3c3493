"""AgentJetJob: defaults, YAML round trip, and rejection of bad input, locally and by the server.

The server validates with the active code's own validator (a subprocess); a bad job gets
422 naming the field and leaves the stored config as it was.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import yaml

from ajet.client import SwarmClient
from ajet.copilot.job import AgentJetJob, JobValidationError, default_job_values
from ajet.errors import SwarmValidationError
from tests.support import ServerHandle


def test_defaults_come_from_the_default_config_and_run_on_cpu() -> None:
    job = AgentJetJob()
    assert job.model_dump() == default_job_values()
    assert (job.model, job.n_gpu, job.algorithm) == ("ajet-tiny", 0, "grpo")


def test_yaml_round_trip_keeps_every_field(tmp_path: Path) -> None:
    job = AgentJetJob(experiment_name="round.trip-1", batch_size=2, num_repeat=4, lr=1e-4,
                      kl_coef=0.05, temperature=0.7, seed=7, save_every=3, max_steps=10,
                      model="/mnt/models/Qwen2.5-7B-Instruct", n_gpu=8)
    assert AgentJetJob.from_yaml(job.to_yaml()) == job
    job.dump_yaml(tmp_path / "job.yaml")
    assert AgentJetJob.load_yaml(tmp_path / "job.yaml") == job
    assert yaml.safe_load(job.to_yaml())["lr"] == 1e-4


def test_partial_yaml_fills_defaults_and_empty_yaml_is_the_default_job() -> None:
    job = AgentJetJob.from_yaml("experiment_name: small\nbatch_size: 1\n")
    assert (job.experiment_name, job.batch_size, job.lr) == ("small", 1, AgentJetJob().lr)
    assert AgentJetJob.from_yaml("") == AgentJetJob()


@pytest.mark.parametrize(("text", "field"), [
    ("learning_rate: 0.1\n", "learning_rate"),         # unknown key (a typo of lr)
    ("batch_size: many\n", "batch_size"),               # wrong type
    ("lr: [0.1]\n", "lr"),                              # wrong type
    ("lr: 5\n", "lr"),                                  # out of range
    ("num_repeat: 0\n", "num_repeat"),                  # out of range
    ("temperature: -1\n", "temperature"),               # out of range
    ("algorithm: ppo\n", "algorithm"),                  # not an allowed value
    ("experiment_name: 'has space'\n", "experiment_name"),
])
def test_bad_fields_are_rejected_by_name(text: str, field: str) -> None:
    with pytest.raises(JobValidationError) as exc:
        AgentJetJob.from_yaml(text)
    assert [e["loc"] for e in exc.value.errors] == [[field]]
    assert field in str(exc.value)


def test_inconsistent_and_malformed_jobs_are_rejected() -> None:
    with pytest.raises(JobValidationError) as exc:
        AgentJetJob.from_yaml("max_new_tokens: 64\nmax_response_length: 32\n")
    assert "max_new_tokens" in exc.value.errors[0]["msg"]
    with pytest.raises(JobValidationError, match="not valid YAML"):
        AgentJetJob.from_yaml("lr: [0.1\n")
    with pytest.raises(JobValidationError, match="mapping"):
        AgentJetJob.from_yaml("- lr\n- 0.1\n")
    with pytest.raises(ValueError):
        AgentJetJob().batch_size = 0  # validate_assignment


def test_server_rejects_bad_jobs_with_422_naming_the_field_and_changes_nothing(
        server: ServerHandle) -> None:
    with SwarmClient(server.url) as client:
        good = client.submit_config(AgentJetJob(experiment_name="kept", lr=0.01))
        for text, field in (("lr: 5\n", "lr"), ("batch_size: many\n", "batch_size"),
                            ("unknown_key: 1\n", "unknown_key"), ("lr: [0.1\n", "")):
            r = httpx.post(f"{server.url}/sync_train_config", json={"yaml": text})
            assert r.status_code == 422, text
            body = r.json()
            if field:
                assert body["detail"][0]["loc"] == [field]
                assert field in body["hint"]
            else:
                assert "YAML" in body["detail"][0]["msg"]
            assert "nothing was changed" in body["hint"]
        with pytest.raises(SwarmValidationError) as exc:
            client.submit_config("num_repeat: 0\n")
        assert exc.value.status == 422 and "num_repeat" in exc.value.hint
        status = client.engine_status()
        assert status.has_config and status.experiment_name == "kept"
        missing_body = httpx.post(f"{server.url}/sync_train_config", json={})
        assert missing_body.status_code == 422 and "yaml" in missing_body.json()["hint"]
        again = client.submit_config(AgentJetJob(experiment_name="kept", lr=0.01))
        assert again.config_hash == good.config_hash  # same job, same normalised YAML
