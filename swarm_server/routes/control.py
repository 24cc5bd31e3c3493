"""Routes: control (placeholder until its owner fills it in; see docs/internals.md)."""

from fastapi import APIRouter

router = APIRouter()


@router.get("/health")
def health() -> dict[str, bool]:
    return {"ok": True}
