"""Compatibility namespace of the AgentJet tuner library."""
