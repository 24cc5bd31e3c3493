"""`EpisodeGateway`: the public episode plane, proxied to the engine's private socket.

The server never imports the engine; it forwards episode calls over the Unix socket
the engine serves (docs/internals.md, "Episode plane (server side)"):

- `begin` asks the engine for an episode, signs a key for it (`episode_keys`) and
  records the episode in the gateway's own table (run id, expiry, ended flag);
- `openai` (every `/v1/*` route: chat, completions, responses, models) verifies the key,
  looks the episode up **by id in that table** (nothing else in the key is trusted),
  refuses unknown, foreign-run and ended episodes with 401, and forwards the request with
  `X-Episode-UUID`, streaming the answer back unchanged;
- `end` / `abort` forward and mark the episode ended, so its key stops working.

One `httpx.AsyncClient` over the socket per engine run. Engine errors keep their
status and `{"detail", "hint"}`; an engine that does not answer is a 409 (it is
stopping or crashed: `get_engine_status` says which). Every method runs on the event
loop thread, so the table needs no lock.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import httpx
from fastapi.responses import Response, StreamingResponse
from starlette.background import BackgroundTask

from ajet.protocol import (
    AbortEpisodeRequest,
    BeginEpisodeRequest,
    BeginEpisodeResponse,
    EndEpisodeRequest,
    EndEpisodeResponse,
    EngineState,
)
from swarm_server.episode_keys import EpisodeKeySigner, InvalidEpisodeKey
from swarm_server.errors import (
    ApiError,
    EngineStateError,
    NotFound,
    Unauthorized,
)
from swarm_server.settings import Settings

__all__ = ["EngineView", "EpisodeGateway"]

log = logging.getLogger(__name__)

_CHALLENGE = {"WWW-Authenticate": "Bearer"}
#: How often expired entries are dropped from the table.
_PRUNE_EVERY_S = 60.0


class EngineView(Protocol):
    """What the gateway needs from `EngineController`."""

    @property
    def state(self) -> EngineState: ...

    def engine_socket(self) -> Path | None: ...

    def current_run_id(self) -> str | None: ...


class EngineRelayedError(ApiError):
    """An error the engine answered, passed on with its status, detail and hint."""

    def __init__(self, status: int, detail: Any, hint: str = "", *,
                 headers: dict[str, str] | None = None, param: str | None = None) -> None:
        super().__init__(detail, hint, headers=headers, param=param)
        self.status = status


@dataclass
class _Entry:
    run_id: str
    expires_at: float
    ended: bool = False


class EpisodeGateway:
    def __init__(self, settings: Settings, engine: EngineView) -> None:
        self.settings = settings
        self.engine = engine
        self.signer = EpisodeKeySigner(ttl_s=settings.episode_key_ttl_s)
        self._episodes: dict[str, _Entry] = {}
        self._client: httpx.AsyncClient | None = None
        self._client_for: tuple[str, Path] | None = None
        self._last_prune = time.time()

    async def aclose(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client, self._client_for = None, None

    # ------------------------------------------------------------------ routes

    async def begin(self, body: BeginEpisodeRequest, *, public_base_url: str
                    ) -> BeginEpisodeResponse:
        run_id, client = await self._target("begin_episode")
        data = await self._post_json(client, "/begin_episode", body.model_dump(mode="json"))
        episode_uuid = str(data["episode_uuid"])
        key, expires_at = self.signer.sign(run_id, episode_uuid)
        self._episodes[episode_uuid] = _Entry(run_id=run_id, expires_at=expires_at)
        self._prune()
        return BeginEpisodeResponse(
            episode_uuid=episode_uuid, openai_base_url=f"{public_base_url.rstrip('/')}/v1",
            openai_api_key=key, run_id=run_id, timeout_s=data.get("timeout_s"))

    async def end(self, body: EndEpisodeRequest) -> EndEpisodeResponse:
        entry = self._live_entry(body.episode_uuid, "end")
        _, client = await self._target("end_episode")
        try:
            data = await self._post_json(client, "/end_episode", body.model_dump(mode="json"))
        except EngineRelayedError as exc:
            if exc.status in (404, 409):  # the engine closed it (timed out, aborted)
                entry.ended = True
            raise
        entry.ended = True
        return EndEpisodeResponse.model_validate(data)

    async def abort(self, body: AbortEpisodeRequest) -> dict[str, Any]:
        entry = self._live_entry(body.episode_uuid, "abort")
        _, client = await self._target("abort_episode")
        try:
            data = await self._post_json(client, "/abort_episode", body.model_dump(mode="json"))
        except EngineRelayedError as exc:
            if exc.status in (404, 409):
                entry.ended = True
            raise
        entry.ended = True
        return data

    def authorize(self, key: str | None) -> str:
        """The episode a `/v1/*` key names, or 401 (for routes that forward nothing)."""
        return self._authorize_key(key)

    async def openai(self, key: str | None, *, method: str, path: str, body: bytes | None,
                     content_type: str | None) -> Response:
        """Forward an OpenAI-compatible request (`/v1/...`) for the episode the key names."""
        episode_uuid = self._authorize_key(key)
        _, client = await self._target("chat")
        headers = {"X-Episode-UUID": episode_uuid}
        if body is not None:
            headers["Content-Type"] = content_type or "application/json"
        request = client.build_request(method, path, content=body, headers=headers)
        try:
            response = await client.send(request, stream=True)
        except httpx.TransportError as exc:
            raise self._unreachable("chat", exc) from exc
        if response.status_code == 200 and response.headers.get(
                "content-type", "").startswith("text/event-stream"):
            return StreamingResponse(response.aiter_raw(), status_code=200,
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"},
                                     background=BackgroundTask(response.aclose))
        try:
            content = await response.aread()
        except httpx.TransportError as exc:
            raise self._unreachable("chat", exc) from exc
        finally:
            await response.aclose()
        if response.status_code == 200:
            return Response(content, status_code=200, media_type="application/json")
        detail, _, _ = _error_parts(content)
        if response.status_code == 404 and path.startswith("/v1/models/"):
            raise self._relay(404, content, response.headers)  # an unknown model name
        if response.status_code in (404, 409):  # the episode closed in the engine
            self._episodes[episode_uuid].ended = True
            raise Unauthorized(f"episode {episode_uuid} is no longer live: {detail}",
                               "call begin_episode for a new episode and use its key",
                               headers=_CHALLENGE)
        raise self._relay(response.status_code, content, response.headers)

    # ------------------------------------------------------------------ private

    def _authorize_key(self, key: str | None) -> str:
        if not key:
            raise Unauthorized("missing episode key",
                               "use the openai_api_key returned by begin_episode as the API key",
                               headers=_CHALLENGE)
        try:
            claims = self.signer.verify(key)
        except InvalidEpisodeKey as exc:
            hint = ("call begin_episode for a new episode" if exc.expired else
                    "use the openai_api_key returned by begin_episode on this server")
            raise Unauthorized(str(exc), hint, headers=_CHALLENGE) from exc
        entry = self._episodes.get(claims.episode_uuid)
        current = self.engine.current_run_id()
        if entry is None or entry.run_id != claims.run_id:
            raise Unauthorized("unknown episode for this key",
                               "call begin_episode for a new episode", headers=_CHALLENGE)
        if entry.run_id != current:
            raise Unauthorized(
                f"episode {claims.episode_uuid} belongs to engine run {entry.run_id}, which is "
                "no longer serving", "call begin_episode for a new episode", headers=_CHALLENGE)
        if entry.ended:
            raise Unauthorized(f"episode {claims.episode_uuid} has ended",
                               "call begin_episode for a new episode", headers=_CHALLENGE)
        return claims.episode_uuid

    def _live_entry(self, episode_uuid: str, action: str) -> _Entry:
        entry = self._episodes.get(episode_uuid)
        if entry is None:
            raise NotFound(f"unknown episode {episode_uuid!r}",
                           "pass the episode_uuid that begin_episode returned")
        current = self.engine.current_run_id()
        if entry.run_id != current:
            raise NotFound(
                f"episode {episode_uuid} belongs to engine run {entry.run_id}; the engine now "
                f"runs {current or 'nothing'}", "its reward cannot be used; begin a new episode")
        if entry.ended:
            raise EngineRelayedError(409, f"cannot {action} episode {episode_uuid}: it has "
                                          "already ended", "call begin_episode for a new episode")
        return entry

    async def _target(self, action: str) -> tuple[str, httpx.AsyncClient]:
        socket_path, run_id = self.engine.engine_socket(), self.engine.current_run_id()
        if socket_path is None or run_id is None:
            state = self.engine.state
            raise EngineStateError(
                f"engine is {state}: cannot {action}",
                "start the engine (start_engine) and wait for ENGINE.ROLLING"
                if state == EngineState.OFFLINE else
                "retry in about 1 s; episodes are served once the engine is ENGINE.ROLLING",
                headers={"Retry-After": "1"})
        if self._client is None or self._client_for != (run_id, socket_path):
            await self.aclose()
            self._client = httpx.AsyncClient(
                transport=httpx.AsyncHTTPTransport(uds=str(socket_path)),
                base_url="http://engine", timeout=self.settings.engine_request_timeout_s)
            self._client_for = (run_id, socket_path)
            # entries of earlier runs can never be used again
            self._episodes = {k: e for k, e in self._episodes.items() if e.run_id == run_id}
        return run_id, self._client

    async def _post_json(self, client: httpx.AsyncClient, path: str, payload: dict[str, Any]
                         ) -> dict[str, Any]:
        try:
            response = await client.post(path, json=payload)
        except httpx.TransportError as exc:
            raise self._unreachable(path.strip("/"), exc) from exc
        if response.status_code != 200:
            raise self._relay(response.status_code, response.content, response.headers)
        data = response.json()
        if not isinstance(data, dict):
            raise EngineRelayedError(502, f"engine answered {path} with a non-object",
                                     "see GET /runs/current/logs")
        return data

    def _relay(self, status: int, content: bytes, headers: Mapping[str, str]) -> ApiError:
        detail, hint, param = _error_parts(content)
        if status >= 500:
            log.warning("engine answered %d: %s", status, detail)
            if status == 503:  # engine not ready (no policy yet, shutting down)
                return EngineStateError(detail, hint or "retry when the engine is ENGINE.ROLLING")
            return EngineRelayedError(502, f"engine error: {detail}",
                                      hint or "see the engine log: GET /runs/current/logs")
        extra = {"Retry-After": headers["retry-after"]} if "retry-after" in headers else None
        return EngineRelayedError(status, detail, hint, headers=extra, param=param)

    def _unreachable(self, action: str, exc: Exception) -> EngineStateError:
        return EngineStateError(
            f"engine did not answer {action} ({type(exc).__name__}); it is {self.engine.state}",
            "check get_engine_status; retry once the engine is ENGINE.ROLLING",
            headers={"Retry-After": "1"})

    def _prune(self) -> None:
        now = time.time()
        if now - self._last_prune < _PRUNE_EVERY_S:
            return
        self._last_prune = now
        self._episodes = {k: e for k, e in self._episodes.items() if e.expires_at > now}


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
