"""The job's `logging` trackers: TensorBoard, W&B, MLflow and SwanLab, in rank 0.

`logging` takes one name, a comma-separated list, or a list: `tensorboard`, `wandb`,
`mlflow`, `swanlab`; `console` (and `none`) mean metrics.jsonl only, as the original's
console logger. Each tracker gets every step's numeric metrics, the run id as its run's
name and the experiment name as its project or group, and, as parameters or tags, the
job's fields and where the code came from (`run_info.json`, written by the swarm server
into the run directory: the snapshot id, who approved it, the base it was reviewed
against and a diff summary), so a curve leads back to the exact code.

Where each writes (`tracker_locations`, also shown by the server):

    tensorboard  <run_dir>/tensorboard         (tensorboard --logdir <run_dir>/tensorboard)
    wandb        <run_dir>/wandb               offline unless WANDB_MODE says otherwise
    mlflow       the server's tracking URI     default sqlite:///<workdir>/mlflow.db
    swanlab      <run_dir>/swanlog             local mode unless SWANLAB_MODE says otherwise

A tracker whose package is missing is refused when the job is configured
(`missing_packages`, run by the validator); one that fails while the run trains is
logged and turned off for that run, and training goes on.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import math
import os
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

__all__ = ["TRACKER_PACKAGES", "RunInfo", "Tracker", "TrackerSet", "missing_packages",
           "open_trackers", "parse_logging", "tracker_locations"]

log = logging.getLogger(__name__)

#: tracker -> (module it imports, what to install for it)
TRACKER_PACKAGES: dict[str, tuple[str, str]] = {
    "tensorboard": ("tensorboard", "pip install 'agentjet-swarm[tensorboard]' (tensorboard)"),
    "wandb": ("wandb", "pip install 'agentjet-swarm[wandb]' (wandb)"),
    "mlflow": ("mlflow", "pip install 'agentjet-swarm[mlflow]' (mlflow)"),
    "swanlab": ("swanlab", "pip install 'agentjet-swarm[swanlab]' (swanlab[dashboard])"),
}
#: `logging` values that name no tracker (metrics.jsonl is always written).
NO_TRACKER = {"console", "none", ""}
#: The run's file the server writes with what it knows of the run's code.
RUN_INFO_FILE = "run_info.json"


def parse_logging(value: str | Iterable[str] | None) -> list[str]:
    """The tracker names a `logging` value asks for, in order, without repeats.

    Raises ValueError naming an unknown one.
    """
    if value is None:
        return []
    items = value.split(",") if isinstance(value, str) else list(value)
    names: list[str] = []
    for item in items:
        name = str(item).strip().lower()
        if name in NO_TRACKER or name in names:
            continue
        if name not in TRACKER_PACKAGES:
            known = ", ".join([*TRACKER_PACKAGES, "console"])
            raise ValueError(f"logging: unknown tracker {name!r}; use one or more of {known}")
        names.append(name)
    return names


def missing_packages(names: Iterable[str]) -> list[tuple[str, str]]:
    """(tracker, what to install) for each tracker whose package is not importable here."""
    missing = []
    for name in names:
        module, install = TRACKER_PACKAGES[name]
        try:
            found = importlib.util.find_spec(module) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            missing.append((name, install))
    return missing


def default_mlflow_uri(workdir: Path) -> str:
    # MLflow 3 refuses the plain file store unless told to; SQLite is its local default
    return f"sqlite:///{Path(workdir).resolve() / 'mlflow.db'}"


def tracker_locations(names: Iterable[str], run_dir: Path, *,
                      mlflow_uri: str) -> dict[str, str]:
    """Where each tracker writes, as a person would open it."""
    places = {"tensorboard": f"tensorboard --logdir {run_dir / 'tensorboard'}",
              "wandb": str(run_dir / "wandb"),
              "mlflow": mlflow_uri,
              "swanlab": str(run_dir / "swanlog")}
    return {name: places[name] for name in names}


@dataclass
class RunInfo:
    """What a tracker labels its run with."""

    run_id: str
    experiment_name: str
    run_dir: Path
    #: the job's fields, as the engine read them
    config: dict[str, Any]
    #: the server's `run_info.json`: snapshot id, approval, base, diff summary
    code: dict[str, Any] = field(default_factory=dict)
    mlflow_uri: str = ""

    @classmethod
    def load(cls, run_dir: Path, *, run_id: str, experiment_name: str,
             config: dict[str, Any], workdir: Path) -> RunInfo:
        path = run_dir / RUN_INFO_FILE
        code: dict[str, Any] = {}
        if path.is_file():
            try:
                code = json.loads(path.read_text())
            except ValueError:
                log.warning("%s is not JSON; the trackers get no code provenance", path)
        uri = str(code.pop("mlflow_tracking_uri", "") or default_mlflow_uri(workdir))
        return cls(run_id=run_id, experiment_name=experiment_name, run_dir=run_dir,
                   config=config, code=code, mlflow_uri=uri)

    def params(self) -> dict[str, str]:
        """Flat string parameters: `config.<field>` and the code's provenance."""
        flat = {f"config.{k}": _text(v) for k, v in sorted(self.config.items())}
        flat.update({f"code.{k}": _text(v) for k, v in sorted(self.code.items())})
        return flat

    def tags(self) -> dict[str, str]:
        return {"run_id": self.run_id, "experiment_name": self.experiment_name,
                **{k: _text(self.code[k]) for k in ("snapshot_id", "approved_by",
                                                    "reviewed_against") if self.code.get(k)}}


