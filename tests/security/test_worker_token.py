"""What a worker-token holder can do to a real server: the second adversarial review's
reproductions, each refused quickly with a clear error while `/health`
keeps answering.

One server for the module (fake engine, control and worker tokens). A snapshot with a
marked diff, marked untracked files and a run on it are made once with the control
token; then the worker token walks every route and must read no code, no diff, no
untracked file name and no host; a regex bomb, a 1e308 reward, infinite metrics, a
malformed body to a control route and a 15 MiB manifest are each refused.
"""

from __future__ import annotations

import json
import re
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field

import httpx
import pytest

from ajet.client import SwarmClient
from ajet.copilot.job import AgentJetJob
from ajet.protocol import EngineState
from tests.support import CONTROL_TOKEN, WORKER_TOKEN, ServerHandle, make_ajet_repo, start_server
from tests.support.access import ACCESS, APPROVER, CONTROL, REVIEWER
from tests.support.fake_engine import server_env

CTL = {"Authorization": f"Bearer {CONTROL_TOKEN}"}
WRK = {"Authorization": f"Bearer {WORKER_TOKEN}"}
MARKER = f"secret_code_{uuid.uuid4().hex[:12]}"
REGEX_BUDGET_S = 0.5
BODY_TIMEOUT_S = 20.0
#: The web console's pages: a worker cannot sign in, so each one is a redirect
#: to the sign-in page, which shows no code either.
UI_PAGES = ["/ui", "/ui/login", "/ui/approvals", "/ui/snapshots", "/ui/snapshots/{snapshot_ref}",
            "/ui/runs", "/ui/static/console.css"]


@dataclass
class Setup:
    server: ServerHandle
    run_id: str
    snapshot_id: str
    blob: str
    host: str
    health: list[float] = field(default_factory=list)


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Setup]:
    root = tmp_path_factory.mktemp("worker")
    server = start_server(root / "swarm", env=server_env(
        AJET_SWARM_TOKEN=CONTROL_TOKEN, AJET_SWARM_WORKER_TOKEN=WORKER_TOKEN,
        AJET_SWARM_LOG_REGEX_TIMEOUT_S=str(REGEX_BUDGET_S),
        AJET_SWARM_REQUEST_BODY_TIMEOUT_S=str(BODY_TIMEOUT_S)))
    repo = make_ajet_repo(root / "repo")
    # a dirty tracked file (the diff) and untracked files (their names), all marked
    rewards = repo / "ajet" / "engine" / "rewards.py"
    rewards.write_text(rewards.read_text() + f"\n{MARKER} = 'a line of synced code'\n")
    (repo / "ajet" / f"{MARKER}_untracked.py").write_text("x = 1\n")
    (repo / "ajet" / "notes").mkdir()
    (repo / "ajet" / "notes" / f"{MARKER}.txt").write_text("private\n")
    try:
        with SwarmClient(server.url, token=CONTROL_TOKEN) as control:
            synced = control.push_code(repo)
            control.configure_and_start(AgentJetJob(experiment_name="walk"), wait_timeout=60)
            run_id = control.engine_status().run_id
            assert run_id is not None
            control.stop_run()
            code = control.get_active_code()
        assert code is not None and code.files
        assert MARKER in (code.provenance.diff or "")  # the marker really is in the diff
        # a regex-bomb target in the run's log: long lines a backtracking search chokes on
        with open(server.workdir / "runs" / run_id / "engine.log", "a") as log:
            log.writelines("a" * 60 + "b\n" for _ in range(200))
        yield Setup(server, run_id, synced.snapshot_id, code.files[0].sha256,
                    code.provenance.host or "")
    finally:
        server.stop()


@pytest.fixture
def health(setup: Setup) -> Iterator[list[float]]:
    """Poll /health every 50 ms during the test; yields the answer times (s)."""
    times: list[float] = []
    stop = threading.Event()

    def poll() -> None:
        with httpx.Client(timeout=5.0) as http:
            while not stop.is_set():
                t0 = time.monotonic()
                try:
                    ok = http.get(f"{setup.server.url}/health").status_code == 200
                except httpx.HTTPError:
                    ok = False
                times.append(time.monotonic() - t0 if ok else float("inf"))
                stop.wait(0.05)

    thread = threading.Thread(target=poll, daemon=True)
    thread.start()
    yield times
    stop.set()
    thread.join(10)
    # a wedge is no answer within 5 s (the client's timeout); speed belongs to make bench
    assert times and all(t < 5.0 for t in times), times


def schema_routes(url: str) -> list[tuple[str, str]]:
    schema = httpx.get(f"{url}/openapi.json", headers=CTL, timeout=30).json()
    return [(m.upper(), p) for p, ops in schema["paths"].items() for m in ops]


