"""Hypothesis strategies for hostile uploads: zips, manifests and blob streams.

Every value drawn is hostile *by construction* (the attack is chosen first, then
dressed in random honest-looking content), so a test can demand a 4xx for each one
without asking the server's own rules which inputs are bad. Sizes are chosen against
`tests.support.hostile.HOSTILE_LIMITS` (20 files, 1 MiB per file, 4 MiB in all, ratio 100).
"""

from __future__ import annotations

import hashlib
import io
import stat
import warnings
import zipfile
from typing import Any

from hypothesis import strategies as st

from tests.support.hostile import blob_record, central_entries, manifest_entry, patch

__all__ = ["hostile_blob_streams", "hostile_manifests", "hostile_names", "hostile_zips"]

MAX_FILES = 20
MAX_FILE_BYTES = 1 << 20
MAX_UNPACKED = 4 << 20

_SEGMENT = st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789_-", min_size=1, max_size=8)
_CONTENT = st.binary(min_size=0, max_size=300)


@st.composite
def honest_names(draw: st.DrawFn, *, min_size: int = 0, max_size: int = 4) -> list[str]:
    """Distinct, case-distinct file names under ajet/ that no rule refuses."""
    names = draw(st.lists(st.lists(_SEGMENT, min_size=1, max_size=3), min_size=min_size,
                          max_size=max_size))
    out: list[str] = []
    for i, parts in enumerate(names):
        out.append("ajet/" + "/".join(parts[:-1] + [f"f{i}_{parts[-1]}.py"]))
    return out


@st.composite
def hostile_names(draw: st.DrawFn) -> str:
    """One file name that escapes, hides or smuggles: each refused by construction."""
    seg = draw(_SEGMENT)
    kind = draw(st.sampled_from([
        "dotdot", "absolute", "backslash", "control", "outside", "dot_git", "empty_part",
        "dot_part", "bare_ajet", "long_part",
    ]))
    if kind == "dotdot":
        depth = draw(st.integers(1, 4))
        return draw(st.sampled_from(["ajet/", "", "ajet/x/"])) + "../" * depth + seg
    if kind == "absolute":
        return "/" + draw(st.sampled_from(["ajet/", "etc/", "tmp/"])) + seg
    if kind == "backslash":
        return draw(st.sampled_from([f"ajet\\..\\{seg}", f"ajet/{seg}\\x", f"..\\ajet\\{seg}"]))
    if kind == "control":
        char = draw(st.sampled_from(["\x01", "\x1b", "\n", "\r", "\t", "\x7f"]))
        return f"ajet/{seg}{char}x.py"
    if kind == "outside":
        return draw(st.sampled_from(["setup.py", f"{seg}/x.py", f"ajet_{seg}/x.py",
                                     f"Ajet/{seg}.py", f"tests/{seg}.py"]))
    if kind == "dot_git":
        return f"ajet/.git/{draw(st.sampled_from(['config', 'hooks/post-checkout', seg]))}"
    if kind == "empty_part":
        return f"ajet//{seg}.py"
    if kind == "dot_part":
        return f"ajet/./{seg}.py"
    if kind == "bare_ajet":
        return "ajet"
    return f"ajet/{'a' * 256}/{seg}.py"


def _colliding_pair(draw: st.DrawFn) -> tuple[str, str]:
    seg = draw(_SEGMENT.filter(lambda s: s.lower() != s.upper()))
    kind = draw(st.sampled_from(["duplicate", "case", "unicode", "file_and_folder"]))
    if kind == "duplicate":
        return f"ajet/{seg}.py", f"ajet/{seg}.py"
    if kind == "case":
        return f"ajet/{seg}.py", f"ajet/{seg.upper()}.py"
    if kind == "unicode":  # NFC and NFD spellings of the same name
        return f"ajet/{seg}\u00e9.py", f"ajet/{seg}e\u0301.py"
    return f"ajet/{seg}", f"ajet/{seg}/inner.py"


def _zip_of(members: list[tuple[str, bytes, int]], method: int = zipfile.ZIP_DEFLATED) -> bytes:
    """A zip with a unix mode per member; duplicates written as they are."""
    buf = io.BytesIO()
    with warnings.catch_warnings(), zipfile.ZipFile(buf, "w") as zf:
        warnings.simplefilter("ignore")  # "Duplicate name": that is the point
        for name, data, mode in members:
            info = zipfile.ZipInfo(name)
            info.create_system = 3
            info.external_attr = mode << 16
            info.compress_type = method
            zf.writestr(info, data)
    return buf.getvalue()


