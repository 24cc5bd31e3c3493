"""The original AgentJet's utility package; only `thread_executors` is provided."""
