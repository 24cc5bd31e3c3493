"""`ajet-mcp`: the MCP server through which a research agent drives AgentJet Swarm training.

Tools wrap the swarm server's HTTP API (`ajet.client.SwarmClient`); every code sync is
shown to a human and approved (MCP elicitation or `ajet-mcp approvals`) before upload.
"""

from mcp_bridge.approvals import Approval, ApprovalStore
from mcp_bridge.bridge import Bridge, BridgeConfig
from mcp_bridge.cli import main
from mcp_bridge.models import ApprovalMode, ToolName
from mcp_bridge.server import build_server

__all__ = [
    "Approval",
    "ApprovalMode",
    "ApprovalStore",
    "Bridge",
    "BridgeConfig",
    "ToolName",
    "build_server",
    "main",
]
