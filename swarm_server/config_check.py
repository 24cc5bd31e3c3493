"""Validate a job's YAML with the *active code's* own validator, in a short subprocess.

docs/design.md: whatever a researcher may patch runs from the active snapshot, config
validation included, so a synced change to `ajet/copilot/job.py` takes effect. The
server therefore never imports the job model itself; it runs
`python -m ajet.copilot.validate` with the snapshot first on `PYTHONPATH` and reads one
JSON object from its stdout.
"""

from __future__ import annotations

import hashlib
import json
import logging
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from swarm_server.engine_user import EngineUser
from ajet.errors import SwarmValidationError
from swarm_server.run_files import redact_secrets
from swarm_server.settings import Settings
from swarm_server.supervisor import engine_env

__all__ = ["ValidatedConfig", "config_hash", "is_inside", "refuse_yaml_expansion",
           "validate_job_yaml"]

log = logging.getLogger(__name__)

_STDERR_TAIL_BYTES = 16 * 1024
#: A validator's JSON result: a job config with notes and a memory estimate, far smaller.
_MAX_RESULT_BYTES = 4 * 1024 * 1024
_STDERR_TAIL_LINES = 15
_STDERR_LINE_CHARS = 400
_HINT_FIX_CODE = ("the validator of the active code failed: fix ajet/copilot/ in your tree and "
                  "sync again, or activate the server's code with activate_snapshot('server')")


@dataclass(frozen=True)
class ValidatedConfig:
    """A job accepted by the active code's validator."""

    config: dict[str, Any]  # every field, defaults filled in
    yaml_text: str  # the normalised YAML stored and handed to the engine
    config_hash: str  # sha256 of `yaml_text`
    experiment_name: str
    ajet_file: str | None  # which ajet the validator ran from
    notes: list[dict[str, str]] = field(default_factory=list)  # accepted without effect
    #: the memory planner's estimate (ajet/engine/planning/memory_plan.py), None when the snapshot's
    #: validator has no planner or the model's config.json is not on this machine
    memory: dict[str, Any] | None = None


def config_hash(yaml_text: str) -> str:
    return hashlib.sha256(yaml_text.encode("utf-8")).hexdigest()


#: libyaml's scanner where installed: linear, and fast on a large text.
_YAML_LOADER: Any = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def refuse_yaml_expansion(yaml_text: str) -> None:
    """Raise `SwarmValidationError` if `yaml_text` uses anchors, aliases or merge keys.

    A few hundred bytes of aliases expand to millions of entries when the YAML is built
    (a "billion laughs"); a job config never needs them. Only the token stream is read
    (linear in the text, nothing is built), so the refusal is immediate; a syntax error
    is left to the validator, which names its position.
    """
    found: dict[str, str] = {}
    previous: Any = None
    try:
        for token in yaml.scan(yaml_text, Loader=_YAML_LOADER):
            if isinstance(token, yaml.AnchorToken):
                found.setdefault("anchors", f"&{token.value}")
            elif isinstance(token, yaml.AliasToken):
                found.setdefault("aliases", f"*{token.value}")
            elif (isinstance(token, yaml.ScalarToken) and token.plain and token.value == "<<"
                  and isinstance(previous, yaml.KeyToken)):
                found.setdefault("merge keys", "<<")
            previous = token
    except yaml.YAMLError:
        pass  # what was scanned before the error still counts
    if found:
        named = ", ".join(f"{kind} ({example})" for kind, example in found.items())
        raise SwarmValidationError(
            422, [{"loc": ["yaml"], "msg": f"YAML {named} are not accepted in a job config: they "
              "can expand a small text into a huge one", "type": "value_error"}],
            "write every value out in full (AgentJetJob(...).to_yaml() does); nothing was "
            "changed (the previous config stays)")


