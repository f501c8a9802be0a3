"""common_nn sweep: PyTorch's test_nn.py CUDA variants of its module and criterion tests, on an
emulated GPU.

Run under `mirage run --gpus-per-node 1 -- python tests/workloads/nn_sweep.py`. The wheel carries
torch/testing/_internal/common_nn.py: the module tests (`module_tests` and `get_new_module_tests()`)
and loss tests (`criterion_tests`) that test/test_nn.py turns into `test_<name>_cuda*` tests, each
calling the entry's own `test_cuda` method, which builds the module on the CPU and on cuda, runs
both and compares outputs, gradients, second derivatives where the entry asks for them, and the
module on non-contiguous inputs. test_nn.py itself is not in the wheel: what it adds is a TestCase
with six small methods (how to run a forward and a backward, which the entries' methods call) and
the rules that turn one entry into several tests. Both are written here from test_nn.py's contract
(torch 2.13):

- a module entry gives one CUDA test, or, where `torch.cuda.is_tf32_supported()` and the entry
  does not say `with_tf32=False`, two: `_fp32` (TF32 off) and `_tf32` (on, at the entry's
  `tf32_precision`); an entry with `check_eval` also gives the same tests of the module in eval mode
  (its `check_with_long_tensor` copy is CPU-only);
- a criterion entry gives one test per dtype: float (`_fp32` and `_tf32` as above), double, half
  unless `check_half=False`, bfloat16 unless `check_bfloat16=False`, and cfloat/cdouble where
  `check_complex`;
- an entry's `decorator` wraps its tests (a skip on ROCm, a precision override), and
  `test_cuda=False` leaves an entry out of the CUDA tests, as in test_nn.py.

Nothing is excluded: a test whose CPU half failed would count as failed, with its message. The last
line of stdout is one JSON object: {"nn_sweep": 1, "passed", "failed", "skipped", "total",
"fraction", "failures": [{"test", "message", "at"}], "skips": {test: reason}}.
"""

from __future__ import annotations

import inspect
import json
import sys
import time
import traceback
import unittest
import warnings
from collections.abc import Callable

import torch
from torch.testing._internal.common_cuda import tf32_off, tf32_on
from torch.testing._internal.common_nn import (CriterionTest, NewModuleTest, NNTestCase, criterion_tests,
                                               get_new_module_tests, module_tests)
from torch.testing._internal.common_utils import freeze_rng_state, set_rng_seed


class CudaParityCase(NNTestCase):
    """The TestCase the entries' `test_cuda` methods take: how test_nn.py runs a module or a loss
    forward and backward, so that the CPU and the device are driven the same way."""

    def runTest(self) -> None:  # unittest needs a method to name; the sweep calls test_cuda itself
        pass

    def _forward(self, module, input):
        with freeze_rng_state():
            return module(*input) if isinstance(input, tuple) else module(input)

    def _backward(self, module, input, output, grad_output, create_graph=False):
        output.backward(grad_output, retain_graph=True, create_graph=create_graph)
        inputs = input if isinstance(input, tuple) else (input,)
        grads = tuple(None if i.grad is None else i.grad.data for i in inputs)
        return grads if isinstance(input, tuple) else grads[0]

    def _forward_criterion(self, criterion, input, target, extra_args=None):
        inputs = input if isinstance(input, tuple) else (input,)
        return criterion(*inputs, target, *(extra_args or ()))

    def _backward_criterion(self, criterion, input, output, target, gradOutput=None, extra_args=None):
        inputs = input if isinstance(input, tuple) else (input,)
        for i in inputs:
            if i.grad is not None:
                i.grad.data.zero_()
        first_output = output[0] if isinstance(output, tuple) else output
        grad = torch.ones(()) if gradOutput is None else gradOutput
        criterion(*inputs, target, *(extra_args or ())).backward(grad.to(first_output))
        grads = tuple(i.grad.data for i in inputs)
        return grads if isinstance(input, tuple) else grads[0]

    def _zero_grad_parameters(self, module):
        for p in module.parameters():
            if p.grad is not None:
                with torch.no_grad():
                    p.grad.zero_()
                p.grad.detach_()

    def _get_parameters(self, module):
        parameters = list(module.parameters())
        return parameters, [p.grad for p in parameters]


def in_eval_mode(constructor: Callable) -> Callable:
    """The entry's constructor with the module left in eval mode (test_nn.py's check_eval copy)."""
    def build(*args, **kwargs):
        module = constructor(*args, **kwargs)
        module.training = False
        return module
    build.__name__ = constructor.__name__
    return build


