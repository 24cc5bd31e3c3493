"""The whole loop on one device: server, engine, 64 concurrent workers, a few steps.

    python -m bench.gpu_e2e --shape qwen2.5-0.5b --out DIR            # on a GPU host
    python -m bench.gpu_e2e --shape small --device cpu --workers 4 --steps 1 --out DIR

It builds a random-weight Qwen2.5-shaped checkpoint (`bench/gpu_model.py`), starts a
swarm server on loopback, configures a job on it (`n_gpu=1`, or `n_gpu=0` on the CPU),
starts the engine, and then:

1. sends a few eval episodes one at a time (streamed chats): time to first token and
   decode tokens/s at 1 concurrent request;
2. runs `--workers` concurrent workers (begin, streamed chat, end with a reward) until
   the engine has finished `--steps` training steps: the same figures at that
   concurrency, and the step metrics;
3. stops the engine and the server.

It prints, and writes to `<out>/gpu_e2e-<shape>.json` and `.md`: decode tokens/s and time
to first token at 1 and N concurrent requests against the HBM floor (the weights' bytes
read once per decode step at 4.8 TB/s), the step time split as the metrics report it,
the peak memory against the planner's estimate, the sampler-trainer log-prob gap where
the engine reports it, and every error, NaN or stall, loudly (exit status 1).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

PROJECT_ROOT = Path(__file__).resolve().parents[1]
if str(PROJECT_ROOT) not in sys.path:  # run from a checkout
    sys.path.insert(0, str(PROJECT_ROOT))

import httpx  # noqa: E402

from ajet.client import SwarmClient  # noqa: E402
from ajet.copilot.job import AgentJetJob  # noqa: E402
from ajet.protocol import EngineState  # noqa: E402
from bench.gpu_model import build_qwen25_shaped  # noqa: E402

log = logging.getLogger("bench.gpu_e2e")

#: H200 HBM3e bandwidth (vendor datasheet), bytes per second.
HBM_BYTES_PER_S = 4.8e12
CONTROL_TOKEN = "gpu-e2e-control-token-0123456789"
WORKER_TOKEN = "gpu-e2e-worker-token-0123456789"
#: A request that has produced nothing for this long is a stall.
STALL_S = 120.0


@dataclass
class Request:
    """One streamed chat: when it started, its first token, its end, its tokens."""

    started: float
    first_token: float | None = None
    ended: float | None = None
    tokens: int = 0
    error: str | None = None

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.started

    @property
    def decode_tokens_per_s(self) -> float | None:
        if self.first_token is None or self.ended is None or self.tokens < 2:
            return None
        span = self.ended - self.first_token
        return (self.tokens - 1) / span if span > 0 else None


@dataclass
class Phase:
    """The requests of one concurrency level."""

    concurrency: int
    requests: list[Request] = field(default_factory=list)
    wall_s: float = 0.0

    def summary(self) -> dict[str, Any]:
        done = [r for r in self.requests if r.error is None and r.ended is not None]
        ttft = [r.ttft_s for r in done if r.ttft_s is not None]
        rates = [r.decode_tokens_per_s for r in done if r.decode_tokens_per_s]
        tokens = sum(r.tokens for r in done)
        return {"concurrency": self.concurrency, "requests": len(self.requests),
                "completed": len(done), "errors": [r.error for r in self.requests if r.error],
                "ttft_s_median": _median(ttft), "ttft_s_max": max(ttft, default=None),
                "decode_tokens_per_s_per_request_median": _median(rates),
                "tokens": tokens,
                "aggregate_tokens_per_s": tokens / self.wall_s if self.wall_s else None}


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def stream_chat(client: httpx.Client, base_url: str, key: str, prompt: str,
                max_tokens: int) -> Request:
    """One streamed chat completion; counts content chunks as tokens."""
    req = Request(started=time.monotonic())
    body = {"model": "policy", "stream": True, "max_tokens": max_tokens,
            "messages": [{"role": "user", "content": prompt}],
            "stream_options": {"include_usage": True}}
    try:
        with client.stream("POST", f"{base_url}/chat/completions", json=body,
                           headers={"Authorization": f"Bearer {key}"},
                           timeout=STALL_S) as reply:
            if reply.status_code != 200:
                reply.read()
                req.error = f"HTTP {reply.status_code}: {reply.text[:300]}"
                return req
            usage_tokens = None
            for line in reply.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    usage_tokens = chunk["usage"].get("completion_tokens")
                for choice in chunk.get("choices", []):
                    if choice.get("delta", {}).get("content"):
                        req.first_token = req.first_token or time.monotonic()
                        req.tokens += 1
            req.ended = time.monotonic()
            if usage_tokens is not None:
                req.tokens = usage_tokens
    except (httpx.HTTPError, ValueError) as exc:
        req.error = f"{type(exc).__name__}: {exc}"
    return req


def digit_share(text_tokens: int) -> float:
    """A reward with some spread: random-weight models make no meaningful text."""
    return (text_tokens % 7) / 6.0


def run_eval_phase(control: SwarmClient, n: int, max_tokens: int) -> Phase:
    phase = Phase(concurrency=1)
    start = time.monotonic()
    with httpx.Client() as http:
        for i in range(n):
            episode = control.open_episode(episode_type="eval", task_id=f"eval{i}")
            req = stream_chat(http, episode.openai_base_url, episode.openai_api_key,
                              "Count to ten:", max_tokens)
            phase.requests.append(req)
            control.report_episode(episode.episode_uuid, f"eval{i}", 0.0)
    phase.wall_s = time.monotonic() - start
    return phase


def run_training_phase(url: str, workers: int, steps: int, max_tokens: int,
                       deadline_s: float) -> Phase:
    """`workers` threads run episodes until the engine reports `steps` steps."""
    phase = Phase(concurrency=workers)
    stop = threading.Event()
    lock = threading.Lock()

    def worker(index: int) -> None:
        with SwarmClient(url, token=WORKER_TOKEN) as client, httpx.Client() as http:
            n = 0
            while not stop.is_set():
                task = f"task{(index + n) % max(1, workers // 4)}"
                try:
                    episode = client.open_episode(task_id=task, discard_episode_timeout=STALL_S)
                except Exception as exc:  # engine between steps, or stopping
                    if stop.is_set():
                        return
                    log.debug("worker %d: begin failed: %s", index, exc)
                    time.sleep(0.2)
                    continue
                req = stream_chat(http, episode.openai_base_url, episode.openai_api_key,
                                  f"Question {n}: what is {index} + {n}?", max_tokens)
                with lock:
                    phase.requests.append(req)
                try:
                    client.report_episode(episode.episode_uuid, task, digit_share(req.tokens))
                except Exception as exc:
                    log.debug("worker %d: end failed: %s", index, exc)
                n += 1

    threads = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(workers)]
    start = time.monotonic()
    for t in threads:
        t.start()
    with SwarmClient(url, token=CONTROL_TOKEN) as control:
        while time.monotonic() - start < deadline_s:
            status = control.engine_status()
            if (status.step or 0) >= steps or status.state == EngineState.OFFLINE:
                break
            time.sleep(0.5)
    phase.wall_s = time.monotonic() - start
    stop.set()
    for t in threads:
        t.join(timeout=STALL_S)
    return phase


def hbm_floor(params: int, bytes_per_param: int = 2) -> dict[str, float]:
    """Decode is bound by reading every weight once per step (bf16: 2 bytes each)."""
    step_s = params * bytes_per_param / HBM_BYTES_PER_S
    return {"weights_gb": params * bytes_per_param / 1e9, "decode_step_floor_s": step_s,
            "tokens_per_s_ceiling_one_request": 1.0 / step_s}


def problems(report: dict[str, Any]) -> list[str]:
    """Everything that should make the run fail: errors, NaNs, stalls, a dead engine."""
    found: list[str] = []
    for name in ("single", "concurrent"):
        summary = report[name]
        if summary["errors"]:
            found.append(f"{name}: {len(summary['errors'])} request error(s), first: "
                         f"{summary['errors'][0]}")
        if summary["completed"] == 0:
            found.append(f"{name}: no request completed")
    for line in report["metrics"]:
        for key, value in line.items():
            if isinstance(value, float) and not math.isfinite(value):
                found.append(f"step {line.get('step')}: {key} is {value}")
    if len(report["metrics"]) < report["steps_wanted"]:
        found.append(f"only {len(report['metrics'])} of {report['steps_wanted']} steps finished "
                     f"in {report['concurrent_wall_s']:.0f} s (a stall?)")
    if report.get("last_error"):
        found.append(f"engine last_error: {report['last_error']}")
    return found


def render(report: dict[str, Any]) -> str:
    floor = report["hbm_floor"]
    lines = [f"# GPU end to end: {report['shape']} ({report['parameters'] / 1e6:.0f}M parameters)",
             "", f"device: {report['device']}; {report['steps_wanted']} steps wanted, "
             f"{len(report['metrics'])} done", "",
             "| concurrency | TTFT median (s) | decode tok/s per request | aggregate tok/s | "
             "completed |", "|---|---|---|---|---|"]
    for name in ("single", "concurrent"):
        s = report[name]
        lines.append(f"| {s['concurrency']} | {_fmt(s['ttft_s_median'])} | "
                     f"{_fmt(s['decode_tokens_per_s_per_request_median'])} | "
                     f"{_fmt(s['aggregate_tokens_per_s'])} | {s['completed']}/{s['requests']} |")
    lines += ["", f"HBM floor: {floor['weights_gb']:.2f} GB of bf16 weights per decode step "
              f"at 4.8 TB/s = {floor['decode_step_floor_s'] * 1e3:.3f} ms, so at most "
              f"{floor['tokens_per_s_ceiling_one_request']:.0f} tok/s for one request", ""]
    lines += ["| step | step_time_s | update_time_s | rollout (step - update) s | "
              "publication | peak_memory_mb | logprob gap mean |", "|---|---|---|---|---|---|---|"]
    for m in report["metrics"]:
        rollout = (m.get("step_time_s") or 0) - (m.get("update_time_s") or 0)
        lines.append(f"| {m.get('step')} | {_fmt(m.get('step_time_s'))} | "
                     f"{_fmt(m.get('update_time_s'))} | {_fmt(rollout)} | "
                     f"{_fmt(_first(m, 'publish_time_s', 'train/publish_time_s'))} | "
                     f"{_fmt(m.get('peak_memory_mb'))} | "
                     f"{_fmt(m.get('train/logprob_gap_mean'))} |")
    plan = report.get("planner") or {}
    lines += ["", f"planner estimate per GPU: {plan.get('peak_gib', 'n/a')} GiB; "
              f"measured peak: {report.get('peak_memory_mb', 'n/a')} MiB", ""]
    lines += ["problems: " + ("none" if not report["problems"] else "")]
    lines += [f"- {p}" for p in report["problems"]]
    return "\n".join(lines) + "\n"


def _first(d: dict[str, Any], *keys: str) -> Any:
    return next((d[k] for k in keys if k in d), None)


def _fmt(value: Any) -> str:
    if value is None:
        return "n/a"
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="qwen2.5-0.5b")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--workers", type=int, default=64)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--single-requests", type=int, default=3)
    parser.add_argument("--deadline-s", type=float, default=180.0)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stderr)
    logging.getLogger("httpx").setLevel(logging.WARNING)
    args.out.mkdir(parents=True, exist_ok=True)
    work = args.out / f"work-{args.shape}"
    model_dir = build_qwen25_shaped(work / "model", args.shape)
    params = json.loads((model_dir / "gpu_model.json").read_text())["parameters"]

    port = _free_port()
    env = {**os.environ, "AJET_SWARM_TOKEN": CONTROL_TOKEN,
           "AJET_SWARM_WORKER_TOKEN": WORKER_TOKEN, "AJET_SWARM_WARM_STANDBY": "0"}
    server_log = open(args.out / f"server-{args.shape}.log", "wb")
    server = subprocess.Popen([sys.executable, "-m", "swarm_server", "start",
                               f"--swarm-port={port}", "--host", "127.0.0.1",
                               "--workdir", str(work)], env=env, stdout=server_log,
                              stderr=subprocess.STDOUT, cwd=work)
    url = f"http://127.0.0.1:{port}"
    report: dict[str, Any] = {"shape": args.shape, "parameters": params, "device": args.device,
                              "steps_wanted": args.steps, "hbm_floor": hbm_floor(params)}
    try:
        with SwarmClient(url, token=CONTROL_TOKEN) as control:
            deadline = time.monotonic() + 30
            while not control.health():
                if time.monotonic() > deadline or server.poll() is not None:
                    raise RuntimeError(f"the swarm server did not start (see {server_log.name})")
                time.sleep(0.1)
            groups = max(1, args.workers // 4)
            job = AgentJetJob(experiment_name=f"gpu-e2e-{args.shape}", model=str(model_dir),
                              n_gpu=1 if args.device == "cuda" else 0, batch_size=groups,
                              num_repeat=4, max_new_tokens=args.max_tokens,
                              max_response_length=args.max_tokens, max_prompt_length=256)
            accepted = control.submit_config(job)
            report["planner"] = accepted.memory
            control.start_run(wait=True, wait_timeout=300)
            log.info("engine ROLLING; %d single requests", args.single_requests)
            single = run_eval_phase(control, args.single_requests, args.max_tokens)
            log.info("%d concurrent workers until step %d", args.workers, args.steps)
            concurrent = run_training_phase(url, args.workers, args.steps, args.max_tokens,
                                            args.deadline_s)
            status = control.engine_status()
            report["last_error"] = status.last_error.model_dump() if status.last_error else None
            report["metrics"] = control.get_metrics("current").points
            control.stop_run(reason="gpu_e2e done")
        report["single"], report["concurrent"] = single.summary(), concurrent.summary()
        report["concurrent_wall_s"] = concurrent.wall_s
        peaks = [m.get("peak_memory_mb") for m in report["metrics"] if m.get("peak_memory_mb")]
        report["peak_memory_mb"] = max(peaks, default=None)
    finally:
        server.terminate()
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
        server_log.close()
    report["problems"] = problems(report)
    text = render(report)
    (args.out / f"gpu_e2e-{args.shape}.json").write_text(json.dumps(report, indent=1, default=str))
    (args.out / f"gpu_e2e-{args.shape}.md").write_text(text)
    sys.stdout.write(text)
    if report["problems"]:
        sys.stdout.write("GPU E2E FAILED\n")
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
