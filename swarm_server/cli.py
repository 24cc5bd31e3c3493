"""`ajet-swarm`: start, inspect and stop a swarm server.

    ajet-swarm start --swarm-port=10086 [--host 127.0.0.1] [--workdir .]
                     [--engine-env NAME,...] [--engine-user NAME] [--new-ledger]
    ajet-swarm status [--swarm-url URL]
    ajet-swarm stop   [--swarm-url URL]      # stops the engine, then the server
    ajet-swarm approvals list | show REF | approve ID | deny ID | revoke ID

`start` writes `<workdir>/swarm_server.pid` so that `stop` can find the process.
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
    start.add_argument("--new-ledger", action="store_true",
                       help="start a fresh ledger when the ledger file is empty or "
                            "unreadable (the old file is moved aside); without it the server "
                            "refuses to start on such a ledger")
    for name, text in (("status", "print the engine status"), ("stop", "stop engine and server")):
        cmd = sub.add_parser(name, help=text)
        cmd.add_argument("--swarm-url", default=_default_url())
        cmd.add_argument("--workdir", default=".", help="the server's workdir (for its pid file)")
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
        return _start(args)
    if args.command == "status":
        return _status(args)
    if args.command == "approvals":
        from swarm_server.approval_cli import run_approvals

        return run_approvals(args)
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
                                   ("engine_user", args.engine_user)) if v is not None}
        if args.new_ledger:
            given["new_ledger"] = True
        settings = Settings(host=args.host, port=args.swarm_port, workdir=workdir, **given)
    except ValidationError as exc:
        for err in exc.errors():
            sys.stderr.write(f"ajet-swarm: {err['msg'].removeprefix('Value error, ')}\n")
        return 2
    try:
        app = create_app(settings)
    except StartupRefused as exc:
        sys.stderr.write(f"ajet-swarm: {exc}\n")
        return 2
    pid_file = workdir / "swarm_server.pid"
    pid_file.write_text(str(os.getpid()))
    try:
        # loop "auto": uvloop where it is installed (the server extra has it, but on
        # Windows), else asyncio; the protocol: httptools where installed, else h11
        uvicorn.run(app, host=settings.host, port=settings.port, log_level=args.log_level,
                    timeout_graceful_shutdown=30, loop="auto",
                    http=with_header_timeout(settings.header_timeout_s,
                                             max_header_bytes=settings.max_header_bytes,
                                             parser=settings.http_parser),
                    h11_max_incomplete_event_size=settings.max_header_bytes)
    finally:
        if pid_file.exists() and pid_file.read_text().strip() == str(os.getpid()):
            pid_file.unlink()
    return 0


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
    pid = int(pid_file.read_text().strip())
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        sys.stderr.write(f"ajet-swarm: no server process {pid}; removing stale pid file\n")
        pid_file.unlink(missing_ok=True)
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
