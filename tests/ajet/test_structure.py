"""The structure of the code, drawn from its imports (ast, nothing imported):

- no import circle between the modules of `ajet`, `swarm_server` and `mcp_bridge`,
  counting every import: module level, inside functions and under `TYPE_CHECKING`;
- the core never imports the compatibility room (`ajet.compat`) nor the original's
  module paths that re-export it, except the named boundary modules, which reach only
  the room's boundary part (docs/compat.md, "Compatibility room");
- that boundary part never pulls in the rest of the room (the original client).

Each check also runs on a small made-up tree that breaks it, so a checker that sees
nothing cannot pass.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("ajet", "swarm_server", "mcp_bridge")

#: The compatibility room and the original's module paths (thin re-exports of the room).
COMPAT_PREFIXES = ("ajet.compat", "ajet.tuner_lib", "ajet.schema", "ajet.task_reader",
                   "ajet.utils", "ajet.default_config")
#: Outside the room, only these may import it: the original's own server routes, and the
#: boundary modules, each with what it may reach.
COMPAT_USERS = {"swarm_server.routes.original": None}  # None: any part of the room
BOUNDARY = {
    # /end_episode and /abort_episode read the original's body as well as this project's
    "swarm_server.routes.episodes": {"ajet.compat", "ajet.compat.boundary"},
    # the rollout runner takes the original's WorkflowOutput as a workflow's result
    "ajet.rollout": {"ajet.compat", "ajet.compat.boundary"},
    # the job reads and writes the original's nested YAML (the server's one
    # /sync_train_config takes both forms; the snapshot's validator parses them)
    "ajet.copilot.job": {"ajet.compat", "ajet.compat.nested_config"},
}
#: What the boundary part of the room may pull in: models and conversions only.
BOUNDARY_PART = {"ajet.compat", "ajet.compat.boundary", "ajet.compat.nested_config",
                 "ajet.compat.wire", "ajet.compat.task"}


# ---------------------------------------------------------------------------- the graph


def module_files(root: Path, packages: Iterable[str]) -> dict[str, Path]:
    """Dotted module name -> file, for every .py file under the packages."""
    found: dict[str, Path] = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


def import_graph(root: Path, packages: Iterable[str]) -> dict[str, set[str]]:
    """Module -> the modules of the packages it imports, anywhere in its source."""
    files = module_files(root, packages)
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        targets: set[str] = set()
        is_package = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text("utf-8"), str(path))):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    targets.add(_deepest(alias.name, files))
            elif isinstance(node, ast.ImportFrom):
                base = _absolute(name, is_package, node.module, node.level)
                for alias in node.names:
                    sub = f"{base}.{alias.name}"
                    # `from pkg import mod` imports the module; `from mod import name` the module
                    targets.add(sub if sub in files else _deepest(base, files))
        targets.discard("")
        targets.discard(name)
        graph[name] = targets
    return graph


def _absolute(module: str, is_package: bool, target: str | None, level: int) -> str:
    if not level:
        return target or ""
    parts = module.split(".") if is_package else module.split(".")[:-1]
    parts = parts[:len(parts) - (level - 1)]
    return ".".join([*parts, target] if target else parts)


def _deepest(name: str, files: dict[str, Path]) -> str:
    """The longest prefix of `name` that is one of our modules ('' for a third party)."""
    while name and name not in files:
        name = name.rpartition(".")[0]
    return name


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []

    def visit(node: str) -> None:
        # recursion depth is bounded by the longest import chain (tens of modules)
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return groups


def _in_room(module: str) -> bool:
    return any(module == p or module.startswith(p + ".") for p in COMPAT_PREFIXES)


def compat_violations(graph: dict[str, set[str]]) -> list[str]:
    """Each import of the compatibility room the rules above do not allow."""
    found = []
    for module, targets in sorted(graph.items()):
        if _in_room(module) or module in COMPAT_USERS:
            continue
        allowed = BOUNDARY.get(module, set())
        for target in sorted(targets):
            if _in_room(target) and target not in allowed:
                found.append(f"{module} imports {target}")
    return found


def reach(graph: dict[str, set[str]], start: Iterable[str]) -> set[str]:
    seen: set[str] = set()
    todo = list(start)
    while todo:
        node = todo.pop()
        if node not in seen:
            seen.add(node)
            todo.extend(graph.get(node, ()))
    return seen


# ---------------------------------------------------------------------------- the checks


def test_no_import_circle() -> None:
    graph = import_graph(ROOT, PACKAGES)
    assert len(graph) > 100 and "ajet.engine.trainer" in graph  # the real tree was read
    assert graph["ajet.client"] >= {"ajet.code_sync", "ajet.protocol"}  # function-level counts
    assert circles(graph) == []


def test_core_does_not_import_the_compatibility_room() -> None:
    graph = import_graph(ROOT, PACKAGES)
    assert compat_violations(graph) == []
    # the named boundaries are real (a stale name here would allow nothing)
    for module, allowed in BOUNDARY.items():
        assert graph[module] & allowed - {"ajet.compat"}, module


def test_the_boundary_part_stays_light() -> None:
    graph = import_graph(ROOT, PACKAGES)
    room = {m for m in reach(graph, BOUNDARY_PART) if m.startswith("ajet.compat")}
    assert room <= BOUNDARY_PART, sorted(room - BOUNDARY_PART)
    assert graph["ajet.compat"] == set()  # the room's __init__ imports nothing
    # and the typed client knows nothing of the room, even through other modules
    assert not {m for m in reach(graph, ["ajet.client"]) if _in_room(m)} - BOUNDARY_PART


def test_the_checks_catch_what_they_forbid(tmp_path: Path) -> None:
    def write(module: str, source: str) -> None:
        path = tmp_path.joinpath(*module.split(".")).with_suffix(".py")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(source, "utf-8")

    write("ajet.__init__", "")
    write("ajet.compat.__init__", "")
    write("ajet.compat.client", "from ajet.client import SwarmClient\n")
    write("ajet.compat.boundary", "from ajet import protocol\n")
    write("ajet.protocol", "")
    write("ajet.engine.__init__", "")
    write("ajet.engine.a", "def f():\n    from . import b\n")
    write("ajet.engine.b", "from typing import TYPE_CHECKING\n"
                           "if TYPE_CHECKING:\n    from ajet.engine.a import f\n")
    write("ajet.client", "import ajet.compat.client\n")
    write("ajet.rollout", "from ajet.compat.boundary import x\n")
    graph = import_graph(tmp_path, ["ajet"])
    assert sorted(circles(graph)) == [["ajet.client", "ajet.compat.client"],
                                      ["ajet.engine.a", "ajet.engine.b"]]
    assert compat_violations(graph) == ["ajet.client imports ajet.compat.client"]
