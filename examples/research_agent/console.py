"""`Console`: what the person running the demo reads (stdout), with phase headers and boxes."""

from __future__ import annotations

import sys
import textwrap
import time
from typing import TextIO

__all__ = ["Console", "progress_bar"]


class Console:
    """Status lines on stdout; `quiet` keeps only phase headers, the table and the verdicts."""

    def __init__(self, *, quiet: bool, out: TextIO = sys.stdout) -> None:
        self.quiet = quiet
        self.out = out
        self.t0 = time.monotonic()

    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    def say(self, text: str = "", *, always: bool = False) -> None:
        if always or not self.quiet:
            print(text, file=self.out, flush=True)

    def wrapped(self, text: str, *, always: bool = False) -> None:
        """One paragraph, wrapped at 96 columns and indented like the status lines."""
        self.say(textwrap.fill(text, 96, initial_indent="  ", subsequent_indent="    ",
                               break_on_hyphens=False), always=always)

    def phase(self, text: str) -> None:
        self.say(f"\n[{self.elapsed():5.1f}s] == {text}", always=True)

    def boxed(self, title: str, body: str, *, max_lines: int = 40) -> None:
        lines = [piece for line in body.rstrip().splitlines()
                 for piece in (textwrap.wrap(line, 92, subsequent_indent="    ") or [""])]
        if len(lines) > max_lines:
            lines = [*lines[:max_lines], f"... ({len(lines) - max_lines} more lines)"]
        self.say(f"  +-- {title} " + "-" * max(0, 70 - len(title)))
        for line in lines:
            self.say(f"  | {line}")
        self.say("  +" + "-" * 76)


def progress_bar(done: int, total: int, width: int = 20) -> str:
    filled = min(width, round(width * done / max(1, total)))
    return "[" + "#" * filled + "." * (width - filled) + "]"
