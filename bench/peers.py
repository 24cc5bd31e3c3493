"""`python -m bench.peers` (`make bench-peers`): code change to new code running, vs Ray.

    python -m bench.peers [--reps 5] [--venv bench/.venv-ray] [--output PATH]

What a user waits for after editing one file of the 150-file, 1.5 MB tree, two ways:

- Ray: `ray job submit --working-dir TREE -- python -c "import torch, transformers, ajet"`
  against a local Ray head on loopback with token authentication (`RAY_AUTH_MODE=token`,
  `RAY_AUTH_TOKEN`), waiting for the job to finish, as `ray job submit` does by default.
  The job only imports the new code; it loads no model.
- Ours: `push_code(TREE, force_restart=True)` until the engine is
  ENGINE.ROLLING on the new snapshot (`bench.bench_restart.restart_once`), which does
  more: it also stops the old engine and loads the model.

The two alternate, one repetition each, after one untimed warm-up each (Ray's first job
also starts its runtime-env machinery). Target: ours at least 2 times faster.

Ray lives in its own virtual environment (`bench/.venv-ray`, ignored by git), created
on first use with `ray[default]`, torch at the project's pinned CPU build
(`constraints.txt`), transformers, and what `import ajet` needs (httpx, pydantic,
PyYAML, GitPython): Python dependencies are never synced, by either system. Everything
started here is stopped at the end (`ray stop --force`, the swarm server).
"""

from __future__ import annotations

import argparse
import logging
import os
import secrets
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from bench.bench_restart import restart_once, start_rolling
from bench.context import BenchContext
from bench.harness import PROJECT_ROOT, LocalServer, free_port
from bench.report import Row, render
from bench.tree import BenchTree, edit_one_file, restore_tree

__all__ = ["PeerUnavailable", "RayHead", "ensure_ray_venv", "main"]

log = logging.getLogger("bench.peers")

DEFAULT_VENV = PROJECT_ROOT / "bench" / ".venv-ray"
DEFAULT_OUTPUT = PROJECT_ROOT / "bench" / "results" / "peers.md"
RERUN = "make bench-peers"
TARGET_SPEEDUP = 2.0
_PACKAGES = ("ray[default]", "torch", "transformers", "httpx", "pydantic", "pyyaml",
             "gitpython")
_CHECK = "import ray, torch, transformers, httpx, pydantic, yaml, git; print(ray.__version__)"
_JOB = "import torch, transformers, ajet"


class PeerUnavailable(RuntimeError):
    """Ray cannot be installed or started here; the message says why and what to try."""


def _tail(path: Path, n: int = 30) -> str:
    try:
        lines = path.read_text("utf-8", errors="replace").splitlines()
    except OSError:
        return ""
    # pip repeats one warning per package for an index folder it cannot read; skip those
    return "\n".join([line for line in lines if "is ignored: it is neither" not in line][-n:])


def ensure_ray_venv(venv: Path) -> str:
    """Create `venv` with Ray, torch and transformers unless it works already; Ray's version."""
    python = venv / "bin" / "python"
    if python.exists():
        ok = subprocess.run([str(python), "-c", _CHECK], capture_output=True, text=True,
                            check=False)
        if ok.returncode == 0:
            return ok.stdout.strip()
    venv.parent.mkdir(parents=True, exist_ok=True)
    install_log = venv.parent / f"{venv.name}-install.log"
    log.warning("installing Ray, torch and transformers into %s (a few minutes; log: %s)",
                venv, install_log)
    with open(install_log, "w") as out:
        steps = [[sys.executable, "-m", "venv", str(venv)],
                 [str(python), "-m", "pip", "install", "--quiet", "-c",
                  str(PROJECT_ROOT / "constraints.txt"), *_PACKAGES]]
        for cmd in steps:
            if subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, check=False).returncode:
                raise PeerUnavailable(
                    f"cannot install Ray into {venv}: `{' '.join(cmd)}` failed:\n"
                    f"{_tail(install_log)}\nFix the cause (package index reachable? disk?) "
                    f"and rerun `{RERUN}`; delete {venv} to start over")
    ok = subprocess.run([str(python), "-c", _CHECK], capture_output=True, text=True,
                        check=False)
    if ok.returncode != 0:
        raise PeerUnavailable(f"Ray installed into {venv} but does not import:\n"
                              f"{ok.stderr[-2000:]}\nDelete {venv} and rerun `{RERUN}`")
    return ok.stdout.strip()


