"""Unmodified Megatron-core 0.16.1 trains a small GPT on emulated MI300X GPUs (see
tests/workloads/megatron_gpt.py): its local layer spec, tensor and pipeline parallelism, the 1F1B
schedule, and its DDP with the distributed optimizer. Megatron-core needs only torch, numpy and
packaging, so it is installed once without dependencies into .venv-megatron/ (ignored by git)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, mirage


@pytest.fixture(scope="module")
def megatron_path() -> Path:
    target = REPO / ".venv-megatron"
    if not (target / "megatron" / "core" / "__init__.py").exists():
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target),
                        "megatron-core==0.16.1"], check=True, timeout=900)
    return target


@pytest.mark.parametrize("tp, pp, ranks", [
    pytest.param(2, 2, 4, id="tp2-pp2"),
    pytest.param(1, 2, 4, id="pp2-dp2-distributed-optimizer", marks=pytest.mark.slow),  # keeps CI under 25 min
])
def test_megatron_core_trains(megatron_path, tp, pp, ranks):
    result = mirage("run", "--quiet", "--profile", "mi300x", "--nproc-per-node", str(ranks), "--gpus-per-node",
                    str(ranks), "--env", f"MEGATRON_TP={tp}", "--env", f"MEGATRON_PP={pp}", "--",
                    "python", "tests/workloads/megatron_gpt.py",
                    env={**os.environ, "PYTHONPATH": str(megatron_path)}, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    line = next(line for line in result.stdout.splitlines() if " losses " in line)
    assert f"TP {tp} x PP {pp} x DP {ranks // (tp * pp)} losses" in line
    losses = [float(x) for x in line.split(" losses ")[1].split()]
    assert len(losses) == 8 and 5.4 < losses[0] < 5.7  # ln(256): an untrained model's cross-entropy
    assert losses[-1] < losses[0] - 0.5, losses  # it learns the counting task
