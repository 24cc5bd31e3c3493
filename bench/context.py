"""`BenchContext`: what every benchmark module gets from `python -m bench`.

One context per run: the repetition count, a scratch folder removed at the end, and the
shared benchmark tree (built once, so every module measures the same tree). `quick`
shrinks the slow parts (upload size, episode count, training time) for the smoke test;
figures from a quick run are not comparable with a full one.
"""

from __future__ import annotations

import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType

from bench.tree import BenchTree, make_tree

__all__ = ["BenchContext"]


@dataclass
class BenchContext:
    #: Repetitions behind each median (the issue asks for at least 5).
    reps: int = 5
    #: Shrink the slow parts; for the smoke test, not for figures.
    quick: bool = False
    #: Scratch folder; a fresh temporary one when None.
    root: Path | None = None
    _tmp: Path | None = field(default=None, repr=False)
    _tree: BenchTree | None = field(default=None, repr=False)
    _n: int = field(default=0, repr=False)

    def __post_init__(self) -> None:
        if self.root is None:
            # short: engine sockets live under it and AF_UNIX paths are limited to ~100 bytes
            self._tmp = Path(tempfile.mkdtemp(prefix="ajb-"))
            self.root = self._tmp

    @property
    def tree(self) -> BenchTree:
        """The 150-file, 1.5 MB ajet/ tree in a git repo, built on first use."""
        if self._tree is None:
            self._tree = make_tree(self.path("tree"))
        return self._tree

    def path(self, name: str) -> Path:
        """A fresh folder under the scratch root (`name-<n>`)."""
        if self.root is None:  # only if a caller reset it; __post_init__ sets it
            raise RuntimeError("BenchContext has no scratch root")
        self._n += 1
        return self.root / f"{name}-{self._n}"

    def close(self) -> None:
        if self._tmp is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)
            self._tmp = None

    def __enter__(self) -> BenchContext:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()