def module_entries() -> list[tuple[NewModuleTest, Callable | None]]:
    """test_nn.py's module entries, each with its decorator."""
    entries = []
    for params in module_tests + get_new_module_tests():
        params = dict(params)
        if "constructor" not in params:
            params["constructor"] = getattr(torch.nn, params.pop("module_name"))
        decorator = params.pop("decorator", None)
        entries.append((NewModuleTest(**params), decorator))
        if "check_eval" in params:
            params["desc"] = "eval" if params.get("desc") is None else params["desc"] + "_eval"
            params["constructor"] = in_eval_mode(params["constructor"])
            entries.append((NewModuleTest(**params), decorator))
    return entries


def criterion_entries() -> list[tuple[CriterionTest, Callable | None]]:
    """test_nn.py's loss entries, each with its decorator."""
    entries = []
    for params in criterion_tests:
        params = dict(params)
        if "constructor" not in params:
            params["constructor"] = getattr(torch.nn, params.pop("module_name"))
        decorator = params.pop("decorator", None)
        entries.append((CriterionTest(**params), decorator))
    return entries


def variants(entry, tf32_supported: bool) -> list[tuple[str, Callable]]:
    """(test name, call) for each CUDA test test_nn.py makes of one entry."""
    name = entry.get_name() + "_cuda"
    parameters = inspect.signature(entry.test_cuda).parameters
    takes_dtype = "dtype" in parameters
    kwargs = {"extra_args": entry.extra_args} if "extra_args" in parameters else {}

    def run(case, **more):
        entry.test_cuda(case, **more, **kwargs)

    def tf32_pair(**more):
        def fp32(case):
            with tf32_off():
                run(case, **more)

        def tf32(case):
            with tf32_on(case, entry.tf32_precision):
                run(case, **more)
        return [("_fp32", fp32), ("_tf32", tf32)]

    if not takes_dtype:
        if tf32_supported and entry.with_tf32:
            return [(name + suffix, call) for suffix, call in tf32_pair()]
        return [(name, lambda case: run(case))]
    tests = ([(name + suffix, call) for suffix, call in tf32_pair(dtype=torch.float)]
             if tf32_supported and entry.with_tf32 else [(name + "_float", lambda case: run(case, dtype=torch.float))])
    dtypes = [("_double", torch.double)]
    if getattr(entry, "check_half", True):
        dtypes.append(("_half", torch.half))
    if getattr(entry, "check_bfloat16", True):
        dtypes.append(("_bfloat16", torch.bfloat16))
    if getattr(entry, "check_complex", False):
        dtypes += [("_cfloat", torch.cfloat), ("_cdouble", torch.cdouble)]
    tests += [(name + suffix, lambda case, dtype=dtype: run(case, dtype=dtype)) for suffix, dtype in dtypes]
    return tests


def main() -> int:
    warnings.simplefilter("ignore")
    start = time.time()
    case = CudaParityCase()
    tf32_supported = torch.cuda.is_tf32_supported()
    stats = {"passed": 0, "failed": 0, "skipped": 0}
    failures, skips = [], {}
    for entry, decorator in module_entries() + criterion_entries():
        if not entry.should_test_cuda:
            continue
        for test_name, call in variants(entry, tf32_supported):
            test = decorator(call) if decorator is not None else call
            set_rng_seed()  # the seed PyTorch's TestCase.setUp draws every test's inputs from
            try:
                test(case)
            except unittest.SkipTest as skip:
                stats["skipped"] += 1
                skips[test_name] = str(skip)[:200]
                continue
            except Exception as error:  # noqa: BLE001 - recorded per test
                stats["failed"] += 1
                where = traceback.extract_tb(error.__traceback__)[-1]
                failures.append({"test": test_name, "message": (f"{type(error).__name__}: "
                                 f"{' '.join(str(error).split())}")[:400],
                                 "at": f"{where.filename.rsplit('/', 1)[-1]}:{where.lineno}"})
                continue
            stats["passed"] += 1
    total = stats["passed"] + stats["failed"]
    for f in failures:
        print(f"FAIL {f['test']}: {f['message']} ({f['at']})", file=sys.stderr)
    print(json.dumps({"nn_sweep": 1, **stats, "total": total, "fraction": stats["passed"] / max(total, 1),
                      "seconds": round(time.time() - start, 1), "failures": failures, "skips": skips}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
