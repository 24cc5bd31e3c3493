"""The soak: mixed traffic against one real server and engine, and an account of every
episode.

    report = run_soak(target, SoakConfig())     # traffic; stops the run at the end
    ledger = account(report, target.workdir)    # per run: client and engine side by side

`tests/faults/test_soak.py` runs it and asserts the accounting (nothing lost, no wedge,
the ledger consistent); `bench/bench_soak.py` runs it and reports the `/health` latency
and the server's memory growth. What runs, on loopback only, bounded in time:

- `workers` rollout workers: begin, chat, end with a random reward, or abort (a random
  share), or hang past the episode timeout so the engine re-queues the claim; the chats
  of a share of the episodes offer a tool (`ADD_TOOL`), and any tool call that comes
  back is answered with a `tool` message in the next chat;
- pollers: `get_engine_status`, the current run's metrics and log tail (worker token);
- `/health` every 0.1 s from a process of its own (an answer within 5 s or it counts
  as a wedge), and the server's resident memory every 0.5 s;
- at `sync_at_s`, a one-file edit synced with `force_restart` (a new engine run);
- the hostile requests of the review, each checked against the answer it must get
  (among them a chat over the engine's size bound with a valid episode key: a 413 that
  names the bound, within `WEDGE_S`).

Every episode a worker began ends in one outcome with a reason: `ended` (the engine took
its reward), `aborted`, `requeued` (the engine timed it out and freed its slot), or
`refused` (the run it belonged to stopped, the engine went away). `account` reads each
run's own last word (`episodes at stop: {...}` in its engine.log, written once no call
can reach it) and its `metrics.jsonl`, so both sides can be compared count by count.
"""

from __future__ import annotations

import json
import logging
import random
import re
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psutil

from ajet.client import SwarmClient
from ajet.protocol import CodeSyncResult

__all__ = ["Episode", "Hostile", "RunAccount", "SoakConfig", "SoakReport", "SoakTarget",
           "account", "run_soak"]

log = logging.getLogger(__name__)

#: An answer slower than this is a wedge.
WEDGE_S = 5.0
#: Backtracks without end on any ordinary log line (`re`, and `regex` without a timeout).
REGEX_BOMB = r"(.|..)*\d{5}"
#: Polls /health every 0.1 s until its stdin closes; prints each latency (s), inf = none.
_HEALTH_POLLER = """
import sys, threading, time, httpx
done = threading.Event()
threading.Thread(target=lambda: (sys.stdin.read(), done.set()), daemon=True).start()
with httpx.Client(timeout=%r) as http:
    while not done.is_set():
        t0 = time.monotonic()
        try:
            ok = http.get(sys.argv[1] + "/health").status_code == 200
        except httpx.HTTPError:
            ok = False
        print(time.monotonic() - t0 if ok else float("inf"), flush=True)
        done.wait(0.1)
""" % WEDGE_S
#: begin/abort pairs of the churn attack (the gateway table must not grow with them)
CHURN = 50
_STOP_LINE = re.compile(r"episodes at stop: (\{.*\})")
#: The function a share of the soak's chats offer (OpenAI function calling).
ADD_TOOL: dict[str, Any] = {"type": "function", "function": {
    "name": "add", "description": "Add two integers.",
    "parameters": {"type": "object", "required": ["a", "b"], "properties": {
        "a": {"type": "integer"}, "b": {"type": "integer"}}}}}
#: An oversized chat's content: over the engine's chat bound (8 x max_prompt_length +
#: 64 KiB) whatever the tiny job's prompt length, under the server's max_json_bytes.
OVERSIZED_CHAT_BYTES = 4 * 2**20


@dataclass(frozen=True)
class SoakTarget:
    """A running server whose engine is ROLLING, and what the soak may use of it."""

    url: str
    port: int
    pid: int
    workdir: Path
    control_token: str
    worker_token: str
    #: a git repository with `ajet/`; the mid-soak sync edits one file of it
    repo: Path


