"""Playbooks for research agents, shipped as package data and served by ajet-mcp as prompts."""
