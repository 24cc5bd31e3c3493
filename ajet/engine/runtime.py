"""The engine process: parse the command line, boot, serve, train, stop.

    python -m ajet.engine --config <run_dir>/job.yaml --run-dir <run_dir> \\
        --socket <socket_path> --run-id <run_id> --workdir <server workdir>

Boot order: config (a bad field fails here, named in the traceback), the private
channel (`GET /status` answers ENGINE.BOOTING from then on), the policy (ajet-tiny is
built first if needed), the generator (`generation/continuous_batching.py`, or `generation/recompute.py` with
AJET_ENGINE_GENERATION=recompute), then the step loop (`trainer.train`).

Exit codes: 0 after a clean stop (SIGTERM/SIGINT, or `max_steps` reached), with the
final checkpoint in `<run_dir>/final/`; 1 on any error, logged with the rank and its
traceback on stderr (which the server appends to `<run_dir>/engine.log`) and recorded in
`<run_dir>/failure.json`; a failed process tears nothing down and exits at once, and a
peer's failure ends every other rank too (`parallel/failures.py`). Signal handlers only
set an event.

Under `torchrun` (docs/distributed.md) every rank runs this and every rank generates;
rank 0 alone opens the private channel, routes each episode's generation to a rank
(`generation/ranks.py`), writes metrics and checkpoints, and decides when to stop (the other ranks
follow it, whatever signals they get themselves).
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the engine's heavy modules load in _run, after the snapshot path is set
    from ajet.copilot.job import AgentJetJob
    from ajet.engine.config import EngineConfig
    from ajet.engine.tracking.trackers import TrackerSet
    from ajet.engine.generation.interface import Generator
    from ajet.engine.parallel.failures import RankFailures
    from ajet.engine.policy import Policy

__all__ = ["CUDA_ALLOC_CONF", "allocator_conf", "main", "parse_args"]

log = logging.getLogger("ajet.engine")

#: The engine's CUDA caching allocator. The KV cache (tens of GiB) is allocated and freed
#: every step, next to the update's tensors: with expandable segments the allocator maps
#: and unmaps pages inside one growing segment instead of keeping fixed-size blocks, so
#: freed memory is not stranded in fragments (torch's `expandable_segments`).
CUDA_ALLOC_CONF = "expandable_segments:True"
#: The private channel's bearer token under `--channel-host` (set by the launcher).
CHANNEL_TOKEN_ENV = "AJET_ENGINE_CHANNEL_TOKEN"


def allocator_conf(current: str | None) -> str:
    """`PYTORCH_CUDA_ALLOC_CONF` for the engine: the operator's options, plus expandable
    segments unless they chose otherwise."""
    if current and "expandable_segments" in current:
        return current
    return ",".join(part for part in (current, CUDA_ALLOC_CONF) if part)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m ajet.engine",
        description="AgentJet training engine (started by the swarm server)")
    p.add_argument("--config", type=Path, required=True, help="the run's job.yaml")
    p.add_argument("--run-dir", type=Path, required=True,
                   help="metrics.jsonl, checkpoints/ and final/ go here")
    p.add_argument("--socket", type=Path, default=None,
                   help="Unix socket of the private channel (default <run-dir>/engine.sock)")
    p.add_argument("--channel-host", default=None,
                   help="serve the private channel on a TCP port of this address instead of "
                        "the Unix socket (a launcher whose server is on another machine); "
                        f"every request must carry the bearer token in ${CHANNEL_TOKEN_ENV}")
    p.add_argument("--channel-address-file", type=Path, default=None,
                   help="with --channel-host: where the bound host:port is written (JSON)")
    p.add_argument("--run-id", default=None, help="the run id the server assigned")
    p.add_argument("--workdir", type=Path, default=Path.cwd(),
                   help="the server's work directory (ajet-tiny is built under models/)")
    p.add_argument("--resume", type=Path, default=None,
                   help="a checkpoint directory to continue from (the job's resume_from, "
                        "resolved by the server)")
    p.add_argument("--log-level", default=os.environ.get("AJET_ENGINE_LOG_LEVEL", "INFO"))
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # read when CUDA first allocates, so before anything touches a GPU (even with torch
    # already imported by the warm standby); torchrun's ranks each run this
    os.environ["PYTORCH_CUDA_ALLOC_CONF"] = allocator_conf(
        os.environ.get("PYTORCH_CUDA_ALLOC_CONF"))
    rank = int(os.environ.get("RANK", "0"))
    where = f" [rank {rank}]" if int(os.environ.get("WORLD_SIZE", "1")) > 1 else ""
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format=f"%(asctime)s %(levelname)s{where} %(name)s: %(message)s")
    # httpx logs every request at INFO: rank 0's calls to ranks on other nodes (TCP)
    logging.getLogger("httpx").setLevel(logging.WARNING)
    stop = threading.Event()

    def request_stop(signum: int, _frame: object) -> None:
        stop.set()  # only a flag: the step loop notices it within sweep_interval_s

    signal.signal(signal.SIGTERM, request_stop)
    signal.signal(signal.SIGINT, request_stop)
    from ajet.engine.parallel.failures import RankFailures

    failures = RankFailures(rank=rank, world_size=int(os.environ.get("WORLD_SIZE", "1")),
                            run_dir=args.run_dir.resolve())
    try:
        return _run(args, stop, rank=rank, failures=failures)
    except Exception as exc:
        # logged with the rank and traceback, recorded for the server; the caller exits
        # at once (see _run: nothing waits on the process group)
        log.error("engine failed (run %s)", args.run_id)
        failures.report(exc)
        return 1


def _run(args: argparse.Namespace, stop: threading.Event, *, rank: int,
         failures: RankFailures) -> int:
    started = time.monotonic()
    import ajet

    from ajet.packaging import folder_snapshot_id

    ajet_file = str(Path(ajet.__file__).resolve())
    # the code's identity is its content, not its path: each node keeps its own copy
    code_id = folder_snapshot_id(Path(ajet_file).parent)
    log.info("engine pid %d, run %s, ajet from %s (content id %s), python %s, "
             "PYTORCH_CUDA_ALLOC_CONF=%s", os.getpid(), args.run_id, ajet_file, code_id[:12],
             sys.version.split()[0], os.environ.get("PYTORCH_CUDA_ALLOC_CONF"))

    # A bad job fails here, before the slow imports, with each bad field named.
    from ajet.copilot.job import AgentJetJob

    AgentJetJob.load_yaml(args.config)

    # heavy imports (torch, transformers) only from here on; never reach for the hub
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    import torch
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # progress bars would fill engine.log
    # transformers' continuous batching logs every cache (re)build at INFO: once a step
    logging.getLogger("ContinuousBatchingLogger").setLevel(logging.WARNING)

    from ajet.engine.transport.unix_server import ChannelServer
    from ajet.engine.plane.app import create_channel_app
    from ajet.engine.plane.episode_plane import EpisodePlane
    from ajet.engine.parallel.distributed import (
        Dist,
        group_store,
        init_distributed,
        start_orphan_watchdog,
    )
    from ajet.engine.plane.episodes import EpisodeRegistry
    from ajet.engine.learner import Learner
    from ajet.engine.metrics import MetricsWriter
    from ajet.engine.planning.peak_memory import PeakMemory
    from ajet.engine.policy import load_policy, resolve_model_path
    from ajet.engine.generation.ranks import RankService, connect_ranks
    from ajet.engine.checkpoints import generation_seed, resume_training
    from ajet.engine.trainer import TrainerParts, finish, follow, train

    run_dir: Path = args.run_dir.resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    job, cfg = load_engine_config(args.config, cuda_devices=torch.cuda.device_count(),
                                  cpu_count=os.cpu_count() or 1)
    log.info("config: %s", cfg.to_json())
    torch.set_num_threads(cfg.cpu_threads)
    torch.manual_seed(cfg.seed)

    channel: ChannelServer | None = None
    plane: EpisodePlane | None = None
    registry: EpisodeRegistry | None = None
    if rank == 0:  # the episode plane answers ENGINE.BOOTING while the rest boots
        registry = EpisodeRegistry(group_size=cfg.num_repeat, max_in_flight=cfg.max_in_flight,
                                   default_timeout_s=cfg.episode_timeout_s,
                                   batch_size=cfg.batch_size,
                                   collection_method=cfg.sample_collection_method)
        plane = EpisodePlane(cfg=cfg, registry=registry, run_id=args.run_id,
                             ajet_file=ajet_file, snapshot_id=code_id,
                             info={"experiment_name": cfg.experiment_name, "model": cfg.model,
                                   "device": cfg.device})
        channel = _open_channel(args, create_channel_app(plane), run_dir)
    local: Generator | None = None  # this rank's generator
    served: RankService | None = None  # ranks > 0: it, served to rank 0
    routed: Generator | None = None  # rank 0 under torchrun: the router over every rank
    metrics: MetricsWriter | None = None
    dist = Dist()
    clean = True
    try:
        # every rank resolves (ajet-tiny: builds) the checkpoint before joining the group
        model_path = resolve_model_path(cfg.model, workdir=args.workdir.resolve(),
                                        seed=cfg.seed)
        dist = init_distributed(on_gpu=cfg.device == "cuda",
                                collective_timeout_s=cfg.collective_timeout_s)
        if dist.active and "TORCHELASTIC_RUN_ID" in os.environ:
            start_orphan_watchdog()
        if dist.world_size > 1:  # a peer's failure ends this rank too, within a second
            failures.store = group_store()
            failures.start()
        ranks_code = dist.gather((ajet_file, code_id))
        device = f"cuda:{dist.local_rank}" if cfg.device == "cuda" else cfg.device
        policy = load_policy(model_path, device=device, dtype=cfg.dtype, seed=cfg.seed)
        # every rank plans (the paged pool's keep-or-release follows it); rank 0 logs it
        memory_plan = _memory_plan(job, policy.device, log_it=dist.is_main)
        memory = PeakMemory(policy.device, planned_bytes=memory_plan.comparable_bytes()
                            if dist.is_main and memory_plan is not None else None)
        memory.mark_loaded(policy.model)  # CPU: the peak counts what training and generation add
        # every rank reads the same checkpoint, so every rank's shard is rank 0's
        learner = Learner(policy, cfg, dist)
        # a continuing run: weights, optimizer and random state from its checkpoint
        start_step = resume_training(learner, args.resume) if args.resume else 0
        # Everything loaded so far lives until exit: freezing it keeps each garbage
        # collection short (transformers collects whenever the generator rebuilds its
        # KV cache, once a step; without this each takes ~0.2 s here).
        gc.freeze()
        local = build_generator(cfg, policy, seed=generation_seed(cfg.seed, start_step),
                                keep_pool=memory_plan is None or memory_plan.pool_kept)
        local.start()
        routed, served = connect_ranks(local, dist, run_dir=run_dir)
        if plane is None or registry is None:  # ranks > 0: generate for rank 0, and
            # run what it sends (updates, checkpoints)
            steps = follow(learner, dist, run_dir=run_dir, run_id=args.run_id,
                           generator=local)
            log.info("rank %d stopped after %d step(s); it generated %d reply(s)", dist.rank,
                     steps, local.stats().get("requests", 0))
            return 0
        plane.world_size = dist.world_size
        plane.ranks_ajet_files = [path for path, _ in ranks_code]
        plane.ranks_snapshot_ids = [ident for _, ident in ranks_code]
        plane.info.update(model_path=str(model_path), parameters=policy.parameter_count())
        plane.set_policy(policy, routed or local)
        metrics = MetricsWriter(run_dir / "metrics.jsonl",
                                mirror=start_trackers(job, run_dir, run_id=args.run_id,
                                                      workdir=args.workdir, plane_info=plane.info))
        log.info("booted in %.1f s (%d process(es))", time.monotonic() - started,
                 dist.world_size)
        parts = TrainerParts(cfg=cfg, registry=registry, policy=policy, learner=learner,
                             metrics=metrics, run_dir=run_dir, run_id=args.run_id, stop=stop,
                             started=started, dist=dist, generator=routed or local,
                             memory=memory, start_step=start_step)
        steps = train(parts)
        reason = "stop requested" if stop.is_set() else f"max_steps={cfg.max_steps} reached"
        log.info("%s after %d step(s); writing the final checkpoint", reason, steps)
        finish(parts, steps)
    except BaseException:
        # A failed rank leaves at once (main reports it, __main__ exits): stopping the
        # generators, the channel or the process group could wait on collectives a
        # peer will never join. The process's exit frees all of it.
        clean = False
        raise
    finally:
        if clean:  # a clean stop's teardown, in order: generation, the channel, the group
            if routed is not None:
                log.info("generation per rank: %s", ", ".join(
                    f"{r['rank']}: {r['routed']} request(s)" for r in routed.stats()["ranks"]))
            for part in (routed, local):
                if part is not None:
                    part.stop()
            if served is not None:
                served.stop()
            if channel is not None:
                channel.stop()
            if registry is not None:  # no call reaches it any more: its last word on its episodes
                log.info("episodes at stop: %s", json.dumps(registry.snapshot(), sort_keys=True))
            if metrics is not None:
                metrics.close()
            failures.stop()
            dist.close()
    log.info("engine stopped cleanly")
    return 0


def _open_channel(args: argparse.Namespace, app: Any, run_dir: Path) -> Any:
    """Rank 0's private channel, started: the Unix socket, or with `--channel-host` a TCP
    port that answers only requests bearing the launcher's token (the same app, so the
    same bounds); its address goes to `--channel-address-file` for the launcher."""
    from ajet.engine.transport.unix_server import BearerGuard, ChannelServer

    if args.channel_host is None:
        channel = ChannelServer(app, args.socket or run_dir / "engine.sock")
        channel.start()
        return channel
    # popped: code this process starts (a tracker, a reward's subprocess) never sees it
    token = os.environ.pop(CHANNEL_TOKEN_ENV, "")
    if len(token) < 16:
        raise RuntimeError(f"--channel-host needs a bearer token of 16+ characters in "
                           f"${CHANNEL_TOKEN_ENV}")
    channel = ChannelServer(BearerGuard(app, token), tcp_host=args.channel_host)
    channel.start()
    if args.channel_address_file is not None and channel.tcp_address is not None:
        host, port = channel.tcp_address
        target = args.channel_address_file
        partial = target.with_name(target.name + ".partial")
        fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump({"host": host, "port": port}, f)
        os.replace(partial, target)  # whole or absent: the launcher polls for it
    return channel


def load_engine_config(path: Path, *, cuda_devices: int, cpu_count: int
                       ) -> tuple[AgentJetJob, EngineConfig]:
    """Read and validate `job.yaml` (raises `JobValidationError` naming bad fields), with
    the model's defaults where the file leaves fields unset, as the server's validator
    chooses them (a validated job has every field written out; a hand-written one not)."""
    from ajet.copilot.job import AgentJetJob
    from ajet.copilot.model_defaults import resolve_job
    from ajet.engine.config import engine_config_from_job

    job, _ = resolve_job(AgentJetJob.load_yaml(path))
    return job, engine_config_from_job(job, cuda_devices=cuda_devices, cpu_count=cpu_count)


def start_trackers(job: AgentJetJob, run_dir: Path, *, run_id: str | None, workdir: Path,
                   plane_info: dict[str, object]) -> TrackerSet | None:
    """The job's `logging` trackers (rank 0), and where they write: `trackers.json` in the
    run directory (the server shows it with the run) and the engine's status info."""
    from ajet.engine.tracking.trackers import RunInfo, open_trackers, parse_logging, \
        tracker_locations

    names = parse_logging(job.logging)
    if not names:
        return None
    info = RunInfo.load(run_dir, run_id=run_id or run_dir.name,
                        experiment_name=job.experiment_name,
                        config=job.model_dump(mode="json"), workdir=workdir.resolve())
    trackers = open_trackers(names, info)
    places = tracker_locations([t.name for t in trackers.trackers], run_dir,
                               mlflow_uri=info.mlflow_uri)
    report = {"trackers": places, "failed": trackers.failed}
    (run_dir / "trackers.json").write_text(json.dumps(report, indent=1))
    plane_info["trackers"] = places
    return trackers


