"""Where the tests find triton: beside the project's environment, never on its path.

`make triton` installs triton into `.venv/triton` (with triton importable, torch and
transformers import it into every engine process: ~0.1 s more per boot and nanobind's
leak report at every exit). The tests that run Triton's interpreter start a child process
with that folder on its `PYTHONPATH`.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

__all__ = ["TRITON_DIR", "interpreter_env", "triton_missing"]

PROJECT_ROOT = Path(__file__).resolve().parents[2]
TRITON_DIR = PROJECT_ROOT / ".venv" / "triton"


def triton_missing() -> str | None:
    """Why triton cannot be run here, or None."""
    if (TRITON_DIR / "triton").is_dir() or importlib.util.find_spec("triton") is not None:
        return None
    return ("the Triton decode kernel's tests need triton: run `make triton` (it installs it "
            "into .venv/triton) or pip install triton")


def interpreter_env() -> dict[str, str]:
    """The environment of a child that runs Triton kernels in its interpreter on CPU."""
    path = os.pathsep.join(p for p in (str(PROJECT_ROOT), str(TRITON_DIR),
                                       os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": path}
