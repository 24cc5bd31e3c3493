"""One router per resource: control (engine lifecycle), code, runs, episodes."""
