"""Operator sweep over PyTorch's OpInfo database: every op on an emulated GPU vs on the CPU.

Runs under mirage. For each OpInfo entry, the first SAMPLES float32 sample inputs run on "cpu"
and on "cuda:0" (same seed, so random ops draw the same numbers: each device's generator is the
same algorithm as the CPU's); outputs are compared, and where the op has autograd, so are the
input gradients of sum(outputs). Samples that fail on the CPU itself are not counted. Prints
one `RESULT {json}` line: passed, failed, total, fraction, failures [{op, error}].
"""

from __future__ import annotations

import json
import os
import signal
import sys

import torch
from torch.testing._internal.common_methods_invocations import op_db
from torch.utils._pytree import tree_flatten, tree_map

SAMPLES = 5
SECONDS_PER_OP = 30


class OpTimeout(Exception):
    pass


def _on_alarm(signum, frame):
    raise OpTimeout()


# Ops whose outputs are uninitialized memory: only shape, dtype and device are compared.
UNINITIALIZED_OUTPUTS = {"empty", "empty_like", "new_empty", "new_empty_strided", "empty_strided", "empty_permuted"}


def to_device(sample_part, device: str):
    def move(value):
        if isinstance(value, torch.device) or value == "cpu":
            return torch.device(device)  # factory ops and .to() name their device in the sample
        if isinstance(value, torch.Tensor):
            moved = value.detach().to(device)
            return moved.requires_grad_(value.requires_grad) if moved.is_floating_point() or moved.is_complex() else moved
        return value
    return tree_map(move, sample_part)


def run(op, sample, device: str):
    """Output (on CPU) and input gradients (on CPU) of one sample on one device."""
    inp, args, kwargs = to_device((sample.input, sample.args, sample.kwargs), device)
    torch.manual_seed(0)
    out = op(inp, *args, **kwargs)
    outputs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
    for t in outputs:
        if t.layout == torch.strided and t.device.type != ("cuda" if device.startswith("cuda") else "cpu"):
            raise AssertionError(f"output on {t.device}, expected {device}")
    grads = []
    leaves = [t for t in tree_flatten((inp, args, kwargs))[0] if isinstance(t, torch.Tensor) and t.requires_grad]
    differentiable = [t for t in outputs if t.requires_grad and t.grad_fn is not None]
    if op.supports_autograd and leaves and differentiable:
        total = sum(t.float().sum() if not t.is_complex() else t.abs().sum() for t in differentiable)
        found = torch.autograd.grad(total, leaves, allow_unused=True)
        grads = [g.detach().cpu() if g is not None else None for g in found]
    return [t.detach().cpu() if t.layout == torch.strided else t for t in outputs], grads


def compare(expected, actual, values: bool = True) -> None:
    for e, a in zip(expected, actual, strict=True):
        if e is None or a is None:
            assert e is None and a is None, "gradient present on one device only"
            continue
        if e.layout != torch.strided:
            continue
        if not values:
            assert (e.shape, e.dtype) == (a.shape, a.dtype), f"{a.shape}/{a.dtype} != {e.shape}/{e.dtype}"
            continue
        torch.testing.assert_close(a, e, equal_nan=True, atol=1e-5, rtol=1.3e-6, check_device=False)


def main() -> None:
    signal.signal(signal.SIGALRM, _on_alarm)
    passed, failures = 0, []
    selected = os.environ.get("OPINFO_SELECT")  # comma-separated names, for debugging one op
    for op in op_db:
        if selected and op.name not in selected.split(","):
            continue
        if not op.supports_dtype(torch.float32, "cpu"):
            continue
        name = op.name + (f".{op.variant_test_name}" if op.variant_test_name else "")
        signal.alarm(SECONDS_PER_OP)
        try:
            samples = []
            for i, sample in enumerate(op.sample_inputs("cpu", torch.float32, requires_grad=op.supports_autograd)):
                if i >= SAMPLES:
                    break
                samples.append(sample)
            for sample in samples:
                try:
                    expected = run(op, sample, "cpu")
                except OpTimeout:
                    raise
                except Exception:
                    continue  # fails on the CPU itself: not counted
                try:
                    actual = run(op, sample, "cuda:0")
                    compare(expected[0], actual[0], values=op.name not in UNINITIALIZED_OUTPUTS)
                    compare(expected[1], actual[1])
                    passed += 1
                except OpTimeout:
                    raise
                except Exception as err:
                    failures.append({"op": name, "error": f"{type(err).__name__}: {str(err).splitlines()[0][:200]}"})
        except OpTimeout:
            failures.append({"op": name, "error": f"timeout after {SECONDS_PER_OP} s"})
        except Exception:
            pass  # building the samples failed: nothing to compare
        finally:
            signal.alarm(0)
    total = passed + len(failures)
    print("RESULT " + json.dumps({"passed": passed, "failed": len(failures), "total": total,
                                  "fraction": passed / total if total else 0.0, "failures": failures}), flush=True)


if __name__ == "__main__":
    if not torch.cuda.is_available():
        sys.exit("run under mirage: mirage run -- python tests/workloads/opinfo_sweep.py")
    main()
