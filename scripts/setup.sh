#!/usr/bin/env bash
# Creates the virtual environment mirage runs in (idempotent): the CPU build of torch 2.13.0,
# mirage itself (editable) and the test dependencies. VENV (default .venv) names it.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
PYTHON=${PYTHON:-$(command -v python3.11 || command -v python3)}
if [ ! -x "$VENV/bin/python" ]; then
  echo "==> creating $VENV with $PYTHON" >&2
  "$PYTHON" -m venv "$VENV"
fi
if ! "$VENV/bin/python" -c "import torch, mirage, pytest" >/dev/null 2>&1; then
  echo "==> installing torch==2.13.0 (CPU build), mirage and test dependencies into $VENV" >&2
  "$VENV/bin/python" -m pip install -q --upgrade pip >/dev/null
  # The CPU build: mirage emulates the GPU; a CUDA build of torch cannot host it.
  "$VENV/bin/python" -m pip install -q torch==2.13.0
  # An editable install that puts the checkout on sys.path (a .pth line) rather than an import
  # finder: the finder's module imports pathlib and importlib.util in every Python process at
  # start-up, 15 ms each, which 64 ranks of a session pay on 2 cores (docs/benchmarks.md, scale).
  # setuptools calls this mode transitional; where it is gone, the default mode is used.
  "$VENV/bin/python" -m pip install -q -e ".[test]" --config-settings editable_mode=compat 2>/dev/null ||
    "$VENV/bin/python" -m pip install -q -e ".[test]"
fi
# Isolated emulated nodes need iproute2 and util-linux's unshare/nsenter (and root); a bare CI
# image may lack iproute2. The Slurm tests install Slurm themselves (scripts/slurm_testbed.sh).
if [ "$(id -u)" = 0 ] && ! command -v ip >/dev/null && command -v apt-get >/dev/null; then
  echo "==> installing iproute2 (isolated emulated nodes)" >&2
  apt-get update -qq >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq iproute2 >/dev/null
fi