@dataclass(frozen=True)
class SoakConfig:
    workers: int = 16
    #: traffic lasts at least this long ...
    duration_s: float = 30.0
    #: ... and, after the sync, until the new run ended this many episodes (or max_s)
    after_sync_ended: int = 16
    max_s: float = 60.0
    #: when the code sync with force_restart happens; None: never
    sync_at_s: float | None = 10.0
    abort_share: float = 0.15
    hang_share: float = 0.06
    #: the share of episodes whose chats offer a tool (`ADD_TOOL`)
    tool_share: float = 0.3
    #: the job's `episode_timeout_s` (a hang sleeps past it)
    episode_timeout_s: float = 2.0
    #: the server's `AJET_SWARM_HEADER_TIMEOUT_S`
    header_timeout_s: float = 2.0
    hostile: bool = True
    tasks: int = 4
    seed: int = 20


@dataclass
class Episode:
    run_id: str | None
    uuid: str
    #: ended | aborted | requeued | refused | error
    outcome: str
    reason: str = ""

    @property
    def ambiguous(self) -> bool:
        """Refused because the engine did not answer: it may or may not have taken it."""
        return self.outcome == "refused" and "did not answer" in self.reason


@dataclass
class Hostile:
    name: str
    expected: str
    got: str
    seconds: float

    @property
    def ok(self) -> bool:
        return self.got == self.expected


@dataclass
class SoakReport:
    episodes: list[Episode] = field(default_factory=list)
    #: begin_episode calls the engine may have claimed without the worker learning the id
    ambiguous_begins: Counter[str] = field(default_factory=Counter)
    health_s: list[float] = field(default_factory=list)
    polls: Counter[int] = field(default_factory=Counter)
    rss_mb: list[float] = field(default_factory=list)
    hostile: list[Hostile] = field(default_factory=list)
    #: chats answered 200 that offered `ADD_TOOL`, and tool calls answered in them
    tool_chats: int = 0
    tool_calls: int = 0
    sync: CodeSyncResult | None = None
    runs: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    wall_s: float = 0.0

    def outcomes(self, run_id: str | None = None) -> Counter[str]:
        return Counter(e.outcome for e in self.episodes if run_id is None or e.run_id == run_id)


@dataclass
class RunAccount:
    """One run, as the clients saw it and as the engine counted it."""

    run_id: str
    client: Counter[str]
    ambiguous_ends: int
    ambiguous_begins: int
    #: the engine's counters at stop (`EpisodeRegistry.snapshot`), None if it left none
    engine: dict[str, int] | None
    #: episodes trained per step (metrics.jsonl)
    trained_per_step: list[int]


# ---------------------------------------------------------------------------- driver


