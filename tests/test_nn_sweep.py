"""PyTorch's test_nn.py CUDA tests of its module and loss entries (common_nn's module_tests,
get_new_module_tests() and criterion_tests, each entry's own `test_cuda` at test_nn.py's dtypes)
on an emulated GPU: tests/workloads/nn_sweep.py under `mirage run --gpus-per-node 1`. Run with
`pytest -s` to see every failure. About 20 s of sweep on 2 cores. The summary goes to
docs/conformance/sweeps/common_nn.json, whose counts docs/conformance.md quotes."""

import json

from conftest import mirage, record_sweep

# docs/conformance.md and README.md: "test_nn's CUDA tests 488 of 488".
DOCUMENTED_TOTAL = 488


def test_common_nn_cuda_tests_on_emulated_gpu():
    result = mirage("run", "--quiet", "--gpus-per-node", "1", "--", "python", "tests/workloads/nn_sweep.py",
                    timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads(result.stdout.splitlines()[-1])
    record_sweep("common_nn", summary)
    headline = (f"common_nn sweep: {summary['passed']}/{summary['total']} CUDA tests pass "
                f"({summary['skipped']} skipped)")
    print(headline)
    for failure in summary["failures"]:
        print(f"  {failure['test']}: {failure['message'][:200]} ({failure['at']})")
    assert summary["failures"] == [], headline
    assert summary["total"] == DOCUMENTED_TOTAL, f"{headline}; docs/conformance.md: {DOCUMENTED_TOTAL}"
