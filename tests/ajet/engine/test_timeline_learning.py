"""Learning through merged samples: a three-turn workflow on ajet-tiny learns digits.

Each episode asks three times; the follow-ups quote the model's earlier replies, so each
call extends the one before and the episode trains as one sample. The reward is the
digit share of all three replies. It must rise by 0.3 within 120 s of start_engine.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from ajet.client import SwarmClient
from ajet.copilot.job import AgentJetJob
from ajet.protocol import BeginEpisodeResponse
from ajet.rollout import RolloutRunner, WorkflowOutput
from tests.support import start_server

PROMPTS = ["Reply with digits only.", "What is 12 + 30?", "Give me a phone number.",
           "Write seven digits."]
TASKS = [{"task_id": f"multi-{i}", "prompt": p} for i, p in enumerate(PROMPTS)]


def digit_share(text: str) -> float:
    return sum(ch.isdigit() for ch in text) / len(text) if text else 0.0


def three_turns(task: dict[str, Any], episode: BeginEpisodeResponse) -> WorkflowOutput:
    import openai

    client = openai.OpenAI(base_url=episode.openai_base_url, api_key=episode.openai_api_key,
                           max_retries=0)
    history: list[dict[str, Any]] = [{"role": "user", "content": task["prompt"]}]
    replies = []
    for _ in range(3):
        reply = client.chat.completions.create(model="ajet-tiny", messages=history,
                                               max_tokens=12).choices[0].message.content or ""
        replies.append(reply)
        history += [{"role": "assistant", "content": reply},
                    {"role": "user", "content": f'You said "{reply}". Once more, digits.'}]
    share = digit_share("".join(replies))
    return WorkflowOutput(reward=share, log_metrics={"digit_share": share})


@pytest.mark.slow
def test_a_three_turn_workflow_learns_through_merged_samples(tmp_path: Path) -> None:
    job = AgentJetJob(batch_size=4, num_repeat=8, lr=0.02, max_new_tokens=12)
    server = start_server(tmp_path / "swarm")
    client = SwarmClient(server.url, timeout=60)
    runner = RolloutRunner(client, three_turns, TASKS, n_workers=4, num_repeat=job.num_repeat)
    try:
        started = time.monotonic()
        client.configure_and_start(job, wait_timeout=120)
        runner.start()
        points: list[dict[str, Any]] = []
        rise = 0.0
        while time.monotonic() - started < 120 and rise < 0.3:
            time.sleep(0.5)
            points = client.get_metrics().points
            if len(points) >= 2:
                first = points[0]["reward_mean"]
                rise = (points[-1]["reward_mean"] + points[-2]["reward_mean"]) / 2 - first
        elapsed = time.monotonic() - started
        runner.stop(timeout=30)
    finally:
        runner.stop(timeout=5)
        client.close()
        server.stop()
    rewards = [round(p["reward_mean"], 3) for p in points]
    assert rise >= 0.3, (rewards, elapsed)
    # every episode's three calls were one sample
    merging = [(p["train/completions"], p["train/samples"]) for p in points]
    assert all(m == (96, 32) for m in merging), merging
