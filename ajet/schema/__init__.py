"""The original AgentJet schema package: `ajet.schema.task` holds `Task` and `WorkflowOutput`."""

from ajet.schema.task import Task, WorkflowOutput

__all__ = ["Task", "WorkflowOutput"]
