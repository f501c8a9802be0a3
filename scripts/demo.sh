#!/usr/bin/env bash
# Sets up the virtual environment if missing and runs the demo: a training run on emulated
# MI350X GPUs.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
VENV=${VENV:-.venv}
exec "$VENV/bin/mirage" run --profile mi350x --gpus-per-node 4 -- python examples/single_gpu_train.py
