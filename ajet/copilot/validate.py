"""`python -m ajet.copilot.validate`: validate a job YAML read from stdin.

Both forms are read: this project's flat YAML and the original AgentJet's nested `ajet:`
tree (converted by `ajet.compat.nested_config`), so the conversion, too, runs from the
active snapshot. `notes` lists settings accepted without effect here.

Fields the user left unset (the client sends only those it set) and whose default follows
the model, `lr`, `max_new_tokens`, `save_every`, ..., are chosen here from the model's
`config.json` (`ajet/copilot/model_defaults.py`); each choice, and each set value far
outside the usual range for the model, is a note (`status` `default` or `unusual`).

After the fields, the memory planner (`ajet/engine/planning/memory_plan.py`, no torch) estimates
the job's peak memory per GPU from the checkpoint's `config.json`; a job that will not fit
is refused here, before anything starts, with the estimate by term, the memory available
and the smallest changes that fit (`memory_check: warn` accepts it with the estimate).

The swarm server runs this from the active snapshot in a short subprocess, so a synced
change to the job schema, the conversion or the planner takes effect (docs/design.md). Prints
one JSON object to stdout: `{"ok": true, "config": {...}, "notes": [...], "memory": {...}
| null}` or `{"ok": false, "message": ..., "errors": [...], "hint"?: ...}`.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import ajet
from ajet.copilot.job import AgentJetJob, JobValidationError
from ajet.copilot.model_defaults import resolve_job
from ajet.engine.planning.memory_plan import plan_job
from ajet.engine.tracking.trackers import missing_packages, parse_logging


def check(text: str) -> dict[str, Any]:
    """The validator's answer for one job YAML (see the module docstring)."""
    where = {"ajet_file": ajet.__file__}
    try:
        job = AgentJetJob.from_yaml(text)
    except JobValidationError as exc:
        return {"ok": False, "message": str(exc), "errors": exc.errors, **where}
    try:
        job, chosen = resolve_job(job)
    except JobValidationError as exc:  # a chosen value breaks a rule with a set one
        return {"ok": False, "message": str(exc), "errors": exc.errors, **where}
    except ValueError as exc:  # a config.json that cannot be read
        return {"ok": False, "message": f"model: {exc}", **where,
                "errors": [{"loc": ["model"], "msg": str(exc), "type": "value_error"}]}
    try:
        plan = plan_job(job)
    except ValueError as exc:  # a config.json the planner cannot read
        return {"ok": False, "message": f"model: {exc}", **where,
                "errors": [{"loc": ["model"], "msg": str(exc), "type": "value_error"}]}
    memory = plan.to_dict() if plan is not None else None
    if plan is not None and not plan.fits and job.memory_check == "refuse":
        return {"ok": False, "message": plan.summary(), **where,
                "errors": [{"loc": [], "msg": plan.render(), "type": "memory_estimate",
                            "memory": memory}],
                "hint": (f"{plan.hint()}; or set memory_check: warn to start it anyway; "
                         "nothing was changed (the previous config stays)")}
    missing = missing_packages(parse_logging(job.logging))
    if missing:
        installs = "; ".join(f"{name}: {install}" for name, install in missing)
        return {"ok": False, "message": f"logging: the tracker package is not installed on "
                f"the cluster: {', '.join(name for name, _ in missing)}", **where,
                "errors": [{"loc": ["logging"], "type": "tracker_missing",
                            "msg": f"{name} is not installed where the engine runs"}
                           for name, _ in missing],
                "hint": f"install it where the engine runs ({installs}), or drop it from "
                        "logging; nothing was changed (the previous config stays)"}
    return {"ok": True, "config": job.model_dump(mode="json"), "notes": job.compat_notes() + chosen,
            "memory": memory, **where}


def main() -> int:
    json.dump(check(sys.stdin.read()), sys.stdout)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
