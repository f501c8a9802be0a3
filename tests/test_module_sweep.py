"""PyTorch's module database (common_modules.module_db) on an emulated GPU against the CPU, as
PyTorch's test_modules.py checks CPU/GPU parity: tests/workloads/module_sweep.py under
`mirage run --gpus-per-node 1`. Run with `pytest -s` to see the fraction and every failure.
About 10 s of sweep on 2 cores."""

import json

from conftest import mirage

MIN_FRACTION = 0.99

# {module: reason} for failures that are understood.
KNOWN_FAILURES = {
    "nn.TransformerDecoderLayer": "one sample (norm_first, no bias): one element of a gradient 2.7e-5 apart "
                                  "(relative; 1.3e-6 allowed), float32 rounding of a gradient summed over several "
                                  "attention paths; the sample passes when it runs alone (cause not isolated)",
}


def test_module_db_sweep_on_emulated_gpu():
    result = mirage("run", "--quiet", "--gpus-per-node", "1", "--", "python", "tests/workloads/module_sweep.py",
                    timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads(result.stdout.splitlines()[-1])
    headline = (f"module sweep: {summary['passed']}/{summary['total']} samples pass (fraction "
                f"{summary['fraction']:.4f}; {summary['excluded_cpu_failure']} excluded as failing on the CPU, "
                f"{summary['known_on_a_gpu']} marked in module_db as failing on a GPU too)")
    print(headline)
    for failure in summary["failures"]:
        known = "known" if failure["module"] in KNOWN_FAILURES else "NEW"
        print(f"  [{known}] {failure['module']} sample {failure['sample']} training={failure['training']} "
              f"{failure['check']}: {failure['message'][:200]}")
    assert summary["total"] > 1500, headline
    unknown = sorted({f["module"] for f in summary["failures"]} - set(KNOWN_FAILURES))
    assert summary["fraction"] >= MIN_FRACTION, f"{headline}; failing modules not in KNOWN_FAILURES: {unknown}"
