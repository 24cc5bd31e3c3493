"""`Bridge`: what one `ajet-mcp` process holds, and the one place client errors become tool errors.

A `Bridge` owns the `SwarmClient` for the configured server, the local approval store,
the background rollout workers and the run the agent started last (the run that tools
address when they are given none). Tool logic
(`mcp_bridge.tools`, `mcp_bridge.sync`) takes a `Bridge` and plain arguments, so it is
tested without MCP in the way.

`swarm_errors()` translates the client's exception tree (`ajet.errors`) into `ToolError`
once, at this boundary: only `ToolError` text reaches the model, and every message ends
with what to call next.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mcp.server.mcpserver.exceptions import ToolError

from ajet.client import SwarmClient
from ajet.errors import (
    ApprovalPending,
    EngineStateConflict,
    PackagingError,
    PayloadTooLarge,
    SwarmAuthError,
    SwarmConnectionError,
    SwarmError,
    SwarmHTTPError,
    SwarmNotFound,
    SwarmTimeout,
    SwarmValidationError,
)
from mcp_bridge.approvals import DEFAULT_TTL_S, ApprovalStore, default_approvals_dir
from mcp_bridge.models import ApprovalMode, ToolName
from mcp_bridge.rollouts import RolloutManager

__all__ = ["CURRENT_RUN", "Bridge", "BridgeConfig", "swarm_errors", "tool_error"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class BridgeConfig:
    """Everything `ajet-mcp` was started with."""

    swarm_url: str
    token: str | None = None
    #: Token for rollout workers' episode calls; the control token if unset.
    worker_token: str | None = None
    #: The git checkout whose `ajet/` is synced and whose workflows run as rollouts.
    repo: Path = field(default_factory=Path.cwd)
    approval: ApprovalMode = ApprovalMode.ASK
    approvals_dir: Path = field(default_factory=default_approvals_dir)
    approval_ttl_s: float = DEFAULT_TTL_S
    #: How long start_engine waits for ENGINE.ROLLING before returning a handle.
    start_wait_s: float = 120.0
    http_timeout_s: float = 30.0

    @classmethod
    def from_env(cls, swarm_url: str, **overrides: Any) -> BridgeConfig:
        """Tokens from `AJET_SWARM_TOKEN` / `AJET_SWARM_WORKER_TOKEN` unless given."""
        overrides.setdefault("token", os.environ.get("AJET_SWARM_TOKEN") or None)
        overrides.setdefault("worker_token", os.environ.get("AJET_SWARM_WORKER_TOKEN") or None)
        return cls(swarm_url=swarm_url.rstrip("/"), **overrides)


#: The run ref meaning the default run (the one start_engine without a name starts).
CURRENT_RUN = "current"


class Bridge:
    """The state behind the MCP tools of one `ajet-mcp` process."""

    def __init__(self, config: BridgeConfig, *, client: SwarmClient | None = None,
                 approvals: ApprovalStore | None = None) -> None:
        self.config = config
        self.client = client or SwarmClient(config.swarm_url, token=config.token,
                                            timeout=config.http_timeout_s)
        self.approvals = approvals or ApprovalStore(config.approvals_dir,
                                                    ttl_s=config.approval_ttl_s)
        # Workflows run in child processes that never get the control token: with a worker
        # token they claim episodes with it; without one the bridge claims for them.
        self.rollouts = RolloutManager(config.swarm_url, token=config.token,
                                       worker_token=config.worker_token, repo=config.repo)
        # The run the agent started last in this session, as it names it (a name, or the
        # run id of an unnamed concurrent run); None: the default run, whose id changes
        # at every restart, so it is addressed as 'current'.
        self.last_run: str | None = None

    @property
    def repo(self) -> Path:
        return self.config.repo

    def run_ref(self, run: str | None) -> str:
        """The run a tool addresses: the one it was given, else the agent's latest run,
        else the server's 'current' (the default run)."""
        if run and run.strip():
            return run.strip()
        return self.last_run or CURRENT_RUN

    def close(self) -> None:
        """Stop rollout workers, then close the HTTP client."""
        try:
            self.rollouts.stop_all(timeout=10.0)
        finally:
            self.client.close()


