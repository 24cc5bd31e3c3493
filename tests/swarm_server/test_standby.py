"""The warm standby (`swarm_server/standby.py`, `swarm_server/standby_keeper.py`).

An engine start hands its command line to a waiting interpreter that has imported the
heavy third-party modules already. What must hold: the engine still runs the active
snapshot's code, the standby becomes the engine process itself (same pid, own process
group: stop, kill and recovery unchanged), a dead or unsuitable standby means a cold
start, and no standby outlives its server. Most tests use the fake engine with a light
preload; one runs the real engine with ajet-tiny.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from ajet.client import SwarmClient
from ajet.copilot.job import AgentJetJob
from ajet.protocol import EngineState, EngineStatus
from swarm_server.ledger import Ledger
from swarm_server.settings import Settings
from swarm_server.standby import engine_sys_path, file_stamps, stale_modules
from swarm_server.standby_keeper import STANDBY_META_KEY, StandbyKeeper
from swarm_server.supervisor import PosixSpawner, SpawnSpec, snapshot_env
from tests.support import ServerHandle, process_alive, start_server, wait_gone
from tests.support.fake_engine import server_env, set_behaviour

#: What the fake engine imports from third parties: cheap to preload.
LIGHT_PRELOAD = '["fastapi", "uvicorn"]'
WARM_LINE = "[warm_standby]"


def warm_env(**extra: str) -> dict[str, str]:
    return server_env(AJET_SWARM_WARM_STANDBY="1", AJET_SWARM_STANDBY_PRELOAD=LIGHT_PRELOAD,
                      **extra)


def standby_pid(server: ServerHandle, *, not_pid: int | None = None,
                timeout: float = 20.0) -> int:
    """The pid of the server's waiting standby (ledger meta), once it is not `not_pid`."""
    deadline = time.monotonic() + timeout
    while True:
        ledger = Ledger(server.workdir / "swarm.sqlite3")
        try:
            raw = ledger.get_meta(STANDBY_META_KEY)
        finally:
            ledger.close()
        if raw is not None:
            pid = int(json.loads(raw)["pid"])
            if pid != not_pid and process_alive(pid):
                return pid
        if time.monotonic() > deadline:
            raise AssertionError(f"no standby other than {not_pid} after {timeout}s:\n"
                                 f"{server.log()[-3000:]}")
        time.sleep(0.05)


def engine_log(server: ServerHandle, status: EngineStatus) -> str:
    return (server.workdir / "runs" / str(status.run_id) / "engine.log").read_text()


def group_members(pgid: int) -> list[int]:
    found = []
    for proc in psutil.process_iter(["status"]):
        try:
            if os.getpgid(proc.pid) == pgid and proc.info["status"] != psutil.STATUS_ZOMBIE:
                found.append(proc.pid)
        except (ProcessLookupError, psutil.Error):
            continue
    return found


def patch_marker(repo: Path, relpath: str, marker: str) -> None:
    """Make a module of the repo's ajet write `marker` to stderr when imported."""
    path = repo / relpath
    path.write_text(path.read_text() + f"\nimport sys as _m\n_m.stderr.write({marker!r} + "
                    "'\\n')\n_m.stderr.flush()\n")


@pytest.fixture
def warm_server(tmp_path: Path) -> Iterator[ServerHandle]:
    handle = start_server(tmp_path / "swarm", env=warm_env())
    yield handle
    handle.stop()


# ---------------------------------------------------------------------------- fake engine


def test_starts_take_the_standby_and_run_the_synced_code(warm_server: ServerHandle,
                                                         ajet_repo: Path) -> None:
    # no config, nothing to start: no standby yet
    assert not psutil.Process(warm_server.proc.pid).children()
    with SwarmClient(warm_server.url) as client:
        client.push_code(ajet_repo)
        client.submit_config(AgentJetJob(experiment_name="warm"))
        first_standby = standby_pid(warm_server)
        first = client.start_run(wait=True, wait_timeout=30)
        assert first.pid == first_standby
        assert WARM_LINE in engine_log(warm_server, first)
        # the run's device slot is set per start: the standby was started before it
        assert first.devices and (f"AJET_ENGINE_DEVICE_SLOTS={first.devices[0]}"
                                  in engine_log(warm_server, first))

        second_standby = standby_pid(warm_server, not_pid=first_standby)
        patch_marker(ajet_repo, "ajet/__init__.py", "PATCHED-INIT-RAN")
        synced = client.push_code(ajet_repo, force_restart=True)
        assert synced.restarted
        second = client.wait_for_state(EngineState.ROLLING, timeout=30)
    assert second.run_id != first.run_id and second.pid == second_standby
    assert not process_alive(first_standby)  # the first engine was stopped
    assert second.snapshot_path is not None and second.ajet_file is not None
    snapshot_dir = (warm_server.workdir / second.snapshot_path).resolve()
    assert Path(second.ajet_file).resolve().parent == snapshot_dir
    log = engine_log(warm_server, second)
    assert WARM_LINE in log and "PATCHED-INIT-RAN" in log
    assert "PATCHED-INIT-RAN" not in engine_log(warm_server, first)


