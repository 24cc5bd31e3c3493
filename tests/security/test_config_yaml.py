"""Job configs without expansion tricks: YAML anchors, aliases and merge keys are a 422
naming them, in well under a second, and nothing is stored. A 306-byte text of nested
aliases ("billion laughs") built 10^6 entries in 46 s and was stored; every worker read
of it then took 15 s.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from swarm_server.config_check import refuse_yaml_expansion
from ajet.errors import SwarmValidationError
from tests.security.inproc import inproc_server
from tests.support import WORKER_TOKEN


def laughs(levels: int = 6, width: int = 10) -> str:
    lines = ["experiment_name: x", "a0: &a0 [lol, lol, lol, lol, lol, lol, lol, lol, lol, lol]"]
    for i in range(1, levels):
        lines.append(f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * width) + "]")
    return "\n".join(lines) + "\n"


@pytest.fixture
def srv(tmp_path: Path) -> Any:
    with inproc_server(tmp_path / "swarm") as s:
        yield s


def test_an_alias_bomb_is_refused_at_once_and_nothing_is_stored(srv: Any) -> None:
    bomb = laughs()
    t0 = time.monotonic()
    r = srv.call("POST", "/sync_train_config", json={"yaml": bomb})
    assert time.monotonic() - t0 < 1.0
    assert r.status_code == 422, r.text
    msg = r.json()["detail"][0]["msg"]
    assert "anchors (&a0)" in msg and "aliases (*a0)" in msg and r.json()["hint"]
    stored = srv.call("GET", "/sync_train_config", token=WORKER_TOKEN)
    assert stored.status_code == 404
    entries = srv.call("GET", "/audit", params={"limit": 1000}).json()["entries"]
    assert entries[-1]["action"] == "sync_config" and "refused" in entries[-1]["outcome"]


def test_merge_keys_are_named_too() -> None:
    with pytest.raises(SwarmValidationError) as exc:
        refuse_yaml_expansion("base: &b {lr: 0.1}\njob:\n  <<: *b\n  n: 1\n")
    assert "merge keys (<<)" in exc.value.detail[0]["msg"]


def test_plain_configs_and_look_alike_text_pass() -> None:
    refuse_yaml_expansion("experiment_name: '&not_an_anchor *nor_alias'\nnote: a << b\n")
    refuse_yaml_expansion("experiment_name: [unclosed\n")  # the validator names the error
    with pytest.raises(SwarmValidationError):  # what precedes a syntax error still counts
        refuse_yaml_expansion("a: &x 1\nb: *x\nc: [unclosed\n")