def concrete(path: str, s: Setup) -> str:
    values = {"run_id": s.run_id, "snapshot_ref": s.snapshot_id, "sha256": s.blob}
    return re.sub(r"\{([^}]+)\}", lambda m: values.get(m.group(1), "0" * 64), path)


# ---------------------------------------------------------------------------- worker views


def test_a_worker_reads_no_code_or_diff_through_any_route(setup: Setup) -> None:
    routes = schema_routes(setup.server.url)
    assert ("GET", "/runs/{run_id}") in routes
    pages = [("GET", p) for p in ("/docs", "/redoc", "/openapi.json", *UI_PAGES)]
    urls = [(m, concrete(p, setup)) for m, p in [*routes, *pages]]
    urls += [(m, u.replace(setup.run_id, "current")) for m, u in urls if setup.run_id in u]
    seen = 0
    with httpx.Client(base_url=setup.server.url, timeout=30) as http:
        for method, url in urls:
            r = http.request(method, url, headers=WRK, params={"tail": 10_000},
                             json={} if method == "POST" else None)
            assert r.status_code < 500, (method, url, r.text)
            assert MARKER not in r.text, (method, url, r.text[:2000])
            seen += r.status_code == 200
    assert seen > 10  # the walk read something
    # the worker token cannot sign in to the console
    login = httpx.post(f"{setup.server.url}/ui/login", data={"token": WORKER_TOKEN})
    assert login.status_code == 401 and "ajet_console" not in login.headers.get(
        "set-cookie", "") and MARKER not in login.text
    # the run's provenance: counts instead of the diff, the names and the host
    worker_view = httpx.get(f"{setup.server.url}/runs/{setup.run_id}", headers=WRK).json()
    prov = worker_view["provenance"]
    assert prov["withheld"] and prov["diff"] == "" and prov["untracked_left_out"] == []
    assert prov["host"] is None and prov["diff_bytes"] > 0 and prov["untracked_count"] == 2
    assert prov["git_head"]  # provenance that is not code stays readable
    # the control token still reads all of it
    control_view = httpx.get(f"{setup.server.url}/runs/{setup.run_id}", headers=CTL).json()
    assert MARKER in control_view["provenance"]["diff"]
    assert control_view["provenance"]["host"] == setup.host and not control_view[
        "provenance"]["withheld"]
    assert any(MARKER in n for n in control_view["provenance"]["untracked_left_out"])


# ---------------------------------------------------------------------------- regex


def test_a_regex_bomb_is_refused_within_its_budget_and_health_answers(
        setup: Setup, health: list[float]) -> None:
    url = f"{setup.server.url}/runs/{setup.run_id}/logs"
    bomb = {"grep": "(a|aa)+$", "regex": "true", "tail": 10}

    def search(out: list[httpx.Response]) -> None:
        out.append(httpx.get(url, params=bomb, headers=WRK, timeout=30))

    answers: list[httpx.Response] = []
    threads = [threading.Thread(target=search, args=(answers,)) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert len(answers) == 4
    for r in answers:
        assert r.status_code == 400, r.text
        assert f"{REGEX_BUDGET_S:g} s budget" in r.json()["detail"]
        assert "AJET_SWARM_LOG_REGEX_TIMEOUT_S" in r.json()["detail"] and r.json()["hint"]
    # the same search as plain text is instant, and a sane regex still works
    plain = httpx.get(url, params={"grep": "(a|aa)+$", "tail": 10}, headers=WRK)
    assert plain.status_code == 200 and plain.json()["lines"] == []
    sane = httpx.get(url, params={"grep": r"a{60}b$", "regex": "true", "tail": 3}, headers=WRK)
    assert sane.status_code == 200 and len(sane.json()["lines"]) == 3


# ---------------------------------------------------------------------------- values


@pytest.mark.parametrize(("body", "where"), [
    ('{"episode_uuid": "e", "task_id": "t", "reward": 1e308}', "reward"),
    ('{"episode_uuid": "e", "task_id": "t", "reward": -2e6}', "reward"),
    ('{"episode_uuid": "e", "task_id": "t", "reward": 1, "log_metrics": {"x": 1e308}}', "x"),
])
def test_rewards_and_metrics_beyond_the_limit_are_422_naming_it(setup: Setup, body: str,
                                                                 where: str) -> None:
    r = httpx.post(f"{setup.server.url}/end_episode", content=body, timeout=30,
                   headers={**WRK, "Content-Type": "application/json"})
    assert r.status_code == 422, r.text
    problem = r.json()["detail"][0]
    assert problem["loc"][-1] == where and r.json()["hint"]
    assert "1e+06" in problem["msg"] and "MAX_" in problem["msg"], problem


@pytest.mark.parametrize("value", ["Infinity", "-Infinity", "NaN"])
def test_numbers_json_forbids_are_refused_naming_the_field(setup: Setup, value: str) -> None:
    # not JSON at all (Python's parser takes them): refused before any route parses them
    body = '{"episode_uuid": "e", "task_id": "t", "reward": 1, "log_metrics": {"x": %s}}'
    r = httpx.post(f"{setup.server.url}/end_episode", content=body % value, timeout=30,
                   headers={**WRK, "Content-Type": "application/json"})
    assert r.status_code == 422, r.text
    problem = r.json()["detail"][0]
    assert problem["loc"] == ["body", "log_metrics", "x"]
    assert problem["msg"] == f"field log_metrics.x: {value} is not a JSON number"
    assert r.json()["hint"]


def test_a_non_finite_reward_is_422(setup: Setup) -> None:
    r = httpx.post(f"{setup.server.url}/end_episode", timeout=30,
                   content='{"episode_uuid": "e", "task_id": "t", "reward": Infinity}',
                   headers={**WRK, "Content-Type": "application/json"})
    assert r.status_code == 422 and "reward" in json.dumps(r.json()["detail"]), r.text


# ---------------------------------------------------------------------------- the gate


def test_a_workers_malformed_json_to_any_control_route_is_403(setup: Setup) -> None:
    # every POST route the worker token may not call (the access table of the auth walk)
    refused = [p for (m, p), access in ACCESS.items() if m == "POST"
               and access in (CONTROL, APPROVER, REVIEWER)]
    assert {"/sync_train_config", "/code/manifest", "/start_engine"} <= set(refused)
    for path in refused:
        r = httpx.post(f"{setup.server.url}{concrete(path, setup)}", content=b"{not json",
                       timeout=30, headers={**WRK, "Content-Type": "application/json"})
        assert r.status_code == 403 and r.json()["hint"], (path, r.text)


def _stalled_upload(port: int, path: str, headers: dict[str, str], declared: int
                    ) -> tuple[bytes, float]:
    """Declare `declared` bytes, send 1 KiB of them, and wait for the server's answer."""
    head = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        t0 = time.monotonic()
        s.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\n{head}Content-Type: application/json"
                  f"\r\nContent-Length: {declared}\r\n\r\n".encode() + b"[" * 1024)
        s.settimeout(BODY_TIMEOUT_S / 2)  # the answer must come without the rest of the body
        reply = b""
        while not _complete(reply):
            chunk = s.recv(65536)
            if not chunk:
                break
            reply += chunk
        return reply, time.monotonic() - t0


