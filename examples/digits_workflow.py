"""Teach ajet-tiny to answer in digits: a workflow whose reward visibly improves on a CPU.

Reward = the share of digit characters in the reply (0 for an empty reply). The
untrained tiny model writes random characters (about 10% digits); after a few dozen
GRPO steps it answers almost only in digits.

Run against a running swarm server (`ajet-swarm start --swarm-port=10086`):

    python examples/digits_workflow.py --swarm-url http://127.0.0.1:10086

If the engine is OFFLINE this starts it on the job the server has stored; with
`--configure` it first sends the default job (ajet-tiny), replacing the stored one. It
never replaces a stored job unless asked, and says which job it runs. Then it runs 4
rollout workers until Ctrl-C (or `--max-episodes`), printing each new metrics line.
The workflow needs the `openai` package: `pip install 'agentjet-swarm[laptop]'` has it.
For the MCP bridge's `start_rollouts`, the workflow spec is
`examples/digits_workflow.py:workflow`.
"""

from __future__ import annotations

import argparse
import logging
import sys
import threading
from pathlib import Path
from typing import Any

# runnable from a checkout without installing: the project root holds ajet/
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ajet.protocol import BeginEpisodeResponse, EngineState
from ajet.rollout import RolloutRunner, WorkflowOutput

PROMPTS = [
    "Reply with digits only.",
    "What is 12 + 30?",
    "Count from one to five.",
    "Give me a phone number.",
    "List a few numbers.",
    "What is your PIN?",
    "In which year did Apollo 11 land?",
    "Write seven digits.",
]

#: One task per prompt; the runner sends each num_repeat times (one GRPO group).
TASKS: list[dict[str, Any]] = [{"task_id": f"digits-{i}", "prompt": p}
                               for i, p in enumerate(PROMPTS)]

_local = threading.local()


def digit_share(text: str) -> float:
    return sum(ch.isdigit() for ch in text) / len(text) if text else 0.0


def _http_client() -> Any:
    # one connection pool per worker thread, shared by every episode's OpenAI client
    import httpx

    if getattr(_local, "http", None) is None:
        _local.http = httpx.Client(timeout=60.0)
    return _local.http


def workflow(task: dict[str, Any], episode: BeginEpisodeResponse) -> WorkflowOutput:
    """One episode: ask the task's prompt through the episode's OpenAI endpoint."""
    import openai

    client = openai.OpenAI(base_url=episode.openai_base_url, api_key=episode.openai_api_key,
                           http_client=_http_client(), max_retries=0)
    reply = client.chat.completions.create(
        model="ajet-tiny", messages=[{"role": "user", "content": task["prompt"]}],
    ).choices[0].message.content or ""
    share = digit_share(reply)
    return WorkflowOutput(reward=share, is_success=share >= 0.5,
                          log_metrics={"digit_share": share, "reply_chars": float(len(reply))},
                          metadata={"reply": reply[:200]})


def _prepare_engine(client: Any, *, configure: bool, start: bool,
                    out: logging.Logger) -> int | None:
    """Bring the engine to a job to run; the job's `num_repeat`, or None with the reason."""
    from ajet.copilot.job import AgentJetJob

    if configure:
        job = AgentJetJob()
        out.info("--configure: sending the default job (%s), replacing the stored one",
                 job.model)
        client.configure_and_start(job, force_restart=True)
        return job.num_repeat
    stored = client.get_train_config()
    if stored is None:
        out.error("the server has no job stored: pass --configure to send the default job "
                  "(ajet-tiny), or configure one first (MCP tool 'configure')")
        return None
    out.info("using the job stored on the server: %s (%s)", stored.experiment_name,
             stored.config.get("model"))
    if client.engine_status().state == EngineState.OFFLINE and start:
        out.info("engine is OFFLINE: starting it on the stored job")
        client.start_run(wait=True)
    return int(stored.config.get("num_repeat", 1))


def main(argv: list[str] | None = None) -> int:
    from ajet.client import SwarmClient

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--swarm-url", required=True, help="e.g. http://127.0.0.1:10086")
    p.add_argument("--token", default=None,
                   help="worker or control token (default: AJET_SWARM_TOKEN / _WORKER_TOKEN)")
    p.add_argument("--workers", type=int, default=4, help="concurrent rollout workers")
    p.add_argument("--max-episodes", type=int, default=None, help="stop after this many")
    p.add_argument("--configure", action="store_true",
                   help="send the default job (ajet-tiny), replacing the stored one, and start")
    p.add_argument("--no-start", action="store_true",
                   help="do not start an OFFLINE engine")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request otherwise
    out = logging.getLogger("digits")

    client = SwarmClient(args.swarm_url, token=args.token)
    num_repeat = _prepare_engine(client, configure=args.configure, start=not args.no_start,
                                 out=out)
    if num_repeat is None:
        client.close()
        return 2
    runner = RolloutRunner(client, workflow, TASKS, n_workers=args.workers,
                           num_repeat=num_repeat, max_episodes=args.max_episodes)
    runner.start()
    seen = 0
    try:
        while runner.running():
            runner.join(timeout=2.0)
            points = client.get_metrics(since_step=seen + 1,
                                        fields=["reward_mean", "success_rate", "step_time_s"]
                                        ).points
            for point in points:
                success = point.get("success_rate")
                out.info("step %3d  reward %.3f  success %s  (%.2f s)", point["step"],
                         point["reward_mean"], "n/a" if success is None else f"{success:.2f}",
                         point["step_time_s"])
                seen = max(seen, int(point["step"]))
    except KeyboardInterrupt:
        out.info("stopping the workers")
        runner.stop()
    stats = runner.stats()
    out.info("%d episodes ended, mean reward %s", stats.episodes_ended, stats.reward_mean)
    client.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
