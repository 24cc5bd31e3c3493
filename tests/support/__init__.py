"""Test support: servers (in process and as real subprocesses), engines, fakes and corpora.

Helpers live here, never in test modules, so no test module imports another:

    servers        real `ajet-swarm start` subprocesses, tokens, repos, status polls
    app            the swarm server app in this process (`create_app` + TestClient)
    fake_engine    a stand-in for `python -m ajet.engine` (run by the servers under test)
    engine         a real engine subprocess; generators without a model
    plane          the engine's private channel app in process, with a scripted generator
    tool_model     a tool-calling ajet-tiny for the end-to-end tool tests
    fake_runs      an in-process fake of the concurrent-runs routes (laptop unit tests)
    episodes, access, environ, invariants, hostile, hostile_zips, strategies, bridge

The names below (servers' tokens and handles) are importable from `tests.support`.
"""

from tests.support.servers import (
    APPROVER_NAME,
    APPROVER_TOKEN,
    CONTROL_TOKEN,
    ENFORCING_ENV,
    PROJECT_ROOT,
    WORKER_TOKEN,
    ServerHandle,
    free_port,
    make_ajet_repo,
    process_alive,
    rolling_server,
    start_server,
    wait_gone,
    wait_status,
)

__all__ = ["APPROVER_NAME", "APPROVER_TOKEN", "CONTROL_TOKEN", "ENFORCING_ENV", "PROJECT_ROOT",
           "WORKER_TOKEN", "ServerHandle", "free_port", "make_ajet_repo", "process_alive",
           "rolling_server", "start_server", "wait_gone", "wait_status"]
