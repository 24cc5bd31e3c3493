"""The original's module path of its wire models (ajet/compat/wire.py)."""

from ajet.compat.wire import (
    CLIENT_ACTIVE_TIMEOUT,
    VALID_STATUSES,
    ActiveSwarmClient,
    AgreeSyncWeightRequest,
    BoolResponse,
    CanContinueEpisodeRequest,
    CanContinueEpisodeResponse,
    ClaimEpisodeRequest,
    ClaimEpisodeResponse,
    EndEpisodeRequest,
    EndEpisodeResponse,
    EpisodeBufferResponse,
    EpisodeStatus,
    SwarmClientInstruction,
    SwarmThrottlePolicy,
    SyncTrainConfigRequest,
)

__all__ = [
    "CLIENT_ACTIVE_TIMEOUT",
    "VALID_STATUSES",
    "ActiveSwarmClient",
    "AgreeSyncWeightRequest",
    "BoolResponse",
    "CanContinueEpisodeRequest",
    "CanContinueEpisodeResponse",
    "ClaimEpisodeRequest",
    "ClaimEpisodeResponse",
    "EndEpisodeRequest",
    "EndEpisodeResponse",
    "EpisodeBufferResponse",
    "EpisodeStatus",
    "SwarmClientInstruction",
    "SwarmThrottlePolicy",
    "SyncTrainConfigRequest",
]
