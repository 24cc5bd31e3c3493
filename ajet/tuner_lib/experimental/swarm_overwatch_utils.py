"""The original's module path of `CurrentBatchRolloutPoolInformation` (ajet/compat/wire.py)."""

from ajet.compat.wire import CurrentBatchRolloutPoolInformation

__all__ = ["CurrentBatchRolloutPoolInformation"]
