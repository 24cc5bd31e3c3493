"""`bench/gpu_generation.py` on a CPU: every item runs and records its figures.

The script as a bare GPU host runs it (pydantic, httpx and yaml refused to ajet), on a
small Qwen2.5-shaped model with a small vocabulary: it must write every item to its JSON
as the item ends and exit 0 when every check holds. The kernel item needs CUDA (the
interpreter run of the kernel is tests/ajet/engine/test_triton_decode.py), the 7B item a
GPU. Marked `bench` like the other scripts' smoke runs (`make bench-smoke`).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.bench.test_gpu_check import BLOCKED_RUN

PROJECT_ROOT = Path(__file__).resolve().parents[2]
SCRIPT = PROJECT_ROOT / "bench" / "gpu_generation.py"

pytestmark = pytest.mark.bench


def test_every_item_runs_on_a_cpu_and_is_written_as_it_ends(tmp_path: Path) -> None:
    child = subprocess.run(
        [sys.executable, "-c", BLOCKED_RUN, str(SCRIPT), "--device", "cpu", "--shape", "small",
         "--vocab", "512", "--out", str(tmp_path), "--budget-s", "240", "--skip", "kernel"],
        capture_output=True, text=True, cwd=PROJECT_ROOT, timeout=300, check=False)
    report = json.loads((tmp_path / "gpu_generation.json").read_text())
    assert child.returncode == 0, (report["failed"], child.stderr[-3000:])
    items = report["items"]
    assert set(items) == {"versions", "cb_cuda_graph", "capture", "step", "greedy",
                          "logprob_gap", "weights", "e2e", "profile"}
    assert items["greedy"]["identical_requests"] == "16/16"
    weights = items["weights"]
    assert weights["gap_to_the_new_weights"] < 1e-4 < weights["gap_to_the_old_weights"]
    assert items["e2e"]["paged"]["tok_s_64"] > 0 and items["e2e"]["continuous_batching"]
    assert items["logprob_gap"]["paged"]["mean_abs_gap"] < 1e-4  # fp32 on a CPU
