"""`ajet-mcp`: the MCP server through which a research agent drives AgentJet Swarm training.

Tools wrap the swarm server's HTTP API (`ajet.client.SwarmClient`); every code sync is
shown to a human and approved (MCP elicitation or `ajet-mcp approvals`) before upload.

This package root stays light (no MCP SDK), so `ajet-mcp approvals ...` starts fast; the
server is built with `mcp_bridge.server.build_server(mcp_bridge.bridge.Bridge(config))`.
"""

from mcp_bridge.approvals import Approval, ApprovalStore
from mcp_bridge.cli import main
from mcp_bridge.models import ApprovalMode, ToolName

__all__ = [
    "Approval",
    "ApprovalMode",
    "ApprovalStore",
    "ToolName",
    "main",
]
