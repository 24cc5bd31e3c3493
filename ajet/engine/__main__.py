"""`python -m ajet.engine --config job.yaml --run-dir DIR --socket SOCK --run-id ID --workdir W`.

Puts `ISOLATED_AGENTJET_BASE_DIR` (the active snapshot's base folder) first on
`sys.path` before importing the rest of `ajet`, so the engine runs the synced code and
not an installed copy (docs/internals.md, "The engine process").
"""

from __future__ import annotations

import logging
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
    # line ran, from wherever sys.path pointed (`-m` puts the working directory first).
    # If that was not the snapshot, start over once with the snapshot at the very front,
    # so that every ajet module, this one included, comes from the snapshot.
    import ajet

    here = os.path.abspath(ajet.__file__)
    if not here.startswith(base + os.sep) and os.environ.get("AJET_ENGINE_REEXEC") != "1":
        env = dict(os.environ, AJET_ENGINE_REEXEC="1")
        env["PYTHONPATH"] = os.pathsep.join(p for p in (base, env.get("PYTHONPATH")) if p)
        bootstrap = (f"import sys; sys.path.insert(0, {base!r}); import runpy; "
                     "runpy.run_module('ajet.engine', run_name='__main__', alter_sys=True)")
        os.execve(sys.executable, [sys.executable, "-c", bootstrap, *sys.argv[1:]], env)


if __name__ == "__main__":
    _snapshot_first()
    from ajet.engine.runtime import main

    code = main()
    # Everything the run keeps (metrics, final checkpoint, log) is written and closed by
    # now. Skip the interpreter's teardown of torch and transformers (about a second on
    # a small CPU): the server waits for this exit before it starts the next engine.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
