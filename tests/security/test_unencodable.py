"""Input no encoder takes back gets a 422 naming the field, on every route with a JSON
body: a lone surrogate escape (`"\\ud800"`, as a value or a key) and the `NaN` /
`Infinity` literals JSON forbids but Python's parser accepts. They were 500s (a lone
surrogate in `begin_episode` metadata left the episode open: it could not be stored).

Property-based: Hypothesis draws a route of the schema, a poison and where in the body
it sits (under the route's own field names or any), against an in-process server. The
episode plane with a rolling engine is covered in `tests/security/test_schemathesis.py`.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from swarm_server.limits import unencodable_field
from tests.security.inproc import InProc, inproc_server
from tests.support import APPROVER_TOKEN, CONTROL_TOKEN

#: Raw JSON text of each poison (json.dumps would refuse or escape them differently).
POISONS = ['"\\ud800"', '"x\\udfffy"', '"\\udc00\\ud800"', "NaN", "Infinity", "-Infinity"]
_NAME = st.text(alphabet="abcdefghijklmnopqrstuvwxyz_", min_size=1, max_size=10)


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory) -> Any:
    with inproc_server(tmp_path_factory.mktemp("unencodable") / "swarm") as s:
        s.ctx.episodes.check_key = lambda key: None  # let /v1/* through to the body gate
        yield s


def json_routes(srv: InProc) -> list[tuple[str, str, list[str]]]:
    """(method, path, top-level field names) of every operation with a JSON body."""
    schema = srv.app.openapi()
    out = []
    for path, ops in schema["paths"].items():
        for method, op in ops.items():
            content = op.get("requestBody", {}).get("content", {})
            if "application/json" not in content:
                continue
            ref = content["application/json"]["schema"]
            ref = ref.get("$ref") or next((a.get("$ref") for a in ref.get("anyOf", [])
                                           if "$ref" in a), None)
            fields = []
            if ref:
                model = schema["components"]["schemas"][ref.rsplit("/", 1)[1]]
                fields = sorted(model.get("properties", {}))
            concrete = path.replace("{snapshot_ref}", "0" * 64).replace("{run_id}", "r1")
            concrete = concrete.replace("{", "").replace("}", "")
            out.append((method.upper(), concrete, fields or ["field"]))
    return out


def _token(path: str) -> str:
    return APPROVER_TOKEN if path.startswith("/approvals") else CONTROL_TOKEN


@st.composite
def poisoned(draw: st.DrawFn, fields: list[str]) -> tuple[str, str]:
    """(raw JSON body, the dotted path of the poison in it)."""
    top = draw(st.sampled_from(fields))
    inner = draw(st.lists(st.one_of(_NAME, st.integers(0, 2)), max_size=3))
    poison = draw(st.sampled_from(POISONS))
    text, path = poison, [top, *[str(p) for p in inner]]
    for part in reversed(inner):
        text = ("[" + ", ".join(["0"] * part + [text]) + "]" if isinstance(part, int)
                else "{" + json.dumps(part) + ": " + text + "}")
    siblings = draw(st.dictionaries(_NAME.filter(lambda n: n != top), st.integers(), max_size=2))
    body = "{" + ", ".join([*(f"{json.dumps(k)}: {v}" for k, v in siblings.items()),
                            f"{json.dumps(top)}: {text}"]) + "}"
    return body, ".".join(path)


def test_every_json_route_names_the_unencodable_field(srv: InProc) -> None:
    routes = json_routes(srv)
    assert any(p == "/begin_episode" for _, p, _ in routes)
    assert any(p == "/end_episode" for _, p, _ in routes)
    assert any(p.startswith("/v1/") for _, p, _ in routes)

    @settings(max_examples=60, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(data=st.data())
    def check(data: st.DataObject) -> None:
        method, path, fields = data.draw(st.sampled_from(routes))
        body, where = data.draw(poisoned(fields))
        r = srv.call(method, path, token=_token(path), content=body.encode(),
                     headers={"Content-Type": "application/json"})
        assert r.status_code == 422, (method, path, body, r.status_code, r.text)
        assert f"field {where}:" in r.text, (path, body, r.text)

    check()


def test_the_episode_routes_refuse_before_anything_is_opened(srv: InProc) -> None:
    r = srv.call("POST", "/begin_episode", content=b'{"metadata": {"note": "\\ud800"}}',
                 headers={"Content-Type": "application/json"})
    problem = r.json()["detail"][0]
    assert r.status_code == 422 and problem["loc"] == ["body", "metadata", "note"]
    assert problem["msg"].startswith("field metadata.note:") and "lone surrogate" in problem["msg"]
    assert r.json()["hint"]
    r = srv.call("POST", "/end_episode", content=b'{"episode_uuid": "e", "task_id": "t", '
                 b'"reward": 1, "log_metrics": {"loss": NaN}}',
                 headers={"Content-Type": "application/json"})
    assert r.status_code == 422 and "log_metrics.loss" in r.text


@given(st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False,
                                                                           allow_infinity=False)
                    | st.text(), lambda kids: st.lists(kids, max_size=3)
                    | st.dictionaries(st.text(max_size=5), kids, max_size=3), max_leaves=12))
@settings(max_examples=60, deadline=None, database=None, derandomize=True)
def test_honest_json_is_never_flagged(value: Any) -> None:
    text = json.dumps(value, ensure_ascii=True)
    bad = unencodable_field(text.encode())
    # text() may draw lone surrogates itself: then (and only then) it must be named
    try:
        json.dumps(value, ensure_ascii=False).encode("utf-8")
        assert bad is None, (text, bad)
    except UnicodeEncodeError:
        assert bad is not None
