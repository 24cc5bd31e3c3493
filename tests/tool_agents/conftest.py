"""The tool-calling model and the server whose engine serves it, for this folder's tests.

One fine-tune of ajet-tiny to call `get_weather` (tests/support/tool_model.py) and one
token-protected server rolling it, shared by every file here. `make test` hands this
folder to one worker as one unit (`pytest_xdist_make_scheduler` in tests/conftest.py),
so the server is package-scoped: it starts before the first file and stops after the
last, instead of idling on each worker until the end of the run.
"""

from __future__ import annotations

import fcntl
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ajet.client import SwarmClient
from tests.support import WORKER_TOKEN, ServerHandle, rolling_server


@pytest.fixture(scope="package")
def tool_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """ajet-tiny fine-tuned to call get_weather, built once per test run (about 20 s of
    CPU): under a `--dist` mode that splits this folder, the workers share one build."""
    from tests.support.tool_model import finetune_tool_model

    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # the run's folder, above every worker's own basetemp
    target = root / "tool-model" / "ajet-tiny-tools"
    target.parent.mkdir(parents=True, exist_ok=True)
    # one worker builds it while the others wait; `finetune_tool_model` returns a
    # finished one (its finetuned.json is written last) as it is
    with open(target.parent / "build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return finetune_tool_model(target)


@pytest.fixture(scope="package")
def tool_server(tool_model: Path, tmp_path_factory: pytest.TempPathFactory
                ) -> Iterator[ServerHandle]:
    """A token-protected server whose engine serves `tool_model`."""
    from tests.support.tool_model import tool_job

    with rolling_server(tmp_path_factory.mktemp("tools"), tool_job(tool_model)) as handle:
        yield handle


@pytest.fixture(scope="package")
def tool_worker(tool_server: ServerHandle) -> Iterator[SwarmClient]:
    with SwarmClient(tool_server.url, token=WORKER_TOKEN, timeout=60) as client:
        yield client


@pytest.fixture(scope="package")
def tool_tokenizer(tool_model: Path) -> Any:
    """The tool model's tokenizer, to render expected prompts in the test process."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tool_model)
