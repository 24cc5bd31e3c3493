"""`--engine-user`: the engine, its standby and the config validator run as another OS
user, which cannot read the server's environment, ledger or tokens file, yet reads its
snapshots and writes its runs; a server whose engine user cannot run the interpreter
refuses to start and says why.

Needs root (the server switches users): the test creates the user (`useradd`) and an
engine interpreter that user can run (a venv from the system `python3` that sees this
checkout and its packages), and skips, saying why, where it cannot.
"""

from __future__ import annotations

import os
import pwd
import shutil
import stat
import subprocess
import sys
import sysconfig
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from swarm_server.errors import StartupRefused
from swarm_server.main import create_app
from swarm_server.settings import Settings
from tests.security.inproc import inproc_server, tiny_ajet
from tests.support import APPROVER_TOKEN, CONTROL_TOKEN, PROJECT_ROOT
from tests.support.fake_engine import MODULE, PIDS_FILE

USER = "ajetenginetest"
SYSTEM_PYTHON = Path("/usr/bin/python3")
VENV = Path("/tmp/ajet-engine-user-venv")

if os.geteuid() != 0:
    pytest.skip("--engine-user needs a server that can switch users: run the tests as root "
                "(CI does)", allow_module_level=True)
if shutil.which("useradd") is None or not SYSTEM_PYTHON.exists():
    pytest.skip("--engine-user tests need useradd and /usr/bin/python3 (Debian's passwd and "
                "python3 packages)", allow_module_level=True)


def _as_user(code: str, *args: str, python: Path | None = None) -> subprocess.CompletedProcess[str]:
    entry = pwd.getpwnam(USER)
    return subprocess.run([str(python or VENV / "bin" / "python"), "-c", code, *args],
                          user=entry.pw_uid, group=entry.pw_gid, extra_groups=[], cwd="/",
                          capture_output=True, text=True, timeout=60, check=False,
                          env={"PATH": "/usr/bin:/bin", "HOME": "/"})


