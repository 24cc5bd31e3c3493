"""The warm standby: an interpreter that imports torch and transformers ahead of time.

    <engine_python> <path>/swarm_server/standby.py --preload torch,transformers,...

Run by the server (`swarm_server.standby_keeper`), never imported by it. An engine start
otherwise spends seconds in a fresh interpreter importing the same third-party modules;
the standby has done that already and waits, so the start pays only for importing
`ajet` from the snapshot and loading the model.

Protocol: after preloading, the standby reads ONE JSON line on stdin, the launch order

    {"argv": ["<python>", "-m", "<engine module>", ...], "env": {...},
     "cwd": "<run dir>", "log_path": "<run dir>/engine.log"}

(`argv` is exactly the command a cold start would run). It then becomes that engine:
environment replaced, cwd changed, stdin from /dev/null, stdout and stderr appended to
`log_path`, `sys.path` rebuilt as `python -m` with that environment's `PYTHONPATH`
would have built it, and the module run as `__main__`. Its exit code is the engine's.
End of file on stdin (the server closed the pipe, or died) ends the standby, code 0.

What keeps stale code out (DESIGN: the engine runs the active snapshot's code):

- Only third-party modules are preloaded; `ajet` and the engine module's package are
  never imported here, so the engine imports them from the snapshot. If either is in
  `sys.modules` anyway, or a preloaded module is not the one the engine's `sys.path`
  would find, or its file changed since it was loaded (an upgrade), or a preload failed
  half way, the standby does not guess: it `exec`s the cold command line in place (same
  pid and process group, just no time saved).
- The standby is started with the engine's environment minus `PYTHONPATH`, so its
  `sys.path` is the interpreter's own; the server hands it an order only when the
  order's environment equals its own apart from `PYTHONPATH` and
  `ISOLATED_AGENTJET_BASE_DIR` (third-party modules read the environment at import).
- The engine still reports `ajet.__file__` and the server still refuses a start whose
  `ajet` is outside the snapshot.

Standard library only: this file runs under `settings.engine_python`.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import json
import os
import runpy
import sys
from typing import Any

#: The packages whose code must come from the snapshot: never preloaded here.
SYNCED_PACKAGE = "ajet"

_EXIT_BAD_ORDER = 2


def _drop_script_dir() -> None:
    """`python path/standby.py` put `swarm_server/` first on sys.path; nothing there is ours
    to import by a top-level name (an `engine.py` or `settings.py` could shadow one)."""
    here = os.path.dirname(os.path.abspath(__file__))
    if sys.path and os.path.abspath(sys.path[0] or os.curdir) == here:
        del sys.path[0]


def preload(names: list[str]) -> list[str]:
    """Import `names` (third-party modules); the problems, one line each (empty = all fine)."""
    problems: list[str] = []
    for name in names:
        if name.split(".")[0] == SYNCED_PACKAGE:
            problems.append(f"{name}: refused, {SYNCED_PACKAGE} must come from the snapshot")
            continue
        try:
            importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name != name:  # something it imports is missing: it ran half way
                problems.append(f"{name}: {type(exc).__name__}: {exc}")
            else:  # not installed here: nothing of it ran, nothing to undo
                sys.stderr.write(f"[warm_standby] {name} is not installed; not preloaded\n")
        except Exception as exc:  # noqa: BLE001 - any failure only makes the start cold
            problems.append(f"{name}: {type(exc).__name__}: {exc}")
    return problems


def pythonpath_entries(pythonpath: str, cwd: str) -> list[str]:
    """The sys.path entries `PYTHONPATH` adds, as the interpreter adds them: absolute, an
    empty entry meaning the working directory."""
    if not pythonpath:
        return []
    return [os.path.abspath(os.path.join(cwd, entry)) if entry else cwd
            for entry in pythonpath.split(os.pathsep)]


def engine_sys_path(base_path: list[str], env: dict[str, str], cwd: str, *,
                    safe_path: bool) -> list[str]:
    """The sys.path `<python> -m <module>` started in `cwd` with `env` would have.

    `base_path` is this interpreter's sys.path without PYTHONPATH and without the script
    directory (stdlib, site-packages, .pth entries). At start-up the PYTHONPATH entries
    come first and `site` drops later duplicates (`removeduppaths`, `addsitedir`); only
    then does `-m` insert the working directory in front (unless `-P`/PYTHONSAFEPATH),
    without removing a duplicate of it.
    """
    seen: set[str] = set()
    result: list[str] = []
    for entry in [*pythonpath_entries(env.get("PYTHONPATH", ""), cwd), *base_path]:
        key = os.path.normcase(os.path.abspath(entry))
        if key not in seen:
            seen.add(key)
            result.append(entry)
    return result if safe_path else [cwd, *result]


def _module_files() -> dict[str, str]:
    """Loaded top-level modules that came from a file: name -> that file."""
    files: dict[str, str] = {}
    for name, module in list(sys.modules.items()):
        spec = getattr(module, "__spec__", None)
        if "." not in name and spec is not None and spec.has_location and spec.origin:
            files[name] = spec.origin  # submodules follow their package
    return files


def file_stamps() -> dict[str, int]:
    """Modification time of each loaded top-level module's file (see `stale_modules`)."""
    stamps: dict[str, int] = {}
    for origin in _module_files().values():
        try:
            stamps[origin] = os.stat(origin).st_mtime_ns
        except OSError:
            continue
    return stamps


