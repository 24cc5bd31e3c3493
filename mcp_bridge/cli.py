"""`ajet-mcp`: run the MCP bridge, or resolve pending sync approvals as the human.

    ajet-mcp --swarm-url URL [--repo PATH] [--approval ask|queue|auto]
             [--transport stdio|streamable-http] [--port N]
    ajet-mcp approvals list | show ID | approve ID | deny ID

The server logs to stderr only: on stdio, stdout is the MCP protocol. The control token
comes from `AJET_SWARM_TOKEN` (never a flag, so it stays out of process listings and
client config files). The `approvals` commands are for a human at a terminal and print
to stdout. They are laptop-side approvals, for a server without approver tokens: they
stop only an agent without shell or file tools (docs/security.md). `approve` shows the
diff and asks to type the snapshot id's first characters on a terminal, and refuses when
the server enforces approvals (then an approver approves on the server).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path

from mcp_bridge.approvals import (
    APPROVALS_DIR_ENV,
    DEFAULT_TTL_S,
    Approval,
    ApprovalError,
    ApprovalStore,
    default_approvals_dir,
)
from mcp_bridge.models import ApprovalMode

__all__ = ["main"]

log = logging.getLogger("mcp_bridge")


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] == "approvals":
        return _approvals_main(args[1:])
    return _serve_main(args)


# ---------------------------------------------------------------------------- serve


def _serve_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="ajet-mcp",
        description="MCP server that lets an agent drive AgentJet Swarm training. "
                    "Token: AJET_SWARM_TOKEN. Human approvals: `ajet-mcp approvals --help`.",
    )
    server = p.add_argument_group("swarm server")
    server.add_argument("--swarm-url", default=os.environ.get("AJET_SWARM_URL"),
                        help="URL of the swarm server, e.g. http://gpu-box:10086 "
                             "(default: $AJET_SWARM_URL)")
    server.add_argument("--repo", type=Path, default=Path.cwd(),
                        help="git checkout holding ajet/ to sync and workflows to run "
                             "(default: the current directory)")
    approval = p.add_argument_group("approval of code syncs")
    approval.add_argument("--approval", choices=[m.value for m in ApprovalMode],
                          default=ApprovalMode.ASK.value,
                          help="ask: MCP elicitation, else a pending approval (default); "
                               "queue: always a pending approval; auto: no human (scripts only)")
    approval.add_argument("--approvals-dir", type=Path, default=None,
                          help=f"folder of pending approvals (default: ${APPROVALS_DIR_ENV} "
                               f"or {default_approvals_dir()})")
    approval.add_argument("--approval-ttl-min", type=float, default=DEFAULT_TTL_S / 60,
                          help="minutes a request, then an approval, stays valid (default: 30)")
    transport = p.add_argument_group("transport")
    transport.add_argument("--transport", choices=["stdio", "streamable-http"], default="stdio")
    transport.add_argument("--port", type=int, default=8765,
                           help="loopback port for --transport streamable-http")
    transport.add_argument("--start-wait-s", type=float, default=120.0,
                           help="how long start_engine waits for ENGINE.ROLLING")
    transport.add_argument("--log-level", default="INFO",
                           choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    return p


def _serve_main(argv: list[str]) -> int:
    args = _serve_parser().parse_args(argv)
    logging.basicConfig(stream=sys.stderr, level=args.log_level,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # One INFO line per HTTP request drowns what matters; errors still surface as tool errors.
    logging.getLogger("httpx").setLevel(max(logging.WARNING, logging.getLogger().level))
    if not args.swarm_url:
        _complain("--swarm-url (or AJET_SWARM_URL) is required")
        return 2
    if args.approval_ttl_min <= 0:
        _complain("--approval-ttl-min must be positive")
        return 2
    # Imported here so `ajet-mcp approvals ...` starts without the MCP SDK.
    from mcp_bridge.bridge import Bridge, BridgeConfig
    from mcp_bridge.server import build_server

    config = BridgeConfig.from_env(
        args.swarm_url,
        repo=args.repo.expanduser().resolve(),
        approval=ApprovalMode(args.approval),
        approvals_dir=(args.approvals_dir.expanduser() if args.approvals_dir
                       else default_approvals_dir()),
        approval_ttl_s=args.approval_ttl_min * 60.0,
        start_wait_s=args.start_wait_s,
    )
    bridge = Bridge(config)
    mcp = build_server(bridge)
    log.info("ajet-mcp serving %s on %s (repo %s, approval %s)", config.swarm_url,
             args.transport, config.repo, config.approval.value)
    if config.approval is ApprovalMode.AUTO:
        log.warning("--approval auto: code syncs reach the cluster without a human review")
    try:
        if args.transport == "stdio":
            mcp.run("stdio")
        else:
            # Loopback only: the bridge holds the control token; never expose it.
            mcp.run("streamable-http", host="127.0.0.1", port=args.port)
    except KeyboardInterrupt:
        pass
    finally:
        bridge.close()
    return 0


# ---------------------------------------------------------------------------- approvals


def _approvals_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="ajet-mcp approvals",
        description="Review and decide the code syncs an agent asked for. Only a human runs "
                    "these; the agent has no tool that approves.",
    )
    p.add_argument("--approvals-dir", type=Path, default=None,
                   help=f"folder of approvals (default: ${APPROVALS_DIR_ENV} or "
                        f"{default_approvals_dir()})")
    sub = p.add_subparsers(dest="command", required=True)
    ls = sub.add_parser("list", help="pending approvals (all with --all)")
    ls.add_argument("--all", action="store_true", help="also decided and expired ones")
    for name, text in (("show", "summary and full diff of one request"),
                       ("approve", "approve one request (exactly that content, that server)"),
                       ("deny", "refuse one request")):
        cmd = sub.add_parser(name, help=text)
        cmd.add_argument("id")
    return p


def _approvals_main(argv: list[str]) -> int:
    args = _approvals_parser().parse_args(argv)
    root = args.approvals_dir.expanduser() if args.approvals_dir else default_approvals_dir()
    store = ApprovalStore(root)
    try:
        if args.command == "list":
            return _list(store, show_all=args.all)
        if args.command == "show":
            _show(store.get(args.id), full=True)
            return 0
        if args.command == "approve":
            pending = store.get(args.id)
            if _server_enforces(pending.server_url):
                _complain(f"approvals: {pending.server_url} enforces approvals on the server; "
                          "a local approval means nothing there. An approver approves at "
                          f"{pending.server_url}/ui/snapshots/{pending.snapshot_id} or with "
                          f"`ajet-swarm approvals approve {pending.snapshot_id}`")
                return 1
            _show(pending, full=True)
            if not _confirmed(pending):
                return 1
            approval = store.approve(args.id)
            _say(f"\nApproved. The agent's next sync_train_code of this exact content on "
                  f"{approval.server_url} proceeds until {_local(approval.expires_at)}.")
            return 0
        approval = store.deny(args.id)
        _say(f"Denied {approval.id} (snapshot {approval.snapshot_id[:16]}). Nothing is uploaded.")
        return 0
    except ApprovalError as exc:
        _complain(f"approvals: {exc}")
        return 1


def _list(store: ApprovalStore, *, show_all: bool) -> int:
    now = time.time()
    rows = [a for a in store.all()
            if show_all or (a.status.value == "pending" and not a.expired(now))]
    if not rows:
        _say(f"No {'' if show_all else 'pending '}approvals in {store.root}.")
        return 0
    _say(f"{'ID':<9} {'STATUS':<9} {'CREATED':<17} {'EXPIRES':<17} {'SNAPSHOT':<13} "
          f"{'+A ~C -R':<10} SERVER")
    for a in rows:
        status = "expired" if a.status.value == "pending" and a.expired(now) else a.status.value
        added, changed, removed = (len(a.files.get(k, [])) for k in ("added", "changed", "removed"))
        counts = f"+{added} ~{changed} -{removed}"
        _say(f"{a.id:<9} {status:<9} {_local(a.created_at):<17} {_local(a.expires_at):<17} "
              f"{a.snapshot_id[:12]:<13} {counts:<10} {a.server_url}")
    _say("\nReview with `ajet-mcp approvals show ID`, then `approve ID` or `deny ID`.")
    return 0


def _show(a: Approval, *, full: bool) -> None:
    _say(f"Approval {a.id}: {a.status.value}")
    _say(f"  server:   {a.server_url}")
    _say(f"  repo:     {a.repo}")
    _say(f"  snapshot: {a.snapshot_id}")
    _say(f"  created:  {_local(a.created_at)}   expires: {_local(a.expires_at)}")
    if a.decided_at:
        _say(f"  decided:  {_local(a.decided_at)} by {a.decided_by}")
    _say()
    _say(a.summary)
    if full:
        _say()
        _say(a.diff or "(no diff)")


def _confirmed(a: Approval) -> bool:
    """A human at a terminal typed the snapshot id's first 12 characters."""
    if not sys.stdin.isatty():
        _complain("approvals: approve asks for confirmation on a terminal; run it there")
        return False
    _say()
    try:
        typed = input(f"Type the first 12 characters of snapshot {a.snapshot_id[:4]}... to "
                      "approve exactly the content shown above: ").strip().lower()
    except EOFError:
        typed = ""
    if typed != a.snapshot_id[:12]:
        _complain("approvals: the snapshot id did not match; nothing was approved")
        return False
    return True


def _server_enforces(server_url: str) -> bool:
    """Whether the server says it enforces approvals (`GET /version`); False if unknown."""
    import httpx

    token = os.environ.get("AJET_SWARM_TOKEN") or os.environ.get("AJET_SWARM_WORKER_TOKEN")
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    try:
        answer = httpx.get(f"{server_url.rstrip('/')}/version", headers=headers, timeout=5)
        return bool(answer.status_code == 200 and answer.json().get("approvals_enforced"))
    except (httpx.HTTPError, ValueError):
        return False


def _say(text: str = "") -> None:
    """Output of the human's `approvals` commands; serving never writes to stdout."""
    sys.stdout.write(f"{text}\n")


def _complain(text: str) -> None:
    sys.stderr.write(f"ajet-mcp: {text}\n")


def _local(ts: float) -> str:
    return datetime.fromtimestamp(ts).strftime("%Y-%m-%d %H:%M")
