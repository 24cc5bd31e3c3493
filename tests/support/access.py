"""Who may call each route: the access table the auth walks check the server against.

The table is the specification: a route the server grows and this table does not name
fails the walk (tests/security/test_auth_walk.py), so nobody adds a route without deciding
who may call it.
"""

from __future__ import annotations

__all__ = ["ACCESS", "APPROVER", "CONTROL", "DOC_ROUTES", "EPISODE_KEY", "OPEN", "READER",
           "REVIEWER"]

OPEN = "open"  # no token
EPISODE_KEY = "episode key"  # the signed key from begin_episode, never a bearer token
READER = "reader"  # worker or control token
CONTROL = "control"  # control token only
APPROVER = "approver"  # an approver token only (the control token cannot approve)
REVIEWER = "reviewer"  # control or approver token: the server's own code, to review

ACCESS: dict[tuple[str, str], str] = {
    ("GET", "/health"): OPEN,
    ("POST", "/v1/chat/completions"): EPISODE_KEY,
    ("POST", "/v1/completions"): EPISODE_KEY,
    ("POST", "/v1/responses"): EPISODE_KEY,
    ("POST", "/v1/messages"): EPISODE_KEY,
    ("POST", "/v1/messages/count_tokens"): EPISODE_KEY,
    ("GET", "/v1/models"): EPISODE_KEY,
    ("GET", "/v1/models/{model}"): EPISODE_KEY,
    ("GET", "/version"): READER,
    ("GET", "/get_engine_status"): READER,
    ("GET", "/runs"): READER,
    ("GET", "/runs/{run_id}"): READER,
    ("POST", "/runs"): CONTROL,
    ("POST", "/runs/{run_id}/stop"): CONTROL,
    ("GET", "/runs/{run_id}/status"): READER,
    ("GET", "/runs/{run_id}/metrics"): READER,
    ("GET", "/runs/{run_id}/logs"): READER,
    ("GET", "/runs/{run_id}/checkpoints"): READER,
    ("GET", "/runs/{run_id}/samples"): READER,
    ("GET", "/runs/{run_id}/checkpoints/{name}"): CONTROL,
    ("GET", "/runs/{run_id}/checkpoints/{name}/archive"): CONTROL,
    ("POST", "/begin_episode"): READER,
    # the original AgentJet's own routes (swarm_server/routes/original.py)
    ("POST", "/claim_episode"): READER,
    ("GET", "/get_current_batch_rollout_pool_information"): READER,
    ("POST", "/get_episode_buffer"): READER,
    ("POST", "/can_continue_episode"): READER,
    ("GET", "/get_server_experiment_dir"): READER,
    ("POST", "/agree_sync_weight"): READER,
    ("POST", "/end_episode"): READER,
    ("POST", "/abort_episode"): READER,
    ("GET", "/sync_train_config"): READER,
    ("POST", "/sync_train_config"): CONTROL,
    ("POST", "/start_engine"): CONTROL,
    ("POST", "/stop_engine"): CONTROL,
    ("POST", "/sync_train_code"): CONTROL,
    ("POST", "/code/manifest"): CONTROL,
    ("POST", "/code/blobs"): CONTROL,
    ("POST", "/code/commit"): CONTROL,
    ("GET", "/code"): CONTROL,
    ("GET", "/code/snapshots"): CONTROL,
    ("GET", "/code/snapshots/{snapshot_ref}"): CONTROL,
    ("GET", "/code/blobs/{sha256}"): CONTROL,
    ("POST", "/code/activate"): CONTROL,
    ("POST", "/code/gc"): CONTROL,
    ("GET", "/audit"): CONTROL,
    ("GET", "/code/server"): REVIEWER,
    ("GET", "/code/server/blobs/{sha256}"): REVIEWER,
    ("GET", "/approvals"): APPROVER,
    ("GET", "/approvals/{snapshot_ref}"): APPROVER,
    ("POST", "/approvals/{snapshot_ref}/approve"): APPROVER,
    ("POST", "/approvals/{snapshot_ref}/deny"): APPROVER,
    ("POST", "/approvals/{snapshot_ref}/revoke"): APPROVER,
}
#: Served outside the schema; a reader token opens them.
DOC_ROUTES = [("GET", "/docs"), ("GET", "/redoc"), ("GET", "/openapi.json"),
              ("GET", "/docs/oauth2-redirect")]
