"""No process of the engine tree holds a token in its environment.

A token-protected server starts a two-process job under torchrun with the warm standby
on; then `/proc/<pid>/environ` of every process the server started (the torchrun agent,
its ranks, the warm standby, anything else) is read: no token (the approvers' included),
nor the names of their variables, nor the path of the approvers' tokens file may be there. The ranks are the fake engine (the environment a rank
gets is torchrun's copy of the agent's, whatever it runs); the real engine's own
environment is read the same way by the soak test (`tests/faults/test_soak.py`).
"""

from __future__ import annotations

import time
from pathlib import Path

import psutil
import pytest

from ajet.client import SwarmClient
from ajet.copilot.job import AgentJetJob
from tests.support import APPROVER_TOKEN, CONTROL_TOKEN, WORKER_TOKEN, start_server
from tests.support.environ import leaked
from tests.support.fake_engine import server_env


def engine_tree(server_pid: int) -> dict[int, str]:
    """pid -> command line of every live process below the server."""
    tree: dict[int, str] = {}
    for proc in psutil.Process(server_pid).children(recursive=True):
        try:
            tree[proc.pid] = " ".join(proc.cmdline())
        except psutil.Error:
            continue  # exited meanwhile (the config validator is short-lived)
    return tree


@pytest.mark.slow
def test_no_process_of_the_engine_tree_holds_a_token(tmp_path: Path) -> None:
    tokens_file = tmp_path / "approver-tokens-file"
    tokens_file.write_text("bob=test-approver-token-bob\n")
    server = start_server(tmp_path / "swarm", env=server_env(
        AJET_SWARM_TOKEN=CONTROL_TOKEN, AJET_SWARM_WORKER_TOKEN=WORKER_TOKEN,
        AJET_SWARM_APPROVER_TOKENS=f"alice={APPROVER_TOKEN}",
        AJET_SWARM_APPROVER_TOKENS_FILE=str(tokens_file), AJET_SWARM_WARM_STANDBY="1"))
    try:
        assert leaked(server.proc.pid)  # the server itself holds them: the check can see
        with SwarmClient(server.url, token=CONTROL_TOKEN) as control:
            control.configure_and_start(AgentJetJob(experiment_name="environ", n_proc=2),
                                        wait_timeout=120)
            deadline = time.monotonic() + 120
            while True:
                tree = engine_tree(server.proc.pid)
                kinds = {"agent": [p for p, c in tree.items() if "torch.distributed.run" in c],
                         "ranks": [p for p, c in tree.items()
                                   if "fake_engine" in c and "torch.distributed" not in c],
                         "standby": [p for p, c in tree.items() if "standby.py" in c]}
                if kinds["agent"] and len(kinds["ranks"]) >= 2 and kinds["standby"]:
                    break
                assert time.monotonic() < deadline, tree
                time.sleep(0.2)
            found = {pid: leaked(pid) for pid in tree if psutil.pid_exists(pid)}
            assert found and not any(found.values()), {tree[p]: s for p, s in found.items() if s}
            control.stop_run()
    finally:
        server.stop()
