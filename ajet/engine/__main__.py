"""`python -m ajet.engine --config job.yaml --run-dir DIR --socket SOCK --run-id ID --workdir W`.

Puts `ISOLATED_AGENTJET_BASE_DIR` (the active snapshot's base folder) first on
`sys.path` before importing the rest of `ajet`, so the engine runs the synced code and
not an installed copy (docs/internals.md, "The engine process").
"""

from __future__ import annotations

import os
import sys


def _snapshot_first() -> None:
    base = os.environ.get("ISOLATED_AGENTJET_BASE_DIR")
    if not base:
        return
    base = os.path.abspath(base)
    if sys.path[:1] != [base]:
        sys.path.insert(0, base)
    # `python -m ajet.engine` imported `ajet` and `ajet.engine` (both light) before this
    # line ran. If they came from elsewhere, start over once with the snapshot first on
    # PYTHONPATH, so that every ajet module, this one included, comes from the snapshot.
    import ajet

    here = os.path.abspath(ajet.__file__)
    if not here.startswith(base + os.sep) and os.environ.get("AJET_ENGINE_REEXEC") != "1":
        env = dict(os.environ, AJET_ENGINE_REEXEC="1")
        env["PYTHONPATH"] = os.pathsep.join(p for p in (base, env.get("PYTHONPATH")) if p)
        os.execve(sys.executable, [sys.executable, "-m", "ajet.engine", *sys.argv[1:]], env)


if __name__ == "__main__":
    _snapshot_first()
    from ajet.engine.runtime import main

    raise SystemExit(main())
