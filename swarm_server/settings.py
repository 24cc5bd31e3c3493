"""`Settings`: every knob of the swarm server, from flags and `AJET_SWARM_*` variables.

One pydantic-settings class; its validator refuses unsafe combinations (a non-loopback
bind without a control token). Limits are documented in `docs/limits.md`.
"""

from __future__ import annotations

import ipaddress
import re
import sys
from pathlib import Path

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

__all__ = ["Settings", "is_loopback"]

MiB = 1024 * 1024
_MODULE_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*")

#: What the engine imports from third parties to load and serve a Qwen2-style policy
#: (the warm standby's default preload; ajet itself always comes from the snapshot).
STANDBY_PRELOAD = (
    "torch", "numpy", "safetensors", "tokenizers", "transformers",
    "transformers.models.auto.modeling_auto", "transformers.models.auto.tokenization_auto",
    "transformers.models.qwen2.modeling_qwen2", "transformers.models.qwen2.tokenization_qwen2",
    "transformers.generation.continuous_batching",
    "yaml", "pydantic", "httpx", "fastapi", "uvicorn",
)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class Settings(BaseSettings):
    """Server configuration. Environment variables use the `AJET_SWARM_` prefix."""

    model_config = SettingsConfigDict(env_prefix="AJET_SWARM_", extra="ignore")

    host: str = "127.0.0.1"
    port: int = Field(default=10086, ge=0, le=65535)
    workdir: Path = Field(default_factory=Path.cwd, description="ajet_temp/, runs/, ledger")

    token: SecretStr | None = Field(default=None, description="AJET_SWARM_TOKEN: control role")
    worker_token: SecretStr | None = Field(
        default=None, description="AJET_SWARM_WORKER_TOKEN: episode plane and read-only routes"
    )

    # engine lifecycle
    engine_python: str = Field(default=sys.executable, description="Interpreter for the engine")
    engine_module: str = Field(
        default="ajet.engine", pattern=r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$",
        description="AJET_SWARM_ENGINE_MODULE: run as `python -m <module>` with the engine "
                    "command line; server tests point it at tests.swarm_server.fake_engine",
    )
    boot_timeout_s: float = Field(default=300.0, gt=0)
    stop_grace_s: float = Field(default=10.0, ge=0)
    status_poll_s: float = Field(default=0.1, gt=0)
    config_validate_timeout_s: float = Field(default=60.0, gt=0)
    warm_standby: bool = Field(
        default=True,
        description="AJET_SWARM_WARM_STANDBY: keep one engine interpreter with "
                    "standby_preload imported, ready for the next single-process start "
                    "(swarm_server/standby_keeper.py; about 350 MB idle RSS, docs/limits.md)",
    )
    standby_preload: list[str] = Field(
        default_factory=lambda: list(STANDBY_PRELOAD),
        description="AJET_SWARM_STANDBY_PRELOAD (a JSON list): third-party modules the warm "
                    "standby imports ahead of time; never ajet, which comes from the snapshot",
    )

    # code snapshots
    keep_snapshots: int = Field(default=10, ge=1)
    max_upload_bytes: int = Field(default=256 * MiB, gt=0)
    max_files: int = Field(default=5000, gt=0)
    max_file_bytes: int = Field(default=32 * MiB, gt=0)
    max_unpacked_bytes: int = Field(default=512 * MiB, gt=0)
    max_compression_ratio: float = Field(default=100.0, gt=1)
    min_free_disk_bytes: int = Field(default=256 * MiB, ge=0)

    # request limits
    max_json_bytes: int = Field(default=16 * MiB, gt=0)
    max_json_depth: int = Field(default=32, gt=0)
    max_header_bytes: int = Field(default=64 * 1024, ge=1024,
                                  description="request line plus headers (swarm_server.limits)")
    request_body_timeout_s: float = Field(
        default=60.0, gt=0, description="longest wait for the next chunk of a request body")
    engine_request_timeout_s: float = Field(default=120.0, gt=0)

    # episodes
    episode_key_ttl_s: float = Field(default=24 * 3600.0, gt=0)

    @field_validator("standby_preload")
    @classmethod
    def _preload_names(cls, names: list[str]) -> list[str]:
        for name in names:
            if not _MODULE_NAME.fullmatch(name):
                raise ValueError(f"standby_preload: {name!r} is not a module name")
            if name.split(".")[0] == "ajet":
                raise ValueError(f"standby_preload: {name!r} must not be preloaded; ajet is "
                                 "imported from the active snapshot at each start")
        return names

    @model_validator(mode="after")
    def _refuse_open_public_bind(self) -> Settings:
        if not is_loopback(self.host) and self.token is None:
            raise ValueError(
                f"refusing to bind {self.host} without a control token: set AJET_SWARM_TOKEN "
                "(and AJET_SWARM_WORKER_TOKEN for rollout workers), or bind 127.0.0.1"
            )
        return self

    @property
    def ajet_temp(self) -> Path:
        return self.workdir / "ajet_temp"

    @property
    def runs_dir(self) -> Path:
        return self.workdir / "runs"

    @property
    def ledger_path(self) -> Path:
        return self.workdir / "swarm.sqlite3"