class _Soak:
    def __init__(self, target: SoakTarget, config: SoakConfig) -> None:
        self.t = target
        self.c = config
        self.report = SoakReport()
        self.lock = threading.Lock()
        self.stop = threading.Event()  # workers: finish the episode in hand, then leave
        self.quiet = threading.Event()  # pollers and samplers
        self.started = time.monotonic()
        self.rng = random.Random(config.seed)
        self.wrk = {"Authorization": f"Bearer {target.worker_token}"}

    # -- shared

    def record(self, episode: Episode) -> None:
        with self.lock:
            self.report.episodes.append(episode)

    def error(self, text: str) -> None:
        log.warning("soak: %s", text)
        with self.lock:
            self.report.errors.append(text)

    def roll(self) -> float:
        with self.lock:
            return self.rng.random()

    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def done(self, attacks: list[threading.Thread]) -> bool:
        """The traffic has run long enough (see `SoakConfig`) and every attack is over."""
        if self.elapsed() >= self.c.max_s:
            return True
        if self.elapsed() < self.c.duration_s or any(t.is_alive() for t in attacks):
            return False
        if self.c.sync_at_s is None:
            return True
        sync = self.report.sync
        if sync is None or sync.run_id is None:
            return False
        with self.lock:
            ended = sum(e.outcome == "ended" and e.run_id == sync.run_id
                        for e in self.report.episodes)
        return ended >= self.c.after_sync_ended

    # -- episodes

    def begin(self, http: httpx.Client, *, until: Callable[[], bool], backoff_s: float = 0.1
              ) -> dict[str, Any] | None:
        """begin_episode, retrying while the engine is not ROLLING; None once `until()`."""
        while not until():
            r = http.post(f"{self.t.url}/begin_episode", json={}, headers=self.wrk)
            if r.status_code == 200:
                data: dict[str, Any] = r.json()
                return data
            if r.status_code == 409:
                if "did not answer" in str(r.json().get("detail")):
                    with self.lock:
                        self.report.ambiguous_begins[self._current_run(http) or "?"] += 1
                time.sleep(backoff_s * (0.5 + self.roll()))
                continue
            self.error(f"begin_episode answered {r.status_code}: {r.text[:300]}")
            time.sleep(0.2)
        return None

    def _current_run(self, http: httpx.Client) -> str | None:
        r = http.get(f"{self.t.url}/get_engine_status", headers=self.wrk)
        return r.json().get("run_id") if r.status_code == 200 else None

    def chat_body(self, messages: list[dict[str, Any]], *, tools: bool) -> dict[str, Any]:
        """A chat of the conversation so far; with `tools`, the `add` function offered
        (OpenAI function calling). The tiny model's replies need not call it."""
        body: dict[str, Any] = {"model": "ajet-tiny", "max_tokens": 4, "messages": messages}
        if tools:
            body["tools"] = [ADD_TOOL]
        return body

    def close(self, http: httpx.Client, path: str, body: dict[str, Any], episode: Episode
              ) -> None:
        r = http.post(f"{self.t.url}{path}", json=body, headers=self.wrk)
        detail = str(r.json().get("detail")) if r.headers.get(
            "content-type", "").startswith("application/json") else r.text[:300]
        if r.status_code == 200:
            episode.outcome = "ended" if path == "/end_episode" else "aborted"
        elif r.status_code == 409 and "timed out" in detail:
            episode.outcome, episode.reason = "requeued", detail
        elif r.status_code in (404, 409):
            episode.outcome, episode.reason = "refused", detail
        else:
            episode.outcome, episode.reason = "error", f"{r.status_code}: {detail}"
            self.error(f"{path} answered {r.status_code}: {detail}")
        self.record(episode)

    def one_episode(self, http: httpx.Client) -> None:
        data = self.begin(http, until=self.stop.is_set)
        if data is None:
            return
        episode = Episode(run_id=data.get("run_id"), uuid=data["episode_uuid"], outcome="?")
        roll = self.roll()
        if roll < self.c.abort_share:
            self.close(http, "/abort_episode", {"episode_uuid": episode.uuid,
                                                "reason": "soak: random abort"}, episode)
            return
        if roll < self.c.abort_share + self.c.hang_share:
            time.sleep(self.c.episode_timeout_s + 1.0)  # the worker went quiet
        task = f"task-{int(self.roll() * self.c.tasks)}"
        key = {"Authorization": f"Bearer {data['openai_api_key']}"}
        tools = self.roll() < self.c.tool_share
        messages: list[dict[str, Any]] = [{"role": "user", "content": f"{task}: add 2 and 3"}]
        for _ in range(1 + int(self.roll() * 2)):
            r = http.post(f"{data['openai_base_url']}/chat/completions",
                          json=self.chat_body(messages, tools=tools), headers=key)
            if r.status_code >= 500:
                self.error(f"chat answered {r.status_code}: {r.text[:300]}")
            if r.status_code != 200:
                break  # 401: the episode is gone (timed out, run restarted); end says which
            answered = _answered(r.json()["choices"][0]["message"])
            messages += answered
            if tools:
                with self.lock:
                    self.report.tool_chats += 1
                    self.report.tool_calls += len(answered) - 1
        reward = round(self.roll(), 3)
        self.close(http, "/end_episode", {
            "episode_uuid": episode.uuid, "task_id": task, "reward": reward,
            "is_success": reward > 0.5, "log_metrics": {"soak_roll": reward}}, episode)

    def worker(self) -> None:
        with httpx.Client(timeout=60) as http:
            while not self.stop.is_set():
                try:
                    self.one_episode(http)
                except httpx.HTTPError as exc:
                    self.error(f"worker: {type(exc).__name__}: {exc}")
                    time.sleep(0.2)

    # -- background

    def health(self) -> None:
        """Poll /health from a process of its own, so the soak's own threads (and their
        GIL) do not delay the polls; one latency per line, `inf` for no answer."""
        proc = subprocess.Popen([sys.executable, "-c", _HEALTH_POLLER, self.t.url],
                                stdout=subprocess.PIPE, stdin=subprocess.PIPE, text=True)
        self.quiet.wait()
        out, _ = proc.communicate(input="", timeout=2 * WEDGE_S + 10)  # closes its stdin
        with self.lock:
            self.report.health_s = [float(line) for line in out.split()]

    def pollers(self) -> None:
        paths = ["/get_engine_status", "/runs/current/metrics?max_points=50",
                 "/runs/current/logs?tail=20", "/runs?limit=5"]
        with httpx.Client(timeout=60, headers=self.wrk) as http:
            i = 0
            while not self.quiet.is_set():
                path = paths[i % len(paths)]
                i += 1
                try:
                    status = http.get(f"{self.t.url}{path}").status_code
                except httpx.HTTPError as exc:
                    self.error(f"poll {path}: {exc}")
                    continue
                with self.lock:
                    self.report.polls[status] += 1
                if status >= 500:
                    self.error(f"poll {path} answered {status}")
                self.quiet.wait(0.25)

    def memory(self) -> None:
        proc = psutil.Process(self.t.pid)
        while not self.quiet.is_set():
            try:
                rss = proc.memory_info().rss / 2**20
            except psutil.Error:
                return
            with self.lock:
                self.report.rss_mb.append(rss)
            self.quiet.wait(0.5)

    def sync(self) -> None:
        assert self.c.sync_at_s is not None
        if self.stop.wait(self.c.sync_at_s):
            return
        edited = self.t.repo / "ajet" / "engine" / "rewards.py"
        edited.write_text(edited.read_text() + f"\n# soak edit at {time.time():.3f}\n")
        with SwarmClient(self.t.url, token=self.t.control_token, timeout=180) as control:
            self.report.sync = control.push_code(self.t.repo, force_restart=True)
        log.info("soak: synced %s with force_restart at %.1f s", self.report.sync.snapshot_id,
                 self.elapsed())

    # -- hostile

    def hostile(self) -> list[threading.Thread]:
        """One thread per attack, all started 2 s into the traffic."""
        return [threading.Thread(target=self._attack, args=attack, name=f"soak-{attack[0]}")
                for attack in self._attacks()]

    def _attack(self, name: str, expected: str, attack: Callable[[], str]) -> None:
        if self.stop.wait(2.0):
            return
        t0 = time.monotonic()
        try:
            got = attack()
        except Exception as exc:  # noqa: BLE001 (recorded as this attack's answer)
            got = f"{type(exc).__name__}: {exc}"
        with self.lock:
            self.report.hostile.append(Hostile(name, expected, got, time.monotonic() - t0))

    def _attacks(self) -> list[tuple[str, str, Callable[[], str]]]:
        url, wrk = self.t.url, self.wrk

        def regex_bomb() -> str:
            answers: list[int] = []

            def one() -> None:
                answers.append(httpx.get(f"{url}/runs/current/logs", headers=wrk, timeout=60,
                                         params={"grep": REGEX_BOMB, "regex": "true"}
                                         ).status_code)

            threads = [threading.Thread(target=one) for _ in range(4)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            return ",".join(map(str, sorted(answers)))

        def bad_values() -> str:
            with httpx.Client(timeout=60) as http:
                data = self.begin(http, until=self.stop.is_set,
                                  backoff_s=0.01)
                if data is None:
                    return "no episode"
                statuses = []
                for body in (f'{{"episode_uuid": "{data["episode_uuid"]}", "task_id": "t", '
                             '"reward": 1e308}',
                             f'{{"episode_uuid": "{data["episode_uuid"]}", "task_id": "t", '
                             '"reward": 1, "log_metrics": {"m": Infinity}}'):
                    statuses.append(http.post(f"{url}/end_episode", content=body, headers={
                        **wrk, "Content-Type": "application/json"}).status_code)
                episode = Episode(run_id=data.get("run_id"), uuid=data["episode_uuid"],
                                  outcome="?")
                self.close(http, "/abort_episode", {"episode_uuid": episode.uuid}, episode)
                return ",".join(map(str, statuses))

        def malformed_control() -> str:
            return str(httpx.post(f"{url}/sync_train_config", content=b"{not json", timeout=60,
                                  headers={**wrk, "Content-Type": "application/json"}
                                  ).status_code)

        def big_manifest() -> str:
            return _stalled_post(self.t.port, "/code/manifest", wrk, 15 * 2**20)

        def anonymous_chat_uploads() -> str:
            socks = [_open_stalled(self.t.port, "/v1/chat/completions", {}, 16 * 2**20)
                     for _ in range(20)]
            try:
                return ",".join(sorted(set(_status_of(s) for s in socks)))
            finally:
                for s in socks:
                    s.close()

        def unfinished_headers() -> str:
            socks = []
            for i in range(50):
                s = socket.create_connection(("127.0.0.1", self.t.port), timeout=30)
                if i % 2:
                    s.sendall(b"POST /begin_episode HTTP/1.1\r\nHost: x\r\nX-Slow: ")
                socks.append(s)
            deadline = time.monotonic() + self.c.header_timeout_s + WEDGE_S
            try:
                left = [s for s in socks if not _closed_by(s, deadline)]
                return f"{50 - len(left)} closed"
            finally:
                for s in socks:
                    s.close()

        def churn() -> str:
            with httpx.Client(timeout=60) as http:
                n = 0
                for _ in range(CHURN):
                    data = self.begin(http, until=self.stop.is_set,
                                      backoff_s=0.01)
                    if data is None:
                        break
                    episode = Episode(run_id=data.get("run_id"), uuid=data["episode_uuid"],
                                      outcome="?")
                    self.close(http, "/abort_episode", {"episode_uuid": episode.uuid}, episode)
                    n += 1
            return "churned" if n else "no episode"  # fewer than CHURN: the soak ended first

        def oversized_chat() -> str:
            with httpx.Client(timeout=60) as http:
                data = self.begin(http, until=self.stop.is_set, backoff_s=0.01)
                if data is None:
                    return "no episode"
                t0 = time.monotonic()
                r = http.post(f"{data['openai_base_url']}/chat/completions", headers={
                    "Authorization": f"Bearer {data['openai_api_key']}"}, json={
                    "model": "ajet-tiny", "max_tokens": 4, "messages": [
                        {"role": "user", "content": "x" * OVERSIZED_CHAT_BYTES}]})
                took = time.monotonic() - t0
                health = http.get(f"{url}/health").status_code
                episode = Episode(run_id=data.get("run_id"), uuid=data["episode_uuid"],
                                  outcome="?")
                self.close(http, "/abort_episode", {"episode_uuid": episode.uuid}, episode)
            detail = str(r.json().get("detail", "")) if r.headers.get(
                "content-type", "").startswith("application/json") else r.text[:200]
            if r.status_code != 413 or "chat bound" not in detail:
                return f"{r.status_code}: {detail[:200]}"
            if took > WEDGE_S:
                return f"413 after {took:.1f} s"
            return f"413 naming the chat bound, health {health}"

        def worker_reads_no_diff() -> str:
            run = httpx.get(f"{url}/runs/current", headers=wrk, timeout=60).json()
            prov = run.get("provenance")
            if prov is None:
                return "no provenance (server code)"
            return "withheld" if prov["withheld"] and not prov["diff"] else "diff shown"

        attacks: list[tuple[str, str, Callable[[], str]]] = [
            ("regex bomb x4 (worker, GET /runs/current/logs)", "400,400,400,400", regex_bomb),
            ("reward 1e308, then log_metrics Infinity, on a live episode", "422,422",
             bad_values),
            (f"begin/abort churn x{CHURN}", "churned", churn),
            ("worker's malformed JSON to POST /sync_train_config", "403", malformed_control),
            ("worker's 15 MiB manifest, 1 KiB of it sent", "403", big_manifest),
            ("20 anonymous 16 MiB chat uploads, 1 KiB each sent, held open", "401",
             anonymous_chat_uploads),
            ("50 connections that never finish their headers", "50 closed",
             unfinished_headers),
            (f"{OVERSIZED_CHAT_BYTES >> 20} MiB chat with a valid episode key, then /health",
             "413 naming the chat bound, health 200", oversized_chat),
        ]
        if self.c.sync_at_s is not None:
            attacks.append(("worker GET /runs/current after the sync: provenance",
                            "withheld", self._after_sync(worker_reads_no_diff)))
        return attacks

    def _after_sync(self, attack: Callable[[], str]) -> Callable[[], str]:
        def later() -> str:
            while self.report.sync is None and not self.stop.is_set():
                time.sleep(0.1)
            return attack()
        return later


def run_soak(target: SoakTarget, config: SoakConfig) -> SoakReport:
    """The traffic of the module docstring; stops the engine's run at the end."""
    soak = _Soak(target, config)
    background = [threading.Thread(target=soak.health, name="soak-health"),
                  threading.Thread(target=soak.pollers, name="soak-polls"),
                  threading.Thread(target=soak.memory, name="soak-rss")]
    traffic = [threading.Thread(target=soak.worker, name=f"soak-worker-{i}")
               for i in range(config.workers)]
    if config.sync_at_s is not None:
        traffic.append(threading.Thread(target=soak.sync, name="soak-sync"))
    attacks = soak.hostile() if config.hostile else []
    traffic += attacks
    for thread in (*background, *traffic):
        thread.start()
    try:
        while not soak.done(attacks):
            time.sleep(0.1)
    finally:
        soak.stop.set()
        for thread in traffic:
            thread.join(timeout=120)
        with SwarmClient(target.url, token=target.control_token, timeout=120) as control:
            soak.report.runs = [r.run_id for r in reversed(control.list_runs(limit=20).runs)]
            control.stop_run(reason="soak finished")  # the run writes its last word
        soak.quiet.set()
        for thread in background:
            thread.join(timeout=30)
    soak.report.wall_s = soak.elapsed()
    return soak.report


# ---------------------------------------------------------------------------- accounting


def account(report: SoakReport, workdir: Path) -> list[RunAccount]:
    """Per run the soak touched: the clients' outcomes next to the engine's counters."""
    runs = dict.fromkeys([*report.runs, *(e.run_id for e in report.episodes if e.run_id)])
    accounts = []
    for run_id in runs:
        if run_id is None:
            continue
        run_dir = workdir / "runs" / run_id
        engine: dict[str, int] | None = None
        log_path = run_dir / "engine.log"
        if log_path.exists():
            for match in _STOP_LINE.finditer(log_path.read_text("utf-8", errors="replace")):
                engine = json.loads(match.group(1))
        metrics = run_dir / "metrics.jsonl"
        steps = [json.loads(line)["episodes"] for line in metrics.read_text().splitlines()
                 if line.strip()] if metrics.exists() else []
        mine = [e for e in report.episodes if e.run_id == run_id]
        accounts.append(RunAccount(
            run_id=run_id, client=Counter(e.outcome for e in mine),
            ambiguous_ends=sum(e.ambiguous for e in mine),
            ambiguous_begins=report.ambiguous_begins.get(run_id, 0),
            engine=engine, trained_per_step=steps))
    return accounts


# ---------------------------------------------------------------------------- raw sockets


def _open_stalled(port: int, path: str, headers: dict[str, str], declared: int
                  ) -> socket.socket:
    """A POST that declares `declared` bytes and sends 1 KiB of them, left open."""
    head = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
    s = socket.create_connection(("127.0.0.1", port), timeout=30)
    s.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\n{head}Content-Type: application/json\r\n"
              f"Content-Length: {declared}\r\n\r\n".encode() + b"{" * 1024)
    return s


