"""`bench/gpu_check.py` on this CPU-only machine: it says it needs a GPU and exits 0, it
fails when `nvidia-smi` lists GPUs torch cannot use, and its CPU smoke runs go through the
same engine code (one process with LoRA and a KL term, FSDP2 over a one-rank gloo group,
checkpoints saved and loaded, generation, the planner; `--ranks 2` on two gloo ranks)
with pydantic, httpx and yaml unimportable from ajet, as on a bare GPU host.

The three smoke runs (the one-process run, about 14 s of CPU, and the two runs of
`--ranks 2` under torchrun, about 25 s) are marked `bench`, like the benchmark modules'
smoke runs: `make bench-smoke` runs them, `make test` leaves them out. They check the
acceptance script; the engine code they drive has its own tests in `make test` (LoRA in
tests/ajet/engine/test_learning.py, the KL term in test_algorithms.py, FSDP2 with
activation checkpointing in test_distributed.py, the bf16 publication in
test_publication.py, checkpoints in test_resume.py), and `make test` keeps the script's
checks that need no engine (no GPU, a driver torch cannot use) and, at import level,
that the engine modules the script imports need none of the client dependencies."""

from __future__ import annotations

import os
import ast
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


def _run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", BLOCKED_RUN, str(SCRIPT), *args],
                          capture_output=True, text=True, cwd=PROJECT_ROOT, timeout=300,
                          check=False, env=env)


SMOKE = ("--device", "cpu", "--dtype", "float32", "--shape", "small", "--groups", "2",
         "--group-size", "2", "--prompt-tokens", "32", "--response-tokens", "16",
         "--micro-batch-tokens", "64", "--new-tokens", "8")


def test_without_a_gpu_it_says_so_and_exits_0() -> None:
    result = _run()
    assert result.returncode == 0, result.stdout + result.stderr
    assert "no CUDA GPU is visible here" in result.stdout
    assert "nothing was run" in result.stdout


@pytest.mark.slow
@pytest.mark.bench
def test_the_cpu_smoke_run_goes_to_the_end_without_the_client_dependencies() -> None:
    # in bf16, as on a GPU: LoRA's fp32 adapters on the one bf16 base, then FSDP2's
    # fp32 masters with the publication cast to bf16
    result = _run(*SMOKE, "--dtype", "bfloat16", "--steps", "2", "--requests", "8")
    out = result.stdout
    assert result.returncode == 0, out + result.stderr
    assert "phase 1, one process: fp32 adapters on the bfloat16 generation model itself" in out
    assert "LoRA rank 16" in out
    assert "FSDP2 over a 1-rank gloo group (control on gloo): float32 masters + bfloat16" in out
    assert "activation checkpointing on" in out and "a frozen KL reference" in out
    # rollout -> update -> rollout in both phases, and a checkpoint that loads back
    assert out.count("rollout on the new weights") == 2
    assert out.count("published weights of the save, exactly") == 2
    assert "adapter_model.safetensors" in out and "model.safetensors" in out
    for line in ("step time:", "decode", "tokens/s", "peak memory:", "planner:",
                 "publication", "gpu_check: OK"):
        assert line in out, out


@pytest.mark.slow
@pytest.mark.bench
def test_two_gloo_ranks_generate_on_every_rank_around_each_update() -> None:
    result = _run(*SMOKE, "--ranks", "2", "--cycles", "1", "--requests", "4", "--grace", "3")
    out = result.stdout
    assert result.returncode == 0, out + result.stderr
    assert "ranks: 2 under torchrun (gloo for tensors, gloo for control)" in out
    for label in ("rollout 1:", "rollout 2 (after the last update):"):
        line = next(x for x in out.splitlines() if label in x)
        assert "rank 0 4/4" in line and "rank 1 4/4" in line, line
    assert "update 1:" in out and "over 2 ranks" in out and "gpu_check: OK" in out


@pytest.mark.slow
@pytest.mark.bench
def test_a_rank_whose_generation_is_held_back_during_the_wait_fails_the_check(
        tmp_path: Path) -> None:
    module = runpy.run_path(str(SCRIPT))
    model = tmp_path / "small-random"
    module["build_checkpoint"](model, "small", device="cpu")
    probe = Path(__file__).with_name("stall_probe.py")
    env = {**os.environ, "PYTHONPATH": str(PROJECT_ROOT)}
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--standalone",
         "--max_restarts=0", str(probe), *SMOKE, "--cycles", "1", "--requests", "4",
         "--grace", "2", "--workdir", str(tmp_path), "--model-dir", str(model)],
        capture_output=True, text=True, cwd=PROJECT_ROOT, timeout=300, env=env, check=False)
    assert result.returncode != 0, result.stdout + result.stderr
    assert "requests stalled on rank 1 (0 of 4 done)" in result.stdout, result.stdout


