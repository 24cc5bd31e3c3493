"""The original AgentJet `SwarmClient`: the typed client plus the original's methods.

    from ajet.tuner_lib.experimental.swarm_client import SwarmClient

`SwarmClient` here subclasses the typed `ajet.client.SwarmClient`, so one object serves
both this project's calls (`engine_status`, `open_episode`, ...) and the names existing
AgentJet scripts use (`get_engine_status`, `begin_episode`, ...); the typed client has
only the former. Every method here is built on the typed calls (the original-only routes
through the base class's request helper); the shape conversions go through
`ajet.compat.boundary`.

Behaviour kept from the original (docs/compat.md lists each name and any difference):

- `get_engine_status()` returns `(status_string, dict)`; `("ENGINE.CANNOT_CONNECT", {})`
  when the server does not answer.
- `start_engine()` returns once the engine serves, `stop_engine()` once it is OFFLINE;
  a boot that fails raises `SwarmServerOfflineError` with the server's `last_error`.
- `begin_episode()` blocks while the engine boots, syncs weights or has no free slot,
  backing off as the original does (15 s while not ROLLING, 2 s with no free slot), and
  raises `SwarmServerOfflineError` once the engine goes OFFLINE after having been up.
- `end_episode()` of an expired or unknown episode becomes an abort; a result that
  meets ENGINE.WEIGHT_SYNCING is dropped with a warning.

Different on purpose: every wait has a deadline (`RetryPolicy`); status is read per
call instead of by a background poller (a poller thread runs only once a weight-sync
callback is registered); `print_rollout_stat` logs (logger `ajet.compat.client`,
INFO) instead of printing.
"""

from __future__ import annotations

import logging
import os
import re
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, fields, replace
from typing import Any

from ajet.client import SwarmClient as TypedSwarmClient
from ajet.compat.boundary import OriginalBodyError, end_request_from_output
from ajet.compat.openai_endpoint import OpenaiBaseUrlAndApiKey
from ajet.compat.task import Task, WorkflowOutput
from ajet.compat.wire import (
    BoolResponse,
    CanContinueEpisodeResponse,
    CurrentBatchRolloutPoolInformation,
    EpisodeBufferResponse,
    EpisodeStatus,
    SwarmThrottlePolicy,
)
from ajet.copilot.job import AgentJetJob
from ajet.errors import (
    ApprovalPending,
    EngineStateConflict,
    SwarmConnectionError,
    SwarmError,
    SwarmNotFound,
    SwarmServerOfflineError,
    SwarmStateError,
    SwarmTimeout,
)
from ajet.protocol import ApprovalState

__all__ = ["RetryPolicy", "SwarmClient"]

log = logging.getLogger(__name__)

OFFLINE, BOOTING, ROLLING = "ENGINE.OFFLINE", "ENGINE.BOOTING", "ENGINE.ROLLING"
ROLLING_POST, WEIGHT_SYNCING = "ENGINE.ROLLING_POST", "ENGINE.WEIGHT_SYNCING"
CANNOT_CONNECT = "ENGINE.CANNOT_CONNECT"
_SERVING = (ROLLING, ROLLING_POST, WEIGHT_SYNCING)
_AGREE_METHODS = ("rollout_until_any_client_agree_sync_weight",
                  "rollout_until_all_clients_agree_sync_weight")
