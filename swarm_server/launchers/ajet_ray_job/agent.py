"""`NodeAgent`: the Ray actor that runs one node's share of an engine run.

One agent per bundle of the run's placement group (so one per node, `STRICT_SPREAD`).
It starts torchrun for its node (`--nnodes`, `--node_rank`, rendezvous on node 0's
address), in its own session, with the environment the swarm server chose (its allow-list)
re-pointed at this node's copy of the code; it keeps the output, each line prefixed with
the node and rank; it notes which of its ranks ended first; and on `terminate` it ends
torchrun's group and every rank (ranks run in sessions of their own), TERM then KILL.

If the agent's process dies (its node lost, the driver gone), torchrun gets SIGKILL
(`PR_SET_PDEATHSIG`, set in the thread that starts it and lives as long as its output),
and each rank exits when its torchrun is gone (the engine's orphan watchdog).
"""

from __future__ import annotations

import collections
import ctypes
import importlib.util
import json
import logging
import os
import re
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

__all__ = ["NodeAgent"]

#: Lines kept between two drains; older ones are dropped (and counted) past this.
MAX_BUFFERED_LINES = 20_000
#: Longest line forwarded (characters); the rest is cut.
MAX_LINE_CHARS = 8_000
#: torchrun's `--tee` prefix of a worker's line: its global rank, or (torch 2.13) its
#: role and local rank
_RANK_PREFIX = re.compile(r"^\[(?:rank(\d+)|default(\d+))\]:")
_PR_SET_PDEATHSIG = 1
#: Variables the engine takes from this node's environment, not from the server's.
_NODE_OWN = ("PATH", "HOME", "USER", "LOGNAME", "SHELL", "TMPDIR", "VIRTUAL_ENV")


