"""AgentJet."""
