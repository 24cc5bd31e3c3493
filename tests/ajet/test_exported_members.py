"""The public surface of `ajet` is exactly its `__all__`, sorted, and stays light."""

from __future__ import annotations

import json
import subprocess
import sys

import ajet


def test_all_is_sorted_and_complete() -> None:
    # dir(): SwarmClient, AgentJetJob and EngineState are imported on first use (PEP 562)
    public = {name for name in dir(ajet) if not name.startswith("_")}
    exported = set(ajet.__all__)
    assert ajet.__all__ == sorted(ajet.__all__)
    assert exported <= public
    # every public class or function defined in ajet's submodules and re-exported is listed
    for name in public - exported:
        obj = getattr(ajet, name)
        assert type(obj).__name__ == "module", f"{name} is public but not in __all__"


def test_laptop_imports_do_not_pull_torch() -> None:
    code = (
        "import sys, json; import ajet; "
        "from ajet.tuner_lib.experimental.swarm_client import SwarmClient; "
        "from ajet.copilot.job import AgentJetJob; import ajet.packaging, ajet.rollout; "
        "print(json.dumps(sorted(m for m in ('torch','transformers') if m in sys.modules)))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout) == []