def _answered(message: dict[str, Any]) -> list[dict[str, Any]]:
    """The assistant's turn, and a `tool` answer to each of its tool calls (the sum)."""
    turn: dict[str, Any] = {"role": "assistant", "content": message.get("content") or ""}
    calls = message.get("tool_calls") or []
    if not calls:
        return [turn]
    turn["tool_calls"] = calls
    answers = []
    for call in calls:
        try:
            args = json.loads(call["function"]["arguments"])
            result = str(int(args["a"]) + int(args["b"]))
        except (KeyError, TypeError, ValueError) as exc:
            result = f"error: {exc}"
        answers.append({"role": "tool", "tool_call_id": call["id"], "content": result})
    return [turn, *answers]


def _status_of(s: socket.socket) -> str:
    """The status code of the answer on `s` (it must come without the rest of the body)."""
    s.settimeout(WEDGE_S)
    reply = b""
    try:
        while b"\r\n" not in reply:
            chunk = s.recv(4096)
            if not chunk:
                break
            reply += chunk
    except socket.timeout:
        return "no answer"
    parts = reply.split(b" ", 2)
    return parts[1].decode() if len(parts) > 1 else "closed"


def _stalled_post(port: int, path: str, headers: dict[str, str], declared: int) -> str:
    s = _open_stalled(port, path, headers, declared)
    try:
        return _status_of(s)
    finally:
        s.close()


def _closed_by(s: socket.socket, deadline: float) -> bool:
    """True once the server closed `s` (anything it sent first is read and dropped)."""
    while (left := deadline - time.monotonic()) > 0:
        s.settimeout(left)
        try:
            if not s.recv(4096):
                return True
        except socket.timeout:
            return False
        except OSError:
            return True
    return False