def test_a_dead_standby_means_a_cold_start_and_a_new_standby(warm_server: ServerHandle) -> None:
    with SwarmClient(warm_server.url) as client:
        client.submit_config(AgentJetJob(experiment_name="cold"))
        dead = standby_pid(warm_server)
        os.kill(dead, signal.SIGKILL)
        # dead, not dying: on a busy machine the signal may not have landed yet when the
        # start arrives, and a standby that dies after taking the order is a failed start
        assert wait_gone(dead)
        status = client.start_run(wait=True, wait_timeout=30)
        assert status.pid is not None and status.pid != dead
        assert WARM_LINE not in engine_log(warm_server, status)
        replacement = standby_pid(warm_server, not_pid=dead)
        assert replacement != status.pid
        assert client.stop_run().stopped
    assert process_alive(replacement)  # kept for the next start


def test_stop_and_kill_of_a_standby_born_engine_clear_its_group(tmp_path: Path) -> None:
    workdir = tmp_path / "swarm"
    server = start_server(workdir, env=warm_env(AJET_SWARM_STOP_GRACE_S="0.5"))
    try:
        with SwarmClient(server.url) as client:
            client.submit_config(AgentJetJob(experiment_name="groups"))
            # stop: SIGTERM is ignored, so the group gets SIGKILL after the grace
            set_behaviour(workdir, spawn_child=True, ignore_term=True)
            standby = standby_pid(server)
            status = client.start_run(wait=True, wait_timeout=30)
            assert status.pid == standby
            child = int((workdir / "runs" / str(status.run_id) / "child.pid").read_text())
            assert client.stop_run().stopped
            assert not group_members(standby) and not process_alive(child)

            # kill: the engine dies by SIGKILL; the server clears what it left in its group
            set_behaviour(workdir, spawn_child=True)
            standby = standby_pid(server, not_pid=standby)
            status = client.start_run(wait=True, wait_timeout=30)
            assert status.pid == standby
            child = int((workdir / "runs" / str(status.run_id) / "child.pid").read_text())
            os.kill(standby, signal.SIGKILL)
            deadline = time.monotonic() + 20
            while client.engine_status().state is not EngineState.OFFLINE:
                assert time.monotonic() < deadline
                time.sleep(0.05)
            assert wait_gone(child) and not group_members(standby)
            run = client.get_run(str(status.run_id))
            assert run.status == "failed" and "SIGKILL" in (run.reason or "")
    finally:
        server.stop()


def test_a_standby_with_ajet_imported_runs_the_cold_command_line(tmp_path: Path,
                                                                 ajet_repo: Path) -> None:
    # swarm_server.supervisor imports ajet.protocol: the standby must not reuse that ajet.
    server = start_server(tmp_path / "swarm", env=server_env(
        AJET_SWARM_WARM_STANDBY="1", AJET_SWARM_STANDBY_PRELOAD='["swarm_server.supervisor"]'))
    try:
        with SwarmClient(server.url) as client:
            client.push_code(ajet_repo)
            client.submit_config(AgentJetJob(experiment_name="tainted"))
            standby = standby_pid(server)
            status = client.start_run(wait=True, wait_timeout=30)
    finally:
        server.stop()
    assert status.pid == standby  # the same process, exec'd into the cold command line
    log = engine_log(server, status)
    assert "running the cold command line instead" in log and "ajet" in log
    assert status.ajet_file is not None and status.snapshot_path is not None
    assert Path(status.ajet_file).resolve().parent == (server.workdir
                                                       / status.snapshot_path).resolve()


def test_no_standby_outlives_its_server(tmp_path: Path) -> None:
    workdir = tmp_path / "swarm"
    server = start_server(workdir, env=warm_env())
    with SwarmClient(server.url) as client:
        client.submit_config(AgentJetJob(experiment_name="orphans"))
    standby = standby_pid(server)
    server.stop()  # SIGTERM: shutdown stops the standby
    assert wait_gone(standby, timeout=5)

    server = start_server(workdir, env=warm_env())  # the stored config: a standby at once
    standby = standby_pid(server)
    server.kill(signal.SIGKILL)
    again = start_server(workdir, env=warm_env())
    try:
        # gone by itself (its stdin pipe closed) or stopped by recovery (pid + start time)
        assert wait_gone(standby)
        assert standby_pid(again, not_pid=standby) != standby
    finally:
        again.stop()
    assert not group_members(standby)


# ---------------------------------------------------------------------------- the keeper


def keeper_settings(workdir: Path) -> Settings:
    return Settings(workdir=workdir, warm_standby=True, standby_preload=[])


def test_recovery_stops_a_standby_left_by_an_earlier_server(tmp_path: Path) -> None:
    settings = keeper_settings(tmp_path)
    ledger = Ledger(settings.ledger_path)
    earlier = StandbyKeeper(settings, ledger, PosixSpawner())
    earlier.ensure()
    pid = earlier.pid
    assert pid is not None and process_alive(pid)
    # `earlier` still holds the pipe open, as a hung (not dead) server would
    later = StandbyKeeper(settings, ledger, PosixSpawner())
    later.recover()
    assert wait_gone(pid, timeout=5)
    assert ledger.get_meta(STANDBY_META_KEY) is None
    earlier.close()
    ledger.close()