def _complete(reply: bytes) -> bool:
    head, sep, body = reply.partition(b"\r\n\r\n")
    length = re.search(rb"content-length: (\d+)", head, re.IGNORECASE)
    return bool(sep) and (length is None or len(body) >= int(length.group(1)))


def test_a_workers_15_mib_manifest_is_refused_before_it_is_read(setup: Setup) -> None:
    reply, _ = _stalled_upload(setup.server.port, "/code/manifest", WRK, 15 * 2**20)
    assert reply.startswith(b"HTTP/1.1 403"), reply[:300]
    # the control token gets past the gate; its oversized body is then refused unread
    reply, _ = _stalled_upload(setup.server.port, "/code/manifest", CTL, 17 * 2**20)
    assert reply.startswith(b"HTTP/1.1 413"), reply[:300]
    # and an anonymous 15 MiB chat body is refused before a byte is buffered
    reply, _ = _stalled_upload(setup.server.port, "/v1/chat/completions", {}, 15 * 2**20)
    assert reply.startswith(b"HTTP/1.1 401"), reply[:300]
    reply, _ = _stalled_upload(setup.server.port, "/v1/chat/completions",
                               {"Authorization": "Bearer ajep_forged.key"}, 15 * 2**20)
    assert reply.startswith(b"HTTP/1.1 401"), reply[:300]
    # begin/end/abort bodies have a bound of their own (max_episode_body_bytes, 1 MiB)
    reply, _ = _stalled_upload(setup.server.port, "/end_episode", WRK, 2 * 2**20)
    assert reply.startswith(b"HTTP/1.1 413") and b"MAX_EPISODE_BODY_BYTES" in reply, reply
    assert httpx.get(f"{setup.server.url}/get_engine_status", headers=WRK).json()[
        "state"] == EngineState.OFFLINE.value


def test_the_episode_prefix_needs_an_episode_key_before_anything(setup: Setup) -> None:
    with httpx.Client(base_url=setup.server.url, timeout=30) as http:
        for path in ("/v1/chat/completions", "/v1/models", "/v1/no/such/route"):
            for headers in ({}, WRK, CTL, {"Authorization": "Bearer ajep_x.y"}):
                r = http.post(path, content=b"{not json", headers=headers)
                assert r.status_code == 401, (path, headers, r.text)
                body = r.json()
                assert body["hint"] and body["error"]["type"] == "authentication_error"
                assert r.headers["www-authenticate"] == "Bearer"
