"""One error vocabulary on the wire: a class per name, one rendering, the same class back.

The swarm server and the engine raise `ajet.errors.SwarmHTTPError` and render it with
`error_response`; the client rebuilds the most specific class from the answer
(`error_for_status`), so what a handler raises is what a caller catches. No two
exception classes of the project share a name.
"""

from __future__ import annotations

import ast
import json
from collections import Counter
from pathlib import Path

import pytest

from ajet.errors import (
    ApprovalPending,
    EngineStateConflict,
    PayloadTooLarge,
    SwarmAuthError,
    SwarmHTTPError,
    SwarmNotFound,
    SwarmValidationError,
    error_for_status,
    error_response,
    validation_error,
)

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("ajet", "swarm_server", "mcp_bridge")


def _exception_classes() -> list[tuple[str, str]]:
    """(name, file) of every class deriving, in the project's own source, from an
    exception: a base named like one, or a class already found."""
    classes: list[tuple[str, list[str], str]] = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if isinstance(node, ast.ClassDef):
                    bases = [ast.unparse(b).rsplit(".", 1)[-1] for b in node.bases]
                    classes.append((node.name, bases, str(path.relative_to(ROOT))))
    found: dict[tuple[str, str], None] = {}
    names: set[str] = set()
    changed = True
    while changed:  # a fixed point: subclasses of subclasses
        changed = False
        for name, bases, where in classes:
            if (name, where) in found:
                continue
            if any(b.endswith(("Error", "Exception")) or b in names for b in bases):
                found[(name, where)] = None
                names.add(name)
                changed = True
    return list(found)


def test_no_two_exception_classes_share_a_name() -> None:
    classes = _exception_classes()
    assert len(classes) > 10  # the walk finds the tree
    counts = Counter(name for name, _ in classes)
    twice = {name: [w for n, w in classes if n == name] for name, c in counts.items() if c > 1}
    assert not twice, f"exception names used twice: {twice}"


def _rendered(exc: SwarmHTTPError, *, openai: bool = False) -> tuple[int, dict, dict]:
    response = error_response(exc, openai=openai)
    return response.status_code, json.loads(bytes(response.body)), dict(response.headers)


@pytest.mark.parametrize("raised", [
    SwarmValidationError(400, "temperature=9 is out of range", "send 0..2", param="temperature"),
    SwarmAuthError(401, "missing bearer token", "send the worker token",
                   headers={"WWW-Authenticate": "Bearer"}),
    SwarmAuthError(403, "claimed by another client", "end only your own episodes"),
    SwarmNotFound(404, "unknown run r-1", "call list_runs"),
    EngineStateConflict(409, "engine is ENGINE.BOOTING", "retry", retry_after_s=1.4),
    ApprovalPending(409, {"snapshot_id": "ab", "approval_state": "pending"}, "ask an approver"),
    PayloadTooLarge(413, "body over 64 bytes", "send less"),
    SwarmHTTPError(503, "no policy loaded", "wait for ENGINE.ROLLING"),
], ids=lambda e: f"{type(e).__name__}-{e.status}")
def test_what_a_handler_raises_is_what_the_client_raises(raised: SwarmHTTPError) -> None:
    status, body, headers = _rendered(raised)
    assert status == raised.status
    assert body["detail"] == raised.detail and body["hint"] == raised.hint
    assert body.get("param") == raised.param
    if raised.retry_after_s is not None:
        assert headers["retry-after"] == "1"
    if raised.headers:
        assert headers["www-authenticate"] == "Bearer"
    # the client's side: the same class, status and fields from the answer
    caught = error_for_status(status, body["detail"], body["hint"], param=body.get("param"))
    assert type(caught) is type(raised)
    assert (caught.status, caught.detail, caught.hint, caught.param) == (
        raised.status, raised.detail, raised.hint, raised.param)


def test_the_openai_shape_keeps_detail_and_hint() -> None:
    status, body, _ = _rendered(
        SwarmValidationError(400, "tool_choice names x", "name a tool sent", param="tool_choice"),
        openai=True)
    assert status == 400
    assert body["detail"] == "tool_choice names x" and body["hint"] == "name a tool sent"
    assert body["error"] == {"message": "tool_choice names x (hint: name a tool sent)",
                             "type": "invalid_request_error", "param": "tool_choice",
                             "code": 400}


def test_validation_errors_name_their_fields() -> None:
    exc = validation_error([{"loc": ("body", "reward"), "msg": "not a number", "type": "x"},
                            {"loc": ("body", "task_id"), "msg": "missing", "type": "y"}])
    status, body, _ = _rendered(exc)
    assert status == 422 and body["param"] == "reward"
    assert [e["loc"] for e in body["detail"]] == [["body", "reward"], ["body", "task_id"]]
    assert "reward, task_id" in body["hint"]
