"""The original AgentJet modules and job model, without a server: import paths, the
schema, the job's original arguments, its nested YAML, the wire conversions, the task
readers and the thread pools."""

from __future__ import annotations

import json
import re
import threading
from pathlib import Path

import pytest
import yaml

from ajet.copilot.job import NO_EFFECT, AgentJetJob, JobValidationError
from ajet.compat.boundary import (
    STEP_REWARD_REFUSED,
    OriginalBodyError,
    end_request_from_original,
    flat_log_metrics,
)
from ajet.schema.task import Task, WorkflowOutput
from ajet.tuner_lib.experimental.interchange_utils import EndEpisodeRequest

ROOT = Path(__file__).resolve().parents[2]

#: Every constructor argument of the original AgentJetJob (charlesHsuGG/AgentJet af6b611).
ORIGINAL_JOB_ARGUMENTS = (
    "ensure_new_experiment base_yaml_config experiment_dir project_name experiment_name "
    "logging n_gpu nnodes model algorithm num_repeat batch_size swarm_mode "
    "swarm_mode_sample_collection_method max_env_worker backbone max_prompt_length "
    "max_response_length max_response_length_in_one_turn max_model_len "
    "tensor_model_parallel_size max_num_seqs mini_batch_num lora_rank lora_alpha "
    "lora_target_modules lora_load_format layered_summon gpu_memory_utilization lr ppo_epochs "
    "use_kl_loss use_kl_in_reward kl_penalty_type compute_madness_checklist "
    "val_print_to_markdown_file_path train_print_to_markdown_file_path total_training_steps "
    "timeline_compare_level").split()
#: The ones other engine work adds (docs/compat.md: training at scale and generation give them effect).
FROM_ENGINE_ISSUES = {"mini_batch_num", "lora_rank", "lora_alpha", "lora_target_modules",
                      "gpu_memory_utilization"}
#: Every public method of the original SwarmClient.
ORIGINAL_CLIENT_METHODS = (
    "get_engine_status get_global_step add_entering_weight_sync_callback begin_episode "
    "end_episode abort_episode can_continue_episode get_episode_buffer sync_train_config "
    "sync_train_code sync_train_code_from_dir start_engine stop_engine "
    "auto_sync_train_config_and_start_engine async_and_start_multi_engine "
    "server_experiment_dir agree_sync_weight get_rollout_stat print_rollout_stat").split()


def test_original_import_paths() -> None:
    from ajet.default_config.ajet_config_schema import AjetTaskReader, HuggingfaceDatRepo
    from ajet.default_config.ajet_default import AjetTaskReader as Alias
    from ajet.task_reader import RouterTaskReader
    from ajet.tuner_lib.as_oai_baseurl_apikey import OpenaiBaseUrlAndApiKey
    from ajet.tuner_lib.experimental import as_swarm_client, swarm_client
    from ajet.tuner_lib.experimental.interchange_utils import SwarmThrottlePolicy
    from ajet.utils.thread_executors import PeriodicDrainThreadPoolExecutor

    assert as_swarm_client.SwarmClient is swarm_client.SwarmClient
    assert swarm_client.SwarmThrottlePolicy is SwarmThrottlePolicy
    assert callable(swarm_client.run_episodes_until_all_complete)
    assert callable(swarm_client.auto_train_with_dataset)
    assert issubclass(swarm_client.SwarmServerOfflineError, Exception)
    assert Alias is AjetTaskReader and HuggingfaceDatRepo().training_split == "train"
    assert RouterTaskReader and PeriodicDrainThreadPoolExecutor
    api = OpenaiBaseUrlAndApiKey(base_url="http://h:1/v1", api_key="k", episode_uuid="e")
    assert api.base_url.endswith("/v1") and api.model == "reserved_field"
    claude = api.as_raw_anthropic_sdk_client()  # the server root, without /v1
    assert str(claude.base_url).rstrip("/") == "http://h:1" and claude.api_key == "k"
    for name in ORIGINAL_CLIENT_METHODS:
        assert callable(getattr(swarm_client.SwarmClient, name)), name


def test_task_and_workflow_output_fields() -> None:
    task = Task(task_id="7", main_query="1+1?", metadata={"answer": "2"})
    assert (task.init_messages, task.env_type) == ([], "")
    out = WorkflowOutput(reward=1.0, metadata={"final_answer": "2"})
    assert out.is_success is None and out.log_metrics == {}
    assert WorkflowOutput(reward=[1.0, 0.0]).reward == [1.0, 0.0]  # accepted, refused later


def test_list_reward_is_refused_and_list_metrics_are_averaged() -> None:
    out = WorkflowOutput(reward=[1.0, 0.5], metadata={"task_id": "t"})
    body = EndEpisodeRequest(client_uuid="c", episode_uuid="e", workflow_output=out,
                             task_id="t")
    with pytest.raises(OriginalBodyError, match=re.escape(STEP_REWARD_REFUSED)):
        end_request_from_original(body)
    assert flat_log_metrics({"a": [1, 2, 3], "b": 0.5, "c": {"x": 1, "y": "s"}, "d": "s",
                             "e": []}) == {"a": 2.0, "b": 0.5, "c/x": 1.0}
    body.workflow_output = WorkflowOutput(reward=1, metadata={"task_id": "other"})
    with pytest.raises(OriginalBodyError, match="must match task_id") as info:
        end_request_from_original(body)
    assert info.value.field == "workflow_output.metadata.task_id"


