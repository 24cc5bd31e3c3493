"""`Settings`: every knob of the swarm server, from flags and `AJET_SWARM_*` variables.

One pydantic-settings class; its validator refuses unsafe combinations (a non-loopback
bind without a control token). Limits are documented in `docs/limits.md`.
"""

from __future__ import annotations

import ipaddress
import re
import sys
from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field, PrivateAttr, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

__all__ = ["Settings", "is_loopback", "parse_approver_tokens"]

MiB = 1024 * 1024
#: The shortest token the server accepts: a short token is guessed by trying them all.
MIN_TOKEN_CHARS = 16
#: Variable name prefixes that never reach code the server runs (`--engine-env` included).
SECRET_ENV_PREFIXES = ("AJET_SWARM_", "AJET_MCP_")
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_USER_NAME = re.compile(r"[a-z_][a-z0-9_.-]{0,31}")
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


_APPROVER_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.@-]{0,63}")


def parse_approver_tokens(text: str, *, source: str) -> dict[str, str]:
    """`{name: token}` from `name=token` items separated by commas or new lines.

    Blank items and lines starting with `#` are skipped. A name is what the ledger and the
    audit log record for every decision, so names are unique and plain.
    """
    out: dict[str, str] = {}
    for item in re.split(r"[,\n]", text):
        item = item.strip()
        if not item or item.startswith("#"):
            continue
        name, sep, token = item.partition("=")
        name, token = name.strip(), token.strip()
        if not sep or not token:
            raise ValueError(f"{source}: {name or item[:20]!r} is not name=token")
        if not _APPROVER_NAME.fullmatch(name):
            raise ValueError(f"{source}: approver name {name!r} must be 1-64 letters, digits "
                             "or _.@- (it is what the audit log records)")
        if name in out:
            raise ValueError(f"{source}: approver {name!r} is listed twice")
        out[name] = token
    return out


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
    approver_tokens: SecretStr | None = Field(
        default=None,
        description="AJET_SWARM_APPROVER_TOKENS: `name=token,...`; with any approver, every "
                    "snapshot needs an approver's approval before it runs (docs/security.md)")
    approver_tokens_file: Path | None = Field(
        default=None,
        description="AJET_SWARM_APPROVER_TOKENS_FILE: a file of `name=token` lines (`#` "
                    "comments), read at start; adds to AJET_SWARM_APPROVER_TOKENS")
    ui_session_ttl_s: float = Field(
        default=8 * 3600.0, gt=0, le=7 * 86_400.0,
        description="AJET_SWARM_UI_SESSION_TTL_S: how long a web console sign-in lasts")
    ui_sign_ins_per_source: int = Field(
        default=10, ge=1, le=10_000,
        description="AJET_SWARM_UI_SIGN_INS_PER_SOURCE: console sign-in attempts per minute "
                    "from one address (past it: 429)")
    ui_sign_ins_overall: int = Field(
        default=100, ge=1, le=100_000,
        description="AJET_SWARM_UI_SIGN_INS_OVERALL: console sign-in attempts per minute "
                    "from all addresses together")
    allow_extension_modules: bool = Field(
        default=False,
        description="AJET_SWARM_ALLOW_EXTENSION_MODULES: accept compiled extension modules "
                    "(.so, .pyd) in snapshots; a reviewer cannot read them")

    new_ledger: bool = Field(
        default=False,
        description="AJET_SWARM_NEW_LEDGER (`--new-ledger`): start a fresh ledger when the "
                    "ledger file is empty or unreadable, moving the old file aside; without "
                    "it such a ledger stops the server at start")

    # where runs are placed (docs/distributed.md)
    launcher: Literal["local", "ray"] = Field(
        default="local",
        description="AJET_SWARM_LAUNCHER (`--launcher`): `local` runs the engine on this "
                    "machine; `ray` places each run on a Ray cluster as one Ray job "
                    "(the `ray` extra; swarm_server/launchers/ray_launcher.py)")
    ray_address: str = Field(
        default="http://127.0.0.1:8265", min_length=1, max_length=2000,
        description="AJET_SWARM_RAY_ADDRESS (`--ray-address`): the Ray cluster's Jobs API "
                    "(its dashboard address); Ray's token authentication, where the cluster "
                    "uses it, is read by Ray's client from the server's environment")
    ray_placement_timeout_s: float = Field(
        default=30.0, gt=0, le=3600,
        description="AJET_SWARM_RAY_PLACEMENT_TIMEOUT_S: how long a run's placement group "
                    "may wait for the cluster once the free resources fit; past it the start "
                    "is refused with what Ray reports free")
    ray_submit_timeout_s: float = Field(
        default=180.0, gt=0, le=3600,
        description="AJET_SWARM_RAY_SUBMIT_TIMEOUT_S: from submitting a run's Ray job to its "
                    "placement (Ray sets up the job's runtime_env: uploads and unpacks the "
                    "code)")
    ray_shared_workdir: bool = Field(
        default=False,
        description="AJET_SWARM_RAY_SHARED_WORKDIR (`--ray-shared-workdir`): the server's "
                    "work directory is the same path on every Ray node (a shared "
                    "filesystem), so a run's ranks import the snapshot from it instead of "
                    "from a runtime_env package Ray uploads and unpacks on each node")
    ray_cpus_per_gpu: float = Field(
        default=1.0, ge=0, le=1024,
        description="AJET_SWARM_RAY_CPUS_PER_GPU: CPUs a GPU run's bundle reserves per GPU "
                    "besides the GPU (a CPU run reserves its n_proc CPUs per node)")

    # engine lifecycle
    engine_env: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="AJET_SWARM_ENGINE_ENV (`--engine-env NAME,...`): more variables passed "
                    "from the server's environment to the engine, its ranks, the standby and "
                    "the config validator (tracker keys, say); synced code can read them")
    engine_user: str | None = Field(
        default=None,
        description="AJET_SWARM_ENGINE_USER (`--engine-user NAME`): run every engine rank, "
                    "the standby and the validator as this OS user (the server must be able "
                    "to switch users, e.g. run as root); docs/security.md")
    engine_python: str = Field(default=sys.executable, description="Interpreter for the engine")
    engine_module: str = Field(
        default="ajet.engine", pattern=r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$",
        description="AJET_SWARM_ENGINE_MODULE: run as `python -m <module>` with the engine "
                    "command line; server tests point it at tests.support.fake_engine",
    )
    boot_timeout_s: float = Field(
        default=300.0, gt=0,
        description="AJET_SWARM_BOOT_TIMEOUT_S: boot deadline of a run whose job has no "
                    "boot_timeout_s (ajet-tiny; larger models get one by size)")
    stop_grace_s: float = Field(
        default=10.0, ge=0,
        description="AJET_SWARM_STOP_GRACE_S: SIGTERM-to-SIGKILL grace of a run whose job "
                    "has no stop_grace_s (ajet-tiny; larger models get one by checkpoint size)")
    max_boot_timeout_s: float = Field(
        default=3600.0, gt=0,
        description="AJET_SWARM_MAX_BOOT_TIMEOUT_S: the most a job's boot_timeout_s may ask")
    max_stop_grace_s: float = Field(
        default=1800.0, ge=0,
        description="AJET_SWARM_MAX_STOP_GRACE_S: the most a job's stop_grace_s may ask")
    devices: int | None = Field(
        default=None, ge=1, le=4096,
        description="AJET_SWARM_DEVICES (`--devices N`): device slots for concurrent runs. "
                    "On a GPU host, the first N visible GPUs (default: all of them); on a CPU "
                    "host, N slots that runs take one per process (default: the CPU count); "
                    "swarm_server/devices.py")
    #: the largest checkpoint GET /runs/{id}/checkpoints/{name}/archive sends
    max_checkpoint_archive_bytes: int = Field(default=256 * 1024 * MiB, gt=0)
    #: where the engines' MLflow tracker writes (logging: mlflow); None: <workdir>/mlflow.db
    mlflow_tracking_uri: str | None = Field(default=None, max_length=2000)
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
    header_timeout_s: float = Field(
        default=10.0, gt=0, description="AJET_SWARM_HEADER_TIMEOUT_S: a connection whose "
        "request line and headers are not complete this long after they began (or after "
        "it opened) is closed (swarm_server.http_protocol)")
    http_parser: Literal["auto", "httptools", "h11"] = Field(
        default="auto", description="AJET_SWARM_HTTP_PARSER: uvicorn's request parser; auto "
        "= httptools where installed (the server extra has it), else h11 "
        "(swarm_server/http_protocol.py)")
    request_body_timeout_s: float = Field(
        default=60.0, gt=0, description="longest wait for the next chunk of a request body")
    engine_request_timeout_s: float = Field(default=120.0, gt=0)
    log_regex_timeout_s: float = Field(
        default=1.0, gt=0, le=60, description="AJET_SWARM_LOG_REGEX_TIMEOUT_S: time budget "
        "of one regex log search (GET /runs/{id}/logs?regex=true); past it: 400")

    # episodes
    episode_key_ttl_s: float = Field(default=24 * 3600.0, gt=0)
    max_episode_body_bytes: int = Field(
        default=1 * MiB, gt=0, description="AJET_SWARM_MAX_EPISODE_BODY_BYTES: body bound of "
        "begin_episode, end_episode and abort_episode")
    max_reward_magnitude: float = Field(
        default=1e6, gt=0, le=1e300, description="AJET_SWARM_MAX_REWARD_MAGNITUDE: "
        "end_episode refuses a reward with a larger absolute value (422)")
    max_metric_magnitude: float = Field(
        default=1e6, gt=0, le=1e300, description="AJET_SWARM_MAX_METRIC_MAGNITUDE: "
        "end_episode refuses a log_metrics value with a larger absolute value (422)")
    max_gateway_episodes: int = Field(
        default=100_000, ge=100, description="AJET_SWARM_MAX_GATEWAY_EPISODES: entries in "
        "the episode gateway's table (swarm_server.episodes); begin_episode answers 409 "
        "when every entry is a live episode")

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

    @field_validator("engine_env", mode="before")
    @classmethod
    def _split_engine_env(cls, value: object) -> object:
        if isinstance(value, str):
            return [v.strip() for v in value.split(",") if v.strip()]
        return value

    @field_validator("engine_env")
    @classmethod
    def _engine_env_names(cls, names: list[str]) -> list[str]:
        for name in names:
            if not _ENV_NAME.fullmatch(name):
                raise ValueError(f"--engine-env: {name!r} is not a variable name")
            if name.upper().startswith(SECRET_ENV_PREFIXES):
                raise ValueError(f"--engine-env: {name} is the server's or the bridge's own "
                                 "setting and never reaches code the server runs")
        return names

    @field_validator("engine_user")
    @classmethod
    def _engine_user_name(cls, name: str | None) -> str | None:
        if name is not None and not _USER_NAME.fullmatch(name):
            raise ValueError(f"--engine-user: {name!r} is not a user name")
        return name

    _approvers: dict[str, str] = PrivateAttr(default_factory=dict)

    @model_validator(mode="after")
    def _load_approvers(self) -> Settings:
        approvers: dict[str, str] = {}
        if self.approver_tokens is not None:
            approvers = parse_approver_tokens(self.approver_tokens.get_secret_value(),
                                              source="AJET_SWARM_APPROVER_TOKENS")
        if self.approver_tokens_file is not None:
            try:
                text = self.approver_tokens_file.read_text("utf-8")
            except OSError as exc:
                raise ValueError(f"AJET_SWARM_APPROVER_TOKENS_FILE: cannot read "
                                 f"{self.approver_tokens_file}: {exc.strerror}") from exc
            for name, token in parse_approver_tokens(
                    text, source=str(self.approver_tokens_file)).items():
                if name in approvers:
                    raise ValueError(f"approver {name!r} is named in both "
                                     "AJET_SWARM_APPROVER_TOKENS and the tokens file")
                approvers[name] = token
        named = {"AJET_SWARM_TOKEN": self.token, "AJET_SWARM_WORKER_TOKEN": self.worker_token}
        for source, secret in named.items():
            if secret is not None and len(secret.get_secret_value()) < MIN_TOKEN_CHARS:
                raise ValueError(f"{source} is shorter than {MIN_TOKEN_CHARS} characters; a "
                                 "short token is found by trying them all: use at least "
                                 f"{MIN_TOKEN_CHARS} random characters (python -c 'import "
                                 "secrets; print(secrets.token_urlsafe(32))')")
        for name, token in approvers.items():
            if len(token) < MIN_TOKEN_CHARS:
                raise ValueError(f"approver {name!r}: the token is shorter than "
                                 f"{MIN_TOKEN_CHARS} characters; use at least "
                                 f"{MIN_TOKEN_CHARS} random characters")
        if approvers and self.token is None:
            raise ValueError(
                "approver tokens need a control token: without AJET_SWARM_TOKEN the control "
                "routes stay open, and anyone could upload and start code; set AJET_SWARM_TOKEN")
        others = {t.get_secret_value() for t in (self.token, self.worker_token) if t}
        tokens = list(approvers.values())
        if len(set(tokens)) != len(tokens) or others & set(tokens):
            raise ValueError("every approver token must differ from the others and from the "
                             "control and worker tokens")
        self._approvers = approvers
        return self

    @property
    def approvers(self) -> dict[str, str]:
        """`{approver name: token}`; empty = approvals are not enforced."""
        return dict(self._approvers)

    @property
    def approvals_enforced(self) -> bool:
        return bool(self._approvers)

    def secret_values(self) -> list[str]:
        """Every configured secret (tokens), longest first: what redaction removes."""
        found = [t.get_secret_value() for t in (self.token, self.worker_token) if t]
        found += list(self._approvers.values())
        return sorted(set(found), key=len, reverse=True)

    @model_validator(mode="after")
    def _engine_python_everywhere(self) -> Settings:
        # A Ray job's entrypoint runs on whichever node Ray picks, with that node's PATH:
        # only an absolute path names the same interpreter on every node
        if self.launcher == "ray" and not Path(self.engine_python).is_absolute():
            raise ValueError(
                f"AJET_SWARM_ENGINE_PYTHON={self.engine_python!r}: under --launcher ray the "
                "engine's interpreter must be an absolute path, the same on every Ray node "
                "(e.g. /opt/venv/bin/python)")
        return self

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

    def mlflow_uri(self) -> str:
        """The MLflow tracking URI the engines use: the setting, or SQLite in the workdir
        (MLflow 3 refuses the plain file store unless told to)."""
        return self.mlflow_tracking_uri or f"sqlite:///{self.workdir.resolve() / 'mlflow.db'}"