@st.composite
def hostile_zips(draw: st.DrawFn) -> tuple[str, bytes]:
    """(attack, zip bytes): honest members plus exactly one attack."""
    names = draw(honest_names())
    members = [(n, draw(_CONTENT), stat.S_IFREG | 0o644) for n in names]
    attack = draw(st.sampled_from([
        "name", "symlink", "special", "collision", "too_big_file", "bomb", "too_many",
        "truncated", "flipped_data", "encrypted", "method", "lying_size", "overlap",
        "entry_count", "no_files", "not_zip",
    ]))
    position = draw(st.integers(0, len(members)))

    def add(name: str, data: bytes, mode: int = stat.S_IFREG | 0o644) -> None:
        members.insert(position, (name, data, mode))

    if attack == "name":
        add(draw(hostile_names()), draw(_CONTENT))
    elif attack == "symlink":
        add(f"ajet/{draw(_SEGMENT)}_link", draw(st.sampled_from([b"/etc/passwd", b"../../x",
                                                                 b"."])),
            stat.S_IFLNK | 0o777)
    elif attack == "special":
        kind = draw(st.sampled_from([stat.S_IFIFO, stat.S_IFCHR, stat.S_IFBLK, stat.S_IFSOCK]))
        add(f"ajet/{draw(_SEGMENT)}_dev", b"", kind | 0o644)
    elif attack == "collision":
        first, second = _colliding_pair(draw)
        members = [m for m in members if m[0].casefold() not in (first.casefold(),
                                                                 second.casefold())]
        members += [(first, b"a = 1\n", stat.S_IFREG | 0o644),
                    (second, b"b = 2\n", stat.S_IFREG | 0o644)]
    elif attack == "too_big_file":
        size = MAX_FILE_BYTES + draw(st.integers(1, 4096))
        data = hashlib.sha256(draw(_CONTENT)).digest() * (size // 32 + 1)
        return attack, _zip_of([*members, ("ajet/big.bin", data[:size], stat.S_IFREG | 0o644)],
                               method=zipfile.ZIP_STORED)
    elif attack == "bomb":
        add(f"ajet/{draw(_SEGMENT)}.txt",
            draw(st.sampled_from([b"\0", b"A", b"ab"])) * draw(st.integers(200_000, 900_000)))
    elif attack == "too_many":
        extra = draw(st.integers(MAX_FILES + 1 - len(members), MAX_FILES + 10 - len(members)))
        members += [(f"ajet/many/m{i}.py", b"x = 1\n", stat.S_IFREG | 0o644)
                    for i in range(extra)]
    elif attack == "not_zip":
        return attack, draw(st.binary(max_size=400).filter(lambda b: b"PK\x05\x06" not in b))
    elif attack == "no_files":
        folders = [(f"ajet/{draw(_SEGMENT)}/", b"", stat.S_IFDIR | 0o755)]
        return attack, _zip_of(folders if draw(st.booleans()) else [])
    if not members:
        members.append((f"ajet/{draw(_SEGMENT)}.py", b"v = 0\n" * 20, stat.S_IFREG | 0o644))
    # Stored data for a flipped byte: every byte then reaches the CRC (deflate's padding
    # bits do not, and a flip there would leave an honest archive).
    method = zipfile.ZIP_STORED if attack == "flipped_data" else zipfile.ZIP_DEFLATED
    data = _zip_of(members, method)
    if attack in ("name", "symlink", "special", "collision", "bomb", "too_many"):
        return attack, data
    return attack, _damage(draw, attack, data)


def _damage(draw: st.DrawFn, attack: str, data: bytes) -> bytes:
    """Damage a well-formed zip's structure; the first member is the victim."""
    first = central_entries(data)[0]
    if attack == "truncated":
        return data[: draw(st.integers(0, len(data) - 1))]
    if attack == "flipped_data":
        # a byte of the first member's stored/compressed data: its CRC can no longer match
        name_len, extra_len = (int.from_bytes(data[26:28], "little"),
                               int.from_bytes(data[28:30], "little"))
        start = 30 + name_len + extra_len
        size = int.from_bytes(data[first + 20: first + 24], "little")
        if size == 0:  # nothing to flip: lie about the CRC instead
            return patch(data, first + 16, "<I", 0xDEADBEEF)
        at = start + draw(st.integers(0, size - 1))
        raw = bytearray(data)
        raw[at] ^= draw(st.integers(1, 255))
        return bytes(raw)
    if attack == "encrypted":
        return patch(data, first + 8, "<H", 0x1)
    if attack == "method":
        return patch(data, first + 10, "<H", draw(st.sampled_from([1, 6, 9, 12, 14, 93, 99])))
    if attack == "lying_size":
        real = int.from_bytes(data[first + 24: first + 28], "little")
        lie = draw(st.integers(0, MAX_FILE_BYTES).filter(lambda n: n != real))
        return patch(data, first + 24, "<I", lie)
    if attack == "overlap":
        return patch(data, first + 20, "<I", len(data) + draw(st.integers(1, 1 << 20)))
    # entry_count: the end record declares far more entries than the limit allows
    eocd = data.rfind(b"PK\x05\x06")
    count = draw(st.integers(2 * MAX_FILES + 17, 0xFFFE))
    return patch(patch(data, eocd + 8, "<H", count), eocd + 10, "<H", count)


# ---------------------------------------------------------------------------- manifests


@st.composite
def hostile_manifests(draw: st.DrawFn, *, stored: list[bytes]) -> tuple[str, list[dict[str, Any]]]:
    """(attack, files): a manifest with one attack; `stored` are blobs the server has."""
    names = draw(honest_names(min_size=1))
    files = [manifest_entry(n, draw(st.sampled_from(stored))) for n in names]
    attack = draw(st.sampled_from([
        "name", "collision", "mode", "too_many", "file_too_big", "total_too_big",
        "unknown_hash", "lying_size", "empty",
    ]))
    if attack == "name":
        files.insert(draw(st.integers(0, len(files))),
                     manifest_entry(draw(hostile_names()), draw(st.sampled_from(stored))))
    elif attack == "collision":
        first, second = _colliding_pair(draw)
        files = [f for f in files if str(f["path"]).casefold() not in (first.casefold(),
                                                                       second.casefold())]
        files += [manifest_entry(first, stored[0]), manifest_entry(second, stored[-1])]
    elif attack == "mode":
        files[0]["mode"] = draw(st.sampled_from([0o777, 0o4755, 0o600, 0o120777, 0o100644, 0]))
    elif attack == "too_many":
        files += [manifest_entry(f"ajet/many/m{i}.py", stored[0])
                  for i in range(MAX_FILES + 1 - len(files) + draw(st.integers(0, 30)))]
    elif attack == "file_too_big":
        files[0]["size"] = MAX_FILE_BYTES + draw(st.integers(1, 1 << 30))
    elif attack == "total_too_big":
        share = MAX_UNPACKED // len(files) + 1
        for f in files:
            f["size"] = min(MAX_FILE_BYTES, share + draw(st.integers(0, 1000)))
        while sum(int(f["size"]) for f in files) <= MAX_UNPACKED:
            files.append({**manifest_entry(f"ajet/pad/p{len(files)}.bin", stored[0]),
                          "size": MAX_FILE_BYTES})
    elif attack == "unknown_hash":
        data = draw(st.binary(min_size=1, max_size=64).filter(lambda b: b not in stored))
        at = draw(st.integers(0, len(files) - 1))
        files[at] = manifest_entry(str(files[at]["path"]), data + b"\0never uploaded")
    elif attack == "lying_size":
        victim = files[draw(st.integers(0, len(files) - 1))]
        victim["size"] = draw(st.integers(0, 1000).filter(lambda n: n != victim["size"]))
    else:
        files = []
    return attack, files


# ---------------------------------------------------------------------------- blob streams


@st.composite
def hostile_blob_streams(draw: st.DrawFn) -> tuple[str, bytes]:
    """(attack, body) for `POST /code/blobs`: good records around one bad one."""
    good = [blob_record(draw(_CONTENT)) for _ in range(draw(st.integers(0, 3)))]
    data = draw(st.binary(min_size=1, max_size=500))
    attack = draw(st.sampled_from(["wrong_hash", "truncated", "bad_header", "too_big",
                                   "too_many"]))
    if attack == "wrong_hash":
        other = draw(st.binary(max_size=100).filter(lambda b: b != data))
        bad = blob_record(data, sha=hashlib.sha256(other).hexdigest())
    elif attack == "truncated":
        whole = blob_record(data)
        bad = whole[: draw(st.integers(1, len(whole) - 1))]
        return attack, b"".join(good) + bad  # a truncated record can only come last
    elif attack == "bad_header":
        sha = hashlib.sha256(data).hexdigest()
        header = draw(st.sampled_from([
            f"{sha.upper()} {len(data)}\n", f"{sha} -{len(data)}\n", f"{sha}  {len(data)}\n",
            f"{sha[:-1]} {len(data)}\n", f"{sha} {len(data)}\r\n", f"{sha} 0{len(data)}\n",
            f"{sha} {len(data)}", "x" * 100,
        ]))
        bad = header.encode() + data
    elif attack == "too_big":
        bad = f"{hashlib.sha256(data).hexdigest()} {MAX_FILE_BYTES + 1}\n".encode() + data
    else:
        bad = b"".join(blob_record(b"%d" % i) for i in range(MAX_FILES + 1))
    cut = draw(st.integers(0, len(good)))
    return attack, b"".join(good[:cut]) + bad + b"".join(good[cut:])
