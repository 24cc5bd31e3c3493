"""`bench/gpu_check.py` on this CPU-only machine: it says it needs a GPU and exits 0, and
its CPU smoke run goes through the same engine code (FSDP2 over a one-rank gloo group,
activation checkpointing, generation, the planner) with pydantic, httpx and yaml
unimportable from ajet, as on a bare GPU host."""

from __future__ import annotations

import runpy
import subprocess
import sys
from pathlib import Path

import pytest

PROJECT_ROOT = Path(__file__).resolve().parents[2]
SCRIPT = PROJECT_ROOT / "bench" / "gpu_check.py"

#: Runs the script with an import hook that refuses pydantic, httpx and yaml to ajet (and
#: to the script itself). transformers' own dependencies may still import them, as they
#: are installed with it on a bare host; pydantic is none of them.
BLOCKED_RUN = """
import importlib.abc, runpy, sys

class RefuseClientDependencies(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] not in ("pydantic", "httpx", "yaml"):
            return None
        frame = sys._getframe(1)
        while frame is not None and frame.f_code.co_filename.startswith("<frozen"):
            frame = frame.f_back
        importer = frame.f_globals.get("__name__", "") if frame is not None else ""
        if importer in ("ajet", "__main__") or importer.startswith("ajet."):
            raise ImportError(f"{importer} imports {name}, absent on a bare GPU host")
        return None

sys.meta_path.insert(0, RefuseClientDependencies())
sys.argv = [sys.argv[1], *sys.argv[2:]]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", BLOCKED_RUN, str(SCRIPT), *args],
                          capture_output=True, text=True, cwd=PROJECT_ROOT, timeout=240,
                          check=False)


def test_without_a_gpu_it_says_so_and_exits_0() -> None:
    result = _run()
    assert result.returncode == 0, result.stdout + result.stderr
    assert "no CUDA GPU is visible here" in result.stdout
    assert "nothing was run" in result.stdout


@pytest.mark.slow
def test_the_cpu_smoke_run_goes_to_the_end_without_the_client_dependencies() -> None:
    result = _run("--device", "cpu", "--dtype", "float32", "--shape", "small", "--steps", "2",
                  "--groups", "2", "--group-size", "2", "--prompt-tokens", "32",
                  "--response-tokens", "16", "--micro-batch-tokens", "64", "--requests", "8",
                  "--new-tokens", "8")
    out = result.stdout
    assert result.returncode == 0, out + result.stderr
    assert "FSDP2 over a 1-rank gloo group" in out and "activation checkpointing on" in out
    for line in ("step time:", "decode", "tokens/s", "peak memory:", "planner:",
                 "gpu_check: OK"):
        assert line in out, out


def test_the_blocker_would_catch_a_client_import() -> None:
    # the hook is what makes the run above meaningful: it refuses ajet.copilot.job
    code = BLOCKED_RUN.replace('runpy.run_path(sys.argv[0], run_name="__main__")',
                               "import ajet.copilot.job")
    result = subprocess.run([sys.executable, "-c", code, str(SCRIPT)], capture_output=True,
                            text=True, cwd=PROJECT_ROOT, check=False)
    assert result.returncode != 0 and "absent on a bare GPU host" in result.stderr


def test_nan_fails_loudly() -> None:
    module = runpy.run_path(str(SCRIPT))
    module["require_finite"]("loss", 1.0, 2.0)
    with pytest.raises(module["GPUCheckFailed"], match="loss is not finite: nan"):
        module["require_finite"]("loss", 1.0, float("nan"))
