"""Episode API keys: HMAC-signed, per episode, expiring.

`begin_episode` hands a rollout worker an OpenAI `api_key` that is good for exactly one
episode of one engine run until it expires:

    ajep_<payload>.<signature>
    payload   = base64url(JSON {"r": run_id, "e": episode_uuid, "x": expiry unix seconds})
    signature = base64url(HMAC-SHA256(secret, payload))

The secret is random per server process, so a server restart voids every key (the
engine it ran is gone too). A key proves only that this server issued it: the gateway
still looks the episode up by id in its own table and refuses ended ones
(`swarm_server.episodes`). Verification is constant-time and says nothing about why a
key failed beyond "invalid" or "expired".
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import json
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["KEY_PREFIX", "EpisodeClaims", "EpisodeKeySigner", "InvalidEpisodeKey"]

KEY_PREFIX = "ajep_"
_MAX_KEY_LEN = 1024


class InvalidEpisodeKey(Exception):
    """The key is malformed, forged, for another server, or expired (`expired`)."""

    def __init__(self, message: str, *, expired: bool = False) -> None:
        super().__init__(message)
        self.expired = expired


@dataclass(frozen=True)
class EpisodeClaims:
    run_id: str
    episode_uuid: str
    expires_at: float


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


class EpisodeKeySigner:
    """Signs and verifies episode keys with one secret (random unless given)."""

    def __init__(self, *, ttl_s: float, secret: bytes | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        self.ttl_s = ttl_s
        self._secret = secret or secrets.token_bytes(32)
        self._clock = clock

    def sign(self, run_id: str, episode_uuid: str) -> tuple[str, float]:
        """A key for this episode and its expiry (unix seconds)."""
        expires_at = float(int(self._clock() + self.ttl_s))
        payload = _b64(json.dumps({"r": run_id, "e": episode_uuid, "x": expires_at},
                                  separators=(",", ":"), sort_keys=True).encode())
        return f"{KEY_PREFIX}{payload}.{self._signature(payload)}", expires_at

    def verify(self, key: str) -> EpisodeClaims:
        """The claims of a genuine, unexpired key; else `InvalidEpisodeKey`."""
        if (not key.isascii() or not key.startswith(KEY_PREFIX) or len(key) > _MAX_KEY_LEN
                or key.count(".") != 1):
            raise InvalidEpisodeKey("not an episode key")
        payload, signature = key[len(KEY_PREFIX):].split(".")
        if not hmac.compare_digest(signature.encode(), self._signature(payload).encode()):
            raise InvalidEpisodeKey("episode key signature does not match")
        try:
            data = json.loads(_unb64(payload))
            claims = EpisodeClaims(run_id=str(data["r"]), episode_uuid=str(data["e"]),
                                   expires_at=float(data["x"]))
        except (ValueError, KeyError, TypeError, binascii.Error) as exc:
            # a valid signature over a bad payload: only possible with our own secret
            raise InvalidEpisodeKey("episode key payload is malformed") from exc
        if self._clock() >= claims.expires_at:
            raise InvalidEpisodeKey("episode key has expired", expired=True)
        return claims

    def _signature(self, payload: str) -> str:
        return _b64(hmac.new(self._secret, payload.encode("ascii"), hashlib.sha256).digest())
