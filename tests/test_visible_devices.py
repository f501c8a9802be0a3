"""Which emulated GPUs a process sees: CUDA's rules for CUDA_VISIBLE_DEVICES, ROCm's layering."""

import subprocess
import sys

import pytest

from conftest import REPO
from mirage.runtime.visible_devices import gpu_uuid, visible_gpus


@pytest.mark.parametrize("value, expected", [
    (None, [0, 1, 2, 3]),
    ("", []),
    ("2", [2]),
    ("3,1", [3, 1]),            # order is the value's: cuda:0 is the node's GPU 3
    ("1, 2", [1, 2]),
    ("1,7,2", [1]),             # out of range: the list ends there
    ("0,-1,2", [0]),            # invalid: same
    ("-1", []),
    ("1,1", [1]),               # repeated: same
    (f"GPU-{gpu_uuid(2, 0)[:8]}", [2]),  # a UUID prefix, as nvidia-smi -L prints it
    ("GPU-", []),                        # "GPU-" alone names none
    (f"0,GPU-{gpu_uuid(3, 0)}", [0, 3]),
    (f"GPU-{gpu_uuid(3, 1)}", []),       # another node's GPU
])
def test_cuda_visible_devices(value, expected):
    env = {} if value is None else {"CUDA_VISIBLE_DEVICES": value}
    assert visible_gpus(4, amd=False, env=env) == expected


def test_uuids_are_distinct_across_a_clusters_nodes_and_stable():
    uuids = {gpu_uuid(gpu, node) for node in range(64) for gpu in range(8)}
    assert len(uuids) == 64 * 8 and gpu_uuid(5, 3) == gpu_uuid(5, 3)
    first = [gpu_uuid(gpu, 0)[0] for gpu in range(8)]
    shared = next(c for c in first if first.count(c) > 1)  # a prefix that fits several GPUs names none
    assert visible_gpus(8, amd=False, env={"CUDA_VISIBLE_DEVICES": f"0,GPU-{shared}"}) == [0]
    assert visible_gpus(4, amd=False, env={"MIRAGE_NODE_RANK": "1", "CUDA_VISIBLE_DEVICES": f"GPU-{gpu_uuid(3, 1)}"}) == [3]


def test_rocm_narrows_with_rocr_then_picks_with_hip_before_cuda():
    assert visible_gpus(8, amd=True, env={"ROCR_VISIBLE_DEVICES": "4,5,6", "HIP_VISIBLE_DEVICES": "2,0"}) == [6, 4]
    assert visible_gpus(8, amd=True, env={"HIP_VISIBLE_DEVICES": "1", "CUDA_VISIBLE_DEVICES": "2"}) == [1]
    assert visible_gpus(8, amd=True, env={"CUDA_VISIBLE_DEVICES": "2"}) == [2]
    assert visible_gpus(8, amd=False, env={"HIP_VISIBLE_DEVICES": "1"}) == list(range(8))  # not CUDA's


def test_a_value_that_hides_every_gpu_is_warned_about():
    result = subprocess.run(
        [sys.executable, "-m", "mirage", "run", "--gpus-per-node", "2", "--env", "CUDA_VISIBLE_DEVICES=",
         "--", "python", "-c", "import torch; print('count', torch.cuda.device_count())"],
        cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "count 0" in result.stdout
    assert "warning: CUDA_VISIBLE_DEVICES='' hides every emulated GPU" in result.stderr
