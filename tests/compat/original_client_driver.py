"""Drive a swarm server with the ORIGINAL AgentJet client module, loaded at run time.

    python original_client_driver.py <bare repo> <commit> <server url> <checkout dir>

The original `swarm_client.py` and the small original modules it needs (its wire models,
`schema/task.py`, `as_oai_baseurl_apikey.py`, `utils/sync_train_code.py`, ...) are read
from the bare AgentJet repository with `git show` into a package tree of their own in
this process (nothing is copied into this project). Stubbed: the loggers (`loguru`,
`beast_logger`), a server-side retry decorator, and the original's `AgentJetJob`, whose `config.to_dict()` is the
original's swarm default YAML with the tutorial's overrides. Only the client's delays
are shortened (its poll and retry constants, and the 8 s pause of a forced restart).

Prints one JSON line: each step's outcome and the original client's own error logs.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import time
import types
from typing import Any

import httpx
import yaml

REPO, COMMIT, URL, CHECKOUT = sys.argv[1:5]
log = logging.getLogger("original-client")
ERRORS: list[str] = []


def source(path: str) -> str:
    return subprocess.run(["git", "-C", REPO, "show", f"{COMMIT}:{path}"], check=True,
                          capture_output=True, text=True).stdout


class _Logger:
    """loguru's `logger`, enough for the original client; errors are recorded."""

    def __getattr__(self, level: str) -> Any:
        def emit(message: object, *args: object, **_: object) -> None:
            text = str(message) % args if args and "%" in str(message) else str(message)
            if level in ("error", "exception"):
                ERRORS.append(text)
            log.info("[%s] %s", level, text)
        return emit


def package(name: str) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__path__ = []  # a package with no files: only what is loaded below
    sys.modules[name] = module
    return module


def load(name: str, path: str) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__file__ = f"<AgentJet {COMMIT}>/{path}"
    sys.modules[name] = module
    exec(compile(source(path), module.__file__, "exec"), module.__dict__)  # noqa: S102
    parent, _, child = name.rpartition(".")
    setattr(sys.modules[parent], child, module)
    return module


class OriginalStyleJob:
    """The original AgentJetJob's surface the client touches: `config.to_dict()` (the
    swarm default YAML with the job's values) and two attributes."""

    def __init__(self, **kwargs: Any) -> None:
        tree = yaml.safe_load(source("ajet/default_config/ajet_swarm_default.yaml"))
        ajet = tree["ajet"]
        ajet["experiment_name"] = kwargs["experiment_name"]
        ajet["model"]["path"] = kwargs["model"]
        ajet["data"]["train_batch_size"] = kwargs["batch_size"]
        ajet["rollout"]["num_repeat"] = kwargs["num_repeat"]
        ajet["trainer_common"]["n_gpus_per_node"] = kwargs["n_gpu"]
        self.config = types.SimpleNamespace(to_dict=lambda: tree)
        self.ensure_new_experiment = False
        self.swarm_mode_sample_collection_method = ajet["swarm_mode_sample_collection_method"]