@dataclass
class RayHead:
    """A local Ray head on 127.0.0.1 with token auth, its job API at `address`."""

    venv: Path
    temp_dir: Path
    token: str
    address: str = ""

    @property
    def env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("RAY_", "AJET_SWARM_", "VIRTUAL_ENV", "PYTHONPATH"))}
        env.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=self.token,
                   RAY_USAGE_STATS_ENABLED="0", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
                   PATH=f"{self.venv / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}")
        return env

    def _ray(self, *args: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
        return subprocess.run([str(self.venv / "bin" / "ray"), *args], env=self.env,
                              capture_output=True, text=True, timeout=timeout, check=False,
                              cwd=self.temp_dir)

    def start(self) -> None:
        dashboard = free_port()
        started = self._ray(
            "start", "--head", "--node-ip-address=127.0.0.1", f"--port={free_port()}",
            "--include-dashboard=true", "--dashboard-host=127.0.0.1",
            f"--dashboard-port={dashboard}", f"--ray-client-server-port={free_port()}",
            f"--temp-dir={self.temp_dir}", "--num-cpus=2", "--disable-usage-stats",
            timeout=300)
        if started.returncode != 0:
            raise PeerUnavailable(
                "`ray start --head` on 127.0.0.1 failed:\n"
                f"{(started.stdout + started.stderr)[-3000:]}\nsee {self.temp_dir}/session_latest/logs")
        self.address = f"http://127.0.0.1:{dashboard}"
        deadline = time.monotonic() + 120
        while True:  # the job API answers a little after `ray start` returns
            probe = self._ray("job", "list", f"--address={self.address}", timeout=120)
            if probe.returncode == 0:
                break
            if time.monotonic() > deadline:
                raise PeerUnavailable(f"Ray's job API at {self.address} did not answer:\n"
                                      f"{(probe.stdout + probe.stderr)[-2000:]}")
            time.sleep(1)
        # the comparison is with an authenticated cluster: a call without the token must fail
        env = {k: v for k, v in self.env.items() if k != "RAY_AUTH_TOKEN"}
        anonymous = subprocess.run([str(self.venv / "bin" / "ray"), "job", "list",
                                    f"--address={self.address}"], env=env, capture_output=True,
                                   text=True, timeout=120, check=False, cwd=self.temp_dir)
        if anonymous.returncode == 0:
            raise PeerUnavailable(f"Ray at {self.address} answered without the token: this "
                                  "Ray version ignores RAY_AUTH_MODE=token")

    def submit(self, working_dir: Path) -> float:
        """Seconds for `ray job submit --working-dir ... -- python -c ...`, until it ends."""
        t0 = time.perf_counter()
        done = self._ray("job", "submit", f"--address={self.address}",
                         f"--working-dir={working_dir}", "--", "python", "-c", _JOB)
        elapsed = time.perf_counter() - t0
        if done.returncode != 0 or "succeeded" not in done.stdout:
            raise RuntimeError(f"the Ray job failed:\n{(done.stdout + done.stderr)[-3000:]}")
        return elapsed

    def stop(self) -> None:
        stopped = self._ray("stop", "--force", timeout=120)
        if stopped.returncode != 0:
            log.error("`ray stop --force` failed: %s", (stopped.stdout + stopped.stderr)[-1000:])


@contextmanager
def ray_head(venv: Path) -> Iterator[RayHead]:
    # short path: Ray puts Unix sockets under its temp dir (AF_UNIX paths ~100 bytes)
    temp_dir = Path(tempfile.mkdtemp(prefix="ajr-"))
    head = RayHead(venv=venv, temp_dir=temp_dir, token=secrets.token_hex(32))
    try:
        head.start()
        yield head
    finally:
        head.stop()
        shutil.rmtree(temp_dir, ignore_errors=True)


def measure(ctx: BenchContext, venv: Path) -> list[Row]:
    tree: BenchTree = ctx.tree
    restore_tree(tree)
    ray_s: list[float] = []
    ours_s: list[float] = []
    with LocalServer(ctx.path("peers")) as server, server.client() as client, \
            ray_head(venv) as head:
        status = start_rolling(client, tree)
        head.submit(tree.root)  # warm-up: Ray's first job starts its runtime-env agent
        for i in range(ctx.reps):
            edit_one_file(tree, f"ray {i}")
            ray_s.append(head.submit(tree.root))
            done = restart_once(client, tree, f"ours {i}", previous=status)
            status = done.status
            ours_s.append(done.total_s)
            log.warning("repetition %d: ray job submit %.2f s, sync + restart %.2f s",
                        i + 1, ray_s[-1], ours_s[-1])
    restore_tree(tree)
    ray_median, ours_median = statistics.median(ray_s), statistics.median(ours_s)
    speedup = ray_median / ours_median
    return [
        Row("ray job submit --working-dir TREE -- python -c 'import torch, transformers, "
            "ajet'", ray_median, "s", rerun=RERUN, repetitions=ctx.reps,
            note="one-file edit, token auth, waits for the job to end"),
        Row("push_code(force_restart=True) until ROLLING on the new snapshot",
            ours_median, "s", "ray job submit", ray_median,
            target=f"<= {1 / TARGET_SPEEDUP:.2f}x Ray ({TARGET_SPEEDUP:g}x faster)",
            met=speedup >= TARGET_SPEEDUP, rerun=RERUN, repetitions=ctx.reps,
            note=f"{speedup:.2f}x faster; also stops the engine and loads the model"),
    ]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.peers",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--reps", type=int, default=5, help="repetitions behind each median")
    p.add_argument("--venv", type=Path, default=DEFAULT_VENV,
                   help=f"Ray's virtual environment (default {DEFAULT_VENV})")
    p.add_argument("--output", type=Path, default=DEFAULT_OUTPUT, help="write the table here")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        version = ensure_ray_venv(args.venv)
        with BenchContext(reps=args.reps) as ctx:
            rows = measure(ctx, args.venv)
    except PeerUnavailable as exc:
        sys.stderr.write(f"bench-peers: Ray is not available here: {exc}\n")
        return 2
    header = (f"# Code change to new code running: AgentJet Swarm vs Ray {version}\n\n"
              f"{time.strftime('%Y-%m-%d %H:%M')} on {os.cpu_count()} CPUs; medians over "
              f"{args.reps} alternating repetitions; ratio = median / reference.")
    text = render(rows, header=header)
    sys.stdout.write("\n" + text)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(text)
    sys.stderr.write(f"written to {args.output}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
