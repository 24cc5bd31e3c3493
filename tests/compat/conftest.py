"""One real server per test module (warm standby on: these modules restart the engine
several times, and the standby makes each boot cheaper)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.support import ServerHandle, start_server


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerHandle]:
    handle = start_server(tmp_path_factory.mktemp("compat") / "swarm",
                          env={"AJET_SWARM_WARM_STANDBY": "1"})
    yield handle
    handle.stop()
