"""Row 1: incremental code sync of the 150-file, 1.5 MB tree on loopback, against the zip.

    python -m bench --only sync

Three cases, each against the one-shot zip (`ajet.packaging.build_zip` +
`SwarmClient.sync_train_code`, i.e. `POST /sync_train_code`) of the same tree:

- first push: a fresh server (no blobs) each repetition;
- unchanged push: the tree the server already runs; also counts the HTTP requests and
  request-body bytes the client sent (the target is one round trip, nothing uploaded);
- one file changed: one filler module edited before each push; the blob bytes sent
  against that file's size (target: at most the file plus 2 KB).

Times are client wall time including packaging (`git ls-files`, hashing), as a user
waits for them; the unchanged case also reports the manifest round trip alone.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import httpx

from ajet.client import SwarmClient
from ajet.packaging import build_zip, package_tree
from bench.context import BenchContext
from bench.harness import LocalServer
from bench.report import Row, timed
from bench.tree import BenchTree, edit_one_file, restore_tree

__all__ = ["run"]

RERUN = "python -m bench --only sync"
#: Allowance over the changed file's size for a one-file push (DESIGN "Budgets").
EXTRA_BYTES = 2048
UNCHANGED_TARGET_MS = 50.0


@dataclass
class _Wire:
    """Requests a `SwarmClient` sent, and their body bytes, by path."""

    requests: list[tuple[str, int]] = field(default_factory=list)

    def hook(self, request: httpx.Request) -> None:
        self.requests.append((request.url.path, len(request.content)))

    def reset(self) -> None:
        self.requests.clear()

    def body_bytes(self, path: str | None = None) -> int:
        return sum(n for p, n in self.requests if path is None or p == path)


def _watched(client: SwarmClient) -> _Wire:
    wire = _Wire()
    # the bench reaches into the client's httpx.Client to count what goes on the wire
    client._http.event_hooks["request"].append(wire.hook)
    return wire


def _zip_push(client: SwarmClient, tree: BenchTree, dest: Path) -> float:
    """Seconds for the one-shot path: package, zip, POST /sync_train_code."""
    t0 = time.perf_counter()
    build_zip(package_tree(tree.root), dest)
    client.push_code_zip(dest)
    return time.perf_counter() - t0


def _ms(samples: list[float]) -> float:
    return statistics.median(samples) * 1000


def run(ctx: BenchContext) -> list[Row]:
    tree = ctx.tree
    restore_tree(tree)
    reps = ctx.reps
    size = f"{tree.files} files, {tree.total_bytes / 1e6:.2f} MB"

    # -- first push: every repetition on a fresh server, incremental then zip
    first: list[float] = []
    zip_first: list[float] = []
    for _ in range(reps):
        with LocalServer(ctx.path("sync-first")) as server, server.client() as client:
            first.append(timed(partial(client.push_code, tree.root)))
        work = ctx.path("sync-first-zip")
        with LocalServer(work) as server, server.client() as client:
            zip_first.append(_zip_push(client, tree, work / "tree.zip"))

    with LocalServer(ctx.path("sync")) as server, server.client() as client:
        wire = _watched(client)
        client.push_code(tree.root)
        zip_path = server.workdir / "tree.zip"

        # -- unchanged push: what goes on the wire, and how long it takes
        unchanged: list[float] = []
        manifest_rt: list[float] = []
        packaging: list[float] = []
        requests: list[int] = []
        uploaded: list[int] = []
        for _ in range(reps):
            wire.reset()
            t0 = time.perf_counter()
            result = client.push_code(tree.root)
            unchanged.append(time.perf_counter() - t0)
            manifest_rt.append(result.timings["manifest_s"])
            packaging.append(result.timings["package_s"])
            requests.append(len(wire.requests))
            uploaded.append(wire.body_bytes("/code/blobs") + result.bytes_uploaded)
        zip_unchanged = [_zip_push(client, tree, zip_path) for _ in range(reps)]

        # -- one file changed: a new edit before each push (incremental and zip alike)
        changed: list[float] = []
        over: list[int] = []
        file_sizes: list[int] = []
        zip_changed: list[float] = []
        for i in range(reps):
            file_size = edit_one_file(tree, f"incremental {i}")
            wire.reset()
            t0 = time.perf_counter()
            result = client.push_code(tree.root)
            changed.append(time.perf_counter() - t0)
            if result.files != 1:
                raise RuntimeError(f"a one-file edit uploaded {result.files} blobs, expected 1")
            over.append(wire.body_bytes("/code/blobs") - file_size)
            file_sizes.append(file_size)
            edit_one_file(tree, f"zip {i}")
            zip_changed.append(_zip_push(client, tree, zip_path))
        restore_tree(tree)

    req = statistics.median(requests)
    up = statistics.median(uploaded)
    over_median = statistics.median(over)
    return [
        Row(f"sync first push ({size})", _ms(first), "ms", "zip POST /sync_train_code",
            _ms(zip_first), rerun=RERUN, repetitions=reps, note="fresh server each time"),
        Row("sync unchanged push", _ms(unchanged), "ms", "zip POST /sync_train_code",
            _ms(zip_unchanged), target=f"<= {UNCHANGED_TARGET_MS:.0f} ms", rerun=RERUN,
            repetitions=reps, met=_ms(unchanged) <= UNCHANGED_TARGET_MS,
            note="client wall time, packaging included"),
        Row("sync unchanged push: manifest round trip", _ms(manifest_rt), "ms",
            target=f"<= {UNCHANGED_TARGET_MS:.0f} ms", rerun=RERUN, repetitions=reps,
            met=_ms(manifest_rt) <= UNCHANGED_TARGET_MS, note="POST /code/manifest"),
        Row("sync unchanged push: packaging", _ms(packaging), "ms", rerun=RERUN,
            repetitions=reps, note="client side: git ls-files, sha256 of every file, provenance"),
        Row("sync unchanged push: HTTP requests", req, "requests", target="1",
            rerun=RERUN, repetitions=reps, met=max(requests) == 1),
        Row("sync unchanged push: blob bytes uploaded", up, "B", target="0", rerun=RERUN,
            repetitions=reps, met=max(uploaded) == 0),
        Row("sync one file changed", _ms(changed), "ms", "zip POST /sync_train_code",
            _ms(zip_changed), rerun=RERUN, repetitions=reps,
            note=f"one ~{statistics.median(file_sizes) / 1e3:.0f} KB file"),
        Row("sync one file changed: upload body bytes - file size", over_median, "B",
            target=f"<= {EXTRA_BYTES} B", rerun=RERUN, repetitions=reps,
            met=max(over) <= EXTRA_BYTES, note="POST /code/blobs bodies"),
    ]
