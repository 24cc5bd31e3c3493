"""The engine's private channel in process: `create_channel_app` behind a `TestClient`.

`plane_app` builds what the engine's runtime builds at boot (an `EngineConfig` from a job,
the episode registry in ENGINE.ROLLING, the `EpisodePlane`) around the ajet-tiny
checkpoint's tokenizer and a `ScriptedGenerator` instead of the model, so the routes of
`ajet.engine.plane` (chat, completions, responses) run exactly as in the engine, without a
subprocess, a socket or a forward pass.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fastapi.testclient import TestClient

from ajet.copilot.job import AgentJetJob
from ajet.engine.config import EngineConfig, engine_config_from_job
from ajet.engine.plane.app import create_channel_app
from ajet.engine.plane.episode_plane import EpisodePlane
from ajet.engine.plane.episodes import EpisodeRegistry
from ajet.engine.policy import load_policy
from ajet.engine.tiny import ensure_tiny_model
from ajet.engine.trajectory import Completion
from ajet.protocol import EngineState
from tests.support.engine import ScriptedGenerator

__all__ = ["PlaneApp", "begin", "end", "plane_app", "recorded", "sse_events"]


@dataclass
class PlaneApp:
    """The channel app of one engine "run", its client, and the scripted generator."""

    http: TestClient
    plane: EpisodePlane
    generator: ScriptedGenerator
    tokenizer: Any

    @property
    def cfg(self) -> EngineConfig:
        return self.plane.cfg

    @property
    def model(self) -> str:
        return self.plane.cfg.model

    def encode(self, text: str) -> list[int]:
        return [int(i) for i in self.tokenizer(text, add_special_tokens=False)["input_ids"]]

    def decode(self, ids: list[int]) -> str:
        return str(self.tokenizer.decode(ids, skip_special_tokens=False))

    def last_ask(self) -> tuple[Any, ...]:
        """What the last call asked the generator for: prompt, length, stop, sampling."""
        r = self.generator.requests[-1]
        return r.prompt_ids, r.max_new_tokens, r.stop, r.temperature, r.top_p

    def render(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
               ) -> list[int]:
        """The prompt ids the checkpoint's own chat template gives (what the model sees)."""
        text = self.tokenizer.apply_chat_template(messages, tools=tools, tokenize=False,
                                                  add_generation_prompt=True)
        return self.encode(text)


@contextmanager
def plane_app(root: Path, *, job: AgentJetJob | None = None,
              with_policy: bool = True) -> Iterator[PlaneApp]:
    """The private channel app for `job`, serving from a scripted generator.

    `with_policy=False`: the state before the model is loaded (the `/v1/*` routes: 503).
    """
    job = job or AgentJetJob(batch_size=1, num_repeat=1, max_new_tokens=96)
    cfg = engine_config_from_job(job, cuda_devices=0, cpu_count=1)
    registry = EpisodeRegistry(group_size=job.num_repeat, max_in_flight=64,
                               default_timeout_s=600, batch_size=job.batch_size)
    registry.set_state(EngineState.ROLLING)
    plane = EpisodePlane(cfg=cfg, registry=registry, run_id="scripted-run",
                         ajet_file=str(root / "ajet" / "__init__.py"))
    policy = load_policy(ensure_tiny_model(root, seed=0), device="cpu", dtype="float32", seed=0)
    generator = ScriptedGenerator(policy.tokenizer, default="",
                                  eos_id=int(policy.tokenizer.convert_tokens_to_ids("<|im_end|>")))
    if with_policy:
        plane.set_policy(policy, generator)
    with TestClient(create_channel_app(plane), raise_server_exceptions=False) as http:
        yield PlaneApp(http, plane, generator, policy.tokenizer)


def begin(app: PlaneApp, **body: Any) -> str:
    r = app.http.post("/begin_episode", json=body)
    assert r.status_code == 200, r.text
    return str(r.json()["episode_uuid"])


def end(app: PlaneApp, uuid: str, *, reward: float = 1.0) -> str:
    r = app.http.post("/end_episode", json={"episode_uuid": uuid, "task_id": f"task-{uuid}",
                                            "reward": reward})
    assert r.status_code == 200, r.text
    return uuid


def recorded(app: PlaneApp, uuid: str) -> list[Completion]:
    """The completions an ended training episode brought to the current batch."""
    ready, open_groups = app.plane.registry.current_batch()
    for group in (*ready, *open_groups):
        for episode in group.episodes:
            if episode.uuid == uuid:
                return list(episode.trajectory.completions)
    raise AssertionError(f"episode {uuid} is not in the current batch")


def sse_events(text: str) -> list[Any]:
    """The `data:` payloads of a server-sent event stream, JSON-decoded ("[DONE]" kept)."""
    out: list[Any] = []
    for block in text.split("\n\n"):
        for line in block.splitlines():
            if line.startswith("data: "):
                data = line.removeprefix("data: ")
                out.append(data if data == "[DONE]" else json.loads(data))
    return out
