"""`EpisodePlane`: the state the private app serves from.

One object per engine process, built by the runtime at boot. The routes (`app.py`,
`openai_api.py`, `responses_api.py`) read the registry and, once the model is loaded,
the chat format and the generator from it.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any

from ajet.errors import SwarmHTTPError
from ajet.engine.config import EngineConfig
from ajet.engine.generation.interface import Generator
from ajet.engine.plane.chat_format import ChatFormat
from ajet.engine.plane.episodes import EpisodeRegistry
from ajet.engine.plane.serving import GenerationTracker
from ajet.engine.policy import Policy
from ajet.protocol import EngineReport

__all__ = ["EpisodePlane"]

log = logging.getLogger(__name__)


@dataclass
class EpisodePlane:
    """What the channel serves. `policy` and `inference` arrive once the model is loaded."""

    cfg: EngineConfig
    registry: EpisodeRegistry
    run_id: str | None
    ajet_file: str
    world_size: int = 1
    #: `ajet.__file__` of every rank (rank 0 first)
    ranks_ajet_files: list[str] = field(default_factory=list)
    #: content id of the ajet/ tree rank 0 imported (`packaging.folder_snapshot_id`)
    snapshot_id: str | None = None
    #: the same for every rank, rank 0 first: the server's code check compares these
    ranks_snapshot_ids: list[str | None] = field(default_factory=list)
    policy: Policy | None = None
    inference: Generator | None = None
    #: the policy's chat template and response parsing; built with `set_policy`
    chat_format: ChatFormat | None = None
    started_at: float = field(default_factory=time.time)
    info: dict[str, Any] = field(default_factory=dict)
    #: generations in progress per episode, cancelled when the episode is aborted
    generations: GenerationTracker = field(default_factory=GenerationTracker)

    def set_policy(self, policy: Policy, inference: Generator) -> None:
        """The model is loaded: chats can be served."""
        self.chat_format = ChatFormat(policy.tokenizer)
        log.info("tool calls are parsed with the %s", self.chat_format.source)
        self.policy, self.inference = policy, inference

    def serving(self) -> tuple[ChatFormat, Generator]:
        """What a `/v1/*` call needs; 503 while no policy is loaded."""
        fmt, inference = self.chat_format, self.inference
        if fmt is None or inference is None:
            raise SwarmHTTPError(503, f"engine is {self.registry.state}: no policy loaded",
                                 "wait for ENGINE.ROLLING and call begin_episode")
        return fmt, inference

    def report(self) -> EngineReport:
        snap = self.registry.snapshot()
        return EngineReport(
            state=self.registry.state, pid=os.getpid(), ajet_file=self.ajet_file,
            step=self.registry.step, run_id=self.run_id, world_size=self.world_size,
            ranks_ajet_files=self.ranks_ajet_files or [self.ajet_file],
            snapshot_id=self.snapshot_id,
            ranks_snapshot_ids=self.ranks_snapshot_ids or [self.snapshot_id],
            episodes_in_flight=snap["episodes_in_flight"],
            info={**self.info, **snap, "uptime_s": round(time.time() - self.started_at, 3),
                  **({"generation": self.inference.stats()} if self.inference else {})},
        )
