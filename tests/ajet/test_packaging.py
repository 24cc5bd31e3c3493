"""ajet.packaging on real git repositories in temp dirs: what is shipped, what is refused."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from ajet.errors import PackagingError
from ajet.packaging import (
    MANIFEST_HEADER,
    build_zip,
    canonical_manifest,
    folder_snapshot_id,
    member_path_problem,
    package_tree,
    snapshot_id_of,
    tree_problems,
)
from ajet.protocol import FileEntry
from tests.support import PROJECT_ROOT

GIT = ["git", "-c", "user.email=t@example.com", "-c", "user.name=test"]


def git(repo: Path, *args: str) -> str:
    return subprocess.run([*GIT, "-C", str(repo), *args], check=True, capture_output=True,
                          text=True).stdout


def tracked(repo: Path) -> set[str]:
    return set(git(repo, "ls-files", "-z", "--", "ajet").split("\0")) - {""}


def small_repo(root: Path) -> Path:
    """A tiny committed ajet/ tree (faster than copying the project's)."""
    (root / "ajet" / "engine").mkdir(parents=True)
    (root / "ajet" / "__init__.py").write_text('"""pkg"""\n')
    (root / "ajet" / "engine" / "rewards.py").write_text("def reward(x):\n    return 1.0\n")
    (root / "ajet" / "run.sh").write_text("#!/bin/sh\necho hi\n")
    os.chmod(root / "ajet" / "run.sh", 0o755)
    (root / "README.md").write_text("outside ajet\n")
    subprocess.run(["git", "init", "-q", "-b", "main", str(root)], check=True)
    git(root, "add", "-A")
    git(root, "commit", "-q", "-m", "init")
    return root


def test_ships_exactly_git_ls_files_with_working_tree_content(ajet_repo: Path) -> None:
    target = ajet_repo / "ajet" / "protocol.py"
    target.write_text(target.read_text() + "\nPATCHED = True\n")
    (ajet_repo / "ajet" / "brand_new.py").write_text("x = 1\n")
    (ajet_repo / "ajet" / "client.py").unlink()  # tracked, deleted: skipped
    (ajet_repo / "ajet" / ".gitignore").write_text("*.log\n")
    (ajet_repo / "ajet" / "debug.log").write_text("ignored\n")
    (ajet_repo / "notes.txt").write_text("outside ajet/\n")

    pkg = package_tree(ajet_repo)

    paths = {f.path for f in pkg.files}
    assert paths == tracked(ajet_repo) - {"ajet/client.py"}
    assert "ajet/brand_new.py" not in paths and "ajet/debug.log" not in paths
    assert pkg.deleted_skipped == ("ajet/client.py",)
    shipped = {f.path: f for f in pkg.files}["ajet/protocol.py"]
    data = target.read_bytes()
    assert shipped.sha256 == hashlib.sha256(data).hexdigest() and shipped.size == len(data)
    # untracked (not ignored) files under ajet/ are named; ignored ones are not
    assert set(pkg.untracked_left_out) == {"ajet/brand_new.py", "ajet/.gitignore"}
    assert pkg.provenance.untracked_left_out == sorted(pkg.untracked_left_out)
    prov = pkg.provenance
    assert prov.dirty and prov.branch == "main" and prov.source == "manifest"
    assert prov.git_head == git(ajet_repo, "rev-parse", "HEAD").strip()
    assert "+PATCHED = True" in prov.diff and "ajet/client.py" in prov.diff
    assert prov.host and prov.created_at


def test_clean_tree_provenance_and_stable_id(tmp_path: Path) -> None:
    repo = small_repo(tmp_path / "r")
    first, second = package_tree(repo), package_tree(repo)
    assert first.snapshot_id == second.snapshot_id == snapshot_id_of(first.entries())
    assert not first.provenance.dirty and first.provenance.diff == ""
    modes = {f.path: f.mode for f in first.files}
    assert modes == {"ajet/__init__.py": 0o644, "ajet/engine/rewards.py": 0o644,
                     "ajet/run.sh": 0o755}
    # content, mode and name changes each change the id
    os.chmod(repo / "ajet" / "run.sh", 0o644)
    assert package_tree(repo).snapshot_id != first.snapshot_id
    os.chmod(repo / "ajet" / "run.sh", 0o755)
    (repo / "ajet" / "engine" / "rewards.py").write_text("def reward(x):\n    return 2.0\n")
    assert package_tree(repo).snapshot_id != first.snapshot_id


def test_a_folder_on_disk_has_its_snapshots_id_whatever_it_is_called(tmp_path: Path) -> None:
    import shutil

    repo = small_repo(tmp_path / "r")
    package = package_tree(repo)
    # as a server keeps it: another folder name, owner-only modes, bytecode beside it
    copy = tmp_path / "node1" / "ajet_temp" / "20250102_101010_000001" / "ajet"
    shutil.copytree(repo / "ajet", copy)
    for path in copy.rglob("*"):
        if path.is_file():
            os.chmod(path, path.stat().st_mode & 0o700)
    (copy / "__pycache__").mkdir()
    (copy / "__pycache__" / "x.cpython-311.pyc").write_bytes(b"bytecode")
    assert folder_snapshot_id(copy) == package.snapshot_id
    (copy / "engine" / "rewards.py").write_text("def reward(x):\n    return 2.0\n")
    assert folder_snapshot_id(copy) != package.snapshot_id


def test_subfolder_of_a_repository(tmp_path: Path) -> None:
    repo = small_repo(tmp_path / "mono" / "proj")
    subprocess.run(["rm", "-rf", str(repo / ".git")], check=True)
    top = tmp_path / "mono"
    subprocess.run(["git", "init", "-q", "-b", "dev", str(top)], check=True)
    git(top, "add", "-A")
    git(top, "commit", "-q", "-m", "init")
    pkg = package_tree(repo)
    assert {f.path for f in pkg.files} == {"ajet/__init__.py", "ajet/engine/rewards.py",
                                           "ajet/run.sh"}
    assert pkg.provenance.branch == "dev"


def test_canonical_form_is_exactly_as_documented() -> None:
    a = FileEntry(path="ajet/b.py", sha256="b" * 64, size=2, mode=0o755)
    b = FileEntry(path="ajet/a.py", sha256="a" * 64, size=10, mode=0o644)
    expected = MANIFEST_HEADER + (
        f"644 {'a' * 64} 10 ajet/a.py\n755 {'b' * 64} 2 ajet/b.py\n".encode())
    assert canonical_manifest([a, b]) == canonical_manifest([b, a]) == expected
    assert snapshot_id_of([a, b]) == hashlib.sha256(expected).hexdigest()


@pytest.mark.parametrize("setup, message", [
    ("symlink", "tracked symlink"),
    ("worktree_symlink", "symlink in the working tree"),
    ("too_big", "file cap"),
    ("empty", "no git-tracked files"),
    ("not_git", "not inside a git checkout"),
    ("no_ajet", "no ajet/ folder"),
    ("backslash", "backslash"),
    ("case_collision", "case-insensitive"),
])
def test_refusals_happen_before_any_upload(tmp_path: Path, setup: str, message: str) -> None:
    root = tmp_path / "r"
    if setup == "not_git":
        (root / "ajet").mkdir(parents=True)
        (root / "ajet" / "x.py").write_text("x = 1\n")
    elif setup == "no_ajet":
        root.mkdir()
        subprocess.run(["git", "init", "-q", str(root)], check=True)
    elif setup == "empty":
        (root / "ajet").mkdir(parents=True)
        subprocess.run(["git", "init", "-q", str(root)], check=True)
        (root / "ajet" / "untracked.py").write_text("x = 1\n")
    else:
        small_repo(root)
        if setup == "symlink":
            os.symlink("/etc/passwd", root / "ajet" / "evil")
            git(root, "add", "ajet/evil")
        elif setup == "worktree_symlink":
            target = root / "ajet" / "engine" / "rewards.py"
            target.unlink()
            os.symlink("/etc/hostname", target)
        elif setup == "too_big":
            (root / "ajet" / "big.bin").write_bytes(b"\0" * 2048)
            git(root, "add", "ajet/big.bin")
        elif setup == "backslash":
            (root / "ajet" / "a\\b.py").write_text("x = 1\n")
            git(root, "add", "-A")
        elif setup == "case_collision":
            (root / "ajet" / "Init.PY").write_text("x = 1\n")
            (root / "ajet" / "INIT.py").write_text("x = 2\n")
            git(root, "add", "-A")
    kwargs = {"max_file_bytes": 1024} if setup == "too_big" else {}
    with pytest.raises(PackagingError, match=message):
        package_tree(root, **kwargs)


def test_build_zip_holds_the_package(tmp_path: Path) -> None:
    repo = small_repo(tmp_path / "r")
    pkg = package_tree(repo)
    out = build_zip(pkg, tmp_path / "code.zip")
    with zipfile.ZipFile(out) as zf:
        assert sorted(zf.namelist()) == sorted(f.path for f in pkg.files)
        for f in pkg.files:
            assert hashlib.sha256(zf.read(f.path)).hexdigest() == f.sha256
            assert (zf.getinfo(f.path).external_attr >> 16) & 0o777 == f.mode
    # deterministic bytes for one tree
    assert build_zip(pkg, tmp_path / "again.zip").read_bytes() == out.read_bytes()


def test_file_edited_after_packaging_is_caught(tmp_path: Path) -> None:
    repo = small_repo(tmp_path / "r")
    pkg = package_tree(repo)
    (repo / "ajet" / "__init__.py").write_text("changed\n")
    with pytest.raises(PackagingError, match="changed while syncing"):
        build_zip(pkg, tmp_path / "code.zip")
    assert not (tmp_path / "code.zip").exists()


@pytest.mark.parametrize("path, ok", [
    ("ajet/x.py", True), ("ajet/sub/ü.py", True), ("ajet", False), ("ajet/", False),
    ("/ajet/x.py", False), ("ajet/../x.py", False), ("ajet/./x.py", False),
    ("ajet//x.py", False), ("other/x.py", False), ("ajet\\x.py", False),
    ("ajet/x\0.py", False), ("ajet/x\n.py", False), ("ajet/.git/config", False),
    ("ajet/" + "a" * 256, False), ("C:/ajet/x.py", False), ("ajet/\udcff.py", False),
])
def test_member_path_rules(path: str, ok: bool) -> None:
    assert (member_path_problem(path) is None) == ok


def test_tree_rules() -> None:
    assert tree_problems(["ajet/a.py", "ajet/b.py"]) == []
    assert "duplicate" in tree_problems(["ajet/a.py", "ajet/a.py"])[0]
    assert "case-insensitive" in tree_problems(["ajet/A.py", "ajet/a.py"])[0]
    assert tree_problems(["ajet/Sub/a.py", "ajet/sub/b.py"])
    assert tree_problems(["ajet/a", "ajet/a/b.py"])
    # NFC and NFD spellings of one name collide on macOS
    assert tree_problems(["ajet/\u00e9.py", "ajet/e\u0301.py"])


def test_laptop_side_imports_no_torch() -> None:
    code = ("import sys, ajet.packaging, ajet.code_sync, ajet.client; "
            "bad = [m for m in ('torch', 'transformers', 'git') if m in sys.modules]; "
            "sys.exit(','.join(bad) or None)")
    proc = subprocess.run([sys.executable, "-c", code], cwd=PROJECT_ROOT, capture_output=True,
                          text=True)
    assert proc.returncode == 0, proc.stderr
