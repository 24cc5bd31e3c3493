"""`SnapshotStore`: the content-addressed blob store and the immutable code snapshots.

Layout under the server's workdir::

    ajet_temp/<YYYYmmdd_HHMMSS_ffffff>/ajet/...   one snapshot (immutable, precompiled)
    ajet_temp/<timestamp>.partial/                being written, or being deleted
    ajet_temp/.blobs/<sha[:2]>/<sha256>           one verified file content per hash
    ajet_temp/.pyc/<cache tag>/<sha256>.pyc       bytecode per source content (a cache)
    ajet_temp/.incoming/<random>/                 temp files of uploads in progress

Everything code sync writes stays under `ajet_temp/` (the three dot-folders are made
at start), so an upload, refused or not, never writes anywhere else on the server.

A snapshot is materialised from blobs (each re-hashed as it is copied) into
`<timestamp>.partial/ajet`, compiled to bytecode by the engine's interpreter, and only
then renamed into place, so a crash or a refusal never leaves a half-written snapshot
where the engine could find it (`recover()` removes `*.partial`). Its id is the hash of
its canonical manifest (`ajet.packaging.snapshot_id_of`): syncing an identical tree
reuses the existing folder. Rows live in the ledger; the active snapshot id in ledger
meta `active_snapshot` (absent = the server's own code, `protocol.SERVER_CODE`).

Garbage collection keeps the newest `keep` snapshots, the active one and every snapshot
a run in the ledger used (runs are the lasting record of results, so their code stays
reproducible), and every snapshot `pinned` names (the ones pending review: an approver
reviewing one must never find it replaced by another upload with the same prefix), and
removes blobs no kept snapshot references once older than a grace
period (so blobs uploaded for a commit still to come are not swept away).
"""

from __future__ import annotations

import datetime as dt
import hashlib
import logging
import os
import py_compile
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from ajet.packaging import file_kind_problem, member_path_problem, snapshot_id_of, tree_problems
from ajet.protocol import SERVER_CODE, FileEntry, GCResult, Provenance, SnapshotPublic
from ajet.errors import PayloadTooLarge, SwarmNotFound, SwarmValidationError
from swarm_server.ledger import Ledger, SnapshotRecord
from swarm_server.settings import Settings
from swarm_server.supervisor import child_env
from swarm_server.uploads import StagedBlob, check_free_disk
from swarm_server.workdir import owner_only

__all__ = ["ACTIVE_META_KEY", "SnapshotStore"]

log = logging.getLogger(__name__)

ACTIVE_META_KEY = "active_snapshot"
_ALLOWED_MODES = (0o644, 0o755)
_CHUNK = 1024 * 1024
#: Provenance is shown to humans; a server keeps a bounded amount of it.
_MAX_DIFF_CHARS = 256 * 1024
_MAX_UNTRACKED_NAMES = 1000
#: Default age below which an unreferenced blob survives GC (a commit may still use it).
BLOB_GRACE_S = 3600.0
_COMPILE_TIMEOUT_S = 300.0
#: Snapshots never change, so their bytecode need not be checked against the source.
_UNCHECKED = py_compile.PycInvalidationMode.UNCHECKED_HASH
_MIN_PREFIX = 4