def build_original_client() -> Any:
    loguru = types.ModuleType("loguru")
    loguru.logger = _Logger()  # type: ignore[attr-defined]
    sys.modules["loguru"] = loguru
    beast = types.ModuleType("beast_logger")
    beast.print_dict = lambda *a, **k: None  # type: ignore[attr-defined]
    beast.register_console = lambda *a, **k: None  # type: ignore[attr-defined]
    sys.modules["beast_logger"] = beast
    for name in ("ajet", "ajet.schema", "ajet.utils", "ajet.copilot", "ajet.tuner_lib",
                 "ajet.tuner_lib.experimental"):
        package(name)
    job_module = types.ModuleType("ajet.copilot.job")
    job_module.AgentJetJob = OriginalStyleJob  # type: ignore[attr-defined]
    sys.modules["ajet.copilot.job"] = job_module
    load("ajet.schema.task", "ajet/schema/task.py")
    load("ajet.utils.networking", "ajet/utils/networking.py")
    retry = types.ModuleType("ajet.utils.retry")  # server-side helper; the client never calls it
    retry.retry_with_backoff = lambda **_: (lambda fn: fn)  # type: ignore[attr-defined]
    sys.modules["ajet.utils.retry"] = retry
    load("ajet.utils.sync_train_code", "ajet/utils/sync_train_code.py")
    load("ajet.tuner_lib.experimental.swarm_overwatch_utils",
         "ajet/tuner_lib/experimental/swarm_overwatch_utils.py")
    load("ajet.tuner_lib.experimental.interchange_utils",
         "ajet/tuner_lib/experimental/interchange_utils.py")
    load("ajet.tuner_lib.as_oai_baseurl_apikey", "ajet/tuner_lib/as_oai_baseurl_apikey.py")
    client = load("ajet.tuner_lib.experimental.swarm_client",
                  "ajet/tuner_lib/experimental/swarm_client.py")
    # shorter delays only; the logic is the original's
    for constant, value in (("ENGINE_STATUS_POLL_INTERVAL", 0.2), ("START_EPISODE_RETRY_DELAY", 0.5),
                            ("WAIT_MORE_AVAIL_EPISODE_RETRY_DELAY", 0.2),
                            ("TROTTLE_EPISODE_RETRY_DELAY", 0.2)):
        setattr(client, constant, value)
    client.time = types.SimpleNamespace(  # type: ignore[attr-defined]
        time=time.time, sleep=lambda s: time.sleep(min(s, 0.5)))
    return client


def main() -> None:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    original = build_original_client()
    task_module = sys.modules["ajet.schema.task"]
    steps: dict[str, Any] = {}
    worker = original.SwarmClient(URL)
    status, status_json = worker.get_engine_status()
    steps["status"] = [status, sorted(status_json)]
    steps["global_step"] = worker.get_global_step()
    synced = worker.sync_train_code_from_dir(CHECKOUT, force_restart=True)
    steps["code_sync"] = [synced["success"], synced["temp_ajet_code_path"],
                          synced["local_zip_file_count"]]
    job = OriginalStyleJob(experiment_name="original_client", model="ajet-tiny", batch_size=1,
                           num_repeat=2, n_gpu=0)
    worker.auto_sync_train_config_and_start_engine(job)
    steps["start"] = worker.get_engine_status()[0]
    worker.auto_sync_train_config_and_start_engine(job)  # ROLLING: nothing to do
    worker.auto_sync_train_config_and_start_engine(job, force_restart=True)
    steps["restart"] = worker.get_engine_status()[0]
    rewards = []
    for i in range(2):
        episode_uuid, api = worker.begin_episode(discard_episode_timeout=60)
        reply = httpx.post(f"{api.base_url}/chat/completions", timeout=120,
                           headers={"Authorization": f"Bearer {api.api_key}"},
                           json={"model": "m", "messages": [{"role": "user", "content": "hi"}]})
        reply.raise_for_status()
        task = task_module.Task(task_id="t0", main_query="hi")
        output = task_module.WorkflowOutput(reward=float(i), metadata={})
        worker.end_episode(task, episode_uuid, output)
        rewards.append(output.metadata["task_id"])
    steps["episodes"] = rewards
    aborted, _ = worker.begin_episode()
    steps["can_continue"] = worker.can_continue_episode(aborted)
    steps["buffer"] = [e.episode_uuid == aborted for e in worker.get_episode_buffer()]
    worker.abort_episode(aborted)
    stat = worker.get_rollout_stat()
    steps["rollout_stat"] = [stat.engine_status, stat.completed_task_target,
                             stat.task_expected_num_repeat]
    worker.print_rollout_stat()
    steps["experiment_dir"] = worker.server_experiment_dir()
    worker.stop_engine()
    steps["stop"] = worker.get_engine_status()[0]
    print(json.dumps({"steps": steps, "errors": ERRORS,
                      "client_file": original.__file__}))


if __name__ == "__main__":
    main()
