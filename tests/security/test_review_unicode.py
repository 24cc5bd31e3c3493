"""The review shows what Python runs: non-ASCII identifiers are flagged with the NFKC form
Python looks up, each such line is followed by the line as it runs (so a search of the
diff for `os.system` finds it), and strings with characters confusable with Latin ones
(Unicode TR39) are flagged.
"""

from __future__ import annotations

from pathlib import Path

from ajet.review_unicode import python_unicode
from tests.security.inproc import inproc_server
from tests.support import APPROVER_TOKEN

HIDDEN = ('"""tiny"""\nimport os\n\n\ndef setup():\n'
          "    \U0001d428\U0001d42c.\U0001d42c\U0001d432\U0001d42c\U0001d42d\U0001d41e\U0001d426"
          "('id')\n    return \uff45\uff56\uff41\uff4c('1')\n\n\nURL = 'https://p\u0430ypal.example'\n"
          "GREETING = '\u65e5\u672c\u8a9e'\n")


def test_the_server_review_flags_and_shows_the_nfkc_form(tmp_path: Path) -> None:
    with inproc_server(tmp_path / "swarm") as srv:
        sid = srv.upload({"ajet/__init__.py": HIDDEN})
        review = srv.call("GET", f"/approvals/{sid}", token=APPROVER_TOKEN,
                          params={"limit": 5000}).json()
    init = next(f for f in review["files"] if f["path"] == "ajet/__init__.py")
    flags = " | ".join(init["flags"])
    assert "non-ASCII identifiers" in flags and "runs as os" in flags and "runs as eval" in flags
    assert "confusable characters in strings" in flags and "U+0430" in flags
    assert "ajet/__init__.py" in review["flagged"]
    diff = review["diff"]
    assert "os.system('id')" in diff and "return eval('1')" in diff
    assert "\u65e5" not in flags  # Japanese text is no look-alike of Latin


def test_every_form_of_hiding_is_found() -> None:
    found = python_unicode(HIDDEN)
    assert [(n, nfkc) for n, _, nfkc in found.identifiers] == [(6, "os"), (6, "system"),
                                                               (7, "eval")]
    assert found.as_run[6] == "    os.system('id')" and found.as_run[7] == "    return eval('1')"
    assert [(n, ch) for n, ch, _ in found.confusables] == [(10, "\u0430")]
    assert not python_unicode("x = 'caf\u00e9'\nnaive = 1\n").flags()
    # identifiers already in NFKC form are still flagged, with no rewrite to show
    plain = python_unicode("caf\u00e9 = 1\n")
    assert plain.identifiers == [(1, "caf\u00e9", "caf\u00e9")] and not plain.as_run


def test_a_file_that_does_not_tokenize_is_scanned_word_by_word() -> None:
    found = python_unicode("def broken(:\n    \uff45\uff56\uff41\uff4c(x) # 'p\u0430y'\n")
    assert [nfkc for _, _, nfkc in found.identifiers] == ["eval"]
    assert found.as_run[2].strip().startswith("eval(x)")
    assert [ch for _, ch, _ in found.confusables] == ["\u0430"]