@pytest.fixture(scope="module")
def engine_python() -> Path:
    try:
        pwd.getpwnam(USER)
    except KeyError:
        subprocess.run(["useradd", "--system", "--user-group", "--no-create-home",
                        "--shell", "/usr/sbin/nologin", USER], check=True)
    system = subprocess.run([str(SYSTEM_PYTHON), "-c", "import sys; print(sys.version_info[:2])"],
                            capture_output=True, text=True, check=True).stdout.strip()
    if system != str(tuple(sys.version_info[:2])):
        pytest.skip(f"the system python3 is {system}, these packages are for "
                    f"{sys.version_info[:2]}: the engine venv cannot share them")
    if not (VENV / "bin" / "python").exists():
        subprocess.run([str(SYSTEM_PYTHON), "-m", "venv", "--without-pip", str(VENV)],
                       check=True, umask=0o022)
    # this checkout, then the packages of the interpreter running the tests
    paths = [str(PROJECT_ROOT)] + [p for p in sys.path if p.endswith("site-packages")
                                   and Path(p).is_dir()]
    site = Path(subprocess.run([str(VENV / "bin" / "python"), "-c",
                                "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip())
    pth = site / "ajet_engine_user_test.pth"
    pth.write_text("\n".join(paths) + "\n")
    pth.chmod(0o644)
    reach = _as_user("import ajet, pydantic, fastapi, uvicorn, tests.support.fake_engine")
    if reach.returncode != 0:
        pytest.skip(f"user {USER} cannot import this checkout and its packages "
                    f"({(reach.stderr.strip().splitlines() or ['?'])[-1]}): put the checkout "
                    f"and {sysconfig.get_paths()['purelib']} where other users can read them")
    return VENV / "bin" / "python"


@pytest.fixture
def workdir() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="ajet-engine-user-"))  # not under pytest's 0700 tmp
    path.chmod(0o711)  # the engine user enters the work directory below it
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_an_interpreter_the_engine_user_cannot_run_is_refused(engine_python: Path,
                                                              workdir: Path) -> None:
    hidden = workdir / "home"  # a 0700 home, as root's pyenv
    hidden.mkdir(mode=0o700)
    (hidden / "python").symlink_to(engine_python)
    with pytest.raises(StartupRefused) as exc:
        create_app(Settings(workdir=workdir / "swarm", engine_user=USER, warm_standby=False,
                            engine_python=str(hidden / "python")))
    text = str(exc.value)
    assert f"--engine-user {USER}" in text and "0700 home directory" in text
    with pytest.raises(StartupRefused, match="no such user"):
        create_app(Settings(workdir=workdir / "swarm", engine_user="nosuchuser-ajet"))


def test_a_tokens_file_the_engine_user_can_read_is_refused(engine_python: Path,
                                                           workdir: Path) -> None:
    tokens = workdir / "approvers"
    tokens.write_text(f"bob={APPROVER_TOKEN}-bob\n")
    tokens.chmod(0o644)
    with pytest.raises(StartupRefused, match="chmod 600"):
        create_app(Settings(workdir=workdir / "swarm", engine_user=USER, warm_standby=False,
                            engine_python=str(engine_python), token=CONTROL_TOKEN,
                            approver_tokens_file=tokens))


def _uid(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Uid:"):
            return int(line.split()[1])
    raise AssertionError("no Uid line")


def _wait(predicate: Any, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.1)


def test_the_engine_runs_as_its_user_and_cannot_reach_the_server(
        engine_python: Path, workdir: Path) -> None:
    uid = pwd.getpwnam(USER).pw_uid
    swarm = workdir / "swarm"
    swarm.mkdir()
    tokens = workdir / "approvers"
    tokens.write_text("carol=test-approver-token-carol\n")
    tokens.chmod(0o600)
    pids = swarm / PIDS_FILE  # the fake engine appends here; the workdir is not its to write
    pids.touch()
    pids.chmod(0o666)
    with inproc_server(swarm, engine_user=USER, engine_python=str(engine_python),
                       engine_module=MODULE, approver_tokens_file=tokens, warm_standby=True,
                       standby_preload=[], status_poll_s=0.05, boot_timeout_s=60) as srv:
        ledger = srv.settings.ledger_path
        assert stat.S_IMODE(ledger.stat().st_mode) == 0o600 and ledger.stat().st_uid == 0
        # the validator runs as the engine user, from the server's code
        r = srv.call("POST", "/sync_train_config", json={"yaml": "experiment_name: eu\n"})
        assert r.status_code == 200, r.text
        _wait(lambda: srv.ctx.engine._standby is not None and srv.ctx.engine._standby.pid)
        standby = srv.ctx.engine._standby.pid
        assert _uid(standby) == uid
        r = srv.call("POST", "/start_engine", json={})
        assert r.status_code == 200, r.text
        _wait(lambda: srv.call("GET", "/get_engine_status").json()["state"] == "ENGINE.ROLLING")
        status = srv.call("GET", "/get_engine_status").json()
        engine = status["pid"]
        assert _uid(engine) == uid
        environ = Path(f"/proc/{engine}/environ").read_bytes()
        assert b"AJET_SWARM" not in environ and CONTROL_TOKEN.encode() not in environ
        assert f"HOME={pwd.getpwnam(USER).pw_dir}".encode() in environ
        run_dir = srv.ctx.engine.run_dir(status["run_id"])
        assert stat.S_IMODE(run_dir.stat().st_mode) == 0o770
        # what approved code could try from inside the engine, as its user
        probe = _as_user(
            "import sys\nfor p in sys.argv[1:]:\n    try:\n        open(p, 'rb').read(1)\n"
            "        print('READ', p)\n    except OSError:\n        print('DENIED', p)\n",
            str(ledger), str(tokens), f"/proc/{os.getpid()}/environ",
            str(swarm / "ajet_temp" / ".blobs"), str(run_dir / "job.yaml"))
        lines = probe.stdout.split("\n")
        assert lines[:4] == [f"DENIED {ledger}", f"DENIED {tokens}",
                             f"DENIED /proc/{os.getpid()}/environ",
                             f"DENIED {swarm / 'ajet_temp' / '.blobs'}"], probe.stdout
        assert lines[4] == f"READ {run_dir / 'job.yaml'}", probe.stdout
        # a process the engine started outside its group (a daemon) dies with the run
        entry = pwd.getpwnam(USER)
        stray = subprocess.Popen(["/bin/sleep", "600"], user=entry.pw_uid, group=entry.pw_gid,
                                 extra_groups=[], start_new_session=True)
        srv.call("POST", "/stop_engine", json={})
        assert stray.wait(timeout=10) == -9
        # a finished run is the server's again: a later engine cannot rewrite its record
        assert run_dir.stat().st_uid == 0 and stat.S_IMODE(run_dir.stat().st_mode) == 0o750
        tamper = _as_user("import sys; open(sys.argv[1], 'a').write('forged')",
                          str(run_dir / "engine.log"))
        assert tamper.returncode != 0 and "Permission" in tamper.stderr
        # approved synced code runs as the engine user too, from its shared snapshot
        full = {f"ajet/{p.relative_to(PROJECT_ROOT / 'ajet')}": p.read_bytes()
                for p in (PROJECT_ROOT / "ajet").rglob("*")
                if p.is_file() and "__pycache__" not in p.parts and p.suffix != ".pyc"}
        synced = srv.upload({**full, "ajet/engine_user_mark.py": b"MARK = 1\n"})
        assert srv.decide(synced, "approve").status_code == 200
        assert srv.activate(synced).status_code == 200
        assert srv.call("POST", "/start_engine", json={}).status_code == 200
        _wait(lambda: srv.call("GET", "/get_engine_status").json()["state"] == "ENGINE.ROLLING")
        status = srv.call("GET", "/get_engine_status").json()
        assert status["snapshot_id"] == synced and _uid(status["pid"]) == uid
        srv.call("POST", "/stop_engine", json={})
        # a new snapshot is shared with the engine's group, read-only
        sid = srv.upload(tiny_ajet("engine-user"))
        folder = srv.ctx.snapshots.folder(srv.ctx.snapshots.get(sid))
        mod = folder / "mod.py"
        assert stat.S_IMODE(folder.stat().st_mode) == 0o750
        assert stat.S_IMODE(mod.stat().st_mode) == 0o640
        assert mod.stat().st_gid == pwd.getpwnam(USER).pw_gid
        read = _as_user("import sys; print(open(sys.argv[1]).read())", str(mod))
        assert "engine-user" in read.stdout, read.stderr


def test_sharing_never_follows_a_symlink_the_engine_planted(engine_python: Path,
                                                            workdir: Path) -> None:
    from swarm_server.engine_user import resolve_engine_user

    target = workdir / "server-secret"
    target.write_text("secret\n")
    target.chmod(0o600)
    swarm = workdir / "swarm"
    (swarm / "models" / "sub").mkdir(parents=True)
    (swarm / "models" / "evil").symlink_to(target)
    (swarm / "models" / "sub" / "evil-dir").symlink_to(workdir)
    settings = Settings(workdir=swarm, engine_user=USER, warm_standby=False)
    user = resolve_engine_user(settings)
    assert user is not None
    user.share_workdir(settings)
    user.seal_run_dir(swarm / "models")
    assert stat.S_IMODE(target.stat().st_mode) == 0o600 and target.stat().st_gid == 0
    assert stat.S_IMODE(workdir.stat().st_mode) == 0o711  # the folder above, untouched
    assert (swarm / "models" / "sub").stat().st_gid == user.gid
