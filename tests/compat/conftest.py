"""One real server per test module, without a warm standby (as `start_server` starts
them): a standby makes a restart quicker but not cheaper, and the one left waiting when
the module ends is about 4 s of CPU for nothing."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.support import ServerHandle, start_server


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerHandle]:
    handle = start_server(tmp_path_factory.mktemp("compat") / "swarm")
    yield handle
    handle.stop()
