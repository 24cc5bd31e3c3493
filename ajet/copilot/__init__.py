"""Job descriptions an AgentJet user writes (compatibility path `ajet.copilot.job`)."""