def test_every_original_job_argument_is_accepted() -> None:
    known = set(AgentJetJob.model_fields) | {"max_response_length_in_one_turn",
                                            "total_training_steps"}
    missing = set(ORIGINAL_JOB_ARGUMENTS) - known - FROM_ENGINE_ISSUES
    assert not missing
    job = AgentJetJob(
        project_name="ajet-swarm", experiment_name="test", logging="swanlab", n_gpu=0,
        nnodes=1, model="ajet-tiny", algorithm="grpo", num_repeat=4, batch_size=8,
        swarm_mode=True, swarm_mode_sample_collection_method="rollout_until_finish_enough_episodes",
        max_env_worker=64, backbone="verl", max_prompt_length=100, max_response_length=50,
        max_response_length_in_one_turn=20, max_model_len=200, tensor_model_parallel_size=2,
        max_num_seqs=32, lora_load_format="safetensors", layered_summon=True, lr=1e-5,
        ppo_epochs=2, use_kl_loss=False, use_kl_in_reward=False, kl_penalty_type="abs",
        compute_madness_checklist=["nonsense"], val_print_to_markdown_file_path="v.md",
        train_print_to_markdown_file_path="t.md", total_training_steps=5,
        timeline_compare_level="token", experiment_dir="/tmp/x", ensure_new_experiment=True)
    assert job.max_new_tokens == job.max_response_length_in_one_turn == 20
    assert job.max_steps == job.total_training_steps == 5
    assert re.fullmatch(r"test_\d{8}-\d{6}", job.experiment_name)
    noted = {n["field"] for n in job.compat_notes()}
    assert {"tensor_model_parallel_size", "compute_madness_checklist"} <= noted
    assert "logging" not in noted  # the trackers give it effect
    assert set(NO_EFFECT) <= set(ORIGINAL_JOB_ARGUMENTS)


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"backbone": "trinity"}, "Trinity backbone is not yet supported"),
    ({"max_model_len": 100}, "must all be None or all be non-None"),
    ({"max_prompt_length": 90, "max_response_length": 20, "max_model_len": 100,
      "max_response_length_in_one_turn": 10}, "illegal token length"),
    ({"max_prompt_length": 10, "max_response_length": 20, "max_model_len": 100,
      "max_response_length_in_one_turn": 30}, "must not exceed max_response_length"),
    ({"swarm_mode": False}, "swarm mode only"),
    ({"use_kl_in_reward": True}, "not supported"),
    ({"algorithm": "gae"}, "grpo"),
    ({"max_new_tokens": 4, "max_response_length_in_one_turn": 5}, "two names"),
])
def test_original_rules_refuse_with_the_reason(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        AgentJetJob(**kwargs)


def test_none_means_not_given_and_the_flat_form_keeps_working() -> None:
    job = AgentJetJob(model=None, lr=None, max_prompt_length=300, max_response_length=40,
                      max_new_tokens=8)
    assert (job.model, job.max_model_len) == ("ajet-tiny", None)
    assert AgentJetJob.from_yaml(job.to_yaml()).model_dump() == job.model_dump()


def test_config_view_reads_and_writes_through(tmp_path: Path) -> None:
    job = AgentJetJob(batch_size=3, num_repeat=2)
    assert job.config.ajet.data.train_batch_size == 3
    job.config.ajet.rollout.max_env_worker = 64
    job.config.ajet.trainer_common.optim.lr = 0.01
    job.config.ajet.rollout.agent_madness_reward = -1.0  # no meaning here: kept and listed
    assert (job.max_env_worker, job.lr) == (64, 0.01)
    assert job.nested_extras == {"ajet": {"rollout": {"agent_madness_reward": -1.0}}}
    assert {"field": "ajet.rollout.agent_madness_reward", "status": "ignored",
            "reason": "no meaning in this project's engine; kept in the job"} in job.compat_notes()
    with pytest.raises(ValueError):
        job.config.ajet.data.train_batch_size = 0  # validated like the field
    assert job.config.to_dict()["ajet"]["model"]["path"] == "ajet-tiny"
    with pytest.raises(AttributeError):
        _ = job.config.ajet.no_such_section


def test_nested_yaml_round_trip_and_override(tmp_path: Path) -> None:
    job = AgentJetJob(experiment_name="nested", batch_size=2, num_repeat=2, max_steps=3,
                      seed=5)
    path = job.dump_job_as_yaml(str(tmp_path / "sub" / "job.yaml"))
    tree = yaml.safe_load(Path(path).read_text())
    assert tree["ajet"]["data"]["train_batch_size"] == 2
    assert tree["ajet"]["trainer_common"]["total_training_steps"] == 3
    assert tree["ajet"]["swarm_remote"]["seed"] == 5  # no original place: own section
    again = AgentJetJob.build_job_from_yaml(path)
    assert again.model_dump() == job.model_dump()
    other = AgentJetJob(batch_size=9)
    assert isinstance(other.build_job_from_yaml(path), dict)  # the original returns a dict
    assert other.batch_size == 2
    assert AgentJetJob(base_yaml_config=path, batch_size=4).model_dump() == {
        **job.model_dump(), "batch_size": 4}


def test_original_nested_yaml_with_foreign_keys_is_accepted_and_listed() -> None:
    text = (ROOT / "tests/compat/original_job.yaml").read_text()
    job = AgentJetJob.from_yaml(text)
    assert (job.experiment_name, job.model, job.batch_size, job.num_repeat) == (
        "nested_yaml_job", "ajet-tiny", 2, 2)
    assert job.max_new_tokens == 8 and job.kl_coef == 0.002 and job.save_every == 0
    ignored = {n["field"] for n in job.compat_notes() if n["status"] == "ignored"}
    assert {"ajet.rollout.agent_madness_reward", "actor_rollout_ref.rollout.n",
            "defaults"} <= ignored
    bad = text.replace("train_batch_size: 2", "train_batch_size: 0")
    with pytest.raises(JobValidationError) as info:
        AgentJetJob.from_yaml(bad)
    assert info.value.errors[0]["loc"] == ["ajet.data.train_batch_size"]


def test_compat_doc_lists_every_original_name() -> None:
    doc = (ROOT / "docs/compat.md").read_text()
    for name in (*ORIGINAL_JOB_ARGUMENTS, *ORIGINAL_CLIENT_METHODS):
        assert f"`{name}" in doc, name


def test_task_readers_read_local_files_only(tmp_path: Path) -> None:
    datasets = pytest.importorskip("datasets")
    from ajet.default_config.ajet_config_schema import (
        AjetTaskReader,
        HuggingfaceDatRepo,
        JsonlDatasetFile,
        JsonlTrainingFp,
    )
    from ajet.task_reader import RouterTaskReader

    rows = datasets.Dataset.from_dict({"question": ["1+1?", "2+2?", "3+3?"],
                                       "answer": ["#### 2", "#### 4", "#### 6"]})
    datasets.DatasetDict({"train": rows, "test": rows}).save_to_disk(str(tmp_path / "saved"))
    (tmp_path / "main").mkdir()
    rows.to_parquet(str(tmp_path / "main" / "train-00000-of-00001.parquet"))
    for where in ("saved", "main", "main/train-00000-of-00001.parquet"):
        reader = RouterTaskReader("huggingface_dat_repo", AjetTaskReader(
            huggingface_dat_repo=HuggingfaceDatRepo(dataset_path=str(tmp_path / where))))
        tasks = sorted(reader.generate_training_tasks(), key=lambda t: t.task_id)
        assert [(t.task_id, t.main_query, t.metadata["answer"]) for t in tasks] == [
            ("0", "1+1?", "#### 2"), ("1", "2+2?", "#### 4"), ("2", "3+3?", "#### 6")]
    hub = RouterTaskReader("huggingface_dat_repo", AjetTaskReader(
        huggingface_dat_repo=HuggingfaceDatRepo(dataset_path="openai/gsm8k")))
    with pytest.raises(ValueError, match="reads local files only"):
        list(hub.generate_training_tasks())
    lines = tmp_path / "t.jsonl"
    lines.write_text("\n".join(json.dumps({"main_query": q, "task_id": str(i)})
                               for i, q in enumerate(["a", "b"])))
    jsonl = RouterTaskReader("jsonl_dataset_file", AjetTaskReader(
        jsonl_dataset_file=JsonlDatasetFile(training=JsonlTrainingFp(file_path=str(lines)))))
    assert [t.main_query for t in jsonl.generate_training_tasks()] == ["a", "b"]
    with pytest.raises(ValueError, match="needs an environment"):
        RouterTaskReader("env_service", AjetTaskReader())


def test_thread_pools_drain_and_retry() -> None:
    from ajet.tuner_lib.experimental.swarm_client import run_episodes_until_all_complete
    from ajet.utils.thread_executors import PeriodicDrainThreadPoolExecutor

    failures = {"x": 2}
    lock = threading.Lock()

    def flaky(task: str) -> str:
        with lock:
            if failures.get(task, 0) > 0:
                failures[task] -= 1
                raise RuntimeError("transient")
        return task.upper()

    assert run_episodes_until_all_complete(["x", "y"], func=flaky) == ["X", "Y"]
    executor = PeriodicDrainThreadPoolExecutor(workers=2, auto_retry=True)
    _, first = executor.submit_with_periodic_drain(fn=flaky, task="a")
    _, drained = executor.submit_with_periodic_drain(fn=flaky, task="b")
    assert first == [] and drained == ["A", "B"]
    executor.shutdown()
    with pytest.raises(ZeroDivisionError):
        run_episodes_until_all_complete(["z"], func=lambda _: 1 / 0 and None, max_attempts=2)
