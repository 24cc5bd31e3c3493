"""A stand-in for `python -m ajet.engine` in server tests: same command line, same socket.

It implements the engine process contract of docs/internals.md without torch: parses
`--config --run-dir --socket --run-id --workdir`, serves `GET /status` (an
`EngineReport` in ENGINE.ROLLING with `ajet.__file__`) over HTTP on the Unix socket, and
exits 0 on SIGTERM. Point a server at it with
`AJET_SWARM_ENGINE_MODULE=tests.support.fake_engine` (see `server_env`).

What it does is read at boot from `<workdir>/fake_engine.json` (see `set_behaviour`):

    mode            "serve" (default) | "crash_at_boot" | "hang" (never opens the socket)
    exit_code       code for crash_at_boot and exit_after_s (default 3)
    exit_after_s    serve, then exit with exit_code after this many seconds
    ignore_term     ignore SIGTERM (the server must SIGKILL it)
    spawn_child     start a child in the same process group (pid in <run_dir>/child.pid)
    report_ajet_file  report this instead of the real ajet.__file__ (and the content id
                    of the folder it names)
    metrics         list of metric points written to <run_dir>/metrics.jsonl at boot

Every start appends its pid to `<workdir>/fake_engine_pids.txt`, and logs the device
slots it was given (`devices: ...`, from `CUDA_VISIBLE_DEVICES` or
`AJET_ENGINE_DEVICE_SLOTS`). It also serves a minimal episode plane: `/begin_episode`,
`/end_episode`, `/abort_episode`, and `/v1/chat/completions`, whose reply names the run
(`run <run id>`), so a test sees which run's engine a request reached.
"""

from __future__ import annotations

import argparse
import http.server
import json
import os
import signal
import socketserver
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

MODULE = "tests.support.fake_engine"
PROJECT_ROOT = Path(__file__).resolve().parents[2]
BEHAVIOUR_FILE = "fake_engine.json"
PIDS_FILE = "fake_engine_pids.txt"


def server_env(**extra: str) -> dict[str, str]:
    """Environment for a swarm server whose engine is this fake (fast timeouts)."""
    env = {
        "AJET_SWARM_ENGINE_MODULE": MODULE,
        "PYTHONPATH": str(PROJECT_ROOT),
        "AJET_SWARM_STOP_GRACE_S": "3",
        "AJET_SWARM_STATUS_POLL_S": "0.05",
        "AJET_SWARM_BOOT_TIMEOUT_S": "30",
    }
    env.update(extra)
    return env


def set_behaviour(workdir: Path, **behaviour: Any) -> None:
    """What the next fake engine started from `workdir` does (see the module docstring)."""
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / BEHAVIOUR_FILE).write_text(json.dumps(behaviour))


def started_pids(workdir: Path) -> list[int]:
    path = workdir / PIDS_FILE
    if not path.exists():
        return []
    return [int(x) for x in path.read_text().split()]


def _load_behaviour(workdir: Path) -> dict[str, Any]:
    path = workdir / BEHAVIOUR_FILE
    return json.loads(path.read_text()) if path.exists() else {}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    for name in ("--config", "--run-dir", "--socket", "--run-id", "--workdir"):
        p.add_argument(name, required=True)
    p.add_argument("--resume", default=None)  # a checkpoint the fake does not read
    args = p.parse_args(argv)
    run_dir, workdir, socket_path = Path(args.run_dir), Path(args.workdir), Path(args.socket)
    behaviour = _load_behaviour(workdir)
    with open(workdir / PIDS_FILE, "a") as f:
        f.write(f"{os.getpid()}\n")
    print(f"fake engine pid {os.getpid()} run {args.run_id} booting", flush=True)
    print(f"config: {Path(args.config).read_text().splitlines()[0]}", flush=True)
    print(f"devices: CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')} "
          f"AJET_ENGINE_DEVICE_SLOTS={os.environ.get('AJET_ENGINE_DEVICE_SLOTS')}", flush=True)

    if behaviour.get("spawn_child"):
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        (run_dir / "child.pid").write_text(str(child.pid))
    if behaviour.get("ignore_term"):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)

    mode = behaviour.get("mode", "serve")
    exit_code = int(behaviour.get("exit_code", 3))
    if mode == "crash_at_boot":
        print("Traceback (most recent call last):", flush=True)
        print('  File "ajet/engine/__main__.py", line 1, in <module>', flush=True)
        print("RuntimeError: fake boot failure", flush=True)
        return exit_code
    if mode == "hang":
        while True:
            time.sleep(1)

    import ajet
    from ajet.protocol import EngineReport, EngineState

    points = behaviour.get("metrics") or []
    if points:
        with open(run_dir / "metrics.jsonl", "a") as f:
            for point in points:
                f.write(json.dumps(point) + "\n")
    from ajet.packaging import folder_snapshot_id

    ajet_file = behaviour.get("report_ajet_file") or ajet.__file__
    report = EngineReport(
        state=EngineState.ROLLING, pid=os.getpid(), ajet_file=ajet_file, run_id=args.run_id,
        step=points[-1]["step"] if points else 0,
        snapshot_id=folder_snapshot_id(Path(ajet_file).parent),
    )
    server = _plane_server(socket_path, report, args.run_id)
    if behaviour.get("exit_after_s") is not None:
        def _exit_later() -> None:
            print(f"fake engine exiting with code {exit_code}", flush=True)
            os._exit(exit_code)
        threading.Timer(float(behaviour["exit_after_s"]), _exit_later).start()

    # the server runs off the main thread; the main thread turns SIGTERM into a clean
    # shutdown, exit code 0, as the real engine does
    stop = threading.Event()
    if not behaviour.get("ignore_term"):
        signal.signal(signal.SIGTERM, lambda *_: stop.set())
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    while not stop.wait(0.05):
        pass
    server.shutdown()
    server.server_close()
    print("fake engine stopped cleanly", flush=True)
    return 0


