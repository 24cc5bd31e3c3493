"""Nothing that fails a check changes the cluster: each refused call leaves the running
engine ROLLING on the same run.

One rolling engine on a server that enforces approvals (the server's own code counts as
approved); each refused call is made the way a user makes it, with the original client
or the typed one, and the run is checked after each.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from ajet.client import SwarmClient
from ajet.copilot.job import AgentJetJob
from ajet.errors import ApprovalPending, SwarmHTTPError
from ajet.packaging import PackagingError
from ajet.protocol import EngineState
from ajet.tuner_lib.experimental.swarm_client import SwarmClient as OriginalSwarmClient
from tests.support import CONTROL_TOKEN, ENFORCING_ENV, ServerHandle, make_ajet_repo, \
    rolling_server

QWEN_7B = Path(__file__).parents[1] / "ajet" / "engine" / "models" / "Qwen2.5-7B-Instruct"

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerHandle]:
    job = AgentJetJob(experiment_name="keeps-running", model="ajet-tiny", n_gpu=0,
                      batch_size=2, num_repeat=2)
    with rolling_server(tmp_path_factory.mktemp("refusals"), job, env=ENFORCING_ENV) as handle:
        yield handle


def _still_rolling(url: str, run_id: str | None) -> None:
    with SwarmClient(url, token=CONTROL_TOKEN) as control:
        status = control.engine_status()
    assert status.state == EngineState.ROLLING, status
    assert status.run_id == run_id, "the run was stopped or replaced"


def _run_id(url: str) -> str | None:
    with SwarmClient(url, token=CONTROL_TOKEN) as control:
        return control.engine_status().run_id


def test_a_sync_from_a_folder_without_ajet_does_not_stop_the_run(
        server: ServerHandle, tmp_path: Path) -> None:
    run = _run_id(server.url)
    original = OriginalSwarmClient(server.url, token=CONTROL_TOKEN)
    with pytest.raises(PackagingError, match="ajet"):
        original.sync_train_code_from_dir(str(tmp_path), force_restart=True)
    _still_rolling(server.url, run)


def test_a_sync_of_unapproved_code_does_not_stop_the_run(server: ServerHandle,
                                                         tmp_path: Path) -> None:
    run = _run_id(server.url)
    repo = make_ajet_repo(tmp_path / "repo")
    with open(repo / "ajet" / "engine" / "rewards.py", "a") as f:
        f.write("\n# an edit no approver has seen\n")
    original = OriginalSwarmClient(server.url, token=CONTROL_TOKEN)
    with pytest.raises(ApprovalPending, match="left as it was"):
        original.sync_train_code_from_dir(str(repo), force_restart=True)
    _still_rolling(server.url, run)


def test_a_config_the_validator_refuses_does_not_stop_the_run(server: ServerHandle) -> None:
    run = _run_id(server.url)
    too_big = AgentJetJob(experiment_name="too-big", model=str(QWEN_7B), n_gpu=1,
                          gpu_memory_gb=8)
    with SwarmClient(server.url, token=CONTROL_TOKEN) as control:
        with pytest.raises(SwarmHTTPError) as refused:
            control.configure_and_start(too_big, force_restart=True)
        assert refused.value.status == 422
    original = OriginalSwarmClient(server.url, token=CONTROL_TOKEN)
    with pytest.raises(SwarmHTTPError):
        original.auto_sync_train_config_and_start_engine(too_big, force_restart=True)
    _still_rolling(server.url, run)
    with SwarmClient(server.url, token=CONTROL_TOKEN) as control:
        assert control.get_train_config().experiment_name == "keeps-running"
