"""`EpisodeGateway`: the public episode plane, proxied to the engine's private socket.

The server never imports the engine; it forwards episode calls over the Unix socket
the engine serves (docs/internals.md, "Episode plane (server side)"):

- `begin` asks the engine for an episode, signs a key for it (`episode_keys`) and
  records the episode in the gateway's own table (run id, expiry, ended flag);
- `check_key` verifies a key and looks the episode up **by id in that table** (nothing
  else in the key is trusted), refusing unknown, foreign-run and ended episodes with
  401; `swarm_server.limits` calls it for every `/v1/*` request before the body is read,
  once, and the route hands `openai` the episode id it found;
- `openai` (every `/v1/*` route: chat, completions, responses, models, and Anthropic's
  messages and count_tokens) forwards the request with `X-Episode-UUID`, streaming the
  answer back unchanged;
- `end` / `abort` forward and mark the episode ended, so its key stops working. `end`
  first refuses (422) a reward or `log_metrics` value that is not finite or is beyond
  `max_reward_magnitude` / `max_metric_magnitude`: one reward of 1e308 used to overflow
  the advantage computation and kill the run.

The table is bounded (`max_gateway_episodes`). An entry that ended (or was aborted, or
idled past the engine's timeout) is pruned once the engine's step has moved past the
step of its last activity, i.e. once the batch it was collected for has been trained;
entries of the current batch stay (the rollout-pool statistics read them). An id the
table no longer knows, or knows as closed, is forwarded to the engine, which remembers
closed episodes and answers 409 ("already ended", "timed out") or 404 itself. Pruning
runs when the step changes or the table is full: amortised O(1) per call.

One `EngineChannel` (`swarm_server.engine_channel`: keep-alive connections, replies
parsed by httptools) over the socket per engine run. Chat bodies are forwarded as the
bytes the client sent and the engine's replies relayed as the bytes it answered (never
parsed here); begin, end and abort bodies are the validated models, serialised once by
pydantic-core. Engine errors keep their status and `{"detail", "hint"}`; an engine that
does not answer is a 409 (it is stopping or crashed: `get_engine_status` says which).
Every method runs on the event loop thread, so the table needs no lock.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from fastapi.responses import Response, StreamingResponse
from pydantic_core import to_json
from starlette.background import BackgroundTask

from ajet.protocol import (
    AbortEpisodeRequest,
    BeginEpisodeRequest,
    BeginEpisodeResponse,
    EndEpisodeRequest,
    EndEpisodeResponse,
    EngineState,
    PlanePath,
)
from ajet.errors import (
    EngineStateConflict,
    SwarmAuthError,
    SwarmHTTPError,
    SwarmNotFound,
    SwarmValidationError,
    error_for_status,
)
from swarm_server.engine_channel import ChannelError, ChannelTarget, EngineChannel, Reply
from swarm_server.episode_keys import EpisodeKeySigner, InvalidEpisodeKey
from swarm_server.settings import Settings

__all__ = ["EpisodeGateway", "RunsView"]

log = logging.getLogger(__name__)

_CHALLENGE = {"WWW-Authenticate": "Bearer"}
#: `log_metrics` of one episode: at most this many keys of at most this many characters.
MAX_LOG_METRICS = 256
MAX_METRIC_NAME = 200


class RunsView(Protocol):
    """What the gateway needs from `RunPool`: which runs serve, on which socket."""

    def default_run_id(self) -> str | None:
        """The default run's id while it serves (begin_episode without a run)."""
        ...

    def serving_socket(self, run_id: str) -> Path | None:
        """The engine socket of `run_id` while it serves, else None."""
        ...

    def run_step(self, run_id: str) -> int | None: ...

    def resolve(self, ref: str) -> str:
        """The run id a run id or name names (404 if none)."""
        ...

    def live_state(self, run_id: str | None) -> EngineState | None:
        """An active run's engine state (`None`: the default run's), else None."""
        ...

    def describe(self, run_id: str | None) -> str:
        """A run's state in words (`None`: the default run's engine)."""
        ...


