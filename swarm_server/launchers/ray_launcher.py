"""`RaySpawner`: the engine controller's `Spawner` for a Ray cluster (`--launcher ray`).

The server stays the one control plane; each run becomes one Ray job (Ray's Jobs API):

- `start` submits the job: the active snapshot's folder is the job's `working_dir` (Ray
  packages it, content-addressed, and unpacks it once per node; under
  `--ray-shared-workdir` the nodes import it from the server's path instead; with no
  snapshot the server's own `ajet/` goes as a py_module), the driver package
  `ajet_ray_job` goes as a py_module, and the run's spec (job shape, engine arguments,
  the engine's environment as the local launcher builds it, a fresh bearer token for
  rank 0's channel) in the job's environment. The entrypoint is the engine's interpreter by its absolute path. `start`
  returns once the driver placed the run (every node's torchrun started), and raises
  `RayPlacementRefused` (409, with what Ray reports free) when the cluster cannot hold
  it; the controller records that run as failed and answers the 409.
- A thread per run follows the job's log (`tail_job_logs`): node lines go to the run's
  `engine.log` as they are (the driver prefixed each with its node and rank); marker
  lines (`ajet_ray_job.wire`) say where rank 0's channel listens and how the job ended.
- The probe and the episode gateway reach rank 0 over that TCP endpoint with the token
  (`TcpEndpoint`); `signal_group` is Ray's `stop_job` (SIGTERM to the driver, which
  ends every node within the run's grace and removes the placement group); `wait` and
  `group_alive` follow the job's status.

A run cannot be adopted by a later server (`adopt` returns None): at start,
`stop_strays` stops the jobs an earlier server of the same workdir left running.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import shlex
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from ajet.protocol import EngineReport
from swarm_server.devices import planner_memory_env
from swarm_server.engine_channel import ChannelTarget, TcpEndpoint
from swarm_server.launchers.ajet_ray_job.wire import MARK, SPEC_ENV, parse_marker
from swarm_server.settings import Settings
from swarm_server.supervisor import (
    EngineProbe,
    PlacementRefused,
    ProcessHandle,
    SpawnSpec,
    TcpProbe,
)

__all__ = ["RayPlacementRefused", "RaySpawner", "job_shape", "node_memory_env"]

log = logging.getLogger(__name__)

#: The driver package, shipped to the cluster as a py_module.
DRIVER_DIR = Path(__file__).resolve().with_name("ajet_ray_job")
#: Ray job states after which nothing of the job runs.
_TERMINAL = frozenset({"SUCCEEDED", "FAILED", "STOPPED"})
#: The driver's exit code when it could not place the run.
_REFUSED_CODE = 3
#: Lines of the job's log kept for an error message.
_TAIL_LINES = 20
#: A Jobs API silent this long means the cluster's head is gone, and the run with it.
UNREACHABLE_AFTER_S = 60.0
#: How long a submission waits for the head's job agent (a cluster that just started).
AGENT_WAIT_S = 60.0
#: Ray's answer while the head has no job agent to take a submission.
_NO_AGENT = "No available agent to submit job"


class RayPlacementRefused(PlacementRefused):
    """409: the Ray cluster cannot hold the run now (`never`: nor with every node idle);
    the detail says what is free."""

    def __init__(self, detail: str, *, never: bool = False) -> None:
        super().__init__(detail, "free resources on the Ray cluster (stop another run), "
                         "add nodes, or ask for fewer nodes (nnodes) or GPUs per node (n_gpu)",
                         never=never)


@dataclass(frozen=True)
class JobShape:
    nnodes: int
    n_gpu: int
    nproc_per_node: int


def job_shape(job: dict[str, object]) -> JobShape:
    def number(key: str, default: int) -> int:
        value = job.get(key)
        return value if isinstance(value, int) and not isinstance(value, bool) else default

    n_gpu = number("n_gpu", 0)
    return JobShape(nnodes=number("nnodes", 1), n_gpu=n_gpu,
                    nproc_per_node=n_gpu if n_gpu > 0 else number("n_proc", 1))


def node_memory_env(nodes: list[dict[str, Any]]) -> dict[str, str]:
    """`AJET_ENGINE_HOST_MEMORY_GB` and `AJET_ENGINE_GPU_MEMORY_GB` from the dashboard's
    node summary: the smallest alive node's host memory (its `mem` total, bytes) and the
    smallest GPU's (`memory_total`, MiB). A run may land on any node, so the smallest."""
    hosts: list[float] = []
    gpus: list[float] = []
    for node in nodes:
        state = (node.get("raylet") or {}).get("state")
        if state not in (None, "ALIVE"):
            continue
        mem = node.get("mem")
        if isinstance(mem, list) and mem and isinstance(mem[0], (int, float)) and mem[0] > 0:
            hosts.append(float(mem[0]))
        for gpu in node.get("gpus") or []:
            total = gpu.get("memory_total", gpu.get("memoryTotal")) if isinstance(gpu, dict) \
                else None
            if isinstance(total, (int, float)) and total > 0:
                gpus.append(float(total))
    return planner_memory_env(host_bytes=hosts, gpu_mib=gpus)


