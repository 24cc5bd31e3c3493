"""`python -m mcp_bridge`: the same as the `ajet-mcp` command."""

from mcp_bridge.cli import main

raise SystemExit(main())
