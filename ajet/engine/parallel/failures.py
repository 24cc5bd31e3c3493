"""A failed rank ends the whole job within seconds, and says why.

An exception on any rank is logged with the rank and its traceback, and the process
exits non-zero at once (`python -m ajet.engine` ends with `os._exit`): no
`destroy_process_group`, no stop of the generator or the channel, nothing that could
wait on collectives still pending on a group a peer has left (torch has no public
abort). torchrun runs with `--max_restarts=0`, so one failed worker stops the others.

That alone can take a while: a peer stuck in an NCCL collective only notices when its
timeout expires, and torchrun's SIGTERM only sets the engine's stop flag. So the first
failure is also put in the process group's store (the TCPStore torchrun's agent hosts,
which outlives the ranks), and every rank polls it (`RankFailures.start`): a rank that
sees a peer's failure logs it and exits at once. Rank 0, or the failed rank itself when
it shares rank 0's node, writes the first failure to `<run_dir>/failure.json`
(`protocol.EngineFailure`), from which the swarm server's `last_error` names the rank
and the exception.
"""

from __future__ import annotations

import logging
import os
import threading
import traceback
from pathlib import Path
from collections.abc import Callable
from typing import Any

from ajet.protocol import ENGINE_FAILURE_FILE, EngineFailure

__all__ = ["RankFailures"]

log = logging.getLogger(__name__)

#: The store key of the first failure (later ones leave it as it is).
_KEY = "ajet/engine_failure"
#: Traceback lines kept in the record (the log has all of them).
_TRACEBACK_LINES = 60


class RankFailures:
    """This rank's side of fail-fast: report its own exception, watch for the peers'.

    `store` is the process group's store (None with one process, or before the group
    exists: then only the file is written). Exits go through `exit_process`, `os._exit` by
    default, so tests can watch one without losing their process.
    """

    def __init__(self, *, rank: int, world_size: int, run_dir: Path, store: Any = None,
                 exit_process: Callable[[int], object] = os._exit) -> None:
        self.rank = rank
        self.world_size = world_size
        self.run_dir = run_dir
        self.store = store
        self._exit = exit_process
        self._reporting = threading.Event()  # this rank failed: its watch stands down
        self._stopped = threading.Event()

    def report(self, exc: BaseException) -> EngineFailure:
        """Log `exc` with this rank and its traceback; record the job's first failure.

        Returns that first failure: this one, or a peer's that came before it (then this
        exception is most likely its consequence, a collective broken by the peer's exit).
        """
        self._reporting.set()
        lines = traceback.format_exception(type(exc), exc, exc.__traceback__)
        log.error("rank %d failed: %s\n%s", self.rank, _one_line(exc), "".join(lines).rstrip())
        mine = EngineFailure(rank=self.rank, world_size=self.world_size,
                             error=_one_line(exc)[:2000],
                             traceback="".join(lines).splitlines()[-_TRACEBACK_LINES:])
        first = self._publish(mine)
        if first.rank != self.rank:
            log.error("rank %d had failed first (%s); the failure above followed it",
                      first.rank, first.error)
        self._write(first)
        return first

    def start(self, interval_s: float = 0.5) -> None:
        """Poll the store for a peer's failure; on one, log it and exit 1 at once."""
        if self.store is None:
            return
        threading.Thread(target=self._watch, args=(interval_s,), daemon=True,
                         name="ajet-rank-failures").start()

    def stop(self) -> None:
        """A clean stop: the watch ends (the store goes away with the group)."""
        self._stopped.set()

    def _watch(self, interval_s: float) -> None:
        while not self._stopped.wait(interval_s):
            try:
                seen = self.store.check([_KEY])
            except Exception:  # noqa: BLE001 - the store's host went away: torchrun is ending us
                return
            if not seen or self._reporting.is_set() or self._stopped.is_set():
                continue
            first = self._read()
            if first is None:
                continue
            log.error("%s; rank %d exits now", first.describe(), self.rank)
            self._write(first)
            for handler in logging.getLogger().handlers:
                handler.flush()
            self._exit(1)
            return

    def _publish(self, mine: EngineFailure) -> EngineFailure:
        """Put `mine` in the store unless a failure is there already; the first one."""
        if self.store is None:
            return mine
        try:
            # compare_set with an empty expected value sets a missing key only
            stored = self.store.compare_set(_KEY, "", mine.model_dump_json())
            return EngineFailure.model_validate_json(stored)
        except Exception as exc:  # noqa: BLE001 - the store is gone too: this one stands
            log.warning("could not tell the other ranks about the failure: %s", exc)
            return mine

    def _read(self) -> EngineFailure | None:
        try:
            return EngineFailure.model_validate_json(self.store.get(_KEY))
        except Exception:  # noqa: BLE001 - unreadable: keep watching until torchrun stops us
            return None

    def _write(self, failure: EngineFailure) -> None:
        """`<run_dir>/failure.json`, once: the first writer on this node wins."""
        if self.rank != 0 and os.environ.get("GROUP_RANK", "0") != "0":
            return  # another node's run directory: the server never reads it
        path = self.run_dir / ENGINE_FAILURE_FILE
        tmp = path.with_name(f".{ENGINE_FAILURE_FILE}.{os.getpid()}")
        try:
            tmp.write_text(failure.model_dump_json(), encoding="utf-8")
            os.link(tmp, path)  # atomic, and refused when another rank was first
        except FileExistsError:
            pass
        except OSError as exc:
            log.warning("could not write %s: %s", path, exc)
        finally:
            tmp.unlink(missing_ok=True)


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__
