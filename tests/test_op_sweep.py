"""PyTorch's OpInfo operator database on an emulated GPU, against the same ops on the CPU.

Runs tests/workloads/op_sweep.py under `mirage run --gpus-per-node 2` (every float32 OpInfo,
its first 3 sample inputs: outputs, output devices, aliasing and input gradients compared with
the CPU's) and checks the pass fraction. Run with `pytest -s` to see the fraction and every
failing op. About 25 s on 2 cores.
"""

import json
import subprocess
import sys
import time

from conftest import REPO

MIN_FRACTION = 0.95

# Ops whose failures are understood: {op name: reason}. A failure of an op not listed here
# fails the test only if the overall fraction drops below MIN_FRACTION.
KNOWN_FAILURES = {
    # Sparse tensors: the shim's fallback serves the dense CUDA key only.
    "to_sparse": "the sparse (COO/CSR) result of the CPU kernel is handed back as a CPU tensor: "
                 "the fallback's map_back re-labels strided results only",
    "sparse.sampled_addmm": "no kernel/fallback for the SparseCsrCUDA dispatch key",
    "sparse.mm": "no kernel/fallback for the SparseCsrCUDA dispatch key (_sparse_mm_reduce_impl)",
    # Seen only with OP_SWEEP_SAMPLES=all (later samples than the default first 3):
    "nn.functional.scaled_dot_product_attention": "with a mask that requires grad the device takes "
                            "memory-efficient attention, as a GPU does, the CPU the math backend; on op_db's "
                            "large-valued samples they are up to 3e-4 apart in the gradients",
}


def run_sweep() -> tuple[dict, float, subprocess.CompletedProcess]:
    started = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-m", "mirage", "run", "--gpus-per-node", "2", "--", sys.executable,
         "tests/workloads/op_sweep.py"],
        cwd=REPO, capture_output=True, text=True, timeout=1200,
    )
    elapsed = time.monotonic() - started
    lines = [line for line in result.stdout.splitlines() if line.startswith('{"op_sweep"')]
    assert lines, f"no summary line (exit {result.returncode}):\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    return json.loads(lines[-1]), elapsed, result


def test_opinfo_sweep_on_emulated_gpu():
    summary, elapsed, result = run_sweep()
    failures = summary["failures"]
    fraction = summary["fraction"]
    headline = (f"op sweep: {summary['passed']}/{summary['total']} samples pass on the emulated GPU "
                f"(fraction {fraction:.4f}; {summary['ops_run']} ops, {summary['failed']} failed, "
                f"{summary['excluded_cpu_failure']} excluded as failing on the CPU; {elapsed:.0f}s)")
    print(headline)
    by_op: dict[str, list[dict]] = {}
    for failure in failures:
        by_op.setdefault(failure["op"], []).append(failure)
    for op, entries in sorted(by_op.items()):
        first = entries[0]
        known = "known" if op in KNOWN_FAILURES else "NEW"
        print(f"  [{known}] {op}{'.' + first['variant'] if first['variant'] else ''}: {len(entries)} sample(s), "
              f"{first['check']}: {first['error']}: {first['message'][:160]}")
    assert result.returncode == 0, f"sweep exited {result.returncode}: {result.stderr[-3000:]}"
    assert summary["total"] > 0 and summary["ops_run"] >= 400, headline
    unknown = sorted(op for op in by_op if op not in KNOWN_FAILURES)
    if unknown:
        print(f"  failing ops not in KNOWN_FAILURES: {unknown}")
    assert fraction >= MIN_FRACTION, f"{headline}; below {MIN_FRACTION}; failing ops not in KNOWN_FAILURES: {unknown}"
    # Every failure is a known one, or the overall fraction still holds.
    assert not unknown or fraction >= MIN_FRACTION, headline
