"""PyTorch's CUDA autocast op lists on an emulated GPU, checked with PyTorch's own harness:
tests/workloads/autocast_sweep.py under `mirage run --gpus-per-node 1`."""

import json

from conftest import mirage


def test_autocast_lists_cast_as_a_cuda_build_casts_them():
    result = mirage("run", "--quiet", "--gpus-per-node", "1", "--", "python", "tests/workloads/autocast_sweep.py",
                    timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads(result.stdout.splitlines()[-1])
    print(f"autocast sweep: {summary['passed']}/{summary['total']} pass")
    assert summary["total"] >= 140
    assert summary["failures"] == [], summary["failures"]