def _die_with_parent_thread() -> None:
    """In the child before exec: SIGKILL when the thread that forked it ends."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except OSError:  # not glibc Linux: the engine's own orphan watchdog still applies
        pass


def _code_base(shared: str | None = None) -> str:
    """The folder this node's copy of `ajet` sits in (the job's working_dir or py_module),
    found without importing it; `shared`: the snapshot's folder on a work directory every
    node mounts, which must then be there."""
    if shared is not None:
        if not (Path(shared) / "ajet" / "__init__.py").is_file():
            raise RuntimeError(f"the snapshot {shared} is not on this node "
                               f"({socket.gethostname()}): the server's work directory is not "
                               "shared with it; mount it at the same path, or start the "
                               "server without --ray-shared-workdir")
        return shared
    found = importlib.util.find_spec("ajet")
    if found is None or found.origin is None:
        raise RuntimeError("ajet is not importable on this node: the Ray job's runtime_env "
                           "did not deliver it")
    return str(Path(found.origin).resolve().parent.parent)


class NodeAgent:
    """One node's share of a run; its methods are called by the job's driver."""

    def __init__(self, index: int, spec: dict[str, Any]) -> None:
        self.index = index
        self.spec = spec
        self._lock = threading.Lock()
        self._lines: collections.deque[str] = collections.deque()
        self._dropped = 0
        self._proc: subprocess.Popen[bytes] | None = None
        self._exit_code: int | None = None
        self._first_end: dict[str, Any] | None = None
        self._ranks: dict[int, int] = {}  # pid -> global rank
        self._terminating = False
        self._started = threading.Event()
        self._output_done = threading.Event()
        self._address_file: Path | None = None

    # ------------------------------------------------------------------ placement

    def describe(self) -> dict[str, Any]:
        import ray

        return {"index": self.index, "node_id": ray.get_runtime_context().get_node_id(),
                "ip": ray.util.get_node_ip_address(), "host": socket.gethostname(),
                "gpus": [str(g) for g in ray.get_gpu_ids()]}

    def free_port(self) -> int:
        """A free TCP port on this node for torchrun's rendezvous (node 0 only)."""
        import ray

        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind((ray.util.get_node_ip_address(), 0))
            return int(sock.getsockname()[1])

    # ------------------------------------------------------------------ the node's torchrun

    def start(self, master_addr: str, master_port: int) -> dict[str, Any]:
        """Start this node's torchrun (or the lone engine process); its pid and start time."""
        import ray

        spec = self.spec
        ip = ray.util.get_node_ip_address()
        argv, env = self._command(master_addr, master_port, ip)
        run_dir = Path(spec["run_dir"])
        run_dir.mkdir(parents=True, exist_ok=True)
        job_file = run_dir / "job.yaml"
        if not job_file.exists():  # a node that does not share the server's workdir
            job_file.write_text(spec["job_yaml"], encoding="utf-8")
        failure: list[BaseException] = []

        def run() -> None:  # lives as long as torchrun's output: PDEATHSIG's parent thread
            try:
                self._proc = subprocess.Popen(
                    argv, cwd=str(run_dir), env=env, stdin=subprocess.DEVNULL,
                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True,
                    close_fds=True, preexec_fn=_die_with_parent_thread)
            except OSError as exc:
                failure.append(exc)
                self._started.set()
                return
            self._started.set()
            threading.Thread(target=self._wait_exit, daemon=True).start()
            threading.Thread(target=self._watch_ranks, daemon=True).start()
            self._read_output()

        threading.Thread(target=run, daemon=True, name="ajet-torchrun").start()
        self._started.wait(60)
        if failure or self._proc is None:
            raise RuntimeError(f"could not start the engine on node {self.index}: "
                               f"{failure[0] if failure else 'no process'}")
        try:
            import psutil

            start_time = psutil.Process(self._proc.pid).create_time()
        except Exception:  # noqa: BLE001 - gone already: the drain reports its exit
            start_time = None
        return {"pid": self._proc.pid, "start_time": start_time}

    def _command(self, master_addr: str, master_port: int, ip: str
                 ) -> tuple[list[str], dict[str, str]]:
        spec = self.spec
        base = _code_base(spec.get("code_base"))
        env = dict(spec["env"])
        for name in _NODE_OWN:  # this node's own, not the server machine's
            if name in os.environ:
                env[name] = os.environ[name]
        server_base = env.pop("ISOLATED_AGENTJET_BASE_DIR", None)
        rest = [p for p in env.get("PYTHONPATH", "").split(os.pathsep)
                if p and p != server_base]
        env["ISOLATED_AGENTJET_BASE_DIR"] = base  # the engine imports ajet from here first
        env["PYTHONPATH"] = os.pathsep.join([base, *rest])
        if spec["n_gpu"] > 0:  # the GPUs Ray gave this bundle, not the server's
            env["CUDA_VISIBLE_DEVICES"] = os.environ.get("CUDA_VISIBLE_DEVICES", "")
        args = list(spec["engine_args"])
        if "--socket" in args:  # the server's Unix socket means nothing on this node
            at = args.index("--socket")
            del args[at:at + 2]
        if self.index == 0:
            self._address_file = Path(spec["run_dir"]) / f"channel-{spec['run_id']}.json"
            self._address_file.unlink(missing_ok=True)
            args += ["--channel-host", ip, "--channel-address-file", str(self._address_file)]
            env["AJET_ENGINE_CHANNEL_TOKEN"] = spec["token"]
        python, module = spec["engine_python"], spec["engine_module"]
        per_node, nnodes = spec["nproc_per_node"], spec["nnodes"]
        if per_node * nnodes <= 1:
            return [python, "-m", module, *args], env
        launcher = [python, "-m", "torch.distributed.run", f"--nproc_per_node={per_node}",
                    "--max_restarts=0", f"--nnodes={nnodes}", f"--node_rank={self.index}",
                    f"--master_addr={master_addr}", f"--master_port={master_port}",
                    "--tee=3"]  # each worker line gets "[rank<global rank>]:"
        return [*launcher, "-m", module, *args], env

    def _read_output(self) -> None:
        proc = self._proc
        assert proc is not None and proc.stdout is not None
        node = f"[node {self.index}]"
        lone = self.spec["nproc_per_node"] * self.spec["nnodes"] <= 1
        for raw in proc.stdout:
            text = raw.decode("utf-8", errors="replace").rstrip("\n")[:MAX_LINE_CHARS]
            found = _RANK_PREFIX.match(text)
            if found:
                rank = int(found[1]) if found[1] is not None else \
                    self.index * self.spec["nproc_per_node"] + int(found[2])
                line = f"{node} [rank {rank}] {text[found.end():]}"
            elif lone:
                line = f"{node} [rank 0] {text}"
            else:
                line = f"{node} [torchrun] {text}"
            with self._lock:
                self._lines.append(line)
                if len(self._lines) > MAX_BUFFERED_LINES:
                    self._lines.popleft()
                    self._dropped += 1
        self._output_done.set()

    def _wait_exit(self) -> None:
        proc = self._proc
        assert proc is not None
        code = proc.wait()
        with self._lock:
            self._exit_code = code
            if self._first_end is None and not self._terminating and code != 0:
                self._first_end = {"rank": None, "pid": proc.pid, "at": time.time(),
                                   "what": "torchrun"}

    def _watch_ranks(self) -> None:
        """Note each rank's pid, and the first that ends while the node was not stopped."""
        import psutil

        proc = self._proc
        assert proc is not None
        lone = self.spec["nproc_per_node"] * self.spec["nnodes"] <= 1
        if lone:
            self._ranks[proc.pid] = 0
        while self._exit_code is None:
            try:
                children = [] if lone else psutil.Process(proc.pid).children()
            except psutil.Error:
                children = []
            for child in children:
                if child.pid in self._ranks:
                    continue
                try:
                    rank = int(child.environ().get("RANK", "-1"))
                except (psutil.Error, ValueError):
                    continue
                if rank >= 0:
                    self._ranks[child.pid] = rank
            for pid, rank in list(self._ranks.items()):
                if pid == proc.pid:
                    continue
                if not psutil.pid_exists(pid) or _is_zombie(pid):
                    with self._lock:
                        if self._first_end is None and not self._terminating:
                            self._first_end = {"rank": rank, "pid": pid, "at": time.time(),
                                               "what": "rank"}
            time.sleep(0.2)

    def drain(self) -> dict[str, Any]:
        """The lines since the last drain, the exit code once torchrun ended, the channel's
        address once rank 0 serves it, and the first rank that ended."""
        channel = None
        if self._address_file is not None and self._address_file.exists():
            try:
                channel = json.loads(self._address_file.read_text(encoding="utf-8"))
            except (OSError, ValueError):
                channel = None  # being replaced: the next drain reads it
        with self._lock:
            lines, self._lines = list(self._lines), collections.deque()
            dropped, self._dropped = self._dropped, 0
            return {"lines": lines, "dropped": dropped, "channel": channel,
                    "exit_code": self._exit_code if self._output_done.is_set()
                    or self._exit_code is not None else None,
                    "first_end": self._first_end, "ranks": sorted(self._ranks.values())}

    def terminate(self, grace_s: float) -> int | None:
        """End torchrun and every rank of this node: TERM, up to `grace_s`, then KILL."""
        with self._lock:
            self._terminating = True
        proc = self._proc
        if proc is None:
            return None
        if proc.poll() is None:
            _signal_group(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                _signal_group(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)
        for pid in list(self._ranks):  # ranks lead sessions of their own under torchrun
            _signal_group(pid, signal.SIGKILL)
        self._output_done.wait(10)
        if self._address_file is not None:
            self._address_file.unlink(missing_ok=True)
        return proc.returncode


def _signal_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def _is_zombie(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.Error:
        return True