def validate_job_yaml(settings: Settings, yaml_text: str, *, base_dir: Path | None,
                      engine_user: EngineUser | None = None,
                      extra_env: dict[str, str] | None = None) -> ValidatedConfig:
    """Run the validator from `base_dir` (a snapshot) or the server's ajet (None).

    Raises `SwarmValidationError` naming each bad field, or saying why the validator failed.
    YAML anchors, aliases and merge keys are refused first (`refuse_yaml_expansion`).
    """
    refuse_yaml_expansion(yaml_text)
    cmd = [settings.engine_python, "-m", "ajet.copilot.validate"]
    # cwd is sys.path[0] under -m: the snapshot itself, or the workdir (no ajet/ inside)
    cwd = base_dir if base_dir is not None else settings.workdir
    try:
        proc = subprocess.run(
            cmd, input=yaml_text.encode("utf-8"), capture_output=True, cwd=cwd,
            # extra_env: the launcher's word on the nodes' memory, for the planner
            env={**engine_env(settings, base_dir, user=engine_user), **(extra_env or {})},
            timeout=settings.config_validate_timeout_s, check=False,
            **(engine_user.popen_kwargs() if engine_user is not None else {}),
        )
    except subprocess.TimeoutExpired as exc:
        raise SwarmValidationError(
            422,
            f"the job validator did not finish within {settings.config_validate_timeout_s:.0f}s",
            _HINT_FIX_CODE,
        ) from exc
    except OSError as exc:
        raise SwarmValidationError(422, f"cannot run the job validator ({cmd[0]}): {exc}",
                                   "check AJET_SWARM_ENGINE_PYTHON on the server") from exc
    # Bounded and redacted: this reaches the control caller in the 422.
    # (A cut first line could hold part of a token, so it goes.)
    stderr_lines = redact_secrets(proc.stderr[-_STDERR_TAIL_BYTES:].decode(
        "utf-8", errors="replace"), settings.secret_values()).strip().splitlines()
    if len(proc.stderr) > _STDERR_TAIL_BYTES:
        stderr_lines = stderr_lines[1:]
    stderr_tail = [line[:_STDERR_LINE_CHARS] for line in stderr_lines[-_STDERR_TAIL_LINES:]]
    try:
        if len(proc.stdout) > _MAX_RESULT_BYTES:
            raise ValueError(f"a result of {len(proc.stdout)} bytes")
        # every string of the result reaches a caller (the 422, the stored config): a
        # token the validator's code came by is redacted there too
        result = _redacted(json.loads(proc.stdout), settings.secret_values())
        if not isinstance(result, dict) or "ok" not in result:
            raise ValueError("not a validator result")
    except ValueError as exc:
        raise SwarmValidationError(
            422,
            {"message": f"the job validator exited with code {proc.returncode} without a result",
             "stderr": stderr_tail},
            _HINT_FIX_CODE,
        ) from exc

    ajet_file = result.get("ajet_file")
    if base_dir is not None and ajet_file and not is_inside(Path(ajet_file), base_dir):
        log.warning("job validator ran from %s, not from the active snapshot %s", ajet_file,
                    base_dir)
    if not result["ok"]:
        errors = [_error(e) for e in result.get("errors") or []]
        # a whole-job rule (loc []) is named by its message: "max_new_tokens must not ..."
        fields = "; ".join(".".join(e["loc"]) or e["msg"].removeprefix("Value error, ")
                           for e in errors) or "(job)"
        # the memory planner's refusal brings its own hint: the changes that would fit
        hint = result.get("hint")
        raise SwarmValidationError(
            422, errors or [{"loc": [], "msg": str(result.get("message", "invalid job")),
                        "type": "value_error"}],
            str(hint) if isinstance(hint, str) and hint else
            f"fix the job field(s): {fields}; nothing was changed (the previous config stays)",
        )
    config = result.get("config")
    if not isinstance(config, dict):
        raise SwarmValidationError(422, "the job validator returned no config", _HINT_FIX_CODE)
    problem = launcher_problem(settings, config)
    if problem is not None:
        field = "rdzv_endpoint" if "required" in problem else "node_rank/rdzv_endpoint"
        raise SwarmValidationError(422, [{"loc": [field], "msg": problem, "type": "value_error"}],
                                   "fix the job's multi-node fields; nothing was changed "
                                   "(the previous config stays)")
    text = yaml.safe_dump(config, sort_keys=False)
    memory = result.get("memory")
    if isinstance(memory, dict) and memory.get("fits") is False:
        log.warning("memory planner: the job may not fit (memory_check: warn): peak ~%s GiB "
                    "of %s GiB", memory.get("peak_gib"), memory.get("available_gib"))
    return ValidatedConfig(
        config=config, yaml_text=text, config_hash=config_hash(text),
        experiment_name=str(config.get("experiment_name") or ""), ajet_file=ajet_file,
        notes=[{k: str(n.get(k, "")) for k in ("field", "status", "reason")}
               for n in result.get("notes") or [] if isinstance(n, dict)],
        memory=memory if isinstance(memory, dict) else None,
    )


def launcher_problem(settings: Settings, job: dict[str, Any]) -> str | None:
    """Why `job`'s multi-node fields do not fit the server's launcher, or None.

    Under Ray the nodes are Ray's: `nnodes` and `n_gpu` (per node) say what to reserve,
    and the node index and rendezvous are the launcher's to choose. The local launcher
    runs one node's share per server, so a job of several nodes names both.
    """
    node_rank, rdzv = job.get("node_rank") or 0, job.get("rdzv_endpoint")
    if settings.launcher == "ray":
        given = [f"node_rank={node_rank}"] if node_rank else []
        given += [f"rdzv_endpoint={rdzv}"] if rdzv else []
        if given:
            return (f"{' and '.join(given)} cannot be set under the Ray launcher: Ray places "
                    "every node of the run and the launcher picks the rendezvous; set only "
                    "nnodes and n_gpu (per node), and leave node_rank and rdzv_endpoint unset")
        return None
    nnodes = job.get("nnodes")
    if isinstance(nnodes, int) and nnodes > 1 and not rdzv:
        return ("rdzv_endpoint (host:port) is required when nnodes > 1 with the local "
                "launcher (each node's server starts its share); or start the server with "
                "--launcher ray to place every node from one server")
    return None


def _redacted(value: Any, secrets: list[str]) -> Any:
    """`value` (parsed JSON) with every configured secret redacted from its strings."""
    if isinstance(value, str):
        return redact_secrets(value, secrets)
    if isinstance(value, list):
        return [_redacted(v, secrets) for v in value]
    if isinstance(value, dict):
        return {redact_secrets(str(k), secrets): _redacted(v, secrets) for k, v in value.items()}
    return value


def _error(raw: Any) -> dict[str, Any]:
    if not isinstance(raw, dict):
        return {"loc": [], "msg": str(raw), "type": "value_error"}
    error = {"loc": [str(p) for p in raw.get("loc") or []], "msg": str(raw.get("msg", "")),
             "type": str(raw.get("type", "value_error"))}
    if isinstance(raw.get("memory"), dict):  # the planner's estimate, term by term
        error["memory"] = raw["memory"]
    return error


def is_inside(path: Path, root: Path) -> bool:
    """True if `path` resolves to a place under `root` (an ajet file inside a snapshot)."""
    try:
        path.resolve().relative_to(root.resolve())
    except ValueError:
        return False
    return True