class Tracker(Protocol):
    name: str

    def log(self, step: int, metrics: Mapping[str, float]) -> None: ...

    def close(self) -> None: ...


class TrackerSet:
    """The run's trackers; a tracker that raises is logged and turned off for the run."""

    def __init__(self, trackers: list[Tracker]) -> None:
        self.trackers = trackers
        self.failed: dict[str, str] = {}

    def log(self, line: Mapping[str, Any]) -> None:
        step = int(line.get("step", 0))
        numbers = {k: float(v) for k, v in line.items()
                   if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)
                   and math.isfinite(v)}
        for tracker in list(self.trackers):
            self._guard(tracker, "log", lambda t=tracker: t.log(step, numbers))

    def close(self) -> None:
        for tracker in list(self.trackers):
            self._guard(tracker, "close", tracker.close)
        self.trackers.clear()

    def _guard(self, tracker: Tracker, what: str, call: Any) -> None:
        try:
            call()
        except Exception as exc:  # a tracker must never stop the training
            log.exception("tracker %s failed to %s; it is off for the rest of this run",
                          tracker.name, what)
            self.failed[tracker.name] = f"{type(exc).__name__}: {exc}"[:500]
            if tracker in self.trackers:
                self.trackers.remove(tracker)


def open_trackers(names: Iterable[str], info: RunInfo) -> TrackerSet:
    """Start each named tracker; one that cannot start is logged and left out."""
    openers = {"tensorboard": _TensorBoard, "wandb": _Wandb, "mlflow": _MLflow,
               "swanlab": _SwanLab}
    trackers: list[Tracker] = []
    failed: dict[str, str] = {}
    for name in names:
        try:
            trackers.append(openers[name](info))
            log.info("tracker %s: %s", name,
                     tracker_locations([name], info.run_dir, mlflow_uri=info.mlflow_uri)[name])
        except Exception as exc:
            log.exception("tracker %s could not start; the run goes on without it", name)
            failed[name] = f"{type(exc).__name__}: {exc}"[:500]
    result = TrackerSet(trackers)
    result.failed.update(failed)
    return result


def _text(value: Any) -> str:
    text = value if isinstance(value, str) else json.dumps(value, sort_keys=True, default=str)
    return text[:5000]  # MLflow's parameter bound is 6000


# ---------------------------------------------------------------------------- backends


class _TensorBoard:
    name = "tensorboard"

    def __init__(self, info: RunInfo) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(info.run_dir / "tensorboard"))
        self.writer.add_text("run/params", _markdown(info.params()), 0)
        for key, value in info.tags().items():
            self.writer.add_text(f"run/{key}", value, 0)
        self.writer.flush()

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        for key, value in metrics.items():
            self.writer.add_scalar(key, value, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class _Wandb:
    name = "wandb"

    def __init__(self, info: RunInfo) -> None:
        import wandb

        mode = os.environ.get("WANDB_MODE", "offline")
        self.run = wandb.init(project=info.experiment_name, group=info.experiment_name,
                              name=info.run_id, id=_wandb_id(info.run_id),
                              dir=str(info.run_dir), mode=mode, config=info.params(),
                              tags=[v[:64] for v in info.tags().values()],
                              settings=wandb.Settings(console="off", silent=True,
                                                      x_disable_stats=True))

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        self.run.log(dict(metrics), step=step)

    def close(self) -> None:
        self.run.finish()


def _wandb_id(run_id: str) -> str:
    return "".join(ch if ch.isalnum() else "-" for ch in run_id)[:64]


class _MLflow:
    name = "mlflow"

    def __init__(self, info: RunInfo) -> None:
        from mlflow.entities import Param, RunTag
        from mlflow.tracking import MlflowClient

        self.client = MlflowClient(tracking_uri=info.mlflow_uri)
        experiment = self.client.get_experiment_by_name(info.experiment_name)
        experiment_id = (experiment.experiment_id if experiment is not None
                         else self.client.create_experiment(info.experiment_name))
        self.run_id = self.client.create_run(experiment_id, run_name=info.run_id,
                                             tags=info.tags()).info.run_id
        self.client.log_batch(self.run_id,
                              params=[Param(k, v) for k, v in info.params().items()],
                              tags=[RunTag("mlflow.runName", info.run_id)])

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(k, v, now, step)
                                                    for k, v in metrics.items()])

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


class _SwanLab:
    name = "swanlab"

    def __init__(self, info: RunInfo) -> None:
        import swanlab

        self.run = swanlab.init(project=info.experiment_name, experiment_name=info.run_id,
                                logdir=str(info.run_dir / "swanlog"),
                                mode=os.environ.get("SWANLAB_MODE", "local"),
                                config={**info.params(), **info.tags()})

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        self.run.log(dict(metrics), step=step)

    def close(self) -> None:
        self.run.finish()


def _markdown(params: Mapping[str, str]) -> str:
    rows = [f"| {k} | {v.replace('|', '/')[:300]} |" for k, v in params.items()]
    return "\n".join(["| parameter | value |", "|---|---|", *rows])
