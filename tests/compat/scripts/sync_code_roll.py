"""The blog's remote-controlled flow (docs/en/blog_sync_train_code.md), run from an
AgentJet checkout: with SYNC_CODE=1 the tracked ajet/ is synced, then the job is
synced and the engine restarted on it."""

import os

from ajet.copilot.job import AgentJetJob
from ajet.tuner_lib.experimental.swarm_client import SwarmClient

swarm_worker = SwarmClient(os.getenv("AJET_SWARM_URL", "http://localhost:10086"))

if os.getenv("SYNC_CODE", "0") == "1":
    result = swarm_worker.sync_train_code_from_dir(os.getcwd(), force_restart=True)
    print("synced:", result["success"], result["temp_ajet_code_path"], result["snapshot_id"])

swarm_worker.auto_sync_train_config_and_start_engine(
    AgentJetJob(
        experiment_name="remote_controlled_grpo",
        algorithm="grpo",
        n_gpu=0,
        model="ajet-tiny",
        batch_size=2,
        num_repeat=2,
    ),
    force_restart=True,
)
print("engine:", swarm_worker.get_engine_status()[0])