def _ajet_imports(path: Path) -> list[str]:
    """The `ajet` modules a file imports, wherever in it (the script imports lazily,
    inside its phases)."""
    names = {node.module for node in ast.walk(ast.parse(path.read_text("utf-8")))
             if isinstance(node, ast.ImportFrom) and node.module
             and node.module.split(".")[0] == "ajet"}
    return sorted(names)


def test_the_engine_modules_it_imports_need_no_client_dependency(tmp_path: Path) -> None:
    """What the `bench` smoke run checks end to end, at import level for `make test`:
    every ajet module the script imports, and the generators `build_generator` imports
    when the script calls it."""
    modules = [*_ajet_imports(SCRIPT), "ajet.engine.generation.continuous_batching",
               "ajet.engine.generation.paged", "ajet.engine.generation.recompute"]
    assert "ajet.engine.policy" in modules, modules
    script = tmp_path / "imports.py"
    script.write_text("import importlib\n" + "".join(
        f"importlib.import_module({name!r})\n" for name in modules) + "print('ok')\n")
    result = subprocess.run([sys.executable, "-c", BLOCKED_RUN, str(script)],
                            capture_output=True, text=True, cwd=PROJECT_ROOT, timeout=120,
                            check=False)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-3000:]


def test_nvidia_smi_listing_gpus_torch_cannot_use_fails_the_check(tmp_path: Path) -> None:
    """The false pass of a driver too old for the wheel: here torch is a CPU build."""
    smi = tmp_path / "nvidia-smi"
    smi.write_text("#!/bin/sh\necho 'GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-0)'\n"
                   "echo 'GPU 1: NVIDIA H100 80GB HBM3 (UUID: GPU-1)'\n")
    smi.chmod(0o755)
    env = {**os.environ, "PATH": f"{tmp_path}{os.pathsep}{os.environ['PATH']}"}
    env.pop("CUDA_VISIBLE_DEVICES", None)
    result = _run(env=env)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "GPU CHECK FAILED" in result.stdout
    assert "nvidia-smi lists 2 GPU(s)" in result.stdout and "can use 0" in result.stdout


def test_the_gpu_count_comparison() -> None:
    module = runpy.run_path(str(SCRIPT))
    problem, listed = module["gpu_visibility_problem"], module["listed_gpus"]
    smi = ("GPU 0: NVIDIA H200 (UUID: GPU-a)\nGPU 1: NVIDIA H200 (UUID: GPU-b)\n"
           "  MIG 1g.18gb Device 0: (UUID: MIG-c)\n")
    assert listed(smi) == 2 and listed("") == 0
    assert problem(None, None, 0) is None  # no nvidia-smi: nothing to compare with
    assert problem(0, None, 0) is None
    assert problem(2, None, 2) is None
    text = problem(2, None, 0, torch_version="2.13.0", torch_cuda=None)
    assert "lists 2 GPU(s)" in text and "a CPU-only build" in text and "can use 0" in text
    assert "CUDA 12.8" in problem(8, None, 0, torch_cuda="12.8")
    # CUDA_VISIBLE_DEVICES narrows what torch should see
    assert problem(8, "0,1", 2) is None
    assert "2 with CUDA_VISIBLE_DEVICES='0,1'" in problem(8, "0,1", 1)
    assert problem(8, "", 0) is None and problem(8, "-1", 0) is None
    assert problem(8, "3,-1,4", 1) is None


def test_ranks_needs_as_many_gpus_or_skips() -> None:
    module = runpy.run_path(str(SCRIPT))
    unavailable = module["ranks_unavailable"]
    assert unavailable(2, 8) is None and unavailable(8, 8) is None
    text = unavailable(2, 1)
    assert "this host has 1 GPU(s)" in text and "skipped" in text


def test_help_describes_both_modes() -> None:
    result = subprocess.run([sys.executable, str(SCRIPT), "--help"], capture_output=True,
                            text=True, cwd=PROJECT_ROOT, timeout=60, check=False)
    assert result.returncode == 0 and "--ranks" in result.stdout, result.stderr


def test_a_stalled_rank_is_named() -> None:
    ranks = runpy.run_path(str(SCRIPT.with_name("gpu_check_ranks.py")), run_name="not_main")
    rows = [{"done": 4, "submitted": 4, "error": None},
            {"done": 0, "submitted": 4, "error": None},
            {"done": 3, "submitted": 4, "error": "RuntimeError('x')"}]
    assert ranks["stalled_ranks"](rows) == ["rank 1 (0 of 4 done)",
                                            "rank 2 (3 of 4 done, failed: RuntimeError('x'))"]
    assert ranks["stalled_ranks"](rows[:1]) == []


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
