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
#: The payload's JSON (`json.dumps` with these options builds an encoder per call).
_CLAIMS_JSON = json.JSONEncoder(separators=(",", ":"), sort_keys=True)


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


# base64url with C calls only (`base64.urlsafe_*` wrap the same in Python calls); every
# `/v1/*` request verifies a key, so its cost is per call of the episode plane
_TO_URLSAFE = bytes.maketrans(b"+/", b"-_")
_FROM_URLSAFE = bytes.maketrans(b"-_", b"+/")


def _b64(data: bytes) -> str:
    return binascii.b2a_base64(data, newline=False).translate(_TO_URLSAFE).rstrip(
        b"=").decode("ascii")


def _unb64(text: str) -> bytes:
    return binascii.a2b_base64((text + "=" * (-len(text) % 4)).encode("ascii").translate(
        _FROM_URLSAFE))


class EpisodeKeySigner:
    """Signs and verifies episode keys with one secret (random unless given)."""

    def __init__(self, *, ttl_s: float, secret: bytes | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        self.ttl_s = ttl_s
        self._secret = secret or secrets.token_bytes(32)
        # keyed once; each signature copies it (OpenSSL 3 looks the digest up again on
        # every one-shot HMAC, a measurable part of verifying a key per request)
        self._mac = hmac.new(self._secret, digestmod=hashlib.sha256)
        self._clock = clock

    def sign(self, run_id: str, episode_uuid: str) -> tuple[str, float]:
        """A key for this episode and its expiry (unix seconds)."""
        expires_at = float(int(self._clock() + self.ttl_s))
        payload = _b64(_CLAIMS_JSON.encode({"r": run_id, "e": episode_uuid,
                                            "x": expires_at}).encode())
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
            data = json.loads(_unb64(payload).decode("utf-8"))  # text: no encoding sniffing
            claims = EpisodeClaims(run_id=str(data["r"]), episode_uuid=str(data["e"]),
                                   expires_at=float(data["x"]))
        except (ValueError, KeyError, TypeError, binascii.Error) as exc:
            # a valid signature over a bad payload: only possible with our own secret
            raise InvalidEpisodeKey("episode key payload is malformed") from exc
        if self._clock() >= claims.expires_at:
            raise InvalidEpisodeKey("episode key has expired", expired=True)
        return claims

    def _signature(self, payload: str) -> str:
        mac = self._mac.copy()
        mac.update(payload.encode("ascii"))
        return _b64(mac.digest())
