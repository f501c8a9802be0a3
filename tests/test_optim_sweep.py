"""PyTorch's optimizer database (common_optimizers.optim_db) on an emulated GPU against the CPU:
tests/workloads/optim_sweep.py under `mirage run --gpus-per-node 1` (every optimizer input for
cuda, with the for-loop, foreach and fused implementations, capturable where given). Run with
`pytest -s` to see the failures. A few seconds of sweep. The summary goes to
docs/conformance/sweeps/optim_db.json, whose counts docs/conformance.md quotes."""

import json

from conftest import mirage, record_sweep

# docs/conformance.md and README.md: "optim_db 274 of 274".
DOCUMENTED_TOTAL = 274


def test_optim_db_sweep_on_emulated_gpu():
    result = mirage("run", "--quiet", "--gpus-per-node", "1", "--", "python", "tests/workloads/optim_sweep.py",
                    timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads(result.stdout.splitlines()[-1])
    record_sweep("optim_db", summary)
    print(f"optim sweep: {summary['passed']}/{summary['total']} cases pass; left out: {summary['skipped']}")
    for failure in summary["failures"]:
        print(f"  {failure['optimizer']} [{failure['input']}] {failure['impl']}: {failure['message'][:200]}")
    assert summary["skipped"] == {}, summary["skipped"]
    assert summary["failures"] == [], summary["failures"]
    assert summary["total"] == DOCUMENTED_TOTAL, (summary["total"], "cases; docs/conformance.md says 274")