@dataclass
class _RayRun:
    """One run's Ray job, as the server follows it."""

    job_id: str
    socket_path: str
    log_path: Path
    token: str = field(repr=False)
    endpoint: TcpEndpoint | None = None
    nodes: list[dict[str, Any]] = field(default_factory=list)
    refused: str | None = None
    never: bool = False  # refused, and no idle cluster of these nodes would hold it
    verdict: dict[str, Any] | None = None
    returncode: int | None = None
    status: str | None = None
    tail: list[str] = field(default_factory=list)
    placed: threading.Event = field(default_factory=threading.Event)  # placed, refused or ended
    ended: threading.Event = field(default_factory=threading.Event)


class RaySpawner:
    """`Spawner` + probe factory + channel targets for runs placed on a Ray cluster."""

    def __init__(self, settings: Settings, client: Any | None = None, *,
                 unreachable_after_s: float = UNREACHABLE_AFTER_S) -> None:
        self.settings = settings
        self._client = client
        self.unreachable_after_s = unreachable_after_s
        self._lock = threading.Lock()
        self._runs: dict[str, _RayRun] = {}  # by the run's socket path (its key in the engine)

    @classmethod
    def connect(cls, settings: Settings) -> RaySpawner:
        """A spawner with a client of the cluster's Jobs API (OSError if unreachable)."""
        try:
            from ray.job_submission import JobSubmissionClient
        except ImportError as exc:
            raise OSError("--launcher ray needs Ray: pip install 'agentjet-swarm[ray]'") from exc
        try:
            client = JobSubmissionClient(settings.ray_address)
        except Exception as exc:  # noqa: BLE001 - Ray raises ConnectionError, RuntimeError, ...
            raise OSError(f"cannot reach the Ray cluster's Jobs API at {settings.ray_address}: "
                          f"{exc}; start Ray (`ray start --head`) or pass --ray-address") from exc
        return cls(settings, client)

    # ------------------------------------------------------------------ Spawner

    def start(self, spec: SpawnSpec) -> ProcessHandle:
        job = yaml.safe_load((spec.cwd / "job.yaml").read_text(encoding="utf-8")) or {}
        run_id = spec.argv[spec.argv.index("--run-id") + 1]
        socket_path = spec.argv[spec.argv.index("--socket") + 1]
        module_at = spec.argv.index(self.settings.engine_module) if \
            self.settings.engine_module in spec.argv else len(spec.argv)
        shape = job_shape(job)
        token = secrets.token_urlsafe(32)
        from swarm_server.engine import run_limits

        grace_s = run_limits(self.settings, job)[1]
        base = spec.env.get("ISOLATED_AGENTJET_BASE_DIR")
        run_spec = {
            "run_id": run_id, "run_dir": str(spec.cwd), "job_yaml": yaml.safe_dump(job),
            "nnodes": shape.nnodes, "n_gpu": shape.n_gpu,
            "nproc_per_node": shape.nproc_per_node,
            "bundle_cpus": (shape.nproc_per_node if shape.n_gpu == 0
                            else self.settings.ray_cpus_per_gpu * shape.n_gpu),
            "engine_python": self.settings.engine_python,
            "engine_module": self.settings.engine_module,
            "engine_args": spec.argv[module_at + 1:],
            # the local launcher's allow-listed environment, less what names this machine's
            # paths (the node's own PATH and HOME serve its interpreter)
            "env": {k: v for k, v in spec.env.items()
                    if k not in ("PATH", "HOME", "USER", "LOGNAME", "SHELL", "TMPDIR",
                                 "VIRTUAL_ENV")},
            "token": token, "grace_s": grace_s,
            "placement_timeout_s": self.settings.ray_placement_timeout_s,
            # a shared work directory: every node imports the snapshot from the server's
            # path (None: from the job's working_dir package, wherever Ray unpacked it)
            "code_base": base if base is not None and self.settings.ray_shared_workdir
            else None,
        }
        py_modules = [str(DRIVER_DIR)]
        runtime_env: dict[str, Any] = {
            "env_vars": {SPEC_ENV: json.dumps(run_spec),
                         # Ray's SIGKILL only after the run's own grace (its stop)
                         "RAY_JOB_STOP_WAIT_TIME_S": str(int(grace_s) + 15)},
            "py_modules": py_modules,
        }
        if base is not None:
            if not self.settings.ray_shared_workdir:
                runtime_env["working_dir"] = base
        else:  # the server's own code: its ajet/ folder, packaged the same way
            import ajet

            py_modules.append(str(Path(ajet.__file__).resolve().parent))
        job_id = f"ajet-{run_id}"
        run = _RayRun(job_id=job_id, socket_path=socket_path, log_path=spec.log_path,
                      token=token)
        spec.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._submit(run_id, entrypoint=f"{shlex.quote(self.settings.engine_python)} -m "
                     "ajet_ray_job", submission_id=job_id, runtime_env=runtime_env,
                     metadata={"ajet_run_id": run_id,
                               "ajet_workdir": str(self.settings.workdir.resolve())})
        with self._lock:
            self._runs[socket_path] = run
        threading.Thread(target=self._follow, args=(run,), daemon=True,
                         name=f"ray-log-{run_id}").start()
        log.info("run %s submitted as Ray job %s (%d node(s) x %d process(es))", run_id,
                 job_id, shape.nnodes, shape.nproc_per_node)
        if not run.placed.wait(self.settings.ray_submit_timeout_s
                               + self.settings.ray_placement_timeout_s):
            self._stop_job(run)
            raise OSError(f"the Ray job {job_id} did not place run {run_id} within "
                          f"{self.settings.ray_submit_timeout_s:g} s of its submission; "
                          f"its log: {' | '.join(run.tail[-5:]) or '(empty)'}")
        if run.refused is not None:
            raise RayPlacementRefused(f"run {run_id}: {run.refused}", never=run.never)
        if not run.nodes:
            raise OSError(f"the Ray job {job_id} ended ({run.status}) before it placed run "
                          f"{run_id}: {(run.verdict or {}).get('detail') or ''} "
                          f"{' | '.join(run.tail[-8:])}".strip())
        first = run.nodes[0]
        # the pid of node 0's torchrun, on node 0's machine: what the status shows
        return ProcessHandle(pid=int(first.get("pid") or 0), start_time=first.get("start_time"),
                             native=run)

    def signal_group(self, handle: ProcessHandle, sig: int) -> bool:
        run: _RayRun = handle.native
        if run.ended.is_set():
            return False
        self._stop_job(run)  # TERM or KILL alike: the driver ends every node, Ray kills it
        return True          # after the run's grace (RAY_JOB_STOP_WAIT_TIME_S)

    def wait(self, handle: ProcessHandle, timeout: float | None) -> bool:
        run: _RayRun = handle.native
        if not run.ended.wait(timeout):
            return False
        handle.returncode = run.returncode
        handle.exited = True
        if run.verdict and not run.verdict.get("stopped") and run.verdict.get("detail"):
            handle.detail = str(run.verdict["detail"])
        return True

    def group_alive(self, handle: ProcessHandle) -> bool:
        run: _RayRun = handle.native
        return not run.ended.is_set()

    def adopt(self, pid: int, start_time: float) -> ProcessHandle | None:
        return None  # a Ray job is found by its id, not a pid: see stop_strays

    # ------------------------------------------------------------------ channel

    def endpoint(self, socket_path: Path) -> TcpEndpoint | None:
        with self._lock:
            run = self._runs.get(str(socket_path))
        return run.endpoint if run is not None else None

    def channel_target(self, socket_path: Path) -> ChannelTarget:
        """For the episode gateway: the run's TCP endpoint (its socket path means nothing
        here: rank 0 may be on another machine)."""
        return self.endpoint(socket_path) or socket_path

    def probe(self, socket_path: Path) -> EngineProbe:
        """`ProbeFactory`: `GET /status` over the run's TCP endpoint, once it is known."""
        return _RayProbe(self, socket_path)

    def planner_env(self) -> dict[str, str]:
        """For the config's memory planner: the smallest host memory and the smallest GPU
        among the cluster's alive nodes, as Ray's dashboard reports them (GiB)."""
        import httpx

        try:
            # Ray's own client headers: they carry its token where the cluster uses one
            headers = dict(getattr(self._client, "_headers", None) or {})
            reply = httpx.get(f"{self.settings.ray_address.rstrip('/')}/nodes",
                              params={"view": "summary"}, headers=headers, timeout=10)
            reply.raise_for_status()
            nodes = reply.json()["data"]["summary"]
        except Exception as exc:  # noqa: BLE001 - the planner then measures this machine
            log.warning("cannot read the Ray nodes' memory (%s); the memory planner uses "
                        "this machine's", exc)
            return {}
        return node_memory_env(nodes)

    def stop_strays(self) -> list[str]:
        """Stop the Ray jobs of this workdir an earlier server left running; their ids."""
        mine = str(self.settings.workdir.resolve())
        stopped = []
        try:
            jobs = self._client.list_jobs()
        except Exception as exc:  # noqa: BLE001
            log.warning("cannot list the Ray cluster's jobs: %s", exc)
            return stopped
        for info in jobs:
            meta = info.metadata or {}
            if meta.get("ajet_workdir") == mine and str(info.status) not in _TERMINAL \
                    and info.submission_id:
                log.warning("stopping Ray job %s (run %s) left by a previous server",
                            info.submission_id, meta.get("ajet_run_id"))
                try:
                    self._client.stop_job(info.submission_id)
                    stopped.append(info.submission_id)
                except Exception as exc:  # noqa: BLE001
                    log.warning("could not stop Ray job %s: %s", info.submission_id, exc)
        return stopped

    # ------------------------------------------------------------------ internals

    def _submit(self, run_id: str, **job: Any) -> None:
        """`submit_job`, again while the head has no job agent yet (a cluster just started:
        Ray answers 500 "No available agent ... try again later"), up to
        `AGENT_WAIT_S`; OSError naming the cluster otherwise."""
        deadline = time.monotonic() + min(AGENT_WAIT_S, self.settings.ray_submit_timeout_s)
        delay = 0.5
        while True:
            try:
                self._client.submit_job(**job)
                return
            except Exception as exc:  # noqa: BLE001 - whatever Ray's client raises
                if _NO_AGENT in str(exc) and time.monotonic() + delay < deadline:
                    log.info("run %s: the Ray head has no job agent yet; submitting again "
                             "in %.1f s", run_id, delay)
                    time.sleep(delay)
                    delay = min(delay * 2, 5.0)
                    continue
                raise OSError(f"cannot submit run {run_id} to the Ray cluster at "
                              f"{self.settings.ray_address}: {exc}") from exc

    def _stop_job(self, run: _RayRun) -> None:
        try:
            self._client.stop_job(run.job_id)
        except Exception as exc:  # noqa: BLE001 - gone already, or Ray unreachable
            log.warning("Ray stop_job(%s): %s", run.job_id, exc)

    def _follow(self, run: _RayRun) -> None:
        """Thread: the job's log into engine.log until the job ends; then its outcome."""
        try:
            asyncio.run(self._tail(run))
        except Exception as exc:  # noqa: BLE001 - a broken stream: the status still ends it
            log.warning("Ray job %s: its log stream broke (%s); following its status",
                        run.job_id, exc)
        self._await_end(run)

    async def _tail(self, run: _RayRun) -> None:
        pending = ""
        with open(run.log_path, "a", encoding="utf-8") as out:
            async for chunk in self._client.tail_job_logs(run.job_id):
                pending += chunk
                *lines, pending = pending.split("\n")
                for line in lines:
                    self._line(run, line, out)
                out.flush()
            if pending:
                self._line(run, pending, out)

    def _line(self, run: _RayRun, line: str, out: Any) -> None:
        event = parse_marker(line)
        if event is None:
            if line.startswith(MARK):
                return
            text = line if line.startswith("[node ") else f"[ray job] {line}"
            out.write(text + "\n")
            run.tail = (run.tail + [text])[-_TAIL_LINES:]
            return
        kind = event["event"]
        if kind == "placed":
            run.nodes = list(event.get("nodes") or [])
            where = ", ".join(f"node {n.get('index')}: {n.get('ip')} (Ray node "
                              f"{str(n.get('node_id'))[:8]}, torchrun pid {n.get('pid')})"
                              for n in run.nodes)
            out.write(f"[ray job] placed on {len(run.nodes)} node(s): {where}\n")
            run.placed.set()
        elif kind == "refused":
            run.refused = str(event.get("reason") or "the cluster cannot hold the run")
            run.never = bool(event.get("never"))
            out.write(f"[ray job] refused: {run.refused}\n")
            run.placed.set()
        elif kind == "channel":
            run.endpoint = TcpEndpoint(str(event["host"]), int(event["port"]), run.token)
            out.write(f"[ray job] rank 0's channel: {run.endpoint} (TCP, bearer token)\n")
        elif kind == "exit":
            run.verdict = event
            out.write(f"[ray job] ended: {event.get('detail')}\n")

    def _await_end(self, run: _RayRun) -> None:
        info = None
        delay = 0.2
        silent_since: float | None = None
        while True:
            try:
                info = self._client.get_job_info(run.job_id)
                silent_since = None
                if str(info.status) in _TERMINAL:
                    break
            except Exception as exc:  # noqa: BLE001 - the dashboard restarting: retry
                log.debug("Ray get_job_info(%s): %s", run.job_id, exc)
                now = time.monotonic()
                silent_since = silent_since if silent_since is not None else now
                if now - silent_since > self.unreachable_after_s:
                    # the head is gone: its driver with it, and each node's agent (and so
                    # its torchrun) once its raylet gives up on the head
                    info = None
                    detail = (f"the Ray cluster at {self.settings.ray_address} stopped "
                              f"answering for {self.unreachable_after_s:g} s (its head node "
                              f"lost?): {type(exc).__name__}: {str(exc)[:200]}")
                    if run.verdict is None:
                        run.verdict = {"event": "exit", "code": 1, "detail": detail,
                                       "stopped": False}
                    break
            time.sleep(delay)
            delay = min(delay * 2, 2.0)
        run.status = str(info.status) if info is not None else "UNREACHABLE"
        if run.verdict is not None and isinstance(run.verdict.get("code"), int):
            run.returncode = int(run.verdict["code"])
        elif info is not None and info.driver_exit_code is not None:
            run.returncode = int(info.driver_exit_code)
        else:  # killed before its verdict (Ray's SIGKILL after a stop, a lost head)
            run.returncode = -15 if run.status == "STOPPED" else 1
        if info is None:
            with open(run.log_path, "a", encoding="utf-8") as out:
                out.write(f"[ray job] {run.job_id}: {(run.verdict or {}).get('detail')}\n")
        elif run.verdict is None and run.status != "STOPPED":
            with open(run.log_path, "a", encoding="utf-8") as out:
                out.write(f"[ray job] {run.job_id} {run.status}: {info.message or ''}\n")
        run.placed.set()
        run.ended.set()
        with self._lock:
            self._runs.pop(run.socket_path, None)


class _RayProbe:
    def __init__(self, spawner: RaySpawner, socket_path: Path) -> None:
        self._spawner = spawner
        self._socket_path = socket_path
        self._probe: TcpProbe | None = None

    def get_report(self) -> EngineReport | None:
        if self._probe is None:
            endpoint = self._spawner.endpoint(self._socket_path)
            if endpoint is None:
                return None  # rank 0 has not opened its channel yet: still booting
            self._probe = TcpProbe(endpoint)
        return self._probe.get_report()

    def close(self) -> None:
        if self._probe is not None:
            self._probe.close()

