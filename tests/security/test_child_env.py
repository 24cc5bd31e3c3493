"""No secret reaches code the server runs, nor the bridge's rollout workflows.

Children of the server (engine, ranks, standby, config validator) get an allow-list of
the server's environment plus `--engine-env` names, never an `AJET_SWARM_*`/`AJET_MCP_*`
variable nor a value holding a token; what a child prints that reaches a caller (the
validator's stderr in a 422, the engine log) is bounded and redacted. The end-to-end
case is the one an approved snapshot can reach: its config validator prints its whole
environment and the approvers' tokens file, then exits without a result.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mcp_bridge.rollouts import child_environment
from swarm_server.run_files import REDACTED, read_log_lines, redact_secrets
from swarm_server.settings import Settings
from swarm_server.supervisor import engine_env, snapshot_env
from tests.security.inproc import BOB_TOKEN, inproc_server
from tests.support import APPROVER_TOKEN, CONTROL_TOKEN, PROJECT_ROOT, WORKER_TOKEN

SERVER_ENV = {
    "PATH": "/usr/bin", "HOME": "/home/srv", "LC_ALL": "C.UTF-8", "LANG": "C.UTF-8",
    "CUDA_VISIBLE_DEVICES": "0,1", "NCCL_DEBUG": "INFO", "PYTORCH_CUDA_ALLOC_CONF": "x",
    "HF_HOME": "/data/hf", "LD_LIBRARY_PATH": "/usr/local/cuda/lib64",
    "https_proxy": "http://proxy:3128", "AJET_ENGINE_GENERATION": "recompute",
    "AJET_SWARM_TOKEN": CONTROL_TOKEN, "AJET_SWARM_WORKER_TOKEN": WORKER_TOKEN,
    "AJET_SWARM_APPROVER_TOKENS": f"alice={APPROVER_TOKEN}",
    "AJET_SWARM_APPROVER_TOKENS_FILE": "/etc/ajet/approvers",
    "AJET_MCP_APPROVALS_DIR": "/home/srv/.config/approvals",
    "AWS_SECRET_ACCESS_KEY": "cloud-secret", "GITHUB_TOKEN": "ghp_secret",
    "WANDB_API_KEY": "wandb-key", "HF_COPY_OF_IT": f"x{APPROVER_TOKEN}x",
}


def test_children_get_an_allow_list_of_the_environment() -> None:
    env = snapshot_env(Path("/snap"), SERVER_ENV, extra=["WANDB_API_KEY", "AJET_SWARM_TOKEN"],
                       secrets=[CONTROL_TOKEN, WORKER_TOKEN, APPROVER_TOKEN])
    for kept in ("PATH", "HOME", "LC_ALL", "LANG", "CUDA_VISIBLE_DEVICES", "NCCL_DEBUG",
                 "PYTORCH_CUDA_ALLOC_CONF", "HF_HOME", "LD_LIBRARY_PATH", "https_proxy",
                 "AJET_ENGINE_GENERATION", "WANDB_API_KEY"):
        assert env[kept] == SERVER_ENV[kept], kept
    assert not [k for k in env if k.startswith(("AJET_SWARM", "AJET_MCP"))]
    for gone in ("AWS_SECRET_ACCESS_KEY", "GITHUB_TOKEN", "HF_COPY_OF_IT"):
        assert gone not in env
    text = json.dumps(env)
    assert "/etc/ajet/approvers" not in text
    assert not any(t in text for t in (CONTROL_TOKEN, WORKER_TOKEN, APPROVER_TOKEN))
    assert env["PYTHONPATH"] == "/snap" and env["ISOLATED_AGENTJET_BASE_DIR"] == "/snap"


def test_no_path_to_the_tokens_file_under_any_name(tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    tokens = tmp_path / "approvers"
    tokens.write_text(f"bob={BOB_TOKEN}\n")
    monkeypatch.setenv("HF_TOKEN_PATH", str(tokens))
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    settings = Settings(workdir=tmp_path, token=CONTROL_TOKEN, approver_tokens_file=tokens)
    env = engine_env(settings, None)
    assert "HF_TOKEN_PATH" not in env and env["HF_HOME"] == str(tmp_path / "hf")


def test_engine_env_never_names_a_server_secret(tmp_path: Path) -> None:
    ok = Settings(workdir=tmp_path, engine_env="WANDB_API_KEY, MLFLOW_TRACKING_URI")
    assert ok.engine_env == ["WANDB_API_KEY", "MLFLOW_TRACKING_URI"]
    for bad in ("AJET_SWARM_TOKEN", "ajet_swarm_approver_tokens", "AJET_MCP_X", "A-B"):
        with pytest.raises(ValueError, match="engine-env"):
            Settings(workdir=tmp_path, engine_env=bad)


def test_the_bridge_rollout_child_loses_every_ajet_variable() -> None:
    env = child_environment({**SERVER_ENV, "AJET_SWARM_APPROVER_TOKEN": APPROVER_TOKEN,
                             "AJET_SWARM_URL": "http://cluster:10086", "MY_TOKEN": CONTROL_TOKEN,
                             "USER_KEY": "keep-me"})
    assert not [k for k in env if k.upper().startswith("AJET_")]
    assert "MY_TOKEN" not in env  # a token copied under another name goes too
    assert env["USER_KEY"] == "keep-me" and env["WANDB_API_KEY"] == "wandb-key"
    assert env["PATH"] == "/usr/bin" and env["AWS_SECRET_ACCESS_KEY"] == "cloud-secret"


def test_redaction_of_what_reaches_a_caller(tmp_path: Path) -> None:
    assert redact_secrets(f"a {CONTROL_TOKEN} b", [CONTROL_TOKEN]) == f"a {REDACTED} b"
    log = tmp_path / "engine.log"
    log.write_text(f"env: TOKEN={WORKER_TOKEN}\nplain line\n")
    lines, _, _ = read_log_lines(log, tail=10, redact=[WORKER_TOKEN])
    assert lines == [f"env: TOKEN={REDACTED}", "plain line"]
    # a search cannot tell whether the token was there
    found, _, _ = read_log_lines(log, tail=10, grep=WORKER_TOKEN[:12], redact=[WORKER_TOKEN])
    assert found == []


VALIDATOR = '''\
import json, os, sys
secrets = {secrets!r}
sys.stderr.write("RAW " + json.dumps(dict(os.environ)) + "\\n")  # what an attack prints
leaks = sorted(k for k, v in os.environ.items()
               if k.startswith(("AJET_SWARM", "AJET_MCP")) or any(s in v for s in secrets)
               or {path!r} in v)
sys.stderr.write("LEAKS " + json.dumps(leaks) + "\\n")
sys.stderr.write("TRACKER " + os.environ.get("TRACKER_KEY", "-") + "\\n")
sys.stderr.write("FILE " + open({path!r}).read().replace("\\n", " ") + "\\n")
sys.exit(3)
'''


def test_an_approved_validator_cannot_hand_a_token_to_the_agent(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tokens_file = tmp_path / "approvers"
    tokens_file.write_text(f"bob={BOB_TOKEN}\n")
    # the server's own environment holds every secret, also under a name of its own
    monkeypatch.setenv("AJET_SWARM_APPROVER_TOKENS_FILE", str(tokens_file))
    monkeypatch.setenv("AJET_SWARM_TOKEN", CONTROL_TOKEN)
    monkeypatch.setenv("HF_LEAKED", APPROVER_TOKEN)
    monkeypatch.setenv("TRACKER_KEY", "tracker-value")
    secrets = [CONTROL_TOKEN, WORKER_TOKEN, APPROVER_TOKEN, BOB_TOKEN]
    with inproc_server(tmp_path / "swarm", approver_tokens=f"alice={APPROVER_TOKEN}",
                       approver_tokens_file=tokens_file, engine_env=["TRACKER_KEY"]) as srv:
        code = VALIDATOR.format(path=str(tokens_file), secrets=secrets)
        sid = srv.upload({"ajet/__init__.py": "", "ajet/copilot/__init__.py": "",
                          "ajet/copilot/validate.py": code})
        assert srv.decide(sid, "approve").status_code == 200
        assert srv.activate(sid).status_code == 200
        r = srv.call("POST", "/sync_train_config", json={"yaml": "experiment_name: x\n"})
    assert r.status_code == 422, r.text
    lines = {ln.split(" ", 1)[0]: ln.split(" ", 1)[1] for ln in r.json()["detail"]["stderr"]}
    assert json.loads(lines["LEAKS"]) == []
    assert lines["TRACKER"] == "tracker-value"  # --engine-env passes it
    # the file is readable by the server's user here; its content is redacted on the way out
    assert lines["FILE"].strip() == f"bob={REDACTED}"
    for token in secrets:
        assert token not in r.text
    assert len(r.content) < 64 * 1024


RESULT = '''\
import json
token = open({path!r}).read().strip().split("=", 1)[1]
print(json.dumps({{"ok": False, "errors": [{{"loc": ["lr"], "msg": "bad " + token}}],
                  "hint": "hint " + token}}))
'''


def test_a_validator_result_is_redacted_too(tmp_path: Path) -> None:
    tokens_file = tmp_path / "approvers"
    tokens_file.write_text(f"bob={BOB_TOKEN}\n")
    with inproc_server(tmp_path / "swarm", approver_tokens=f"alice={APPROVER_TOKEN}",
                       approver_tokens_file=tokens_file) as srv:
        sid = srv.upload({"ajet/__init__.py": "", "ajet/copilot/__init__.py": "",
                          "ajet/copilot/validate.py": RESULT.format(path=str(tokens_file))})
        assert srv.decide(sid, "approve").status_code == 200
        assert srv.activate(sid).status_code == 200
        r = srv.call("POST", "/sync_train_config", json={"yaml": "experiment_name: x\n"})
    assert r.status_code == 422, r.text
    assert BOB_TOKEN not in r.text and r.json()["detail"][0]["msg"] == f"bad {REDACTED}"
    assert r.json()["hint"] == f"hint {REDACTED}"


def test_short_tokens_are_refused_at_start(tmp_path: Path) -> None:
    for kw in ({"token": "0123"}, {"token": CONTROL_TOKEN, "worker_token": "short-worker"},
               {"token": CONTROL_TOKEN, "approver_tokens": "alice=4242"}):
        with pytest.raises(ValueError, match="shorter than 16 characters"):
            Settings(workdir=tmp_path, **kw)  # type: ignore[arg-type]
    assert Settings(workdir=tmp_path, token="x" * 16).token is not None


def test_the_cli_refuses_a_server_secret_in_engine_env(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("AJET_SWARM_")}
    started = subprocess.run(
        [sys.executable, "-m", "swarm_server", "start", "--swarm-port", "0", "--workdir",
         str(tmp_path), "--engine-env", "WANDB_API_KEY,AJET_SWARM_APPROVER_TOKENS"],
        env=env, capture_output=True, text=True, timeout=60, cwd=PROJECT_ROOT)
    assert started.returncode == 2, started.stderr[-2000:]
    assert "AJET_SWARM_APPROVER_TOKENS is the server's or the bridge's own setting" \
        in started.stderr
