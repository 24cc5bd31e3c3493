"""Routes: the API schema and its pages (`/openapi.json`, `/docs`, `/redoc`), reader token;
and the server's index (`/`), for a reader token or an episode key (`deps.IndexAuth`).

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

from swarm_server.deps import IndexAuth, ReaderAuth

__all__ = ["router"]

router = APIRouter(include_in_schema=False)

OPENAPI_URL = "/openapi.json"
OAUTH2_REDIRECT_URL = "/docs/oauth2-redirect"


@router.api_route("/", methods=["GET", "HEAD"])
async def index(request: Request, _: IndexAuth) -> JSONResponse:
    """Where things are. Harnesses that know only a base URL and a key (Claude Code with
    `ANTHROPIC_BASE_URL`) probe it before their first call."""
    return JSONResponse({"service": request.app.title, "version": request.app.version,
                         "docs": "/docs", "episode_plane": {
                             "openai_base_url": "/v1", "anthropic_base_url": "/",
                             "routes": ["/v1/chat/completions", "/v1/completions",
                                        "/v1/responses", "/v1/messages",
                                        "/v1/messages/count_tokens", "/v1/models"]}})


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
