"""What Python reads in a source file, where it differs from what a reviewer sees.

Python normalises identifiers to NFKC (PEP 3131) before it looks them up, so
`𝐨𝐬.𝐬𝐲𝐬𝐭𝐞𝐦('id')` (mathematical bold) and `ｅｖａｌ(...)` (fullwidth) run as
`os.system` and `eval`, while a text search of the diff finds neither. `python_unicode`
finds every non-ASCII identifier with the NFKC form Python runs, and the string literals
holding characters Unicode lists as confusable with Latin ones (Cyrillic `а` for `a`,
from the TR39 confusables data as packaged by `confusable_homoglyphs`), so the review can
flag both and show each such line as Python reads it.

A file that does not tokenize (a syntax error the interpreter would refuse anyway) is
scanned word by word instead, so a broken file cannot hide its identifiers.
"""

from __future__ import annotations

import io
import re
import tokenize
import unicodedata
from dataclasses import dataclass, field

from confusable_homoglyphs import confusables

__all__ = ["UnicodeFindings", "python_unicode"]

#: At most this many examples of each kind in a flag (the lines carry the rest).
_EXAMPLES = 5
_WORD = re.compile(r"\w+")
_QUOTED = re.compile(r"(['\"]).*?\1")


@dataclass
class UnicodeFindings:
    """Non-ASCII identifiers and confusable strings of one Python file."""

    #: (line number, identifier as written, its NFKC form)
    identifiers: list[tuple[int, str, str]] = field(default_factory=list)
    #: (line number, confusable character, what it looks like)
    confusables: list[tuple[int, str, str]] = field(default_factory=list)
    #: line number -> the line with every identifier in its NFKC form (where that differs)
    as_run: dict[int, str] = field(default_factory=dict)

    def flags(self) -> list[str]:
        out = []
        if self.identifiers:
            shown = ", ".join(f"line {n} {_visible(raw)} runs as {nfkc}"
                              for n, raw, nfkc in self.identifiers[:_EXAMPLES])
            more = f" (+{len(self.identifiers) - _EXAMPLES} more)" \
                if len(self.identifiers) > _EXAMPLES else ""
            out.append(f"non-ASCII identifiers, read by Python in NFKC form: {shown}{more}")
        if self.confusables:
            shown = ", ".join(f"line {n} {_visible(ch)} looks like {like!r}"
                              for n, ch, like in self.confusables[:_EXAMPLES])
            more = f" (+{len(self.confusables) - _EXAMPLES} more)" \
                if len(self.confusables) > _EXAMPLES else ""
            out.append(f"confusable characters in strings (Unicode TR39): {shown}{more}")
        return out


def python_unicode(text: str) -> UnicodeFindings:
    """Non-ASCII identifiers (with their NFKC form) and confusable strings in `text`."""
    found = UnicodeFindings()
    if text.isascii():
        return found
    lines = text.split("\n")
    # line -> [(start col, end col, nfkc)], applied right to left
    edits: dict[int, list[tuple[int, int, str]]] = {}
    try:
        tokens = list(tokenize.generate_tokens(io.StringIO(text).readline))
    except (tokenize.TokenError, SyntaxError):
        tokens = None
    if tokens is None:
        for n, line in enumerate(lines, start=1):
            quoted = [(m.start(), m.end()) for m in _QUOTED.finditer(line)]
            for m in _WORD.finditer(line):
                if not any(a <= m.start() < b for a, b in quoted):
                    _identifier(found, edits, n, m.start(), m.end(), m.group())
            for a, b in quoted:
                _strings(found, n, line[a:b])
    else:
        for tok in tokens:
            if tok.type == tokenize.NAME:
                (n, start), (end_n, end) = tok.start, tok.end
                if n == end_n:
                    _identifier(found, edits, n, start, end, tok.string)
            elif tok.type == tokenize.STRING:
                _strings(found, tok.start[0], tok.string)
    for n, spans in edits.items():
        line = lines[n - 1] if n - 1 < len(lines) else ""
        for start, end, nfkc in sorted(spans, reverse=True):
            line = line[:start] + nfkc + line[end:]
        found.as_run[n] = line
    return found


def _identifier(found: UnicodeFindings, edits: dict[int, list[tuple[int, int, str]]],
                n: int, start: int, end: int, name: str) -> None:
    if name.isascii():
        return
    nfkc = unicodedata.normalize("NFKC", name)
    found.identifiers.append((n, name, nfkc))
    if nfkc != name:
        edits.setdefault(n, []).append((start, end, nfkc))


def _strings(found: UnicodeFindings, n: int, literal: str) -> None:
    if literal.isascii():
        return
    hits = confusables.is_confusable(literal, greedy=True, preferred_aliases=["latin"])
    for hit in hits or []:
        if hit["character"].isascii():  # a quote looks like a backtick: not the concern
            continue
        glyphs = hit.get("homoglyphs") or []
        like = glyphs[0]["c"] if glyphs else "?"
        found.confusables.append((n, hit["character"], like))


def _visible(text: str) -> str:
    """`text` with its code points named when it is not plain ASCII (`𝐨` U+1D428)."""
    return f"{text!r} ({' '.join(f'U+{ord(c):04X}' for c in text if not c.isascii())})"
