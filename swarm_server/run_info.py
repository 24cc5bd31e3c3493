"""`run_info.json`: what the server knows of a run's code, written into its run directory.

The engine's trackers label their runs with it (`ajet/engine/tracking/trackers.py`), so a
curve in TensorBoard, W&B, MLflow or SwanLab leads back to the exact code: the snapshot
id, who approved it and when, the base its review was computed against, the client's
git provenance and a summary of its diff. The MLflow tracking URI is the server's
setting, passed the same way.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ajet.protocol import SERVER_CODE, SnapshotApproval
from swarm_server.ledger import SnapshotRecord

__all__ = ["RUN_INFO_FILE", "diff_summary", "write_run_info"]

RUN_INFO_FILE = "run_info.json"


def diff_summary(diff: str) -> dict[str, int]:
    """Files, added and removed lines of a unified diff (`git diff HEAD`)."""
    files = added = removed = 0
    for line in diff.splitlines():
        if line.startswith("diff --git "):
            files += 1
        elif line.startswith("+") and not line.startswith("+++"):
            added += 1
        elif line.startswith("-") and not line.startswith("---"):
            removed += 1
    return {"files": files, "added": added, "removed": removed}


def write_run_info(run_dir: Path, *, snapshot: SnapshotRecord | None,
                   approval: SnapshotApproval, mlflow_tracking_uri: str) -> Path:
    provenance: dict[str, Any] = snapshot.provenance if snapshot else {}
    info = {
        "snapshot_id": snapshot.id if snapshot else SERVER_CODE,
        "approval": approval.state.value,
        "approved_by": approval.approver or (snapshot.approved_by if snapshot else None),
        "approved_at": approval.at,
        "reviewed_against": getattr(approval, "base", None),
        "git_head": provenance.get("git_head"),
        "branch": provenance.get("branch"),
        "dirty": provenance.get("dirty", False),
        "diff_summary": diff_summary(str(provenance.get("diff") or "")),
        "mlflow_tracking_uri": mlflow_tracking_uri,
    }
    path = run_dir / RUN_INFO_FILE
    path.write_text(json.dumps(info, indent=1), encoding="utf-8")
    return path
