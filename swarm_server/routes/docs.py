"""Routes: the API schema and its pages (`/openapi.json`, `/docs`, `/redoc`), reader token.

FastAPI's own schema routes carry no dependency, so they would answer anyone the first
gate lets through, an approver token included. Served here instead, they declare their
requirement like every other route (`deps.ReaderAuth`: the worker or control token).
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.openapi.docs import (
    get_redoc_html,
    get_swagger_ui_html,
    get_swagger_ui_oauth2_redirect_html,
)
from fastapi.responses import HTMLResponse, JSONResponse

from swarm_server.deps import ReaderAuth

__all__ = ["router"]

router = APIRouter(include_in_schema=False)

OPENAPI_URL = "/openapi.json"
OAUTH2_REDIRECT_URL = "/docs/oauth2-redirect"


@router.get(OPENAPI_URL)
async def openapi(request: Request, _: ReaderAuth) -> JSONResponse:
    return JSONResponse(request.app.openapi())


@router.get("/docs")
async def swagger(request: Request, _: ReaderAuth) -> HTMLResponse:
    return get_swagger_ui_html(openapi_url=OPENAPI_URL, title=f"{request.app.title} - docs",
                               oauth2_redirect_url=OAUTH2_REDIRECT_URL)


@router.get(OAUTH2_REDIRECT_URL)
async def swagger_redirect(_: ReaderAuth) -> HTMLResponse:
    return get_swagger_ui_oauth2_redirect_html()


@router.get("/redoc")
async def redoc(request: Request, _: ReaderAuth) -> HTMLResponse:
    return get_redoc_html(openapi_url=OPENAPI_URL, title=f"{request.app.title} - ReDoc")