def tool_error(what: str, next_step: str) -> ToolError:
    """A `ToolError` whose text says what happened and what to call next."""
    what = what.rstrip()
    if not what.endswith((".", "!", "?")):
        what += "."
    return ToolError(f"{what} Next: {next_step}")


@contextmanager
def swarm_errors(next_step: str) -> Iterator[None]:
    """Turn client errors into `ToolError` naming `next_step` (a tool call).

    The server's own `hint` is kept in the text for context, but it speaks HTTP routes;
    the model is told the next *tool* to call.
    """
    try:
        yield
    except ToolError:
        raise
    except SwarmAuthError as exc:
        raise tool_error(
            f"the swarm server refused the request ({exc.status}: {_detail(exc)})",
            "start ajet-mcp with AJET_SWARM_TOKEN set to the server's control token "
            f"(ask the human); then call {ToolName.ENGINE_STATUS}",
        ) from exc
    except ApprovalPending as exc:
        detail = exc.detail if isinstance(exc.detail, dict) else {}
        ways = detail.get("approve_with") or {}
        where = "; ".join(f"{k}: {v}" for k, v in ways.items() if isinstance(v, str))
        raise tool_error(
            f"the server refused: {detail.get('message', exc.detail)}. Only a human approver "
            f"can approve it, on the server ({where or 'ajet-swarm approvals'}, with their own "
            "approver token); you cannot",
            f"ask the human to review it there; {next_step} once they approved it (or "
            f"{ToolName.ACTIVATE_SNAPSHOT} an approved snapshot)") from exc
    except EngineStateConflict as exc:
        raise tool_error(f"engine state conflict: {_detail(exc)}{_hint(exc)}",
                         f"call {ToolName.ENGINE_STATUS}, then {next_step}") from exc
    except SwarmNotFound as exc:
        raise tool_error(f"not found: {_detail(exc)}{_hint(exc)}", next_step) from exc
    except PayloadTooLarge as exc:
        raise tool_error(f"the server refused the upload as too large: {_detail(exc)}{_hint(exc)}",
                         "make the change smaller (fewer or smaller files under ajet/), then "
                         f"call {ToolName.SYNC_TRAIN_CODE} again") from exc
    except SwarmValidationError as exc:
        raise tool_error(
            f"the server rejected the input ({exc.status}): {_detail(exc)}{_hint(exc)}", next_step
        ) from exc
    except SwarmHTTPError as exc:
        raise tool_error(f"the swarm server failed ({exc.status}): {_detail(exc)}{_hint(exc)}",
                         f"call {ToolName.ENGINE_STATUS}, then {next_step}") from exc
    except SwarmConnectionError as exc:
        raise tool_error(
            f"cannot reach the swarm server: {exc}",
            "check the server is running (`ajet-swarm start`) and ajet-mcp's --swarm-url; "
            f"then call {ToolName.ENGINE_STATUS}",
        ) from exc
    except SwarmTimeout as exc:
        raise tool_error(str(exc),
                         f"call {ToolName.ENGINE_STATUS} and {ToolName.READ_LOGS}") from exc
    except PackagingError as exc:
        raise tool_error(
            f"cannot package ajet/: {exc}",
            "fix the working tree (git add new files, remove symlinks or oversized files), "
            f"then call {ToolName.SYNC_TRAIN_CODE} again",
        ) from exc
    except SwarmError as exc:
        raise tool_error(str(exc), next_step) from exc


def _detail(exc: SwarmHTTPError) -> str:
    detail = exc.detail
    if isinstance(detail, list):  # FastAPI validation errors: name the fields
        parts = []
        for item in detail[:10]:
            if isinstance(item, dict):
                loc = ".".join(str(p) for p in item.get("loc", []) if p != "body")
                parts.append(f"{loc or '(body)'}: {item.get('msg', item)}")
            else:
                parts.append(str(item))
        text = "; ".join(parts)
    else:
        text = str(detail)
    return text[:1500]


def _hint(exc: SwarmHTTPError) -> str:
    hint = exc.hint.strip()
    return f" (server hint: {hint[:300]})" if hint else ""
