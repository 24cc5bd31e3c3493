"""Routes: runs (placeholder until its owner fills it in; see docs/internals.md)."""

from fastapi import APIRouter

router = APIRouter()
