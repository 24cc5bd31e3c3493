"""`python -m ajet.copilot.validate`: validate a job YAML read from stdin.

Both forms are read: this project's flat YAML and the original AgentJet's nested `ajet:`
tree (converted by `ajet.copilot.nested_config`), so the conversion, too, runs from the
active snapshot. `notes` lists settings accepted without effect here.

The swarm server runs this from the active snapshot in a short subprocess, so a synced
change to the job schema takes effect (DESIGN.md). Prints one JSON object to stdout:
`{"ok": true, "config": {...}, "notes": [...]}` or `{"ok": false, "message": ..., "errors": [...]}`.
"""

from __future__ import annotations

import json
import sys

import ajet
from ajet.copilot.job import AgentJetJob, JobValidationError


def main() -> int:
    text = sys.stdin.read()
    try:
        job = AgentJetJob.from_yaml(text)
    except JobValidationError as exc:
        json.dump({"ok": False, "message": str(exc), "errors": exc.errors,
                   "ajet_file": ajet.__file__}, sys.stdout)
        return 0
    json.dump({"ok": True, "config": job.model_dump(mode="json"), "notes": job.compat_notes(),
               "ajet_file": ajet.__file__}, sys.stdout)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
