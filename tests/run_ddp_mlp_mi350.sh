#!/usr/bin/env bash
# The DDP demo: an MLP trained with DistributedDataParallel over nccl, launched by torchrun,
# on emulated MI350X GPUs. On first run it creates the virtual environment and installs
# everything. Knobs: NPROC (ranks = GPUs per node, default 2), STEPS (50), PROFILE (mi350x),
# VENV (.venv-mi350), SKIP_INSTALL=1 (reuse the venv as it is).
set -euo pipefail
cd "$(dirname "$0")/.."
NPROC=${NPROC:-2}
STEPS=${STEPS:-50}
PROFILE=${PROFILE:-mi350x}
export VENV=${VENV:-.venv-mi350}
if [ "${SKIP_INSTALL:-0}" != "1" ]; then
  ./scripts/setup.sh
fi
STEPS=$STEPS "$VENV/bin/mirage" run --quiet --profile "$PROFILE" --gpus-per-node "$NPROC" \
  -- torchrun --standalone --nproc_per_node="$NPROC" tests/fixtures/ml/ddp_mlp.py
echo "==> PASS: DDP MLP trained on $NPROC emulated $PROFILE GPUs via torchrun"
