"""`examples/digits_workflow.py` never replaces a stored job unless asked to."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from ajet.client import SwarmClient
from ajet.copilot.job import AgentJetJob
from tests.support import CONTROL_TOKEN, PROJECT_ROOT, start_server

EXAMPLE = PROJECT_ROOT / "examples" / "digits_workflow.py"


def _run(url: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(EXAMPLE), "--swarm-url", url,
                           "--token", CONTROL_TOKEN, *args],
                          capture_output=True, text=True, timeout=120)


def test_the_example_keeps_the_stored_job_and_says_which_it_runs(tmp_path: Path) -> None:
    handle = start_server(tmp_path / "srv", env={"AJET_SWARM_TOKEN": CONTROL_TOKEN})
    try:
        empty = _run(handle.url, "--no-start", "--max-episodes", "0")
        assert empty.returncode == 2
        assert "--configure" in empty.stderr and "no job stored" in empty.stderr
        with SwarmClient(handle.url, token=CONTROL_TOKEN) as control:
            assert control.get_train_config() is None  # nothing was sent on its own
            control.submit_config(AgentJetJob(experiment_name="my-own-job", num_repeat=3))
            done = _run(handle.url, "--no-start", "--max-episodes", "0")
            assert done.returncode == 0, done.stderr
            assert "using the job stored on the server: my-own-job" in done.stderr
            stored = control.get_train_config()
            assert stored is not None and stored.experiment_name == "my-own-job"
    finally:
        handle.stop()
