"""`bench/gpu_decode_kernel.py` on a CPU: its measuring loop, not the kernel's speed.

The script run end to end on ajet-tiny's heads under Triton's interpreter (a subprocess:
TRITON_INTERPRET must be set before triton is first imported, see
tests/ajet/engine/test_triton_decode.py), with pydantic, httpx and yaml refused to ajet
as on a bare GPU host; then, in process, a spent budget, a case that fails and a
machine without CUDA, none of which may raise. Marked `bench` like the other scripts'
smoke runs: `make bench-smoke` runs it, `make test` leaves it out.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bench.gpu_decode_kernel import run
from tests.bench.test_gpu_check import BLOCKED_RUN
from tests.support.triton_env import interpreter_env, triton_missing

if (_MISSING := triton_missing()) is not None:
    pytest.skip(_MISSING, allow_module_level=True)

PROJECT_ROOT = Path(__file__).resolve().parents[2]
SCRIPT = PROJECT_ROOT / "bench" / "gpu_decode_kernel.py"
TINY = {"heads": 4, "kv_heads": 2, "head_dim": 16, "page_size": 16}

pytestmark = pytest.mark.bench


def test_the_script_runs_under_the_interpreter() -> None:
    env = interpreter_env()
    child = subprocess.run(
        [sys.executable, "-c", BLOCKED_RUN, str(SCRIPT), "--device", "cpu", "--dtype",
         "float32", "--shape", "ajet-tiny", "--page-size", "16", "--batches", "1,2",
         "--contexts", "16,40", "--reps", "1", "--warmup", "0", "--budget-s", "60"],
        capture_output=True, text=True, cwd=PROJECT_ROOT, timeout=120, check=False, env=env)
    assert child.returncode == 0, child.stderr[-4000:]
    rows = json.loads(child.stdout)
    assert [(r["batch"], r["context"]) for r in rows] == [(1, 16), (1, 40), (2, 16), (2, 40)]
    for row in rows:
        assert row["shape"] == "ajet-tiny" and row["dtype"] == "float32"
        assert row["triton_ms"] > 0 and row["torch_ms"] > 0 and row["triton_gbps"] > 0
        assert row["max_abs_diff"] < 1e-5


def test_a_spent_budget_returns_a_note() -> None:
    rows = run("cpu", **TINY, batches=(1, 2), contexts=(16,), dtype=torch.float32, budget_s=0)
    assert len(rows) == 1 and "2 of 2 cases not run" in rows[0]["note"]


def test_a_failed_case_is_recorded_not_raised() -> None:
    """head_dim 80 is refused by the kernel (and in this process triton is not even
    importable: it lives beside the environment); either way the torch path measures."""
    rows = run("cpu", heads=2, kv_heads=1, head_dim=80, page_size=16, batches=(1,),
               contexts=(16,), dtype=torch.float32, budget_s=30, reps=1, warmup=0)
    assert len(rows) == 1
    error = rows[0]["triton_error"]
    assert ("head_dim" in error or "triton" in error) and rows[0]["torch_ms"] > 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA device")
def test_no_cuda_device_is_a_note() -> None:
    rows = run("cuda", **TINY, budget_s=30)
    assert rows == [{**TINY, "dtype": "bfloat16", "note": "no CUDA device: nothing measured"}]
