"""PyTorch's optimizer database (common_optimizers.optim_db) on an emulated GPU against the CPU:
tests/workloads/optim_sweep.py under `mirage run --gpus-per-node 1` (every optimizer input for
cuda, with the for-loop, foreach and fused implementations, capturable where given). Run with
`pytest -s` to see the fraction. A few seconds of sweep."""

import json

from conftest import mirage

MIN_FRACTION = 0.99


def test_optim_db_sweep_on_emulated_gpu():
    result = mirage("run", "--quiet", "--gpus-per-node", "1", "--", "python", "tests/workloads/optim_sweep.py",
                    timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads(result.stdout.splitlines()[-1])
    impls = {(f["impl"]) for f in summary["failures"]}
    print(f"optim sweep: {summary['passed']}/{summary['total']} cases pass (fraction {summary['fraction']:.4f}); "
          f"left out: {summary['skipped']}")
    for failure in summary["failures"]:
        print(f"  {failure['optimizer']} [{failure['input']}] {failure['impl']}: {failure['message'][:200]}")
    assert summary["total"] >= 250 and set(summary["skipped"]) == {"SparseAdam"}, summary["skipped"]
    assert summary["fraction"] >= MIN_FRACTION, (summary["fraction"], impls)
