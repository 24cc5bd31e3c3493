"""Engine test support: a real `python -m ajet.engine` subprocess, and generators without a
model for in-process tests of the episode plane.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from ajet.copilot.job import AgentJetJob
from ajet.engine.generation.interface import (
    GenerationHandle,
    GenerationRequest,
    GenerationResult,
    Generator,
    ReplyText,
)
from tests.support.servers import PROJECT_ROOT

__all__ = [
    "SCRIPTED_LOGPROB",
    "EngineHandle",
    "FakeClock",
    "ScriptedGenerator",
    "StubGenerator",
    "spawn_engine",
    "wait_for_state",
]


@dataclass
class EngineHandle:
    proc: subprocess.Popen[bytes]
    run_dir: Path
    socket: Path
    log_path: Path
    client: httpx.Client

    def log(self) -> str:
        return self.log_path.read_text("utf-8", errors="replace")

    def stop(self, timeout: float = 30.0) -> int:
        self.client.close()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        return int(self.proc.returncode)


def spawn_engine(root: Path, job: AgentJetJob | str, *, run_id: str = "test-run"
                 ) -> EngineHandle:
    """Spawn the engine like the server does (own session, log file, cwd = run dir).

    `job` may be raw YAML text, to test what the engine does with a bad one.
    """
    run_dir = root / "runs" / run_id
    run_dir.mkdir(parents=True)
    text = job if isinstance(job, str) else job.to_yaml()
    (run_dir / "job.yaml").write_text(text)
    socket = run_dir / "engine.sock"
    log_path = run_dir / "engine.log"
    env = {**os.environ, "PYTHONPATH": str(PROJECT_ROOT)}
    env.pop("ISOLATED_AGENTJET_BASE_DIR", None)
    with open(log_path, "ab") as log_file:
        proc = subprocess.Popen(
            [sys.executable, "-m", "ajet.engine", "--config", str(run_dir / "job.yaml"),
             "--run-dir", str(run_dir), "--socket", str(socket), "--run-id", run_id,
             "--workdir", str(root)],
            cwd=run_dir, stdout=log_file, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            env=env, start_new_session=True)
    client = httpx.Client(transport=httpx.HTTPTransport(uds=str(socket)),
                          base_url="http://engine", timeout=60.0)
    return EngineHandle(proc, run_dir, socket, log_path, client)


def wait_for_state(engine: EngineHandle, state: str, *, timeout: float = 120.0) -> dict:
    deadline = time.monotonic() + timeout
    last: dict = {}
    while time.monotonic() < deadline:
        if engine.proc.poll() is not None:
            raise RuntimeError(f"engine exited ({engine.proc.returncode}):\n{engine.log()}")
        try:
            last = engine.client.get("/status").json()
            if last["state"] == state:
                return last
        except httpx.TransportError:
            pass
        time.sleep(0.05)
    raise TimeoutError(f"engine not {state} after {timeout}s (last {last}):\n{engine.log()}")


class StubGenerator(Generator):
    """A generator without a model, for tests of what sits around one: `submit` is the
    test's, the lifecycle does nothing."""

    def start(self) -> None: ...

    def stop(self, timeout: float = 10.0) -> None: ...

    def pause(self) -> None: ...

    def resume(self) -> None: ...


class FakeClock:
    """A clock the test moves by hand (`clock.now += 5`), for the registry's timeouts."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


#: the log-prob `ScriptedGenerator` gives every token it "samples"
SCRIPTED_LOGPROB = -0.25


class ScriptedGenerator(StubGenerator):
    """Answers each request with the next scripted reply, as a backend delivers one.

    `say(text, ...)` queues replies (an empty script answers ""). A reply is tokenized with
    the run's tokenizer and delivered on a thread of its own, as the backends do: its text
    in deltas through `ReplyText` (stop strings cut it, and held back while they may still
    appear), then one `GenerationResult` with the prompt's ids, the reply's ids plus the
    end-of-turn token, and `SCRIPTED_LOGPROB` per token. A reply longer than
    `max_new_tokens` is cut there, with finish reason "length", as a model's would be.
    Every request is kept in `requests`, for tests of what the routes asked for.
    """

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.end_of_turn = int(tokenizer.convert_tokens_to_ids("<|im_end|>"))
        self.script: deque[str] = deque()
        self.requests: list[GenerationRequest] = []
        self._lock = threading.Lock()

    def say(self, *replies: str) -> None:
        with self._lock:
            self.script.extend(replies)

    def submit(self, request: GenerationRequest) -> GenerationHandle:
        with self._lock:
            self.requests.append(request)
            text = self.script.popleft() if self.script else ""
        handle = GenerationHandle(request)
        threading.Thread(target=self._deliver, args=(handle, text), daemon=True).start()
        return handle

    def _deliver(self, handle: GenerationHandle, text: str) -> None:
        request = handle.request
        ids = [int(i) for i in self.tokenizer(text, add_special_tokens=False)["input_ids"]]
        reply = ReplyText(lambda part: str(self.tokenizer.decode(part)), request.stop)
        served: list[int] = []
        for token in ids:
            if len(served) == request.max_new_tokens:
                break
            served.append(token)
            handle.delta(reply.update(served))
            if reply.stopped:
                break
        text_ids = list(served)
        finish = "length"
        if reply.stopped:
            finish = "stop"
        elif len(served) == len(ids) and len(served) < request.max_new_tokens:
            finish = "stop"
            served.append(self.end_of_turn)  # a model's end of turn is recorded too
        handle.delta(reply.update(text_ids, done=True))
        handle.finish(GenerationResult(prompt_ids=list(request.prompt_ids),
                                       response_ids=served,
                                       logprobs=[SCRIPTED_LOGPROB] * len(served),
                                       text=reply.text, finish_reason=finish))