#: An end_episode record is forgotten this long after its episode expired (as the original).
_CLEAN_RECORD_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class RetryPolicy:
    """Back-offs and deadlines of the original surface's waits (seconds).

    The back-offs are the original's; `AJET_SWARM_BACKOFF_SCALE` (e.g. 0.05) scales them,
    so tests run fast without editing a script. Deadlines are not scaled.
    """

    #: how often a wait reads the engine status (the original: 5 s)
    status_poll_s: float = 1.0
    #: a claim refused while the engine boots, syncs weights or drains, or a failed call
    busy_retry_s: float = 15.0
    #: a claim refused because every episode slot of the step is taken
    no_slot_retry_s: float = 2.0
    #: a throttle policy holds this client back
    throttle_retry_s: float = 2.0
    #: an agree_sync_weight the server did not take yet
    agree_retry_s: float = 2.0
    #: auto_sync_train_config_and_start_engine retries an unreachable server once, after this
    unreachable_retry_s: float = 16.0
    #: pause after a forced stop (the original: 8 s; this server's stop is synchronous)
    restart_settle_s: float = 0.0
    #: longest wait for an engine state (start, stop, boot)
    engine_wait_s: float = 3600.0
    #: longest begin_episode wait for a free episode
    begin_episode_wait_s: float = 3600.0

    @classmethod
    def from_env(cls) -> RetryPolicy:
        scale = float(os.environ.get("AJET_SWARM_BACKOFF_SCALE", "1") or 1)
        if scale == 1:
            return cls()
        deadlines = {"engine_wait_s", "begin_episode_wait_s"}
        return replace(cls(), **{f.name: getattr(cls(), f.name) * scale
                                 for f in fields(cls) if f.name not in deadlines})


