"""`python -m bench.profiled_server ARGS`: `python -m swarm_server ARGS` with a cProfile
that the profiler switches by signal (`bench.profile_episodes --cprofile`).

SIGUSR1 starts a fresh profile of the event loop's thread (where every request runs)
and writes `$AJET_BENCH_PSTATS.on`; SIGUSR2 stops it and writes the stats to
`$AJET_BENCH_PSTATS` (pstats' marshal format). Python runs signal handlers on the main
thread, the one uvicorn's event loop runs on, so the profile covers that thread only.
With `AJET_BENCH_PSTATS_TIMER=thread` the profile's clock is the thread's CPU time
(`time.thread_time`) instead of the wall clock: a socket write then costs what the
kernel spends on it, not the time until the peer process that it woke gives the CPU
back.
"""

from __future__ import annotations

import cProfile
import os
import signal
import sys
import time
from pathlib import Path
from types import FrameType

__all__ = ["main"]


def main(argv: list[str]) -> int:
    out = Path(os.environ["AJET_BENCH_PSTATS"])
    state: dict[str, cProfile.Profile | None] = {"profile": None}
    cpu = os.environ.get("AJET_BENCH_PSTATS_TIMER") == "thread"

    def start(_: int, __: FrameType | None) -> None:
        profile = state["profile"] = (cProfile.Profile(time.thread_time) if cpu
                                      else cProfile.Profile())
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