def test_the_keeper_refuses_torchrun_and_a_changed_environment(tmp_path: Path) -> None:
    settings = keeper_settings(tmp_path)
    ledger = Ledger(settings.ledger_path)
    keeper = StandbyKeeper(settings, ledger, PosixSpawner())
    try:
        keeper.ensure()
        pid = keeper.pid
        assert pid is not None
        run_dir = tmp_path / "runs" / "r1"
        torchrun = SpawnSpec(argv=[settings.engine_python, "-m", "torch.distributed.run",
                                   "--nproc_per_node=2", "-m", settings.engine_module],
                             cwd=run_dir, env=snapshot_env(None), log_path=run_dir / "engine.log")
        assert keeper.take(torchrun) is None and keeper.pid == pid  # kept for the next one

        env = dict(snapshot_env(tmp_path), OMP_NUM_THREADS="7")  # read by torch at import
        changed = SpawnSpec(argv=[settings.engine_python, "-m", settings.engine_module],
                            cwd=run_dir, env=env, log_path=run_dir / "engine.log")
        assert keeper.take(changed) is None
        assert keeper.pid is None and wait_gone(pid, timeout=5)
    finally:
        keeper.close()
        ledger.close()


def test_the_standby_builds_sys_path_as_python_m_would(tmp_path: Path) -> None:
    run_dir, lib = tmp_path / "run", tmp_path / "lib"
    run_dir.mkdir()
    lib.mkdir()
    (lib / "show_path.py").write_text("import json, sys\nprint(json.dumps(sys.path))\n")
    base_env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    pythonpath = os.pathsep.join([str(lib), "", "relative", str(lib), str(tmp_path / "none")])
    env = {**base_env, "PYTHONPATH": pythonpath}
    fresh = subprocess.run([sys.executable, "-m", "show_path"], cwd=run_dir, env=env,
                           capture_output=True, text=True, check=True)
    # the standby's own path: the same interpreter without PYTHONPATH, minus its script dir
    own = subprocess.run([sys.executable, "-c", "import json, sys; print(json.dumps(sys.path))"],
                         env=base_env, capture_output=True, text=True, check=True)
    base_path = json.loads(own.stdout)[1:]
    assert engine_sys_path(base_path, env, str(run_dir), safe_path=False) \
        == json.loads(fresh.stdout)


def test_a_preloaded_module_upgraded_or_shadowed_is_stale(tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    lib, shadow = tmp_path / "lib", tmp_path / "shadow"
    for folder in (lib, shadow):
        folder.mkdir()
        (folder / "standby_probe_mod.py").write_text("VALUE = 1\n")
    monkeypatch.syspath_prepend(str(lib))
    __import__("standby_probe_mod")
    try:
        stamps = file_stamps()
        assert not [s for s in stale_modules(sys.path, stamps) if "standby_probe_mod" in s]
        shadowed = stale_modules([str(shadow), *sys.path], stamps)
        assert [s for s in shadowed if s.startswith("standby_probe_mod ")]
        os.utime(lib / "standby_probe_mod.py", ns=(0, 10**9))  # as a reinstall would
        upgraded = stale_modules(sys.path, stamps)
        assert [s for s in upgraded if "standby_probe_mod" in s and "changed on disk" in s]
    finally:
        sys.modules.pop("standby_probe_mod", None)


# ---------------------------------------------------------------------------- real engine


@pytest.mark.slow
def test_real_engine_restart_on_patched_code_uses_the_standby(tmp_path: Path,
                                                              ajet_repo: Path) -> None:
    server = start_server(tmp_path / "swarm", env={"AJET_SWARM_WARM_STANDBY": "1",
                                                   "AJET_SWARM_STOP_GRACE_S": "5"})
    try:
        with SwarmClient(server.url) as client:
            client.push_code(ajet_repo)
            client.submit_config(AgentJetJob(model="ajet-tiny", experiment_name="warm-real",
                                                 batch_size=1, num_repeat=2))
            first = client.start_run(wait=True, wait_timeout=120)
            assert first.pid is not None
            standby = standby_pid(server, not_pid=first.pid, timeout=60)

            patch_marker(ajet_repo, "ajet/engine/runtime.py", "PATCHED-RUNTIME-RAN")
            synced = client.push_code(ajet_repo, force_restart=True)
            assert synced.restarted
            second = client.wait_for_state(EngineState.ROLLING, timeout=120)
            assert second.run_id != first.run_id and second.pid == standby
            assert second.ajet_file is not None and second.snapshot_path is not None
            snapshot_dir = (server.workdir / second.snapshot_path).resolve()
            assert Path(second.ajet_file).resolve().parent == snapshot_dir
            log = engine_log(server, second)
            assert WARM_LINE in log and "PATCHED-RUNTIME-RAN" in log
            assert client.stop_run().stopped
            assert not group_members(standby)
    finally:
        server.stop()
