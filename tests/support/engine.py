"""Engine test support: a real `python -m ajet.engine` subprocess, and generators without a
model for in-process tests of the episode plane.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from ajet.copilot.job import AgentJetJob
from ajet.engine.generation.interface import (
    GenerationHandle,
    GenerationRefused,
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


def spawn_engine(root: Path, job: AgentJetJob | str, *, run_id: str = "test-run",
                 extra_args: tuple[str, ...] = ()) -> EngineHandle:
    """Spawn the engine like the server does (own session, log file, cwd = run dir).

    `job` may be raw YAML text, to test what the engine does with a bad one.
    """
    run_dir = root / "runs" / run_id
    run_dir.mkdir(parents=True)
    text = job if isinstance(job, str) else job.to_yaml()
    (run_dir / "job.yaml").write_text(text)
    socket = run_dir / "engine.sock"
    if len(str(socket)) > 100:  # AF_UNIX's bound; pytest-xdist's temp paths pass it
        socket = Path(tempfile.mkdtemp(prefix="ajet-eng-")) / "engine.sock"
    log_path = run_dir / "engine.log"
    env = {**os.environ, "PYTHONPATH": str(PROJECT_ROOT)}
    env.pop("ISOLATED_AGENTJET_BASE_DIR", None)
    with open(log_path, "ab") as log_file:
        proc = subprocess.Popen(
            [sys.executable, "-m", "ajet.engine", "--config", str(run_dir / "job.yaml"),
             "--run-dir", str(run_dir), "--socket", str(socket), "--run-id", run_id,
             "--workdir", str(root), *extra_args],
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
SCRIPTED_LOGPROB = -0.5


class ScriptedGenerator(StubGenerator):
    """Replies with scripted text, one token per step, as a backend does: each token is
    streamed through `ReplyText` (stop strings, held-back deltas), the reply ends at the
    end-of-turn token, a stop string or `max_new_tokens`, with a log-prob per token.

    `replies` is the queue of texts to answer with (then `default`), `requests` what was
    submitted; `delay_s` waits before the first token, `max_positions` is the context. A
    reply is generated on a thread of its own, like a backend's loop; each token gets
    `SCRIPTED_LOGPROB`.
    """

    def __init__(self, tokenizer: Any, *, eos_id: int, default: str = "Hello.") -> None:
        self.tokenizer = tokenizer
        self.eos_id = eos_id
        self.default = default
        self.replies: list[str] = []
        self.requests: list[GenerationRequest] = []
        self.max_positions = 1 << 30
        #: seconds before the first token (a long prefill)
        self.delay_s = 0.0

    def submit(self, request: GenerationRequest) -> GenerationHandle:
        if len(request.prompt_ids) >= self.max_positions:
            raise GenerationRefused(f"the prompt is {len(request.prompt_ids)} tokens; the "
                                    f"model's context is {self.max_positions}")
        self.requests.append(request)
        text = self.replies.pop(0) if self.replies else self.default
        handle = GenerationHandle(request)
        threading.Thread(target=self._run, args=(handle, text), daemon=True).start()
        return handle

    def _run(self, handle: GenerationHandle, text: str) -> None:
        request = handle.request
        script = [*self.tokenizer(text, add_special_tokens=False)["input_ids"], self.eos_id]
        reply = ReplyText(lambda ids: str(self.tokenizer.decode(ids, skip_special_tokens=True)),
                          request.stop)
        ids: list[int] = []
        done = "length"
        time.sleep(self.delay_s)
        for token in script:
            if handle.done:  # cancelled
                return
            ids.append(token)
            delta = reply.update(ids)
            if token == self.eos_id or reply.stopped:
                done = "stop"
            elif len(ids) >= request.max_new_tokens:
                done = "length"
            else:
                handle.delta(delta)
                continue
            handle.delta(delta + reply.update(ids, done=True))
            break
        handle.finish(GenerationResult(prompt_ids=list(request.prompt_ids), response_ids=ids,
                                       logprobs=[SCRIPTED_LOGPROB] * len(ids), text=reply.text,
                                       finish_reason=done))

    def say(self, *replies: str) -> None:
        """Queue the next replies."""
        self.replies.extend(replies)

    @property
    def end_of_turn(self) -> int:
        return self.eos_id