class _UnixHTTPServer(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True


def _plane_server(socket_path: Path, report: Any, run_id: str) -> _UnixHTTPServer:
    """The status route and the minimal episode plane, on the standard library's HTTP
    server: this process starts for almost every server test, and FastAPI with uvicorn
    would cost each start about half a second of CPU."""
    live: set[str] = set()

    def status(_: dict[str, Any], __: str) -> tuple[int, Any]:
        return 200, report.model_copy(update={"episodes_in_flight": len(live)}
                                      ).model_dump(mode="json")

    def begin(_: dict[str, Any], __: str) -> tuple[int, Any]:
        episode = uuid.uuid4().hex
        live.add(episode)
        return 200, {"episode_uuid": episode, "timeout_s": 600.0}

    def end(body: dict[str, Any], _: str) -> tuple[int, Any]:
        if body["episode_uuid"] not in live:
            return 404, {"detail": f"episode {body['episode_uuid']} unknown to run {run_id}",
                         "hint": "begin"}
        live.discard(body["episode_uuid"])
        return 200, {"episode_uuid": body["episode_uuid"], "accepted": True, "step": 0}

    def abort(body: dict[str, Any], _: str) -> tuple[int, Any]:
        live.discard(body["episode_uuid"])
        return 200, {"episode_uuid": body["episode_uuid"], "requeued": True}

    def chat(_: dict[str, Any], episode: str) -> tuple[int, Any]:
        if episode not in live:
            return 404, {"detail": f"episode {episode} unknown to run {run_id}"}
        return 200, {"id": "fake", "object": "chat.completion", "created": 0, "model": "fake",
                     "choices": [{"index": 0, "finish_reason": "stop",
                                  "message": {"role": "assistant", "content": f"run {run_id}"}}],
                     "usage": {"prompt_tokens": 1, "completion_tokens": 2, "total_tokens": 3}}

    routes = {("GET", "/status"): status, ("POST", "/begin_episode"): begin,
              ("POST", "/end_episode"): end, ("POST", "/abort_episode"): abort,
              ("POST", "/v1/chat/completions"): chat}

    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive, as the server's client expects

        def _answer(self) -> None:
            length = int(self.headers.get("content-length") or 0)
            raw = self.rfile.read(length) if length else b""
            route = routes.get((self.command, self.path.split("?", 1)[0]))
            if route is None:
                code, body = 404, {"detail": "Not Found"}
            else:
                code, body = route(json.loads(raw) if raw else {},
                                   self.headers.get("x-episode-uuid", ""))
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        do_GET = do_POST = _answer

        def address_string(self) -> str:  # a Unix socket has no client address
            return "engine-socket"

        def log_message(self, *_: Any) -> None:
            pass

    socket_path.unlink(missing_ok=True)  # a stale socket file would make bind fail
    return _UnixHTTPServer(str(socket_path), Handler)


if __name__ == "__main__":
    raise SystemExit(main())
