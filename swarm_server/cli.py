"""`ajet-swarm`: start, inspect and stop a swarm server.

    ajet-swarm start --swarm-port=10086 [--host 127.0.0.1] [--workdir .]
                     [--engine-env NAME,...] [--engine-user NAME] [--new-ledger]
    ajet-swarm status [--swarm-url URL]
    ajet-swarm stop   [--swarm-url URL]      # stops the engine, then the server
    ajet-swarm approvals list | show REF | approve ID | deny ID | revoke ID
    ajet-swarm runs checkpoints RUN              # a run's checkpoints
    ajet-swarm runs download RUN [--checkpoint NAME] DIR   # resumable, verified

`start` writes `<workdir>/swarm_server.pid` (the pid and the process's start time) so that
`stop` can find the process, and `stop` signals it only when that pid is still this
server (same start time, a `swarm_server` command line), never a process that reused it.
`approvals` is for headless approvers: it reads one approver token from
`AJET_SWARM_APPROVER_TOKEN` (the server's own list is `AJET_SWARM_APPROVER_TOKENS`) and
prints the review the server computed from its own files, every control character
escaped. `show` takes a prefix and prints the full id; a decision takes only the full id,
and asks to type its first characters, or takes `--yes`.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import time
from pathlib import Path

__all__ = ["main"]

log = logging.getLogger("swarm_server")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ajet-swarm", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    start = sub.add_parser("start", help="start the server in the foreground")
    start.add_argument("--swarm-port", type=int, default=10086, help="TCP port (default 10086)")
    start.add_argument("--host", default="127.0.0.1",
                       help="bind address; non-loopback needs AJET_SWARM_TOKEN")
    start.add_argument("--workdir", default=".",
                       help="where ajet_temp/, runs/ and the ledger live (default: cwd)")
    start.add_argument("--log-level", default="info")
    start.add_argument("--engine-env", default=None, metavar="NAME,...",
                       help="more variables of this environment passed to the engine, its "
                            "ranks, the standby and the config validator (synced code can "
                            "read them; AJET_SWARM_* and AJET_MCP_* never pass)")
    start.add_argument("--engine-user", default=None, metavar="NAME",
                       help="run the engine, the standby and the validator as this OS user "
                            "(the server must be able to switch users: run it as root)")
    start.add_argument("--devices", type=int, default=None, metavar="N",
                       help="device slots for concurrent runs: the first N visible GPUs, or "
                            "on a CPU host N slots, one per engine process (default: all "
                            "GPUs, or the CPU count)")
    start.add_argument("--launcher", choices=("local", "ray"), default=None,
                       help="where runs are placed: this machine (local, the default) or a "
                            "Ray cluster (ray; pip install 'agentjet-swarm[ray]')")
    start.add_argument("--ray-address", default=None, metavar="URL",
                       help="the Ray cluster's Jobs API address (default "
                            "http://127.0.0.1:8265)")
    start.add_argument("--ray-shared-workdir", action="store_true",
                       help="under --launcher ray: --workdir is the same path on every Ray "
                            "node (a shared filesystem); ranks import the snapshot from it "
                            "instead of from a package Ray ships to each node")
    start.add_argument("--new-ledger", action="store_true",
                       help="start a fresh ledger when the ledger file is empty or "
                            "unreadable (the old file is moved aside); without it the server "
                            "refuses to start on such a ledger")
    for name, text in (("status", "print the engine status"), ("stop", "stop engine and server")):
        cmd = sub.add_parser(name, help=text)
        cmd.add_argument("--swarm-url", default=_default_url())
        cmd.add_argument("--workdir", default=".", help="the server's workdir (for its pid file)")
    runs = sub.add_parser("runs", help="a run's checkpoints, and downloading one "
                                        "(control token from AJET_SWARM_TOKEN)")
    runs.add_argument("--swarm-url", default=_default_url())
    run_verbs = runs.add_subparsers(dest="verb", required=True)
    listing = run_verbs.add_parser("checkpoints", help="list a run's checkpoints")
    listing.add_argument("run", help="a run id, or 'current'")
    download = run_verbs.add_parser("download", help="download a checkpoint into DIR/<name>")
    download.add_argument("run", help="a run id, or 'current'")
    download.add_argument("dir", help="the folder to download into")
    download.add_argument("--checkpoint", default=None,
                          help="final or step_<n> (default: the latest complete)")
    approvals = sub.add_parser(
        "approvals", help="review and decide pending code snapshots (AJET_SWARM_APPROVER_TOKEN)")
    approvals.add_argument("--swarm-url", default=_default_url())
    verbs = approvals.add_subparsers(dest="verb", required=True)
    verbs.add_parser("list", help="pending snapshots and recent decisions")
    show = verbs.add_parser("show", help="a snapshot's review: the server-side diff, escaped")
    show.add_argument("ref", help="snapshot id or unique prefix")
    show.add_argument("--offset", type=int, default=0, help="first diff line to print")
    show.add_argument("--lines", type=int, default=None,
                      help="print at most this many diff lines (default: all, page by page)")
    show.add_argument("--base", default=None,
                      help="compare with 'server' or an approved snapshot instead")
    for verb, text in (("approve", "approve exactly this content"),
                       ("deny", "refuse it: it never runs"),
                       ("revoke", "revoke an approval: it never runs again")):
        cmd = verbs.add_parser(verb, help=text)
        cmd.add_argument("ref", help="the full snapshot id (64 hex characters; `show` "
                                     "prints it)")
        cmd.add_argument("--note", default="", help="why (kept in the ledger)")
        cmd.add_argument("--yes", action="store_true",
                         help="do not ask to type the snapshot id (after reviewing with show)")
    return p


def _default_url() -> str:
    return os.environ.get("AJET_SWARM_URL", "http://127.0.0.1:10086")


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "start":
        missing = _missing_server_modules()
        if missing:
            sys.stderr.write(f"ajet-swarm: the swarm server needs the server extra, and "
                             f"{', '.join(missing)} is not installed: pip install "
                             "'agentjet-swarm[server]' (or '[cluster]' for the engine too)\n")
            return 2
        return _start(args)
    if args.command == "status":
        return _status(args)
    if args.command == "approvals":
        from swarm_server.approval_cli import run_approvals

        return run_approvals(args)
    if args.command == "runs":
        return _runs(args)
    return _stop(args)


def _start(args: argparse.Namespace) -> int:
    import uvicorn
    from pydantic import ValidationError

    from swarm_server.http_protocol import with_header_timeout
    from swarm_server.errors import StartupRefused
    from swarm_server.main import create_app
    from swarm_server.settings import Settings

    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # httpx logs every request at INFO; the engine status poll alone would be 10 lines/s
    logging.getLogger("httpx").setLevel(logging.WARNING)
    workdir = Path(args.workdir).resolve()
    try:
        given = {k: v for k, v in (("engine_env", args.engine_env),
                                   ("engine_user", args.engine_user),
                                   ("launcher", args.launcher),
                                   ("ray_address", args.ray_address)) if v is not None}
        if args.new_ledger:
            given["new_ledger"] = True
        if args.ray_shared_workdir:
            given["ray_shared_workdir"] = True
        if args.devices is not None:
            given["devices"] = args.devices
        settings = Settings(host=args.host, port=args.swarm_port, workdir=workdir, **given)
    except ValidationError as exc:
        for err in exc.errors():
            sys.stderr.write(f"ajet-swarm: {err['msg'].removeprefix('Value error, ')}\n")
        return 2
    busy = _port_in_use(settings.host, settings.port)
    if busy:
        sys.stderr.write(
            f"ajet-swarm: port {settings.port} on {settings.host} is already in use ({busy}). "
            f"Is a server running there? `ajet-swarm status --swarm-url "
            f"http://{settings.host}:{settings.port}`; or start on another port with "
            "--swarm-port\n")
        return 2
    try:
        app = create_app(settings)
    except StartupRefused as exc:
        sys.stderr.write(f"ajet-swarm: {exc}\n")
        return 2
    pid_file = workdir / "swarm_server.pid"
    pid_file.write_text(json.dumps({"pid": os.getpid(), "started": _start_time(os.getpid())}))
    try:
        # loop "auto": uvloop where it is installed (the server extra has it, but on
        # Windows), else asyncio; the protocol: httptools where installed, else h11
        uvicorn.run(app, host=settings.host, port=settings.port, log_level=args.log_level,
                    timeout_graceful_shutdown=30, loop="auto",
                    http=with_header_timeout(settings.header_timeout_s,
                                             max_header_bytes=settings.max_header_bytes,
                                             parser=settings.http_parser,
                                             quiet_paths=app.lane.paths if app.lane else
                                             frozenset()),
                    h11_max_incomplete_event_size=settings.max_header_bytes)
    finally:
        if _pid_of(pid_file) == (os.getpid(), _start_time(os.getpid())):
            pid_file.unlink()
    return 0


#: Modules `ajet-swarm start` imports: the `server` extra.
_SERVER_MODULES = ("fastapi", "uvicorn", "pydantic_settings", "psutil", "jinja2", "multipart")


def _missing_server_modules() -> list[str]:
    import importlib.util

    def missing(name: str) -> bool:
        try:
            return importlib.util.find_spec(name) is None
        except (ImportError, ValueError):  # ValueError: blocked in sys.modules
            return True

    return [name for name in _SERVER_MODULES if missing(name)]


def _port_in_use(host: str, port: int) -> str | None:
    """Why `host:port` cannot be bound now, or None when it can."""
    import errno
    import socket

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
        try:
            probe.bind((host, port))
        except OSError as exc:
            return "address already in use" if exc.errno == errno.EADDRINUSE else str(exc)
    return None


def _start_time(pid: int) -> float | None:
    import psutil

    try:
        return psutil.Process(pid).create_time()
    except psutil.NoSuchProcess:
        return None


def _pid_of(pid_file: Path) -> tuple[int, float | None] | None:
    """(pid, start time) from a pid file; a plain pid from an older server has no time."""
    try:
        text = pid_file.read_text().strip()
    except OSError:
        return None
    try:
        data = json.loads(text)
    except ValueError:
        return None
    if isinstance(data, int):
        return data, None
    if isinstance(data, dict) and isinstance(data.get("pid"), int):
        return data["pid"], data.get("started")
    return None


def _is_this_server(pid: int, started: float | None) -> bool:
    """`pid` runs a swarm server, and the same process that wrote the pid file."""
    import psutil

    try:
        proc = psutil.Process(pid)
        if started is not None and abs(proc.create_time() - started) > 0.01:
            return False
        cmdline = " ".join(proc.cmdline())
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return False
    return "swarm_server" in cmdline or "ajet-swarm" in cmdline


def _status(args: argparse.Namespace) -> int:
    from ajet.client import SwarmClient
    from ajet.errors import SwarmError

    try:
        with SwarmClient(args.swarm_url, timeout=10) as client:
            status = client.engine_status()
    except SwarmError as exc:
        sys.stderr.write(f"ajet-swarm: {exc}\n")
        return 1
    sys.stdout.write(json.dumps(status.model_dump(mode="json"), indent=2) + "\n")
    return 0


def _runs(args: argparse.Namespace) -> int:
    from ajet.client import SwarmClient
    from ajet.errors import SwarmError

    try:
        with SwarmClient(args.swarm_url, timeout=60) as client:
            if args.verb == "checkpoints":
                page = client.list_checkpoints(args.run)
                for c in page.checkpoints:
                    sys.stdout.write(f"{c.name:<20} step {c.step!s:<6} {c.bytes:>14,} bytes "
                                     f"{c.files:>5} files {'complete' if c.complete else 'partial'}"
                                     f"{' lora' if c.lora else ''}{' +merged' if c.merged else ''}\n")
                return 0
            path = client.download_checkpoint(args.run, args.dir, name=args.checkpoint)
    except (SwarmError, FileExistsError) as exc:
        sys.stderr.write(f"ajet-swarm: {exc}\n")
        return 1
    sys.stdout.write(f"{path}\n")
    return 0


def _stop(args: argparse.Namespace) -> int:
    from ajet.client import SwarmClient
    from ajet.errors import SwarmError

    try:
        with SwarmClient(args.swarm_url, timeout=60) as client:
            result = client.stop_run(reason="ajet-swarm stop")
            sys.stderr.write(f"engine stopped: {result.stopped}\n")
    except SwarmError as exc:
        sys.stderr.write(f"ajet-swarm: engine not stopped through the API: {exc}\n")
    pid_file = Path(args.workdir).resolve() / "swarm_server.pid"
    if not pid_file.exists():
        sys.stderr.write(f"ajet-swarm: no pid file at {pid_file}; is the server's workdir there?\n")
        return 1
    found = _pid_of(pid_file)
    if found is None:
        sys.stderr.write(f"ajet-swarm: {pid_file} is not a pid file this server wrote; "
                         "remove it and find the server with `ps`\n")
        return 1
    pid, started = found
    if not _is_this_server(pid, started):
        sys.stderr.write(f"ajet-swarm: no swarm server runs as pid {pid} any more (the pid "
                         f"file {pid_file} is stale); removed it. Nothing was signalled.\n")
        pid_file.unlink(missing_ok=True)
        return 1
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        pid_file.unlink(missing_ok=True)
        sys.stderr.write(f"ajet-swarm: server {pid} had already exited\n")
        return 1
    deadline = time.monotonic() + 40
    while time.monotonic() < deadline:
        if not _running(pid):
            sys.stderr.write(f"server {pid} stopped\n")
            return 0
        time.sleep(0.1)
    sys.stderr.write(f"ajet-swarm: server {pid} still running after 40 s\n")
    return 1


def _running(pid: int) -> bool:
    """True while `pid` runs; an exited server its parent has not reaped yet counts as gone."""
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
