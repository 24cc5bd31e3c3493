#!/usr/bin/env bash
# Install the GPU bundle offline: a venv that reuses the host's torch, transformers and
# peft (--system-site-packages), the bundle's wheels, then this checkout (editable).
#
#   bash bench/gpu_install.sh [BUNDLE_DIR] [VENV_DIR]     # defaults: bench/gpu_bundle, /tmp/ajet-gpu-venv
#
# Build the bundle first, on a machine with the package index: python -m bench.gpu_bundle
set -euo pipefail
cd "$(dirname "$0")/.."
bundle=${1:-bench/gpu_bundle}
venv=${2:-/tmp/ajet-gpu-venv}
python=${PYTHON:-python3}
if [ ! -f "$bundle/requirements.txt" ]; then
  echo "gpu_install: no bundle at $bundle: run 'python -m bench.gpu_bundle' where PyPI is reachable, and carry $bundle" >&2
  exit 2
fi
"$python" -m venv --system-site-packages "$venv"
# --system-site-packages reaches the *base* interpreter's packages only: where the host's
# python3 is itself a venv (a GPU image's /opt/torch/.venv, say), its torch would stay
# invisible. A .pth file puts the host interpreter's own site folders after the venv's.
host_sites=$("$python" -c 'import site, sysconfig; print("\n".join(dict.fromkeys([*site.getsitepackages(), sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]])))')
venv_site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
printf '%s\n' "$host_sites" > "$venv_site/zz_host_site.pth"
"$venv/bin/python" -m pip install --quiet --no-index --find-links "$bundle" -r "$bundle/requirements.txt"
"$venv/bin/python" -m pip install --quiet --no-index --no-build-isolation --no-deps -e .
"$venv/bin/python" -c "import swarm_server, ajet, fastapi, torch, transformers; print('gpu_install: ok, torch', torch.__version__, 'transformers', transformers.__version__)"
