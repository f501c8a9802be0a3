"""PyTorch's OpInfo operator database on an emulated GPU, against the same ops on the CPU.

Runs tests/workloads/op_sweep.py under `mirage run --gpus-per-node 2` (every float32 OpInfo,
its first 3 sample inputs: outputs, output devices, aliasing and input gradients compared with
the CPU's) and checks the pass fraction. Run with `pytest -s` to see the fraction and every
failure.
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
    "nn.functional.conv1d": "convolution_backward (CompositeExplicitAutograd) picks the CUDA slow-conv "
                            "backend for device tensors and calls a DispatchStub with no CUDA kernel",
    "nn.functional.conv2d": "as conv1d: convolution_backward's DispatchStub has no CUDA kernel",
    "nn.functional.conv3d": "as conv1d: convolution_backward's DispatchStub has no CUDA kernel",
    "nn.functional.conv_transpose1d": "as conv1d: convolution_backward's DispatchStub has no CUDA kernel",
    "nn.functional.conv_transpose2d": "as conv1d: convolution_backward's DispatchStub has no CUDA kernel",
    "nn.functional.conv_transpose3d": "as conv1d: convolution_backward's DispatchStub has no CUDA kernel",
    "nn.functional.ctc_loss": "ctc_loss asks aten::_use_cudnn_ctc_loss, which has only a CUDA kernel "
                              "(none on the CPU for the fallback to reach)",
    "sgn": "backward of sgn on a real input yields an autograd ZeroTensor; the fallback maps it back as "
           "an ordinary device tensor over a null pointer (reading it segfaults)",
    "to_sparse": "sparse results are not mapped back to the device (the fallback maps strided only)",
    "sparse.sampled_addmm": "sparse CSR device tensors: no fallback for the SparseCsrCUDA key",
    "sparse.mm": "sparse CSR device tensors: no fallback for the SparseCsrCUDA key",
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
    assert fraction >= MIN_FRACTION, f"{headline}; below {MIN_FRACTION}; unlisted failures: {unknown}"
    # Every failure is either a known one, or the fraction still holds (checked above): unlisted
    # failures are reported, not fatal.
    if unknown:
        print(f"  unlisted failing ops (fraction still >= {MIN_FRACTION}): {unknown}")
