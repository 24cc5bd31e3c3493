"""`DevicePool`: the device slots concurrent runs share, and who holds which.

On a GPU host a slot is a GPU index: the visible GPUs (the server's own
`CUDA_VISIBLE_DEVICES`, else what `nvidia-smi -L` lists), or the first `--devices N` of
them. A run holds `n_gpu` of them and its engine sees only those (`CUDA_VISIBLE_DEVICES`
in its environment; with `CUDA_DEVICE_ORDER=PCI_BUS_ID` when the indices are nvidia-smi's,
so CUDA numbers the GPUs as nvidia-smi does). The memory planner checks a job against the
smallest GPU among the slots (`planner_env`): a run may be given any of them. On a CPU
host there is nothing to hand out, but the same scheduling runs on `--devices N` slots
(default: the CPU count), one per engine process (`n_proc`), so queueing and refusals
behave and are tested as on a GPU host. Under the Ray launcher the pool counts nothing:
Ray's placement groups reserve each run's GPUs.

The server never imports torch: the GPUs are counted from the environment and the
driver's tool, which is what the engine's CUDA runtime will see.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from ajet.errors import EngineStateConflict
from ajet.protocol import DevicePoolStatus

__all__ = ["GPU_MEMORY_ENV", "HOST_MEMORY_ENV", "DevicePool", "detect_gpu_memory", "detect_gpus",
           "devices_needed", "planner_memory_env"]

log = logging.getLogger(__name__)

_NVIDIA_SMI_TIMEOUT_S = 10.0
#: The memory planner's overrides of one node's host memory and one GPU's memory, in GiB
#: (ajet/engine/planning/memory_plan.py reads them; the server never imports the engine).
HOST_MEMORY_ENV = "AJET_ENGINE_HOST_MEMORY_GB"
GPU_MEMORY_ENV = "AJET_ENGINE_GPU_MEMORY_GB"


def detect_gpus(environ: Mapping[str, str] | None = None) -> list[int]:
    """The GPU indices a child of this server can use: `CUDA_VISIBLE_DEVICES` when set
    (integer indices only; UUIDs are refused with a log line), else `nvidia-smi -L`."""
    env = os.environ if environ is None else environ
    visible = env.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        items = [item.strip() for item in visible.split(",") if item.strip()]
        if all(item.isdigit() for item in items):
            return [int(item) for item in items]
        log.warning("CUDA_VISIBLE_DEVICES=%s is not a list of indices; concurrent runs use "
                    "no GPU slots (set it to indices, e.g. 0,1,2,3)", visible)
        return []
    listing = _nvidia_smi(env, "-L")
    if listing is None:
        return []
    return [i for i, line in enumerate(line for line in listing.splitlines()
                                       if line.startswith("GPU "))]


def detect_gpu_memory(environ: Mapping[str, str] | None = None) -> dict[int, int]:
    """Each GPU's total memory in MiB by nvidia-smi's index (empty when unknown)."""
    env = os.environ if environ is None else environ
    listing = _nvidia_smi(env, "--query-gpu=index,memory.total",
                          "--format=csv,noheader,nounits")
    memory: dict[int, int] = {}
    for line in (listing or "").splitlines():
        index, _, total = line.partition(",")
        try:
            memory[int(index)] = int(float(total))
        except ValueError:  # an odd line ("[N/A]"): that GPU's memory stays unknown
            continue
    return memory


def _nvidia_smi(env: Mapping[str, str], *args: str) -> str | None:
    tool = shutil.which("nvidia-smi", path=env.get("PATH"))
    if tool is None:
        return None
    try:
        return subprocess.run([tool, *args], capture_output=True, text=True, check=True,
                              timeout=_NVIDIA_SMI_TIMEOUT_S).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        log.warning("nvidia-smi %s failed (%s); no GPU slots", " ".join(args), exc)
        return None


def planner_memory_env(*, host_bytes: Iterable[float] = (), gpu_mib: Iterable[float] = ()
                       ) -> dict[str, str]:
    """The planner's overrides for the smallest of the hosts and of the GPUs a run may get
    (a run may land on any of them); a figure without values is left out."""
    hosts, gpus = list(host_bytes), list(gpu_mib)
    env = {}
    if hosts:
        env[HOST_MEMORY_ENV] = f"{min(hosts) / 2**30:.3f}"
    if gpus:
        env[GPU_MEMORY_ENV] = f"{min(gpus) / 1024:.3f}"
    return env


def devices_needed(job: Mapping[str, object], kind: str) -> int:
    """Slots one node of `job` takes: `n_gpu` GPUs on a GPU host (a CPU job takes none),
    `n_gpu` or else `n_proc` slots on a CPU host."""
    def number(key: str, default: int) -> int:
        value = job.get(key)
        return value if isinstance(value, int) and not isinstance(value, bool) else default

    n_gpu = number("n_gpu", 0)
    if kind == "ray":
        return 0
    if kind == "gpu":
        return n_gpu
    return n_gpu if n_gpu > 0 else max(1, number("n_proc", 1))


@dataclass(frozen=True)
class _Grant:
    run_id: str
    slots: tuple[int, ...]


class DevicePool:
    """Slots, and the runs holding them. Thread-safe; every method is O(slots)."""

    def __init__(self, kind: str, slots: list[int], *, memory_mib: Mapping[int, int] | None
                 = None, pci_order: bool = False) -> None:
        self.kind = kind
        self.slots = list(slots)
        #: GPU slot -> its total memory (MiB), where nvidia-smi said
        self.memory_mib = {s: m for s, m in (memory_mib or {}).items() if s in self.slots}
        #: the slots are nvidia-smi's indices: runs get CUDA_DEVICE_ORDER=PCI_BUS_ID
        self.pci_order = pci_order
        self._held: dict[str, _Grant] = {}
        self._lock = threading.Lock()

    @classmethod
    def for_host(cls, devices: int | None, environ: Mapping[str, str] | None = None
                 ) -> DevicePool:
        env = os.environ if environ is None else environ
        gpus = detect_gpus(env)
        if not gpus:
            return cls("cpu", list(range(devices or os.cpu_count() or 1)))
        slots = gpus[:devices] if devices else gpus
        # without CUDA_VISIBLE_DEVICES the indices are nvidia-smi's (PCI bus order), and
        # each run is told so; the operator's indices are in CUDA's order, which is the
        # same only with CUDA_DEVICE_ORDER=PCI_BUS_ID
        from_smi = "CUDA_VISIBLE_DEVICES" not in env
        memory = detect_gpu_memory(env)
        if memory and not from_smi and env.get("CUDA_DEVICE_ORDER") != "PCI_BUS_ID":
            # nvidia-smi's index k may be another GPU than CUDA's: count each as the smallest
            memory = dict.fromkeys(slots, min(memory.values()))
        return cls("gpu", slots, memory_mib=memory, pci_order=from_smi)

    @classmethod
    def for_ray(cls) -> DevicePool:
        """Under the Ray launcher: no local slots to count; a run needs none here, and
        Ray's placement group reserves its GPUs (or refuses, with what is free)."""
        return cls("ray", [])

    @property
    def total(self) -> int:
        return len(self.slots)

    def free(self) -> list[int]:
        with self._lock:
            return self._free_locked()

    def acquire(self, run_id: str, count: int) -> list[int] | None:
        """`count` free slots for `run_id` (the lowest ones), or None if not that many are
        free. A run that holds slots already gets the same ones back."""
        with self._lock:
            grant = self._held.get(run_id)
            if grant is not None:
                return list(grant.slots)
            free = self._free_locked()
            if count > len(free):
                return None
            self._held[run_id] = _Grant(run_id, tuple(free[:count]))
            return free[:count]

    def release(self, run_id: str) -> None:
        with self._lock:
            self._held.pop(run_id, None)

    def held(self) -> dict[str, list[int]]:
        with self._lock:
            return {run_id: list(g.slots) for run_id, g in self._held.items()}

    def holders(self) -> str:
        """Who holds what, in words (for a refusal's message)."""
        held = self.held()
        if not held:
            return "no run holds any"
        return "; ".join(f"run {run_id} holds {','.join(map(str, slots))}"
                         for run_id, slots in held.items())

    def busy(self, need: int, own: int = 0) -> EngineStateConflict:
        """The refusal of a start that needs `need` slots (`own`: slots the starter holds
        and gives back first)."""
        free = len(self.free()) + own
        return EngineStateConflict(
            409, f"the job needs {need} device slot(s) and {free} of {self.total} are free "
                 f"({self.holders()})",
            "stop a run (POST /runs/{id}/stop; GET /runs?state=active lists them), or start "
            "this one with POST /runs, which queues it until the devices are free")

    def status(self, queued: list[str]) -> DevicePoolStatus:
        return DevicePoolStatus(kind="ray" if self.kind == "ray" else
                                "gpu" if self.kind == "gpu" else "cpu", total=self.total, free=self.free(), held=self.held(),
                                queued=queued)

    def environment(self, slots: list[int]) -> dict[str, str]:
        """What a run's engine gets in its environment for `slots`."""
        if self.kind == "ray":
            return {}
        if self.kind == "gpu":
            env = {"CUDA_VISIBLE_DEVICES": ",".join(map(str, slots))}
            if self.pci_order:
                env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
            return env
        return {"AJET_ENGINE_DEVICE_SLOTS": ",".join(map(str, slots))}

    def planner_env(self) -> dict[str, str]:
        """For the memory planner at config time, on a GPU host: the smallest GPU among
        the slots (a run may be given any of them), else the slots themselves, so that it
        never plans against a GPU no run can get. Nothing on a CPU host or under Ray."""
        if self.kind != "gpu" or not self.slots or GPU_MEMORY_ENV in os.environ:
            return {}  # (the operator's own figure for the planner stands)
        if len(self.memory_mib) == len(self.slots):
            return planner_memory_env(gpu_mib=self.memory_mib.values())
        env = {"CUDA_VISIBLE_DEVICES": ",".join(map(str, self.slots))}
        if self.pci_order:
            env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
        return env

    def _free_locked(self) -> list[int]:
        taken = {slot for grant in self._held.values() for slot in grant.slots}
        return [slot for slot in self.slots if slot not in taken]
