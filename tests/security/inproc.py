"""An enforcing swarm server in this process (`TestClient(create_app(settings))`), for the
security tests where a socket is not the point: snapshots uploaded as zips, approver and
control calls, and console sign-ins through the same app.
"""

from __future__ import annotations

import io
import re
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from fastapi import FastAPI
from fastapi.testclient import TestClient

from swarm_server.main import create_app
from swarm_server.settings import Settings
from tests.support import APPROVER_NAME, APPROVER_TOKEN, CONTROL_TOKEN, WORKER_TOKEN

#: A second approver, to tell who decided what.
BOB_TOKEN = "test-approver-token-bob"


@dataclass
class InProc:
    app: FastAPI
    settings: Settings
    http: TestClient

    @property
    def ctx(self) -> Any:
        return self.app.state.ctx

    def call(self, method: str, path: str, token: str | None = CONTROL_TOKEN,
             **kw: Any) -> httpx.Response:
        headers = dict(kw.pop("headers", {}) or {})
        if token is not None:
            headers["Authorization"] = f"Bearer {token}"
        return self.http.request(method, path, headers=headers, **kw)

    def upload(self, files: dict[str, Any]) -> str:
        """Sync a zip of `files` (paths under ajet/) with the control token; its snapshot id."""
        buf = io.BytesIO()
        with zipfile.ZipFile(buf, "w") as z:
            for name, text in files.items():
                z.writestr(name, text)
        r = self.call("POST", "/sync_train_code", content=buf.getvalue(),
                      headers={"Content-Type": "application/zip"})
        body = r.json()
        if r.status_code == 409:  # stored, pending: the refusal names it
            return str(body["detail"]["snapshot_id"])
        assert r.status_code == 200, body
        return str(body["snapshot_id"])

    def decide(self, snapshot_id: str, verb: str, token: str = APPROVER_TOKEN,
               note: str = "") -> httpx.Response:
        return self.call("POST", f"/approvals/{snapshot_id}/{verb}", token=token,
                         json={"snapshot_id": snapshot_id, "note": note})

    def activate(self, snapshot_id: str) -> httpx.Response:
        return self.call("POST", "/code/activate", json={"snapshot_id": snapshot_id})

    def state(self, snapshot_id: str) -> dict[str, Any]:
        r = self.call("GET", f"/approvals/{snapshot_id}", token=APPROVER_TOKEN,
                      params={"limit": 1})
        assert r.status_code == 200, r.text
        return dict(r.json()["approval"])

    def sign_in(self, token: str, **headers: str) -> httpx.Response:
        return self.http.post("/ui/login", data={"token": token}, headers=headers,
                              follow_redirects=False)


def tiny_ajet(marker: str) -> dict[str, str]:
    """A small ajet/ tree whose content depends on `marker`."""
    return {"ajet/__init__.py": '"""tiny"""\n', "ajet/mod.py": f"MARK = {marker!r}\n"}


def csrf_of(html: str) -> str:
    found = re.search(r'name="csrf" value="([^"]+)"', html)
    assert found, "no CSRF field on the page"
    return found.group(1)


@contextmanager
def inproc_server(workdir: Path, **settings_kw: Any) -> Iterator[InProc]:
    """An enforcing server (control, worker, approvers alice and bob) in this process."""
    kw: dict[str, Any] = {
        "token": CONTROL_TOKEN, "worker_token": WORKER_TOKEN,
        "approver_tokens": f"{APPROVER_NAME}={APPROVER_TOKEN},bob={BOB_TOKEN}",
        "warm_standby": False}
    kw.update(settings_kw)
    settings = Settings(workdir=workdir, **kw)
    app = create_app(settings)
    with TestClient(app) as http:
        yield InProc(app, settings, http)
