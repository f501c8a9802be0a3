"""Unmodified Megatron-core 0.16.1 trains a small GPT on emulated MI300X GPUs (see
tests/workloads/megatron_gpt.py): its local layer spec, tensor and pipeline parallelism, the 1F1B
schedule, and its DDP with the distributed optimizer. Megatron-core needs only torch, numpy and
packaging, so it is installed once without dependencies into .venv-megatron/ (ignored by git)."""

from __future__ import annotations

import json
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


def test_megatron_sc21_row_predicts_with_megatrons_fused_kernels(megatron_path, tmp_path):
    """bench/megatron_sc21.py's 1.7B row (E33 of docs/validation.md): 32 A100s, one node standing
    for four, predicted by megatron-core with Megatron's fused causal softmax, which megatron-core
    takes only when its CUDA extension imports (bench/megatron_extensions stands in for it): each
    of the 24 layers runs it forward twice (the layer is recomputed in the backward) and backward
    once. Its attention dropout is CUDA's one fused kernel, with no separate Bernoulli draw; its
    biases are fused as 2021's TorchScript fused them, each fusion one kernel
    (bench/megatron_extensions/jit_fusions.py): bias + GeLU forward twice and backward once, bias +
    dropout + residual add twice a layer, forward twice."""
    trace = tmp_path / "trace.json"
    result = mirage("run", "--timing", "--predict-only", "--trace", str(trace), "--profile", "a100", "--num-nodes", "4",
                    "--gpus-per-node", "8", "--stand-ins", "4", "--", "sh", "-c",
                    "torchrun --nnodes=$MIRAGE_NUM_NODES --node-rank=$MIRAGE_NODE_RANK --nproc-per-node=8 "
                    "--rdzv-endpoint=$MASTER_ADDR:$MASTER_PORT bench/megatron_sc21.py --size 1.7B --steps 1",
                    timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "E2E {" in result.stdout
    kernels = [e["name"] for e in json.loads(trace.read_text())["traceEvents"]
               if e.get("ph") == "X" and e.get("pid") == 0 and e.get("tid", 0) != 0]
    assert kernels.count("scaled_upper_triang_masked_softmax_forward") == 2 * 24
    assert kernels.count("scaled_upper_triang_masked_softmax_backward") == 24
    assert kernels.count("aten::native_dropout") >= 2 * 24 and "aten::bernoulli_" not in kernels
    assert kernels.count("bias_gelu") == 2 * 24 and kernels.count("bias_gelu_back") == 24
    assert kernels.count("bias_dropout_add_fused_train") == 2 * 2 * 24