@dataclass
class _Entry:
    run_id: str
    expires_at: float  # of its key (unix time)
    timeout_s: float  # the engine's idle timeout for it
    last_active: float  # monotonic time of its last begin, chat or end
    step: int  # the engine's step at its last activity
    ended: bool = False

    def closed(self, now: float) -> bool:
        """Ended or aborted here, or idle so long that the engine has timed it out (twice
        its timeout: the engine measures idleness from the end of a completion)."""
        return self.ended or now - self.last_active > 2 * self.timeout_s


class EpisodeGateway:
    def __init__(self, settings: Settings, runs: RunsView, *,
                 channel_target: Callable[[Path], ChannelTarget] | None = None) -> None:
        self.settings = settings
        self.runs = runs
        # where a run's channel really is: its socket, or the launcher's TCP endpoint
        self._channel_target = channel_target or (lambda path: path)
        self.signer = EpisodeKeySigner(ttl_s=settings.episode_key_ttl_s)
        self._episodes: dict[str, _Entry] = {}
        self._channels: dict[str, tuple[Path, EngineChannel]] = {}  # run id -> its channel
        self._pruned_at_step: dict[str, int] = {}  # run id -> step its entries were pruned at
        #: the server's public base URL by what it is made of (scheme, server, Host, root
        #: path): begin_episode answers it on every call (`routes.episodes`); the Host
        #: header is the caller's, so the routes keep it bounded
        self.base_urls: dict[tuple[Any, ...], str] = {}

    async def aclose(self) -> None:
        for _, channel in self._channels.values():
            channel.close()
        self._channels.clear()

    # ------------------------------------------------------------------ routes

    async def begin(self, body: BeginEpisodeRequest, *, public_base_url: str
                    ) -> BeginEpisodeResponse:
        wanted = self.runs.resolve(body.run_id) if body.run_id else None
        run_id, channel = self._target("begin_episode", wanted)
        self._make_room(run_id)
        # the run is the gateway's business: the engine's body has no such field
        data = await self._post_json(channel, PlanePath.BEGIN_EPISODE,
                                     to_json(body, exclude={"run_id"}))
        episode_uuid = str(data["episode_uuid"])
        key, expires_at = self.signer.sign(run_id, episode_uuid)
        timeout_s = data.get("timeout_s")
        self._episodes[episode_uuid] = _Entry(
            run_id=run_id, expires_at=expires_at, last_active=time.monotonic(),
            timeout_s=float(timeout_s) if timeout_s else self.settings.episode_key_ttl_s,
            step=self._step(run_id))
        root = public_base_url.rstrip("/")
        return BeginEpisodeResponse(
            episode_uuid=episode_uuid, openai_base_url=f"{root}/v1", openai_api_key=key,
            anthropic_base_url=root, run_id=run_id, timeout_s=data.get("timeout_s"))

    async def end(self, body: EndEpisodeRequest) -> EndEpisodeResponse:
        self._check_values(body)
        entry = self._live_entry(body.episode_uuid)
        _, channel = self._target("end_episode", entry.run_id if entry else None)
        data = await self._post_json(channel, PlanePath.END_EPISODE, to_json(body),
                                     entry=entry)
        self._close(entry)
        return EndEpisodeResponse.model_validate(data)

    async def abort(self, body: AbortEpisodeRequest) -> dict[str, Any]:
        entry = self._live_entry(body.episode_uuid)
        _, channel = self._target("abort_episode", entry.run_id if entry else None)
        data = await self._post_json(channel, PlanePath.ABORT_EPISODE, to_json(body),
                                     entry=entry)
        self._close(entry)
        return data

    async def openai(self, episode_uuid: str, *, method: str, path: str, body: bytes | None
                     ) -> Response:
        """Forward an OpenAI-compatible request (`/v1/...`) for the episode whose key the
        first gate verified (`check_key`): the body as the client sent it, the engine's
        answer as it came (streamed on)."""
        entry = self._episodes.get(episode_uuid)
        if entry is None or entry.ended:  # ended (or pruned) while its body was read
            raise SwarmAuthError(401, f"episode {episode_uuid} has ended",
                                 "call begin_episode for a new episode", headers=_CHALLENGE)
        entry.last_active, entry.step = time.monotonic(), self._step(entry.run_id)
        _, channel = self._target("chat", entry.run_id)
        try:
            reply = await channel.send(method, path, body,
                                       headers=(("x-episode-uuid", episode_uuid),))
        except ChannelError as exc:
            raise self._unreachable("chat", exc) from exc
        if reply.status == 200 and reply.headers.get(
                "content-type", "").startswith("text/event-stream"):
            return StreamingResponse(reply.chunks(), status_code=200,
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"},
                                     background=BackgroundTask(reply.close))
        try:
            content = await reply.read()
        except ChannelError as exc:
            raise self._unreachable("chat", exc) from exc
        finally:
            reply.close()
        entry.last_active = time.monotonic()
        if reply.status == 200:
            return Response(content, status_code=200, media_type="application/json")
        detail, _, _ = _error_parts(content)
        if reply.status == 404 and path.startswith("/v1/models/"):
            raise self._relay(reply, content)  # an unknown model name
        if reply.status == 404 and detail == "Not Found":
            # the engine runs code that has no such route (an older snapshot); the
            # episode itself is fine
            raise SwarmNotFound(404, f"the engine's code does not serve {path} (its snapshot "
                                "predates it)", "sync the current ajet/ and restart the "
                                "engine, or use another API of the episode plane")
        if reply.status in (404, 409):  # the episode closed in the engine
            entry.ended = True
            raise SwarmAuthError(401, f"episode {episode_uuid} is no longer live: {detail}",
                                 "call begin_episode for a new episode and use its key",
                                 headers=_CHALLENGE)
        raise self._relay(reply, content)

    async def engine_call(self, method: str, path: str,
                          payload: dict[str, Any] | None = None) -> dict[str, Any] | None:
        """A statistics call on the engine's socket; None when no engine serves (or the
        engine's code has no such route).

        For the original AgentJet's routes (`routes/original.py`), which answer with
        defaults while the engine is not serving instead of an error.
        """
        run_id = self.runs.default_run_id()
        if run_id is None or self.runs.serving_socket(run_id) is None:
            return None
        action = path.strip("/")
        _, channel = self._target(action, run_id)
        body = None if method == "GET" else json.dumps(payload or {}).encode()
        try:
            reply, content = await channel.request(method, path, body)
        except ChannelError as exc:
            raise self._unreachable(action, exc) from exc
        if reply.status == 404:
            return None  # an engine from code that predates these routes: the defaults
        if reply.status != 200:
            raise self._relay(reply, content)
        data = json.loads(content)
        return data if isinstance(data, dict) else None

    def check_key(self, key: str | None) -> str:
        """The episode id of a genuine key of a live episode of the serving run, else 401."""
        if not key:
            raise SwarmAuthError(401, "missing episode key",
                                 "use the openai_api_key returned by begin_episode as the API key",
                                 headers=_CHALLENGE)
        try:
            claims = self.signer.verify(key)
        except InvalidEpisodeKey as exc:
            hint = ("call begin_episode for a new episode" if exc.expired else
                    "use the openai_api_key returned by begin_episode on this server")
            raise SwarmAuthError(401, str(exc), hint, headers=_CHALLENGE) from exc
        entry = self._episodes.get(claims.episode_uuid)
        if entry is None or entry.run_id != claims.run_id:
            raise SwarmAuthError(401, "unknown episode for this key",
                                 "call begin_episode for a new episode", headers=_CHALLENGE)
        if self.runs.serving_socket(entry.run_id) is None:
            raise SwarmAuthError(
                401,
                f"episode {claims.episode_uuid} belongs to engine run {entry.run_id}, which is "
                "no longer serving", "call begin_episode for a new episode", headers=_CHALLENGE)
        if entry.ended:
            raise SwarmAuthError(401, f"episode {claims.episode_uuid} has ended",
                                 "call begin_episode for a new episode", headers=_CHALLENGE)
        return claims.episode_uuid

    def table_size(self) -> int:
        """Entries in the table (live, and closed ones not pruned yet)."""
        return len(self._episodes)

    # ------------------------------------------------------------------ private

    def _check_values(self, body: EndEpisodeRequest) -> None:
        """422 for a reward or metric value the training could not use."""
        problems: list[dict[str, Any]] = []

        def check(loc: list[str], value: float, limit: float, setting: str) -> None:
            if not math.isfinite(value) or abs(value) > limit:
                problems.append({"loc": loc, "type": "value_error", "msg": (
                    f"{value!r} is not finite or beyond the server's limit of ±{limit:g} "
                    f"({setting})")})

        settings = self.settings
        check(["body", "reward"], body.reward, settings.max_reward_magnitude,
              "AJET_SWARM_MAX_REWARD_MAGNITUDE")
        if len(body.log_metrics) > MAX_LOG_METRICS:
            problems.append({"loc": ["body", "log_metrics"], "type": "value_error",
                             "msg": f"{len(body.log_metrics)} log_metrics; at most "
                                    f"{MAX_LOG_METRICS} per episode"})
        for name, value in list(body.log_metrics.items())[:MAX_LOG_METRICS]:
            if len(name) > MAX_METRIC_NAME:
                problems.append({"loc": ["body", "log_metrics"], "type": "value_error",
                                 "msg": f"log_metrics name of {len(name)} characters; at "
                                        f"most {MAX_METRIC_NAME}"})
            check(["body", "log_metrics", name[:MAX_METRIC_NAME]], value,
                  settings.max_metric_magnitude, "AJET_SWARM_MAX_METRIC_MAGNITUDE")
        if problems:
            raise SwarmValidationError(422, problems, "send finite values within the limits "
                                          "(docs/limits.md); scale the reward, or ask the "
                                          "server's operator to raise the limit")

    def _live_entry(self, episode_uuid: str) -> _Entry | None:
        """The episode's entry if it belongs to the serving run; None if the table does not
        know it (pruned once its batch was trained, or never issued). An unknown or closed
        episode is still forwarded: the engine remembers why it closed (ended, aborted,
        timed out) and answers 409 or 404 with that reason itself."""
        entry = self._episodes.get(episode_uuid)
        if entry is None:
            return None
        if self.runs.serving_socket(entry.run_id) is None:
            raise SwarmNotFound(
                404, f"episode {episode_uuid} belongs to engine run {entry.run_id}, which no "
                f"longer serves ({self.runs.describe(entry.run_id)})",
                "its reward cannot be used; begin a new episode")
        return entry

    def _target(self, action: str, run_id: str | None) -> tuple[str, EngineChannel]:
        """The run (`None`: the default run) and its channel, or 409 if it does not serve."""
        wanted = run_id
        if run_id is None:
            run_id = self.runs.default_run_id()
        socket_path = self.runs.serving_socket(run_id) if run_id is not None else None
        if run_id is None or socket_path is None:
            state = self.runs.live_state(wanted)
            waiting = state is not None and state is not EngineState.OFFLINE
            raise EngineStateConflict(
                409, f"{self.runs.describe(wanted)}: cannot {action}",
                "retry in about 1 s; episodes are served once the engine is ENGINE.ROLLING"
                if waiting else
                "start the engine (start_engine) and wait for ENGINE.ROLLING" if wanted is None
                else f"GET /runs/{wanted}/status says why; start a run with POST /runs",
                retry_after_s=1)
        held = self._channels.get(run_id)
        if held is not None and (held[0] is socket_path or held[0] == socket_path):
            return run_id, held[1]
        channel = EngineChannel(self._channel_target(socket_path),
                                timeout_s=self.settings.engine_request_timeout_s)
        self._channels[run_id] = (socket_path, channel)
        self._forget_ended_runs()
        return run_id, channel

    def _forget_ended_runs(self) -> None:
        """Close the channels, and drop the entries, of runs that no longer serve: their
        episodes can never be used again."""
        ended = [run_id for run_id in self._channels
                 if self.runs.serving_socket(run_id) is None]
        for run_id in ended:
            self._channels.pop(run_id)[1].close()  # idle connections of the old run
            self._pruned_at_step.pop(run_id, None)
        serving = set(self._channels)
        self._episodes = {k: e for k, e in self._episodes.items() if e.run_id in serving}

    async def _post_json(self, channel: EngineChannel, path: str, body: bytes, *,
                         entry: _Entry | None = None) -> dict[str, Any]:
        """The engine's JSON answer; its error relayed. A 404 or 409 about the episode
        of `entry` means the engine closed it (timed out, aborted): closed here too."""
        try:
            reply, content = await channel.request("POST", path, body)
        except ChannelError as exc:
            raise self._unreachable(path.strip("/"), exc) from exc
        if reply.status != 200:
            if reply.status in (404, 409):
                self._close(entry)
            raise self._relay(reply, content)
        data = json.loads(content)
        if not isinstance(data, dict):
            raise SwarmHTTPError(502, f"engine answered {path} with a non-object",
                                 "see GET /runs/current/logs")
        return data

    def _relay(self, reply: Reply, content: bytes) -> SwarmHTTPError:
        status, headers = reply.status, reply.headers
        detail, hint, param = _error_parts(content)
        if status >= 500:
            log.warning("engine answered %d: %s", status, detail)
            if status == 503:  # engine not ready (no policy yet, shutting down)
                return EngineStateConflict(
                    409, detail, hint or "retry when the engine is ENGINE.ROLLING")
            return SwarmHTTPError(502, f"engine error: {detail}",
                                  hint or "see the engine log: GET /runs/current/logs")
        retry = headers.get("retry-after", "")
        return error_for_status(status, detail, hint, param=param,
                                retry_after_s=float(retry) if retry.isdigit() else None)

    def _unreachable(self, action: str, exc: ChannelError) -> EngineStateConflict:
        log.info("engine did not answer %s: %s", action, exc)
        return EngineStateConflict(
            409, f"engine did not answer {action} ({exc.reason}); {self.runs.describe(None)}",
            "check get_engine_status; retry once the engine is ENGINE.ROLLING",
            retry_after_s=1)

    def _step(self, run_id: str) -> int:
        step = self.runs.run_step(run_id) or 0
        if step > self._pruned_at_step.get(run_id, 0):
            self._pruned_at_step[run_id] = step
            self._prune(run_id, step)
        return step

    def _close(self, entry: _Entry | None) -> None:
        if entry is not None:
            entry.ended, entry.last_active = True, time.monotonic()
            entry.step = self._step(entry.run_id)

    def _prune(self, run_id: str, step: int) -> None:
        """Drop the run's closed entries whose batch was trained, and any entry whose key
        expired."""
        now, wall = time.monotonic(), time.time()
        self._episodes = {
            k: e for k, e in self._episodes.items()
            if not ((e.run_id == run_id and e.step < step and e.closed(now))
                    or e.expires_at <= wall)}

    def _make_room(self, run_id: str) -> None:
        """Keep the table under `max_gateway_episodes` before a begin adds to it."""
        limit = self.settings.max_gateway_episodes
        if len(self._episodes) < limit:
            return
        self._prune(run_id, self._step(run_id) + 1)  # full: closed entries go even now
        if len(self._episodes) < limit:
            log.warning("episode gateway table full (%d): dropped closed entries of the "
                        "current batch", limit)
            return
        raise EngineStateConflict(
            409, f"the episode gateway tracks {len(self._episodes)} live episodes, its limit",
            "end or abort episodes, retry in about 1 s, or raise "
            "AJET_SWARM_MAX_GATEWAY_EPISODES", retry_after_s=1)


def _error_parts(content: bytes) -> tuple[Any, str, str | None]:
    """`(detail, hint, param)` of an engine error body."""
    try:
        body = json.loads(content)
    except ValueError:
        return content.decode("utf-8", "replace")[:500], "", None
    if isinstance(body, dict):
        param = body.get("param")
        return (body.get("detail", body), str(body.get("hint", "") or ""),
                param if isinstance(param, str) else None)
    return body, "", None
