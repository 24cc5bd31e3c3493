"""The research agent's workbench: a throwaway git repository and the ideas it tests there.

Each idea is one change against the best run so far, with its hypothesis and the outcome
that would refute it. A code idea edits one module of the repository's `ajet/` (the
agent's file tools, in the real case); a config idea changes job fields through
`configure`, with no sync. The edits are written as a researcher would write them; the
third one carries a slip the agent does not see (`math.isqrt` for `math.sqrt`), so the
engine that runs it dies at its first update.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

__all__ = [
    "IDEAS",
    "Idea",
    "git",
    "keep_edit",
    "make_throwaway_repo",
    "patch_advantages",
    "patch_rewards",
    "revert_edit",
]


def git(repo: Path, *args: str) -> str:
    cmd = ["git", "-c", "user.email=agent@example.com", "-c", "user.name=research-agent",
           "-c", "commit.gpgsign=false", "-C", str(repo), *args]
    return subprocess.run(cmd, check=True, capture_output=True, text=True).stdout


def make_throwaway_repo(root: Path, project_root: Path) -> Path:
    """A git repository with a committed copy of the project's ajet/ and the workflow."""
    root.mkdir(parents=True)
    shutil.copytree(project_root / "ajet", root / "ajet",
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    (root / "examples").mkdir()
    shutil.copy2(project_root / "examples" / "digits_workflow.py", root / "examples")
    git(root, "init", "-q", "-b", "main")
    git(root, "add", "ajet", "examples")
    git(root, "commit", "-q", "-m", "AgentJet as the research agent found it")
    return root


def keep_edit(repo: Path, module: str, message: str) -> None:
    """Commit a kept change, so the next idea's diff starts from it."""
    git(repo, "commit", "-q", "-m", message, "--", module)


def revert_edit(repo: Path, module: str) -> None:
    """Undo an uncommitted edit: the repository matches the best run's code again."""
    git(repo, "checkout", "-q", "--", module)


def _replace_line(repo: Path, module: str, pattern: str, build: Callable[[re.Match[str]], str]
                  ) -> str:
    path = repo / module
    text = path.read_text(encoding="utf-8")
    match = re.compile(pattern, re.MULTILINE).search(text)
    if match is None:
        raise RuntimeError(f"{module} no longer has a line matching {pattern!r}; update the "
                           "edit in examples/research_agent/lab.py to the module's new shape")
    path.write_text(text[:match.start()] + build(match) + text[match.end():], encoding="utf-8")
    return git(repo, "diff", "--", module)


def patch_advantages(repo: Path) -> str:
    """Keep only positive advantages in `grpo_advantages`; returns `git diff` of the edit."""
    def build(m: re.Match[str]) -> str:
        indent = m["indent"]
        return (f"{indent}# research_loop hypothesis: learn only from better-than-average "
                f"episodes\n{indent}# (rejection-sampling style); worse-than-average ones get "
                f"advantage 0.\n{indent}advantages[i] = max(0.0, {m['expr']})")

    # the assignment of each episode's normalised advantage inside grpo_advantages
    return _replace_line(repo, "ajet/engine/advantages.py",
                         r"^(?P<indent>[ \t]+)advantages\[i\] = (?P<expr>.+)$", build)


def patch_rewards(repo: Path) -> str:
    """Square-root rewards in `process_rewards`, written with the slip `math.isqrt`.

    `math.isqrt` takes integers only, so the first batch of float rewards raises
    `TypeError` in the engine's first update; the module itself imports fine, so the
    engine boots and serves episodes until then.
    """
    def build(m: re.Match[str]) -> str:
        indent = m["indent"]
        return (f"{indent}# research_loop hypothesis: concave rewards (the square root of the "
                f"share)\n{indent}# give partly right replies more credit than a linear "
                f"reward.\n{indent}out.append(math.isqrt(reward))")

    return _replace_line(repo, "ajet/engine/rewards.py",
                         r"^(?P<indent>[ \t]+)out\.append\(reward\)$", build)


def double_lr(config: dict[str, Any]) -> dict[str, Any]:
    """The job fields to send: the best run's learning rate, doubled."""
    return {"lr": round(float(config["lr"]) * 2, 6)}


@dataclass(frozen=True)
class Idea:
    """One change to test against the best run so far."""

    key: str
    title: str
    kind: Literal["code", "config"]
    hypothesis: str
    null: str
    #: code ideas: the module edited, and the edit (returns its `git diff`)
    module: str | None = None
    edit: Callable[[Path], str] | None = None
    #: config ideas: the job fields to send, from the best run's config
    change: Callable[[dict[str, Any]], dict[str, Any]] | None = None


IDEAS: tuple[Idea, ...] = (
    Idea(
        key="positive-advantages", kind="code", module="ajet/engine/advantages.py",
        edit=patch_advantages,
        title="code: learn from better-than-average replies only",
        hypothesis=("Learning only from better-than-average replies (advantages clipped at "
                    "0, as in rejection-sampling fine-tuning) raises the digit share faster "
                    "than GRPO: pushing down bad replies mostly adds noise."),
        null=("The negative advantages carry half of GRPO's signal: without them the digit "
              "share rises more slowly."),
    ),
    Idea(
        key="double-lr", kind="config", change=double_lr,
        title="config: twice the learning rate",
        hypothesis=("Twice the learning rate raises the digit share faster within the same "
                    "steps: the baseline's updates are too small to use each batch fully."),
        null=("Twice the learning rate overshoots: updates get noisier and the digit share "
              "rises no faster, or falls."),
    ),
    Idea(
        key="sqrt-rewards", kind="code", module="ajet/engine/rewards.py",
        edit=patch_rewards,
        title="code: square-root rewards",
        hypothesis=("Concave rewards (the square root of the digit share) give replies with "
                    "a few digits more credit, so early learning is faster."),
        null=("Within a GRPO group only the ranking and spacing of rewards matter; the "
              "square root compresses the spacing at the top and learning gets no faster."),
    ),
)
