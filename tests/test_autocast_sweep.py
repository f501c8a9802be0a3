"""PyTorch's CUDA autocast op lists on an emulated GPU, checked with PyTorch's own harness:
tests/workloads/autocast_sweep.py under `mirage run --gpus-per-node 1`. The summary goes to
docs/conformance/sweeps/autocast.json, whose counts docs/conformance.md quotes."""

import json

from conftest import mirage, record_sweep

# docs/conformance.md and README.md: "the CUDA autocast lists 144 of 144".
DOCUMENTED_TOTAL = 144


def test_autocast_lists_cast_as_a_cuda_build_casts_them():
    result = mirage("run", "--quiet", "--gpus-per-node", "1", "--", "python", "tests/workloads/autocast_sweep.py",
                    timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads(result.stdout.splitlines()[-1])
    record_sweep("autocast", summary)
    print(f"autocast sweep: {summary['passed']}/{summary['total']} pass")
    assert summary["failures"] == [], summary["failures"]
    assert summary["total"] == DOCUMENTED_TOTAL, (summary["total"], "docs/conformance.md says 144")
