"""The original's module path of `Task` and `WorkflowOutput` (ajet/compat/task.py)."""

from ajet.compat.task import Task, WorkflowOutput

__all__ = ["Task", "WorkflowOutput"]
