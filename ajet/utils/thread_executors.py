"""The original's module path of its thread pools (ajet/compat/thread_executors.py)."""

from ajet.compat.thread_executors import (
    BoundedThreadPoolExecutor,
    PeriodicDrainThreadPoolExecutor,
    retrying,
)

__all__ = ["BoundedThreadPoolExecutor", "PeriodicDrainThreadPoolExecutor", "retrying"]