def stale_modules(path: list[str], stamps: dict[str, int]) -> list[str]:
    """Loaded top-level modules that the engine would not get as they are: an import along
    `path` finds another file, or their file changed since `stamps` (a package upgraded
    while the standby waited)."""
    stale: list[str] = []
    for name, origin in _module_files().items():
        stamp = stamps.get(origin)  # None: not a plain file (a zip member), or loaded later
        try:
            changed = stamp is not None and os.stat(origin).st_mtime_ns != stamp
        except OSError:
            changed = True
        if changed:
            stale.append(f"{name} ({origin} changed on disk)")
            continue
        found = importlib.machinery.PathFinder.find_spec(name, path)
        if found is None or found.origin is None:
            continue  # loaded through another finder (an editable install's): same either way
        if os.path.realpath(found.origin) != os.path.realpath(origin):
            stale.append(f"{name} ({origin} vs {found.origin})")
    return stale


def _read_order() -> dict[str, Any] | None:
    line = sys.stdin.buffer.readline()
    if not line.strip():
        return None
    order = json.loads(line)
    argv, env = order.get("argv"), order.get("env")
    if (not isinstance(argv, list) or len(argv) < 3 or argv[1] != "-m"
            or not all(isinstance(a, str) for a in argv) or not isinstance(env, dict)
            or not isinstance(order.get("cwd"), str) or not isinstance(order.get("log_path"), str)):
        raise ValueError("the launch order needs argv ['<python>', '-m', '<module>', ...], "
                         "env, cwd and log_path")
    return order


def _become_process(order: dict[str, Any]) -> None:
    """Environment, cwd and file descriptors exactly as the cold spawn would set them."""
    os.environ.clear()
    os.environ.update(order["env"])
    os.chdir(order["cwd"])
    sys.stdout.flush()
    sys.stderr.flush()
    log_fd = os.open(order["log_path"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    null_fd = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null_fd, 0)
    os.dup2(log_fd, 1)
    os.dup2(log_fd, 2)
    os.close(null_fd)
    os.close(log_fd)


def _exec_cold(order: dict[str, Any], why: str) -> None:
    sys.stderr.write(f"[warm_standby] pid {os.getpid()}: {why}; running the cold command "
                     "line instead\n")
    sys.stderr.flush()
    os.execve(order["argv"][0], order["argv"], order["env"])


def main(argv: list[str]) -> int:
    names: list[str] = []
    if len(argv) == 2 and argv[0] == "--preload":
        names = [n for n in argv[1].split(",") if n]
    elif argv:
        sys.stderr.write("usage: standby.py [--preload mod1,mod2,...]\n")
        return _EXIT_BAD_ORDER
    _drop_script_dir()
    if os.environ.get("PYTHONPATH"):
        # Started with a PYTHONPATH, its entries cannot be told apart from the rest.
        problems = ["the standby was started with PYTHONPATH set"]
    else:
        problems = preload(names)
    base_path = list(sys.path)
    stamps = file_stamps()

    try:
        order = _read_order()
    except (ValueError, json.JSONDecodeError) as exc:
        sys.stderr.write(f"[warm_standby] bad launch order: {exc}\n")
        return _EXIT_BAD_ORDER
    if order is None:
        return 0  # the server closed the pipe: not needed any more
    _become_process(order)

    module = order["argv"][2]
    env: dict[str, str] = order["env"]
    if problems:
        _exec_cold(order, "preloading failed (" + "; ".join(problems) + ")")
    synced = {SYNCED_PACKAGE, module.split(".")[0]}
    loaded = sorted(m for m in sys.modules if m.split(".")[0] in synced)
    if loaded:
        _exec_cold(order, f"{', '.join(loaded)} already imported")
    # os.getcwd(), not the order's cwd: the interpreter resolves symlinks the same way
    sys.path[:] = engine_sys_path(base_path, env, os.getcwd(),
                                  safe_path=bool(getattr(sys.flags, "safe_path", False)))
    importlib.invalidate_caches()
    stale = stale_modules(sys.path, stamps)
    if stale:
        _exec_cold(order, "preloaded modules differ from what the engine would import: "
                   + ", ".join(stale))
    # The engine's own first lines in engine.log say where ajet came from; this one says
    # that the interpreter was warm, for whoever compares boot times.
    sys.stderr.write(f"[warm_standby] pid {os.getpid()}: warm interpreter "
                     f"({len(names)} module(s) preloaded) running python -m {module}\n")
    sys.stderr.flush()
    sys.argv[:] = [order["argv"][0], *order["argv"][3:]]  # run_module sets argv[0]
    runpy.run_module(module, run_name="__main__", alter_sys=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
