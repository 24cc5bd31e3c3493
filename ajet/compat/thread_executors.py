"""Thread pools that AgentJet rollout scripts use, as the original names them.

    executor = PeriodicDrainThreadPoolExecutor(workers=BATCH * GRPO_N, auto_retry=True)
    for task in dataset.generate_training_tasks():
        for _ in range(GRPO_N):
            executor.submit_with_periodic_drain(fn=rollout, task=task)

`PeriodicDrainThreadPoolExecutor` runs at most `max_parallel` calls at once and, every
`workers` submissions, waits until all in flight have finished (one batch at a time).
With `auto_retry`, a call that raises is run again, as in the original, but at most
`max_attempts` times (the original retries forever), and the error is logged.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any

__all__ = ["BoundedThreadPoolExecutor", "PeriodicDrainThreadPoolExecutor", "retrying"]

log = logging.getLogger(__name__)


def retrying(fn: Callable[..., Any], max_attempts: int) -> Callable[..., Any]:
    """`fn`, run again when it raises, at most `max_attempts` times in all."""

    def run(*args: Any, **kwargs: Any) -> Any:
        for attempt in range(1, max_attempts + 1):
            try:
                return fn(*args, **kwargs)
            except Exception:
                if attempt == max_attempts:
                    raise
                log.exception("episode failed (attempt %d of %d); retrying", attempt,
                              max_attempts)
        return None

    return run


class BoundedThreadPoolExecutor:
    """A thread pool whose `submit` blocks while `max_queue_size` calls are pending."""

    def __init__(self, max_workers: int, max_queue_size: int = 100) -> None:
        self.executor = ThreadPoolExecutor(max_workers=max_workers)
        self.semaphore = threading.Semaphore(max_queue_size)

    def submit(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Future[Any]:
        self.semaphore.acquire()

        def run() -> Any:
            try:
                return fn(*args, **kwargs)
            finally:
                self.semaphore.release()

        return self.executor.submit(run)

    def shutdown(self, wait: bool = True) -> None:
        self.executor.shutdown(wait=wait)


class PeriodicDrainThreadPoolExecutor:
    """Run calls in threads; every `workers` submissions, wait for all in flight."""

    def __init__(self, workers: int = 100, max_parallel: int | None = None,
                 auto_retry: bool = True, block_first_run: bool = False, *,
                 max_attempts: int = 20) -> None:
        self._max_workers = workers
        self._executor = ThreadPoolExecutor(max_workers=max_parallel or workers)
        self._submitted = 0
        self._auto_retry = auto_retry
        self._max_attempts = max_attempts
        self._block_first_run = block_first_run
        self.current_futures: list[Future[Any]] = []

    def submit(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Future[Any]:
        """Submit one call (retried when `auto_retry`); never blocks, except the first
        call with `block_first_run`, which is waited for."""
        target = retrying(fn, self._max_attempts) if self._auto_retry else fn
        future = self._executor.submit(target, *args, **kwargs)
        if self._block_first_run:
            self._block_first_run = False
            future.result()
        return future

    def submit_with_periodic_drain(self, fn: Callable[..., Any], *args: Any, **kwargs: Any
                                   ) -> tuple[Future[Any], list[Any]]:
        """Submit; on every `workers`-th submission wait for all in flight and return
        their results (in submission order; a failed call is logged and left out)."""
        self._submitted += 1
        future = self.submit(fn, *args, **kwargs)
        self.current_futures.append(future)
        results: list[Any] = []
        if self._submitted % self._max_workers == 0:
            results = self.drain()
        return future, results

    def drain(self) -> list[Any]:
        """Wait for every call in flight; their results in submission order."""
        futures, self.current_futures = self.current_futures, []
        wait(futures)
        results = []
        for future in futures:
            try:
                results.append(future.result())
            except Exception:
                log.exception("Error in task execution")
        return results

    def shutdown(self, wait: bool = True) -> None:
        self._executor.shutdown(wait=wait)
