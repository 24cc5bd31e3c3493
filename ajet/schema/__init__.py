"""The original AgentJet schema package: `ajet.schema.task` (ajet/compat/task.py)."""

from ajet.compat.task import Task, WorkflowOutput

__all__ = ["Task", "WorkflowOutput"]