def build_generator(cfg: EngineConfig, policy: Policy, *, seed: int | None = None,
                    keep_pool: bool = True) -> Generator:
    """This rank's generator: the backend `generation_backend` (or the env) names.

    `bench/gpu_check.py` and `bench/memory_plan_probe.py` generate with it too, and the
    memory planner sizes the same KV cache (`kv_cache.generation_concurrency`). `seed`
    (default the job's) moves on with the step in a resumed run. `keep_pool`: the paged
    backend keeps its pool across updates (the memory plan says whether it fits)."""
    from ajet.engine.generation.interface import PolicyView
    from ajet.engine.generation.kv_cache import generation_concurrency

    seed = cfg.seed if seed is None else seed
    backend = os.environ.get("AJET_ENGINE_GENERATION") or cfg.generation_backend
    max_request_tokens = cfg.max_prompt_length + cfg.max_response_length
    concurrency = generation_concurrency(cfg.max_generation_batch, cfg.max_in_flight)
    if backend == "recompute":
        from ajet.engine.generation.recompute import RecomputeGenerator

        log.warning("generating with the reference backend (no KV cache): "
                    "AJET_ENGINE_GENERATION=recompute")
        return RecomputeGenerator(policy, temperature=cfg.temperature, top_p=cfg.top_p,
                                  max_batch=cfg.max_generation_batch, seed=seed)
    view = PolicyView.of(policy, temperature=cfg.temperature, top_p=cfg.top_p, seed=seed)
    if backend == "paged":
        from ajet.engine.generation.paged import PagedGenerator, PagedSettings

        return PagedGenerator(view, PagedSettings(
            max_request_tokens=max_request_tokens, concurrency=concurrency,
            gpu_memory_utilization=cfg.gpu_memory_utilization,
            cpu_kv_cache_mb=cfg.cpu_kv_cache_mb, cpu_prefill_tokens=cfg.cpu_max_batch_tokens,
            gpu_prefill_tokens=cfg.gpu_prefill_tokens, prefix_sharing=cfg.prefix_sharing,
            cuda_graphs=cfg.cuda_graphs, kernel=cfg.paged_kernel, keep_pool=keep_pool))
    if backend != "continuous_batching":
        raise ValueError(f"unknown generation backend {backend!r}; use paged, "
                         "continuous_batching or recompute (the job's generation_backend, "
                         "or AJET_ENGINE_GENERATION)")
    from ajet.engine.generation.continuous_batching import CacheSettings, ContinuousBatchingGenerator

    return ContinuousBatchingGenerator(view, CacheSettings(
        max_request_tokens=max_request_tokens, concurrency=concurrency,
        gpu_memory_utilization=cfg.gpu_memory_utilization,
        cpu_kv_cache_mb=cfg.cpu_kv_cache_mb, cpu_max_batch_tokens=cfg.cpu_max_batch_tokens,
        prefix_sharing=cfg.prefix_sharing))


def _memory_plan(job: object, device: object, *, log_it: bool) -> Any:
    """The memory planner's `MemoryPlan` for this job on this device (logged where
    `log_it`), or None where it has no estimate; its `comparable_bytes()` is what the
    metrics' `peak_memory_mb` should come to (`planned_peak_mb`)."""
    import torch

    from ajet.engine.planning.memory_plan import Available, JobView, detect_available, plan_job

    view = JobView.from_job(job)
    dev = torch.device(str(device))
    if dev.type == "cuda":
        props = torch.cuda.get_device_properties(dev)
        available = Available(int(props.total_memory), f"torch.cuda: {props.name}")
    else:
        available = detect_available(view)
    try:
        plan = plan_job(job, available=available)
    except ValueError as exc:  # an unusual config.json: the engine runs without a plan
        log.warning("memory plan: no estimate (%s)", exc)
        return None
    if plan is not None and log_it:
        log.log(logging.INFO if plan.fits else logging.WARNING, "%s\n%s", plan.summary(),
                plan.render())
    return plan
