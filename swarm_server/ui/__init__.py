"""The web console for approvers and operators: `/ui` on the swarm server.

Server-rendered pages (Jinja2 templates, Pygments highlighting, inline SVG curves; no
JavaScript, no third-party CSS or script in the repository) over the same ledger and
snapshot store as the API: pending approvals with the server-side diff, snapshots and the
runs that used them, runs with their curves and log tail. Sign-in makes a cookie session
(`swarm_server.ui.sessions`); `deps.ConsoleAuth` is its one check.
"""

# The routes (`swarm_server.ui.routes.router`) are imported by `main`, not here: this
# package root stays importable from `deps`, which the routes themselves import.
from swarm_server.ui.sessions import COOKIE, ConsoleSession, SessionStore

__all__ = ["COOKIE", "ConsoleSession", "SessionStore"]
