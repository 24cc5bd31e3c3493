"""Fixtures for the engine's tests: the private channel app in process (tests/support/plane.py)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.support.plane import PlaneApp, plane_app


@pytest.fixture(scope="module")
def plane(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PlaneApp]:
    """The channel app of a rolling engine whose "model" is a `ScriptedGenerator`."""
    with plane_app(tmp_path_factory.mktemp("plane")) as app:
        yield app


@pytest.fixture(scope="module")
def bare_plane(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PlaneApp]:
    """The same app before the model is loaded: the `/v1/*` routes cannot serve yet."""
    with plane_app(tmp_path_factory.mktemp("bare-plane"), with_policy=False) as app:
        yield app
