"""`python -m bench.profiled_server ARGS`: `python -m swarm_server ARGS` with a cProfile
that the profiler switches by signal (`bench.profile_episodes --cprofile`).

SIGUSR1 starts a fresh profile of the event loop's thread (where every request runs)
and writes `$AJET_BENCH_PSTATS.on`; SIGUSR2 stops it and writes the stats to
`$AJET_BENCH_PSTATS` (pstats' marshal format). Python runs signal handlers on the main
thread, the one uvicorn's event loop runs on, so the profile covers that thread only.
"""

from __future__ import annotations

import cProfile
import os
import signal
import sys
from pathlib import Path
from types import FrameType

__all__ = ["main"]


def main(argv: list[str]) -> int:
    out = Path(os.environ["AJET_BENCH_PSTATS"])
    state: dict[str, cProfile.Profile | None] = {"profile": None}

    def start(_: int, __: FrameType | None) -> None:
        profile = state["profile"] = cProfile.Profile()
        profile.enable()
        out.with_suffix(".on").write_text("on")

    def stop(_: int, __: FrameType | None) -> None:
        profile, state["profile"] = state["profile"], None
        if profile is not None:
            profile.disable()
            tmp = out.with_suffix(".tmp")
            profile.dump_stats(tmp)
            tmp.replace(out)

    signal.signal(signal.SIGUSR1, start)
    signal.signal(signal.SIGUSR2, stop)
    from swarm_server.cli import main as server_main

    return server_main(argv)


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
