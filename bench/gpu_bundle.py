"""Build the GPU bundle: the wheels a bare GPU host needs beyond torch, transformers and peft.

    python -m bench.gpu_bundle                     # -> bench/gpu_bundle/ (git-ignored)
    python -m bench.gpu_bundle --python-version 3.12 --out DIR

The first GPU host this project meets has Python 3.12 with torch, transformers and peft,
no network, and room for at most 64 MiB of files carried with the checkout. The swarm
server and the engine need more than that (FastAPI, uvicorn, httpx, pydantic, PyYAML,
GitPython, ...). This script downloads, here, binary wheels of the project's base
dependencies and its `server` extra for the host's Python and platform (`pip download
--only-binary=:all: --python-version ... --platform ...`), plus setuptools and wheel so
that the offline editable install of the checkout can build, and writes next to them:

- `requirements.txt`: what `bench/gpu_install.sh` installs, offline;
- `MANIFEST.json`: every wheel with its size and sha256, and the total.

torch, transformers, peft and what they pull in (numpy, tokenizers, safetensors,
huggingface-hub) are not downloaded: the host's own copies are used through a venv with
`--system-site-packages`. The bundle is refused when it would not fit the carry limit.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

log = logging.getLogger("bench.gpu_bundle")

PROJECT_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = PROJECT_ROOT / "bench" / "gpu_bundle"
#: What the device tool carries with a checkout, all paths together.
CARRY_LIMIT_BYTES = 64 * 1024 * 1024
#: manylinux tags a glibc-2.28+ x86_64 host accepts, newest first.
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64",
             "linux_x86_64")
#: Provided by the host (its torch stack); never bundled.
HOST_PROVIDED = ("torch", "transformers", "peft", "tokenizers", "safetensors", "numpy",
                 "huggingface-hub")
#: An offline `pip install -e .` of the checkout builds with these.
BUILD_TOOLS = ("setuptools>=77", "wheel")


def bundle_requirements(pyproject: Path = PROJECT_ROOT / "pyproject.toml") -> list[str]:
    """The base dependencies and the `server` extra, as pip requirement strings."""
    project = tomllib.loads(pyproject.read_text())["project"]
    wanted = [*project["dependencies"], *project["optional-dependencies"]["server"]]
    return [r for r in wanted if requirement_name(r) not in HOST_PROVIDED] + list(BUILD_TOOLS)


def requirement_name(requirement: str) -> str:
    """The normalised project name of a requirement string (`PyYAML>=6` -> `pyyaml`)."""
    for stop in "<>=!~;[ ":
        requirement = requirement.split(stop, 1)[0]
    return requirement.strip().lower().replace("_", "-")


def download(requirements: list[str], out: Path, python_version: str) -> None:
    """`pip download` binary wheels of `requirements` for the GPU host into `out`."""
    cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--only-binary=:all:",
           "--python-version", python_version, "--implementation", "cp", "-d", str(out)]
    for platform in PLATFORMS:
        cmd += ["--platform", platform]
    subprocess.run([*cmd, *requirements], check=True)


def write_manifest(out: Path, requirements: list[str], python_version: str) -> dict:
    wheels = sorted(out.glob("*.whl"))
    files = [{"name": w.name, "bytes": w.stat().st_size,
              "sha256": hashlib.sha256(w.read_bytes()).hexdigest()} for w in wheels]
    manifest = {"python_version": python_version, "platforms": list(PLATFORMS),
                "requirements": requirements, "files": files,
                "total_bytes": sum(f["bytes"] for f in files)}
    (out / "MANIFEST.json").write_text(json.dumps(manifest, indent=1) + "\n")
    (out / "requirements.txt").write_text("\n".join(requirements) + "\n")
    return manifest


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--python-version", default="3.12",
                        help="the GPU host's Python (default %(default)s)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.out.exists():
        shutil.rmtree(args.out)
    args.out.mkdir(parents=True)
    requirements = bundle_requirements()
    download(requirements, args.out, args.python_version)
    manifest = write_manifest(args.out, requirements, args.python_version)
    total = manifest["total_bytes"]
    log.info("%d wheels, %.1f MB in %s", len(manifest["files"]), total / 1e6, args.out)
    if total > CARRY_LIMIT_BYTES:
        log.error("the bundle (%.1f MiB) does not fit the %d MiB carried with a checkout",
                  total / 2**20, CARRY_LIMIT_BYTES // 2**20)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