class SnapshotStore:
    """Blobs and snapshots on disk, their rows in the ledger, and which one is active."""

    def __init__(self, settings: Settings, ledger: Ledger) -> None:
        self.settings = settings
        self.ledger = ledger
        self._workdir = settings.workdir.resolve()
        # One lock for every change on disk: materialise, activate, GC never interleave.
        self._lock = threading.RLock()
        self._tag: str | None = None  # the engine interpreter's bytecode cache tag
        #: Ids GC must keep whoever asks (set by `main.build_context`: pending reviews).
        self.pinned: Callable[[], set[str]] = set
        #: Called on each new snapshot folder (`EngineUser.share_snapshot` under
        #: `--engine-user`: the engine's group may read it).
        self.share: Callable[[Path], None] | None = None

    # ------------------------------------------------------------------ paths

    @property
    def workdir(self) -> Path:
        return self._workdir

    @property
    def snapshots_dir(self) -> Path:
        return self.workdir / "ajet_temp"

    @property
    def blobs_dir(self) -> Path:
        return self.snapshots_dir / ".blobs"

    @property
    def pyc_dir(self) -> Path:
        return self.snapshots_dir / ".pyc"

    @property
    def incoming_dir(self) -> Path:
        return self.snapshots_dir / ".incoming"

    def blob_path(self, sha256: str) -> Path:
        return self.blobs_dir / sha256[:2] / sha256

    def folder(self, record: SnapshotRecord) -> Path:
        """Absolute path of the snapshot's `ajet/` folder."""
        return self.workdir / record.path

    # ------------------------------------------------------------------ engine seam

    def recover(self) -> None:
        """Remove leftovers of interrupted work; forget snapshots whose folder vanished."""
        with self._lock:
            if self.snapshots_dir.is_dir():
                for partial in self.snapshots_dir.glob("*.partial"):
                    log.warning("removing interrupted snapshot folder %s", partial)
                    shutil.rmtree(partial, ignore_errors=True)
            shutil.rmtree(self.incoming_dir, ignore_errors=True)
            for folder in (self.incoming_dir, self.blobs_dir, self.pyc_dir):
                folder.mkdir(parents=True, exist_ok=True)
            for rec in self.ledger.list_snapshots():
                if not self.folder(rec).is_dir():
                    log.warning("snapshot %s: folder %s is gone; dropping its record",
                                rec.id[:12], rec.path)
                    self.ledger.delete_snapshot(rec.id)
            active = self.ledger.get_meta(ACTIVE_META_KEY)
            if active and active != SERVER_CODE and self.ledger.get_snapshot(active) is None:
                log.warning("active snapshot %s is gone; the server's own code is active now",
                            active[:12])
                self.ledger.set_meta(ACTIVE_META_KEY, None)

    def active(self) -> SnapshotRecord | None:
        """The active snapshot, or None when the server's own code is active."""
        active = self.ledger.get_meta(ACTIVE_META_KEY)
        if not active or active == SERVER_CODE:
            return None
        rec = self.ledger.get_snapshot(active)
        if rec is None or not self.folder(rec).is_dir():
            log.warning("active snapshot %s is missing on disk; using the server's own code",
                        active[:12])
            return None
        return rec

    def active_id(self) -> str:
        rec = self.active()
        return rec.id if rec else SERVER_CODE

    def base_dir(self, record: SnapshotRecord) -> Path:
        """The folder that contains the snapshot's `ajet/`: ISOLATED_AGENTJET_BASE_DIR."""
        return self.folder(record).parent

    def activate(self, snapshot_id: str) -> SnapshotRecord | None:
        """Make `snapshot_id` (exact id, or 'server') the active code. Only call this
        inside `EngineController.swap_code`, which guarantees the engine is down."""
        with self._lock:
            if snapshot_id == SERVER_CODE:
                self.ledger.set_meta(ACTIVE_META_KEY, None)
                log.info("activated the server's own code")
                return None
            rec = self.get(snapshot_id)
            if rec is None:
                raise SwarmNotFound(404, f"no snapshot {snapshot_id} on this server",
                                    "GET /code/snapshots lists the snapshots")
            self.ledger.set_meta(ACTIVE_META_KEY, rec.id)
            log.info("activated snapshot %s at ./%s", rec.id[:12], rec.path)
            return rec

    # ------------------------------------------------------------------ lookups

    def get(self, snapshot_id: str) -> SnapshotRecord | None:
        """A snapshot by exact id, if its row and its folder both exist."""
        rec = self.ledger.get_snapshot(snapshot_id)
        if rec is None or not self.folder(rec).is_dir():
            return None
        return rec

    def resolve(self, ref: str) -> SnapshotRecord | None:
        """A snapshot by id or unique prefix (>= 4 hex chars); 'server' gives None."""
        if ref == SERVER_CODE:
            return None
        ref = ref.strip().lower()
        if len(ref) < _MIN_PREFIX or any(c not in "0123456789abcdef" for c in ref):
            raise SwarmValidationError(
                400, f"{ref!r} is not a snapshot id, a prefix of at least {_MIN_PREFIX} "
                f"hex characters, or '{SERVER_CODE}'",
                "GET /code/snapshots lists the snapshot ids")
        matches = [r for r in self.ledger.find_snapshots(ref) if self.folder(r).is_dir()]
        if not matches:
            raise SwarmNotFound(
                404, f"no snapshot matches {ref!r}", "GET /code/snapshots lists them")
        if len(matches) > 1:
            raise SwarmValidationError(400, f"{ref!r} matches {len(matches)} snapshots",
                                       "give more characters of the snapshot id")
        return matches[0]

    def records(self) -> list[SnapshotRecord]:
        """Snapshots present on disk, newest first."""
        return [r for r in self.ledger.list_snapshots() if self.folder(r).is_dir()]

    def public(self, rec: SnapshotRecord, *, files: bool = False) -> SnapshotPublic:
        return SnapshotPublic(
            snapshot_id=rec.id, path=rec.path, created=rec.created, file_count=rec.file_count,
            total_bytes=rec.total_bytes, active=rec.id == self.active_id(),
            provenance=Provenance.model_validate(rec.provenance), approved_by=rec.approved_by,
            files=[FileEntry.model_validate(e) for e in rec.manifest] if files else None,
        )

    # ------------------------------------------------------------------ blobs

    def has_blob(self, sha256: str) -> bool:
        return self.blob_path(sha256).is_file()

    def missing_blobs(self, entries: Sequence[FileEntry]) -> list[str]:
        """Distinct hashes of `entries` absent from the store, in manifest order.

        Present blobs are touched, so GC's grace period protects them until the commit
        that this question usually precedes.
        """
        missing: dict[str, None] = {}
        checked: set[str] = set()
        for e in entries:
            if e.sha256 in checked:
                continue
            checked.add(e.sha256)
            try:
                os.utime(self.blob_path(e.sha256))
            except FileNotFoundError:
                missing[e.sha256] = None
            except PermissionError:  # present but not ours to touch: still present
                pass
        return list(missing)

    def adopt_blobs(self, staged: Sequence[StagedBlob]) -> list[str]:
        """Move verified temp files into the store (atomic per blob); returns new hashes."""
        added: list[str] = []
        for blob in staged:
            dest = self.blob_path(blob.sha256)
            if dest.is_file():
                continue
            dest.parent.mkdir(parents=True, exist_ok=True)
            os.chmod(blob.path, 0o400)  # immutable, and private (swarm_server.workdir)
            os.replace(blob.path, dest)
            added.append(blob.sha256)
        return added

    def discard_blobs(self, hashes: Sequence[str]) -> None:
        """Remove blobs just adopted for a refused upload, and a shard folder it emptied."""
        for sha in hashes:
            path = self.blob_path(sha)
            path.unlink(missing_ok=True)
            try:
                path.parent.rmdir()
            except OSError:
                pass  # other blobs share the shard

    @contextmanager
    def held(self) -> Iterator[None]:
        """Hold the store's lock: no GC or materialisation until the block ends (used
        around an activation, so the chosen snapshot cannot be collected meanwhile)."""
        with self._lock:
            yield

    @contextmanager
    def incoming(self) -> Iterator[Path]:
        """A fresh temp folder for one upload, removed when the block ends."""
        self.incoming_dir.mkdir(parents=True, exist_ok=True)
        path = Path(tempfile.mkdtemp(dir=self.incoming_dir))
        try:
            yield path
        finally:
            shutil.rmtree(path, ignore_errors=True)

    # ------------------------------------------------------------------ snapshots

    def validate_manifest(self, files: Sequence[FileEntry]) -> list[FileEntry]:
        """The manifest, checked against the naming rules and the server's caps."""
        s = self.settings
        if not files:
            raise SwarmValidationError(400, "empty manifest", "send at least one file under ajet/")
        if len(files) > s.max_files:
            raise PayloadTooLarge(413, f"{len(files)} files; the limit is {s.max_files}",
                                  "raise AJET_SWARM_MAX_FILES on the server")
        problems = [f"{e.path!r}: {why}" for e in files
                    if (why := member_path_problem(e.path) or file_kind_problem(
                        e.path, allow_extension_modules=s.allow_extension_modules))]
        problems += [f"{e.path}: mode {e.mode:o} (only 644 and 755)" for e in files
                     if e.mode not in _ALLOWED_MODES]
        if not problems:
            problems = tree_problems(e.path for e in files)
        if problems:
            shown = "; ".join(problems[:10])
            more = f" (and {len(problems) - 10} more)" if len(problems) > 10 else ""
            raise SwarmValidationError(
                400, f"manifest refused: {shown}{more}",
                "only regular files under ajet/ with plain POSIX names, and no "
                "file that runs without reviewable source (.pyc, __pycache__/, "
                ".pth; .so/.pyd unless the server allows them)")
        for e in files:
            if e.size > s.max_file_bytes:
                raise PayloadTooLarge(413, f"{e.path}: {e.size} bytes, over the {s.max_file_bytes}-"
                                      "byte file limit", "raise AJET_SWARM_MAX_FILE_BYTES")
        total = sum(e.size for e in files)
        if total > s.max_unpacked_bytes:
            raise PayloadTooLarge(413, f"{total} bytes in all; the limit is {s.max_unpacked_bytes}",
                                  "raise AJET_SWARM_MAX_UNPACKED_BYTES")
        return list(files)

    def materialise(self, files: Sequence[FileEntry], provenance: Provenance, *,
                    approved_by: str | None = None
                    ) -> tuple[SnapshotRecord, bool, dict[str, float]]:
        """The snapshot of a validated manifest whose blobs are all stored.

        Returns (record, reused, timings). An identical manifest reuses the existing
        folder. Otherwise the files are copied out of the store (each re-hashed),
        compiled, and renamed into place; a failure leaves nothing behind.
        """
        entries = list(files)
        snapshot_id = snapshot_id_of(entries)
        timings: dict[str, float] = {}
        with self._lock:
            existing = self.get(snapshot_id)
            if existing is not None:
                return existing, True, timings
            missing = self.missing_blobs(entries)
            if missing:
                raise SwarmValidationError(
                    400,
                    {"message": f"{len(missing)} blob(s) of the manifest are not on the server",
                     "missing": missing[:100]},
                    "POST /code/manifest, upload the missing blobs to POST /code/blobs, "
                    "then commit again",
                )
            # The caps were checked on the manifest's sizes; a size that lies about its
            # blob would let the real bytes pass max_file_bytes / max_unpacked_bytes.
            lying = [e.path for e in entries if self.blob_path(e.sha256).stat().st_size != e.size]
            if lying:
                raise SwarmValidationError(
                    400,
                    f"manifest size differs from the uploaded content for: {', '.join(lying[:10])}",
                    "send each file's real size (ajet.packaging.package_tree computes it)",
                )
            total = sum(e.size for e in entries)
            # Files plus bytecode: twice the sources is a generous bound.
            check_free_disk(self.snapshots_dir, needed=2 * total,
                            keep_free=self.settings.min_free_disk_bytes)
            name = self._new_folder_name()
            partial = (self.snapshots_dir / f"{name}.partial").resolve()
            final = self.snapshots_dir / name
            try:
                t0 = time.perf_counter()
                for e in entries:
                    self._copy_blob(e, partial)
                t1 = time.perf_counter()
                compiled = self._compile(entries, partial, final / "ajet")
                t2 = time.perf_counter()
                if self.share is not None:
                    self.share(partial)
                os.rename(partial, final)
            except BaseException:
                shutil.rmtree(partial, ignore_errors=True)
                raise
            timings = {"materialise_s": round(t1 - t0, 4), "compile_s": round(t2 - t1, 4)}
            rec = SnapshotRecord(
                id=snapshot_id, path=f"ajet_temp/{name}/ajet", created=time.time(),
                file_count=len(entries), total_bytes=total,
                manifest=[e.model_dump() for e in entries],
                provenance=_bounded(provenance).model_dump(mode="json"),
                approved_by=approved_by,
            )
            self.ledger.add_snapshot(rec)
            log.info("new snapshot %s at ./%s (%d files, %d bytes, %d compiled now)",
                     snapshot_id[:12], rec.path, len(entries), total, compiled)
            return rec, False, timings

    def gc(self, keep: int | None = None, *, blob_grace_s: float = BLOB_GRACE_S) -> GCResult:
        """Remove old snapshots and unreferenced blobs (see the module docstring)."""
        keep = keep if keep is not None else self.settings.keep_snapshots
        with self._lock:
            records = self.ledger.list_snapshots()  # newest first
            protected = {r.id for r in records[:keep]} | {self.active_id()}
            protected |= self.ledger.snapshot_ids_used_by_runs()
            protected |= self.pinned()
            removed: list[str] = []
            kept: list[SnapshotRecord] = []
            for rec in records:
                if rec.id in protected:
                    kept.append(rec)
                    continue
                self._remove_folder(rec)
                self.ledger.delete_snapshot(rec.id)
                removed.append(rec.id)
            referenced = {e["sha256"] for rec in kept for e in rec.manifest}
            removed_blobs = self._sweep_blobs(referenced, blob_grace_s)
            self._sweep_bytecode(referenced)
        if removed or removed_blobs:
            log.info("gc: removed %d snapshot(s) and %d blob(s); kept %d snapshot(s)",
                     len(removed), removed_blobs, len(kept))
        return GCResult(removed_snapshots=removed, removed_blobs=removed_blobs,
                        kept=[r.id for r in kept])

    # ------------------------------------------------------------------ private

    def _new_folder_name(self) -> str:
        self.snapshots_dir.mkdir(parents=True, exist_ok=True)
        while True:
            name = dt.datetime.now().strftime("%Y%m%d_%H%M%S_%f")
            if not (self.snapshots_dir / name).exists() and not (
                    self.snapshots_dir / f"{name}.partial").exists():
                return name
            time.sleep(0.000_01)

    def _copy_blob(self, entry: FileEntry, root: Path) -> None:
        dest = root / entry.path
        # The path passed member_path_problem; check once more as a last line of defence
        # (`root` is resolved and fresh, so only '..' or a symlink could escape it).
        if not os.path.realpath(dest.parent).startswith(str(root) + os.sep):
            raise SwarmValidationError(400, f"{entry.path}: escapes the snapshot folder")
        dest.parent.mkdir(parents=True, exist_ok=True)
        digest = hashlib.sha256()
        written = 0
        with open(self.blob_path(entry.sha256), "rb") as src, open(dest, "xb") as out:
            while chunk := src.read(_CHUNK):
                written += len(chunk)
                if written > entry.size:  # never write more than the caps were checked on
                    raise SwarmValidationError(
                        400, f"{entry.path}: content is larger than its manifest size")
                digest.update(chunk)
                out.write(chunk)
        if digest.hexdigest() != entry.sha256:
            raise SwarmValidationError(422, f"blob {entry.sha256} is corrupt in the server's store",
                                       "POST /code/gc, then sync again to re-upload it")
        os.chmod(dest, owner_only(entry.mode))  # 0o644 -> 0o600: private (swarm_server.workdir)

    def _compile(self, entries: Sequence[FileEntry], root: Path, shown_as: Path) -> int:
        """Bytecode for every `.py` of the snapshot at `root`; refuse a syntax error (422).

        Bytecode is made by the engine's interpreter, hash-based and unchecked (snapshots
        never change), and cached per source sha256 under `ajet_temp/.pyc/<cache tag>/`: a
        one-file edit compiles one file. `-s/-p` make messages name the final folder, not
        the `.partial` one (the import system fixes `co_filename` at load anyway).
        Returns how many files were compiled now.
        """
        tag = self._cache_tag()
        if tag is None:
            return 0  # bytecode is an optimisation: the engine imports from source
        cache = self.pyc_dir / tag
        todo: list[tuple[FileEntry, Path]] = []
        for e in entries:
            if not e.path.endswith(".py"):
                continue
            src = root / e.path
            pyc = src.parent / "__pycache__" / f"{src.name[:-3]}.{tag}.pyc"
            cached = cache / f"{e.sha256}.pyc"
            pyc.parent.mkdir(exist_ok=True)
            try:
                shutil.copyfile(cached, pyc)
            except FileNotFoundError:
                todo.append((e, pyc))
        if not todo:
            return 0
        if self._same_interpreter():
            self._compile_here(todo, root, shown_as)
        else:
            self._compile_in_engine_python(todo, root, shown_as)
        cache.mkdir(parents=True, exist_ok=True)
        for e, pyc in todo:
            if pyc.is_file():
                tmp = cache / f".{e.sha256}.{os.getpid()}.tmp"
                shutil.copyfile(pyc, tmp)
                os.replace(tmp, cache / f"{e.sha256}.pyc")
        return len(todo)

    def _compile_here(self, todo: Sequence[tuple[FileEntry, Path]], root: Path,
                      shown_as: Path) -> None:
        # The engine runs this very interpreter: compile in-process, no start-up cost.
        # (compile() only parses; nothing of the synced code runs here.)
        errors: list[str] = []
        for e, pyc in todo:
            shown = shown_as.parent / e.path
            try:
                py_compile.compile(str(root / e.path), cfile=str(pyc), dfile=str(shown),
                                   doraise=True, invalidation_mode=_UNCHECKED)
            except py_compile.PyCompileError as exc:
                errors.append(exc.msg)
        if errors:
            raise _compile_refusal("\n".join(errors), shown_as.parent)

    def _compile_in_engine_python(self, todo: Sequence[tuple[FileEntry, Path]], root: Path,
                                  shown_as: Path) -> None:
        ajet_root = root / "ajet"
        cmd = [self.settings.engine_python, "-I", "-m", "compileall", "-q",
               "--invalidation-mode", "unchecked-hash",
               "-s", str(ajet_root), "-p", str(shown_as), "-i", "-"]
        listing = "".join(f"{root / e.path}\n" for e, _ in todo)
        try:
            proc = subprocess.run(cmd, input=listing, capture_output=True, text=True,
                                  errors="replace", timeout=_COMPILE_TIMEOUT_S,
                                  env=child_env(os.environ))  # no token, like every child
        except (OSError, subprocess.TimeoutExpired) as exc:
            log.warning("could not precompile %s with %s: %s", root,
                        self.settings.engine_python, exc)
            return
        if proc.returncode != 0:
            text = (proc.stdout + proc.stderr).replace(str(ajet_root), str(shown_as))
            raise _compile_refusal(text, shown_as.parent)

    def _same_interpreter(self) -> bool:
        engine = shutil.which(self.settings.engine_python) or self.settings.engine_python
        return os.path.realpath(engine) == os.path.realpath(sys.executable)

    def _cache_tag(self) -> str | None:
        """`sys.implementation.cache_tag` of the engine's interpreter, found once."""
        if self._tag is None:
            if self._same_interpreter():
                self._tag = sys.implementation.cache_tag or ""
                return self._tag or None
            try:
                proc = subprocess.run(
                    [self.settings.engine_python, "-I", "-c",
                     "import sys; print(sys.implementation.cache_tag or '')"],
                    capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL,
                    env=child_env(os.environ))
                self._tag = proc.stdout.strip() if proc.returncode == 0 else ""
            except (OSError, subprocess.TimeoutExpired) as exc:
                log.warning("cannot run the engine interpreter %s: %s",
                            self.settings.engine_python, exc)
                self._tag = ""
        return self._tag or None

    def _remove_folder(self, rec: SnapshotRecord) -> None:
        folder = self.folder(rec).parent
        if not folder.is_dir():
            return
        # Rename first so a crash mid-delete leaves a .partial that recover() removes.
        doomed = folder.with_name(folder.name + ".partial")
        os.rename(folder, doomed)
        shutil.rmtree(doomed, ignore_errors=True)

    def _sweep_bytecode(self, referenced: set[str]) -> None:
        # Cached bytecode is derived data: drop it with the last snapshot that used it.
        if not self.pyc_dir.is_dir():
            return
        for pyc in self.pyc_dir.glob("*/*"):
            if pyc.name.startswith(".") or pyc.name.split(".", 1)[0] not in referenced:
                pyc.unlink(missing_ok=True)

    def _sweep_blobs(self, referenced: set[str], grace_s: float) -> int:
        if not self.blobs_dir.is_dir():
            return 0
        now = time.time()
        removed = 0
        for shard in self.blobs_dir.iterdir():
            if not shard.is_dir():
                continue
            for blob in shard.iterdir():
                if blob.name in referenced:
                    continue
                try:
                    if now - blob.stat().st_mtime < grace_s:
                        continue
                    blob.unlink()
                    removed += 1
                except FileNotFoundError:
                    continue
        return removed


def _compile_refusal(output: str, base: Path) -> SwarmValidationError:
    # Name files as ajet/..., the way the client knows them.
    output = output.replace(str(base) + os.sep, "")
    return SwarmValidationError(
        422, {"message": "the synced code does not compile", "output": output[-2000:]},
        "fix the syntax error(s) named above and sync again; nothing was activated",
    )


def _bounded(p: Provenance) -> Provenance:
    diff = p.diff
    if len(diff) > _MAX_DIFF_CHARS:
        diff = diff[:_MAX_DIFF_CHARS] + "\n... diff truncated by the server\n"
    names = p.untracked_left_out[:_MAX_UNTRACKED_NAMES]
    # the worker-view fields are the server's to set (routes/runs.py), never the client's
    return p.model_copy(update={"diff": diff, "untracked_left_out": names, "withheld": False,
                                "diff_bytes": None, "untracked_count": None})
