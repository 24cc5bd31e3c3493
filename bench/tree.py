"""The benchmark tree: a git repository whose `ajet/` holds 150 files and about 1.5 MB.

It is the project's own `ajet/` (so an engine can really run from a snapshot of it) plus
generated filler modules under `ajet/_bench_filler/` that bring it to the size the
issue names. Filler is valid Python with varied text, so it compresses and precompiles
like source code does (about 3-4x with deflate), not like a run of zeros.

`edit_one_file` changes one filler module in place (tracked, uncommitted), which makes a
new snapshot with exactly one changed blob; `restore_tree` puts the committed text back,
so each benchmark module starts from the same clean tree.
"""

from __future__ import annotations

import random
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["BenchTree", "edit_one_file", "make_tree", "restore_tree"]

_WORDS = (
    "episode reward advantage policy gradient token snapshot engine rollout worker group "
    "batch sample logprob entropy clip ratio update metric server client manifest blob "
    "commit restart config trainer learner value baseline normalise mean std step wall"
).split()
_GIT = ["git", "-c", "user.email=bench@example.com", "-c", "user.name=bench",
        "-c", "commit.gpgsign=false"]


@dataclass(frozen=True)
class BenchTree:
    root: Path  # the repository root, which holds ajet/
    files: int
    total_bytes: int
    edit_target: Path  # the filler module `edit_one_file` changes
    original: str = field(repr=False)  # its committed text


def _filler_module(index: int, size: int, rng: random.Random) -> str:
    lines = [f'"""Benchmark filler module {index}: generated, never imported."""', "",
             "from __future__ import annotations", "", f"TABLE_{index} = ("]
    body = sum(len(line) + 1 for line in lines) + 2
    n = 0
    while body < size - 64:
        words = " ".join(rng.choice(_WORDS) for _ in range(rng.randint(4, 9)))
        line = f"    ({n}, {rng.randint(0, 10**6)}, {words!r}),"
        lines.append(line)
        body += len(line) + 1
        n += 1
    lines += [")", ""]
    text = "\n".join(lines)
    return text + "#" * max(0, size - len(text.encode()) - 1) + "\n"


def make_tree(root: Path, *, files: int = 150, total_bytes: int = 1_500_000,
              source: Path | None = None, seed: int = 0) -> BenchTree:
    """A committed git repo at `root`: a copy of `source` (the project's ajet/) plus filler."""
    source = source or Path(__file__).resolve().parents[1] / "ajet"
    root.mkdir(parents=True, exist_ok=True)
    ajet = root / "ajet"
    shutil.copytree(source, ajet, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    copied = [p for p in ajet.rglob("*") if p.is_file()]
    used = sum(p.stat().st_size for p in copied)
    n_filler = files - len(copied)
    if n_filler < 1 or used >= total_bytes:
        raise ValueError(f"{source} already has {len(copied)} files / {used} bytes; "
                         f"cannot make a {files}-file, {total_bytes}-byte tree from it")
    filler_dir = ajet / "_bench_filler"
    filler_dir.mkdir()
    (filler_dir / "__init__.py").write_text('"""Generated benchmark filler."""\n')
    n_filler -= 1
    per_file = (total_bytes - used - (filler_dir / "__init__.py").stat().st_size) // n_filler
    rng = random.Random(seed)
    for i in range(n_filler):
        (filler_dir / f"mod_{i:03d}.py").write_text(_filler_module(i, per_file, rng))
    subprocess.run(["git", "init", "-q", "-b", "main", str(root)], check=True)
    subprocess.run([*_GIT, "-C", str(root), "add", "ajet"], check=True)
    subprocess.run([*_GIT, "-C", str(root), "commit", "-q", "-m", "bench tree"], check=True)
    all_files = [p for p in ajet.rglob("*") if p.is_file()]
    return BenchTree(root=root, files=len(all_files),
                     total_bytes=sum(p.stat().st_size for p in all_files),
                     edit_target=filler_dir / "mod_000.py",
                     original=(filler_dir / "mod_000.py").read_text())


def edit_one_file(tree: BenchTree, marker: str) -> int:
    """Change one tracked file (a marker line appended); returns the file's new size."""
    path = tree.edit_target
    path.write_text(path.read_text() + f"# edit {marker}\n")
    return path.stat().st_size


def restore_tree(tree: BenchTree) -> None:
    """Undo `edit_one_file`: the edited file gets its committed text back."""
    tree.edit_target.write_text(tree.original)
