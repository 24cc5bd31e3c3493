"""The measured peak memory each metrics line carries, next to the planner's estimate.

`peak_memory_mb` (MiB, the peak since the engine booted, so it only grows):

- GPU: `torch.cuda.max_memory_allocated` on this rank's device, every tensor torch
  allocated there (weights included), not the CUDA context nor the caching allocator's
  reserve;
- CPU: the resident set's high-water mark (`VmHWM`) minus the resident set measured after
  the imports and the model load (`mark_loaded`), so it is what training and generation
  added: gradients, optimizer state, activations, logits, the KV cache, and the pages
  torch's kernels and the allocator keep.

`planned_peak_mb` is the memory planner's estimate of the same quantity
(`MemoryPlan.comparable_bytes`): on CPU without the loaded model, on GPU without the CUDA
context and allocator slack. Under torchrun the line is rank 0's (it generates and trains,
so it holds the most).
"""

from __future__ import annotations

import resource
import sys
from pathlib import Path

import torch

__all__ = ["PeakMemory"]

MiB = 1024 * 1024


def _proc_status_bytes(field: str) -> int | None:
    """A `VmRSS`-style line of /proc/self/status in bytes (Linux); None without /proc."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _hwm_bytes() -> int:
    """The resident set's high-water mark."""
    hwm = _proc_status_bytes("VmHWM")
    if hwm is not None:
        return hwm
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # bytes on macOS, KiB on Linux


def _page_in(model: torch.nn.Module) -> None:
    """Read one value per memory page of every weight.

    transformers loads a safetensors checkpoint whose dtype matches by mapping the file:
    the weights enter the resident set only when first read, in the first forward pass.
    Reading them here puts them in the baseline, so the peak is what training and
    generation add, whatever the checkpoint's dtype.
    """
    with torch.no_grad():
        for tensor in [*model.parameters(), *model.buffers()]:
            if tensor.device.type == "cpu" and tensor.numel() and tensor.is_contiguous():
                step = max(1, 4096 // tensor.element_size())
                tensor.view(-1)[::step].sum()


class PeakMemory:
    """Call `mark_loaded()` once the model is loaded; `fields()` for each metrics line."""

    def __init__(self, device: torch.device, *, planned_bytes: int | None = None) -> None:
        self.device = device
        self.planned_bytes = planned_bytes
        self._loaded: int | None = None

    def mark_loaded(self, model: torch.nn.Module | None = None) -> None:
        """Take the CPU baseline now, after the imports and the load of `model`."""
        if self.device.type == "cuda":
            return  # max_memory_allocated counts from the process start, weights included
        if model is not None:
            _page_in(model)
        # without /proc (macOS) the high-water mark so far stands in for the current RSS
        self._loaded = _proc_status_bytes("VmRSS") or _hwm_bytes()

    def peak_bytes(self) -> int:
        if self.device.type == "cuda":
            return int(torch.cuda.max_memory_allocated(self.device))
        if self._loaded is None:
            raise RuntimeError("PeakMemory.mark_loaded() was not called after the model load")
        return max(0, _hwm_bytes() - self._loaded)

    def fields(self) -> dict[str, float]:
        out = {"peak_memory_mb": round(self.peak_bytes() / MiB, 1)}
        if self.planned_bytes is not None:
            out["planned_peak_mb"] = round(self.planned_bytes / MiB, 1)
        return out