class SwarmClient(TypedSwarmClient):
    """The typed client plus the original AgentJet client's methods and constructor.

    The constructor is the original's (`verbose`, `agentjet_job` and
    `auto_start_swarm_server` positional); `retry` sets the back-offs and deadlines of
    the original methods' waits. Everything else is the typed client's.
    """

    def __init__(
        self,
        server_url: str,
        verbose: bool = True,
        agentjet_job: AgentJetJob | None = None,
        auto_start_swarm_server: bool = False,
        *,
        token: str | None = None,
        timeout: float = 30.0,
        swarm_workdir: str | os.PathLike[str] | None = None,
        server_start_timeout: float = 30.0,
        server_env: Mapping[str, str] | None = None,
        retry: RetryPolicy | None = None,
    ) -> None:
        #: the original client's switches: chatty progress logs, and the last job sent
        self.verbose = verbose
        self._agentjet_job = agentjet_job
        # before the base's __init__: a failed auto-start calls close(), which reads these
        self.client_uuid = str(uuid.uuid4())
        self.retry = retry or RetryPolicy.from_env()
        self._records_lock = threading.Lock()
        self._episode_expiry: dict[str, float] = {}
        self._begin_lock = threading.Lock()  # throttled claims are checked one at a time
        self._recent_seen_tasks: list[str] = []
        self._sync_callbacks: list[Callable[[], Any]] = []
        self._last_seen: tuple[str | None, int | None] = (None, None)
        self._observe_lock = threading.Lock()
        self._poller: threading.Thread | None = None
        self._poller_stop = threading.Event()
        super().__init__(server_url, auto_start_swarm_server=auto_start_swarm_server,
                         token=token, timeout=timeout, swarm_workdir=swarm_workdir,
                         server_start_timeout=server_start_timeout, server_env=server_env)

    def close(self) -> None:
        """Stop the status poller (if a callback started it), then as the typed client."""
        self._poller_stop.set()
        if self._poller is not None and self._poller is not threading.current_thread():
            self._poller.join(timeout=5)
        super().close()

    def __enter__(self) -> SwarmClient:
        return self

    # ------------------------------------------------------------------ engine status

    def get_engine_status(self) -> tuple[str, dict[str, Any]]:
        """`(status, reply)`: `ENGINE.*` and the server's status reply as a dict
        (`engine_status`, `engine_status_detail`, `global_step`, and this project's keys).

        `("ENGINE.CANNOT_CONNECT", {})` when the server does not answer.
        """
        try:
            data = self.engine_status().model_dump(mode="json")
        except SwarmConnectionError as exc:
            log.error("Error getting engine status: %s", exc)
            return CANNOT_CONNECT, {}
        self._observe(data["engine_status"], data.get("global_step"))
        return data["engine_status"], data

    def get_global_step(self) -> int:
        """The engine's current training step (0 before any)."""
        _, data = self.get_engine_status()
        return int(data.get("global_step") or 0)

    def add_entering_weight_sync_callback(self, callback: Callable[[], Any]) -> None:
        """Call `callback()` once each time the engine enters ENGINE.WEIGHT_SYNCING.

        A background thread polls the status every `retry.status_poll_s`. An update that
        starts and ends between two polls is still reported once (the step advanced).
        """
        with self._observe_lock:
            self._sync_callbacks.append(callback)
            if self._poller is None:
                self._poller = threading.Thread(target=self._poll_status, daemon=True,
                                                name=f"SwarmClient-poll-{self.client_uuid[:8]}")
                self._poller.start()

    def _poll_status(self) -> None:
        while not self._poller_stop.wait(self.retry.status_poll_s):
            try:
                self.get_engine_status()
            except Exception:  # noqa: BLE001 - the poller must survive any one failure
                log.exception("engine status poll failed (continuing)")

    def _observe(self, status: str, step: int | None) -> None:
        with self._observe_lock:
            last_status, last_step = self._last_seen
            self._last_seen = (status, step)
            entered = status == WEIGHT_SYNCING and last_status != WEIGHT_SYNCING
            passed = (last_status is not None and last_status != WEIGHT_SYNCING
                      and step is not None and last_step is not None and step > last_step)
            callbacks = list(self._sync_callbacks) if (entered or passed) else []
        for callback in callbacks:
            try:
                callback()
            except Exception:  # noqa: BLE001 - as the original: a callback never breaks polling
                log.exception("Error in entering_weight_sync callback")

    def _wait_for(self, wanted: Iterable[str], *, started: bool = False,
                  timeout: float | None = None) -> tuple[str, dict[str, Any]]:
        """Poll until the status is one of `wanted`.

        Raises `SwarmServerOfflineError` if the engine is OFFLINE after it was up (or,
        with `started`, after this client started it), `SwarmTimeout` past the deadline.
        """
        wanted = tuple(wanted)
        begun = time.time()
        deadline = time.monotonic() + (timeout or self.retry.engine_wait_s)
        seen_up = started
        while True:
            status, data = self.get_engine_status()
            if status in wanted:
                return status, data
            if status not in (OFFLINE, CANNOT_CONNECT):
                seen_up = True
            failed = (data.get("last_error") or {}).get("at", 0) >= begun if started else False
            if status == OFFLINE and OFFLINE not in wanted and (seen_up or failed):
                raise SwarmServerOfflineError(_offline_message(wanted, data))
            if time.monotonic() > deadline:
                waited = timeout or self.retry.engine_wait_s
                raise SwarmTimeout(f"engine still {status} after {waited:.0f}s waiting for "
                                   f"{', '.join(wanted)}; see get_run_logs()")
            time.sleep(self.retry.status_poll_s)

    # ------------------------------------------------------------------ lifecycle

    def start_engine(self) -> None:
        """Start the engine on the synced config; returns once it serves episodes."""
        status, _ = self.get_engine_status()
        if status != OFFLINE:
            raise SwarmStateError(f"Cannot start engine when engine is NOT ENGINE.OFFLINE. "
                                  f"(current status: {status})")
        self.start_run()
        self._info("Successfully started training engine on Swarm server")
        self._wait_for(_SERVING, started=True)
        self._info("Training engine is now ROLLING and ready.")

    def stop_engine(self) -> None:
        """Stop the engine; returns once it is OFFLINE (at once if it already is)."""
        status, _ = self.get_engine_status()
        if status == OFFLINE:
            self._info("Engine is already OFFLINE. No action needed.")
            return
        stopped = self.stop_run(reason="stop_engine()")
        if stopped.waited_for:  # a checkpoint was being written: the stop waited for it
            self._info(stopped.message or "waited for the checkpoint being written")
        self._info("Successfully stopped training engine on Swarm server"
                   + (f"; last complete checkpoint: {stopped.last_checkpoint}"
                      if stopped.last_checkpoint else ""))
        self._wait_for((OFFLINE,))

    def sync_train_config(self, agentjet_job: AgentJetJob) -> dict[str, Any]:
        """Send the job (only while OFFLINE). Returns `success` and the server's reply
        (`config_hash`, `config`, and `notes` on settings without effect here)."""
        status, _ = self.get_engine_status()
        self._agentjet_job = agentjet_job
        if status != OFFLINE:
            raise SwarmStateError("Cannot sync train config when engine is NOT ENGINE.OFFLINE. "
                                  f"(current status: {status})")
        accepted = self.submit_config(agentjet_job)
        for note in accepted.notes:
            log.warning("job setting %s: %s (%s)", note.field, note.status, note.reason)
        self._info("Synced train config to Swarm server")
        return {**accepted.model_dump(mode="json"), "success": True}

    def sync_train_code(self, zip_file_path: str) -> dict[str, Any]:
        """Upload a zip of `ajet/` (only while OFFLINE). Returns `success`, `message`,
        `temp_ajet_code_path` and this project's `snapshot_id`, `bytes_uploaded`, ..."""
        status, _ = self.get_engine_status()
        if status != OFFLINE:
            raise SwarmStateError("Cannot sync train code when engine is NOT ENGINE.OFFLINE. "
                                  f"(current status: {status})")
        if not os.path.isfile(zip_file_path):
            raise FileNotFoundError(f"Training code zip file does not exist: {zip_file_path}")
        result = self.push_code_zip(zip_file_path).model_dump(mode="json")
        self._info(f"Synced train code to Swarm server: {result['temp_ajet_code_path']}")
        return result

    def sync_train_code_from_dir(self, directory_path: str,
                                 force_restart: bool = False) -> dict[str, Any]:
        """Sync the git-tracked files under `<directory_path>/ajet`.

        As in the original, `force_restart=True` stops the engine and leaves it OFFLINE on
        the new code (the next start uses it); this project's `push_code(path,
        force_restart=True)` restarts it instead. The upload is incremental: only files
        the server lacks are sent. Every check runs before the engine is stopped: the
        folder is packaged, uploaded and stored first, and a snapshot the server will not
        run (awaiting approval) is refused with the engine left as it was.
        """
        from ajet.code_sync import push_package
        from ajet.packaging import package_tree

        package = package_tree(directory_path)  # PackagingError: nothing has changed yet
        if not force_restart:
            status, _ = self.get_engine_status()
            if status != OFFLINE:
                raise SwarmStateError("Cannot sync train code when engine is NOT "
                                      f"ENGINE.OFFLINE. (current status: {status}); pass "
                                      "force_restart=True")
            result = push_package(self, package).model_dump(mode="json")
        else:
            stored = push_package(self, package, activate=False)
            approval = stored.approval.state if stored.approval else ApprovalState.NOT_ENFORCED
            if approval not in (ApprovalState.APPROVED, ApprovalState.NOT_ENFORCED):
                raise ApprovalPending(
                    409, f"snapshot {stored.snapshot_id[:12]} is {approval}: the server will "
                    "not run it, and the engine was left as it was",
                    "ask an approver to approve it (web console /ui), then sync again",
                    method="POST", path="/code/commit")
            status, _ = self.get_engine_status()
            if status != OFFLINE:
                log.warning("Force restarting the engine...")
                self.stop_engine()
            result = self.activate_snapshot(stored.snapshot_id).model_dump(mode="json")
            result.update(files=stored.files, bytes_uploaded=stored.bytes_uploaded)
        self._info(f"Synced train code to Swarm server: {result['temp_ajet_code_path']}")
        return {**result, "local_zip_file_path": None, "local_zip_file_count": result["files"]}

    def auto_sync_train_config_and_start_engine(self, agentjet_job: AgentJetJob,
                                                force_restart: bool = False,
                                                _retry_once: bool = True) -> None:
        """Bring the engine to ROLLING with this job, as the original's table says:

        OFFLINE: sync the config and start; ROLLING / ROLLING_POST: nothing (logged);
        BOOTING / WEIGHT_SYNCING: wait for ROLLING; unreachable: retry once, then raise.
        `force_restart=True` stops a running engine first.
        """
        if force_restart and self.get_engine_status()[0] != OFFLINE:
            self.check_config(agentjet_job)  # a refused config must not stop the run
            log.warning("Force restarting the engine...")
            self.stop_engine()
            time.sleep(self.retry.restart_settle_s)
        if getattr(agentjet_job, "ensure_new_experiment", False) and not force_restart:
            log.warning("ensure_new_experiment is set to True, but force_restart is not set! "
                        "Will still continue the experiment on the current model version!")
        self._agentjet_job = agentjet_job
        status, _ = self.get_engine_status()
        if status == OFFLINE:
            self._info("Engine is OFFLINE. Syncing train config and starting engine...")
            self.sync_train_config(agentjet_job)
            self.start_engine()
        elif status in (ROLLING, ROLLING_POST):
            self._info(f"Engine is already {status}. No action needed.")
        elif status == CANNOT_CONNECT:
            log.error("Unable to connect to swarm server at %s.", self.server_url)
            if not _retry_once:
                raise SwarmConnectionError(f"Unable to connect to swarm server at "
                                           f"{self.server_url}; is `ajet-swarm start` running?")
            time.sleep(self.retry.unreachable_retry_s)
            self.auto_sync_train_config_and_start_engine(agentjet_job, force_restart=False,
                                                         _retry_once=False)
        elif status in (BOOTING, WEIGHT_SYNCING):
            self._info(f"Engine is {status}. Waiting until it becomes ROLLING...")
            self._wait_for(_SERVING, started=status == BOOTING)
            self._info("Training engine is now ROLLING and ready.")
        else:
            raise SwarmStateError(f"Cannot sync train config or start engine when engine is "
                                  f"in status: {status}")

    @staticmethod
    def async_and_start_multi_engine(client_job_pairs: list[tuple[SwarmClient, AgentJetJob]],
                                     force_restart: bool = False) -> None:
        """`auto_sync_train_config_and_start_engine` on several servers at once."""
        errors: list[tuple[str, BaseException]] = []

        def start(client: SwarmClient, job: AgentJetJob) -> None:
            try:
                client.auto_sync_train_config_and_start_engine(job, force_restart=force_restart)
            except Exception as exc:  # noqa: BLE001 - collected and raised below
                log.exception("Error starting engine on %s", client.server_url)
                errors.append((client.server_url, exc))

        threads = [threading.Thread(target=start, args=pair, daemon=True)
                   for pair in client_job_pairs]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        if errors:
            raise SwarmError(f"Failed to start {len(errors)} engine(s): {errors}")

    # ------------------------------------------------------------------ episodes

    def begin_episode(self, discard_episode_timeout: float = 240, episode_type: str = "train",
                      throttle_policy: SwarmThrottlePolicy | None = None
                      ) -> tuple[str, OpenaiBaseUrlAndApiKey]:
        """Block until an episode is claimed; returns `(episode_uuid, base_url_and_key)`.

        `discard_episode_timeout`: idle seconds (no chat) before the server re-queues the
        episode. `episode_type="eval"`: served, never trained on. `throttle_policy`:
        hold this client back while its tasks would fill too much of the batch.
        """
        deadline = time.monotonic() + self.retry.begin_episode_wait_s
        max_episode_time = 8 * discard_episode_timeout  # later, end_episode becomes an abort
        delay = 0.0
        while True:
            if delay:
                time.sleep(delay)
            if time.monotonic() > deadline:
                raise SwarmTimeout(f"no episode could be claimed within "
                                   f"{self.retry.begin_episode_wait_s:.0f}s; "
                                   "see get_engine_status() and get_rollout_stat()")
            status, data = self.get_engine_status()
            if status != ROLLING:
                self._info(f"Engine status is {status}. Waiting until ENGINE.ROLLING...")
                status, data = self._wait_for((ROLLING,),
                                              timeout=max(1.0, deadline - time.monotonic()))
            lock = self._begin_lock if throttle_policy is not None else None
            if lock is not None:
                lock.acquire()
            try:
                if throttle_policy is not None and episode_type == "train" and \
                        self._should_throttle(throttle_policy, self.get_rollout_stat()):
                    self._info("Throttle policy is active, delaying episode ...")
                    delay = self.retry.throttle_retry_s
                    continue
                try:
                    claimed = self.open_episode(
                        discard_episode_timeout, episode_type=episode_type,
                        client_uuid=self.client_uuid,
                        task_id=throttle_policy.current_task_id if throttle_policy else None)
                except EngineStateConflict as exc:
                    now_status, _ = self.get_engine_status()
                    delay = (self.retry.no_slot_retry_s if now_status == ROLLING
                             else self.retry.busy_retry_s)
                    self._info(f"Cannot claim an episode now ({exc.detail}). Retrying ...")
                    continue
                except SwarmConnectionError as exc:
                    log.error("Error claiming episode: %s. Retrying ...", exc)
                    delay = self.retry.busy_retry_s
                    continue
            finally:
                if lock is not None:
                    lock.release()
            with self._records_lock:
                now = time.time()
                self._episode_expiry[claimed.episode_uuid] = now + max_episode_time
                for known, expiry in list(self._episode_expiry.items()):
                    if expiry < now - _CLEAN_RECORD_TIMEOUT_S:
                        del self._episode_expiry[known]
            # the server's view of its own address may differ from ours (a proxy)
            base_url = re.sub(r"^https?://[^/]+", self.server_url, claimed.openai_base_url)
            anthropic_url = re.sub(r"^https?://[^/]+", self.server_url,
                                   claimed.anthropic_base_url or
                                   claimed.openai_base_url.removesuffix("/v1"))
            self._info(f"Claimed episode {claimed.episode_uuid}, current global step: "
                       f"{data.get('global_step', 'unknown')}")
            return claimed.episode_uuid, OpenaiBaseUrlAndApiKey(
                base_url=base_url, api_key=claimed.openai_api_key,
                anthropic_base_url=anthropic_url, episode_uuid=claimed.episode_uuid)

    def end_episode(self, task: Task, episode_uuid: str, workflow_output: WorkflowOutput,
                    declare_client_active: bool = True) -> None:
        """Report the episode's result; the engine trains on it (not on eval episodes).

        An episode this client does not know, or that outlived 8x its
        `discard_episode_timeout`, is aborted instead, as in the original. A list reward
        is refused with the original's message (the episode is aborted first).
        """
        if not episode_uuid:
            log.error("No episode to end.")
            return
        with self._records_lock:
            expiry = self._episode_expiry.pop(episode_uuid, None)
        if expiry is None or expiry < time.time():
            log.warning("Episode %s has expired or is unknown to this client. Please use a "
                        "larger `discard_episode_timeout` when `begin_episode`. Skipping "
                        "end_episode.", episode_uuid)
            self.abort_episode(episode_uuid)
            return
        task_id = task.task_id
        if not task_id:
            raise ValueError("task.task_id must be valid!")
        workflow_output.metadata["task_id"] = task_id
        try:
            request = end_request_from_output(episode_uuid, task_id, workflow_output,
                                              client_uuid=self.client_uuid,
                                              declare_client_active=declare_client_active)
        except OriginalBodyError:
            self.abort_episode(episode_uuid)
            raise
        try:
            self.report_episode(
                episode_uuid, task_id, request.reward, is_success=request.is_success,
                metadata=request.metadata, log_metrics=request.log_metrics,
                client_uuid=self.client_uuid, declare_client_active=declare_client_active)
        except (EngineStateConflict, SwarmNotFound):
            status, _ = self.get_engine_status()
            if status == WEIGHT_SYNCING:
                log.warning("Engine is in WEIGHT_SYNCING state, episode %s will be discarded. "
                            "This is expected during weight sync.", episode_uuid)
                return
            raise
        self._info(f"Ended episode {episode_uuid}")

    def abort_episode(self, episode_uuid: str, declare_client_active: bool = True) -> None:
        """Give the episode up (its slot is re-queued). Never raises, as in the original."""
        if not episode_uuid:
            log.error("No episode to end.")
            return
        with self._records_lock:
            self._episode_expiry.pop(episode_uuid, None)
        try:
            self.cancel_episode(episode_uuid, reason="abort_episode()",
                                         client_uuid=self.client_uuid,
                                         declare_client_active=declare_client_active)
            self._info(f"Aborted episode {episode_uuid}")
        except SwarmError as exc:
            log.error("Error aborting episode %s: %s", episode_uuid, exc)

    def can_continue_episode(self, episode_uuid: str) -> bool:
        """True while the episode is claimed by this client and the engine takes results."""
        if not episode_uuid:
            return False
        try:
            data = self._call("POST", "/can_continue_episode",
                                       json={"client_uuid": self.client_uuid,
                                             "episode_uuid": episode_uuid})
            return CanContinueEpisodeResponse.model_validate(data).can_continue
        except SwarmError as exc:
            log.error("Error checking can_continue_episode: %s", exc)
            return False

    def get_episode_buffer(self) -> list[EpisodeStatus]:
        """The claimed episodes of the engine (all clients); [] on error."""
        try:
            data = self._call("POST", "/get_episode_buffer", json={})
            return EpisodeBufferResponse.model_validate(data).buffer
        except SwarmError as exc:
            log.error("Error getting episode buffer: %s", exc)
            return []

    def get_rollout_stat(self) -> CurrentBatchRolloutPoolInformation:
        """The current batch's statistics; an empty record on error."""
        try:
            data = self._call("GET", "/get_current_batch_rollout_pool_information")
            return CurrentBatchRolloutPoolInformation.model_validate(data)
        except SwarmError as exc:
            log.error("Error getting rollout statistics: %s", exc)
            return CurrentBatchRolloutPoolInformation()

    def print_rollout_stat(self) -> dict[str, str]:
        """Log the current batch's progress (INFO, logger `ajet.compat.client`); returns it."""
        stat = self.get_rollout_stat()
        per_task = [len(v) for v in stat.completed_tasks_details.values()]
        summary = {
            "Completed tasks: (current) / (required)":
                f"{stat.completed_tasks} / {stat.completed_task_target}",
            "Completed episodes: (current) / (required)":
                f"{stat.completed_episodes} / {stat.completed_episode_target}",
            "Average episodes per task: (current) / (expected)":
                f"{(sum(per_task) / len(per_task)) if per_task else 0.0:.2f} / "
                f"{stat.task_expected_num_repeat}",
            "Completed non-dummy tasks: (current) / (required)":
                f"{stat.completed_non_dummy_tasks} / {stat.completed_non_dummy_task_target}",
            "Tasks (Number of episodes completed for each task)":
                "  ".join(f"Task-{t} ({len(v)})" for t, v in stat.completed_tasks_details.items()),
        }
        log.info("Current Swarm Rollout Pool Information (%s, step %s):\n%s",
                 stat.engine_status, stat.global_step,
                 "\n".join(f"  {k}: {v}" for k, v in summary.items()))
        return summary

    def server_experiment_dir(self) -> str | None:
        """The current run's directory on the server (None before any run)."""
        try:
            data = self._call("GET", "/get_server_experiment_dir")
            return data.get("server_experiment_dir")
        except SwarmError:
            return "saved_experiments"  # the original's fallback

    def agree_sync_weight(self) -> bool:
        """Tell the server this client agrees to the next update.

        Only for the `rollout_until_*_agree_sync_weight` collection methods. Retries
        while the server does not take it yet (this client has not ended a rewarded
        episode since the last update); returns True once taken and the engine has
        moved on to the update, False if the engine left ROLLING first.
        """
        job = self._agentjet_job
        if job is None:
            raise ValueError("Please call sync_train_config with a valid AgentJetJob before "
                             "agree_sync_weight.")
        if job.swarm_mode_sample_collection_method not in _AGREE_METHODS:
            raise ValueError("agree_sync_weight is only applicable when "
                             "swarm_mode_sample_collection_method is set to "
                             f"{' or '.join(_AGREE_METHODS)}.")
        deadline = time.monotonic() + self.retry.engine_wait_s
        while time.monotonic() < deadline:
            status, data = self.get_engine_status()
            if status not in (ROLLING, ROLLING_POST):
                log.warning("agree_sync_weight: engine is %s, abandoning agreement.", status)
                return False
            step = data.get("global_step")
            try:
                reply = BoolResponse.model_validate(self._call(
                    "POST", "/agree_sync_weight", json={"client_uuid": self.client_uuid}))
            except SwarmConnectionError as exc:
                log.error("agree_sync_weight errored: %s. Retrying ...", exc)
                reply = BoolResponse(success=False, failure_reason=str(exc))
            if reply.success:
                self._info("agree_sync_weight: registered with server")
                self._wait_past_rolling(step)
                return True
            log.warning("agree_sync_weight rejected: %s. Retrying in %.1fs...",
                        reply.failure_reason, self.retry.agree_retry_s)
            time.sleep(self.retry.agree_retry_s)
        raise SwarmTimeout(f"agree_sync_weight not taken within {self.retry.engine_wait_s:.0f}s")

    def _wait_past_rolling(self, step: int | None) -> None:
        """Until the engine leaves ROLLING for the update (or has already done it)."""
        deadline = time.monotonic() + self.retry.engine_wait_s
        while time.monotonic() < deadline:
            status, data = self.get_engine_status()
            if status in (ROLLING_POST, WEIGHT_SYNCING) or (
                    step is not None and (data.get("global_step") or 0) > step):
                return
            if status == OFFLINE:
                raise SwarmServerOfflineError(_offline_message((ROLLING_POST,), data))
            time.sleep(self.retry.status_poll_s)
        raise SwarmTimeout("the engine did not start the update after agree_sync_weight")

    def _should_throttle(self, policy: SwarmThrottlePolicy,
                         pool: CurrentBatchRolloutPoolInformation) -> bool:
        """The original's task-ratio throttle: hold back a new task of this client while
        its distinct tasks in the batch reach `expected_batch_size * ratio`."""
        job = self._agentjet_job
        if job is not None and \
                job.swarm_mode_sample_collection_method != "rollout_until_finish_enough_tasks":
            raise ValueError(f"Current sample collection method "
                             f"({job.swarm_mode_sample_collection_method}) does not support "
                             "throttle policy.")
        task = policy.current_task_id
        if not task:
            raise ValueError("a throttle policy needs current_task_id")
        mine: set[str] = set()
        others: set[str] = set()
        counts: dict[str, int] = {}
        for task_id, clients in pool.completed_tasks_client_uuids.items():
            counts[task_id] = len(clients)
            if any(c != self.client_uuid for c in clients):
                others.add(task_id)
            if self.client_uuid in clients:
                mine.add(task_id)
        if pool.running_episode_details:
            for detail in pool.running_episode_details.values():
                task_id = detail.get("optional_task_id", "")
                if detail.get("client_uuid", "") != self.client_uuid:
                    others.add(task_id)
                elif task_id:
                    mine.add(task_id)
        elif sum(n >= policy.expected_num_repeat for n in counts.values()) < \
                policy.expected_batch_size:
            return False
        if task in self._recent_seen_tasks or task in mine or task in others:
            return False
        if len(mine - others) >= policy.expected_batch_size * policy.ratio:
            return True
        limit = max(1, policy.expected_batch_size * policy.expected_num_repeat * 3)
        self._recent_seen_tasks = [*self._recent_seen_tasks, task][-limit:]
        return False

    def _info(self, message: str) -> None:
        if self.verbose:
            log.info(message)


def _offline_message(wanted: Iterable[str], data: dict[str, Any]) -> str:
    err = data.get("last_error") or {}
    text = (f"Engine status is OFFLINE while waiting for {list(wanted)}. "
            f"{err.get('reason') or 'The engine stopped.'}")
    tail = "\n".join((err.get("log_tail") or [])[-20:])
    return f"{text}\n{tail}".strip() + "\nSee get_run_logs() or the swarm server log."
