"""Autocast sweep: PyTorch's CUDA autocast op lists (autocast_test_lists.AutocastTestLists) on an
emulated GPU, checked with PyTorch's own harness (TestAutocast._run_autocast_outofplace: under
torch.autocast("cuda") every op must produce the dtype a CUDA build casts it to, bit for bit what
casting its inputs by hand gives), list by list as PyTorch's test_cuda.py runs them: fp16 and
bf16 ops, fp32 ops, ops that promote, ops with builtin promotion, torch._C._nn and linalg ops,
Tensor methods; the banned ops must raise.

Run under `mirage run --gpus-per-node 1 -- python tests/workloads/autocast_sweep.py`. The last
line of stdout is one JSON object: {"autocast_sweep": 1, "passed", "failed", "total",
"fraction", "failures": [{"list", "op", "message"}]}.
"""

from __future__ import annotations

import json
import sys
import warnings

import torch
from torch.testing._internal.autocast_test_lists import AutocastTestLists, TestAutocast

FP16, BF16, FP32 = torch.float16, torch.bfloat16, torch.float32


class Harness(TestAutocast):
    def runTest(self) -> None:  # a TestCase needs one to be instantiated
        pass


def cases(lists: AutocastTestLists):
    """(list name, op, callable running the check) in test_cuda.py's order."""
    harness = Harness()

    def run(op, args, run_as, amp, module=torch, kwargs=None, out_type=None):
        return lambda: harness._run_autocast_outofplace(op, args, run_as, device="cuda", module=module,
                                                       add_kwargs=kwargs, out_type=out_type, amp_dtype=amp)

    for entry in lists.torch_fp16:
        op, args, skip = entry[0], entry[1], (entry[2] if len(entry) == 3 else False)
        if not skip:
            yield "torch_fp16", op, run(op, args, FP16, FP16)
            yield "torch_bf16", op, run(op, args, BF16, BF16)
    for entry in lists.torch_fp32:
        op, args, kwargs = harness.args_maybe_kwargs(entry)
        yield "torch_fp32", op, run(op, args, FP32, FP16, kwargs=kwargs)
    for op, args in lists.torch_need_autocast_promote:
        yield "torch_need_autocast_promote", op, run(op, args, FP32, FP16)
    for op, args, out_type in lists.torch_expect_builtin_promote:
        yield "torch_expect_builtin_promote", op, run(op, args, FP32, FP16, out_type=out_type)
    for op, args in lists.nn_fp16:
        yield "nn_fp16", op, run(op, args, FP16, FP16, module=torch._C._nn)
        yield "nn_bf16", op, run(op, args, BF16, BF16, module=torch._C._nn)
    for entry in lists.nn_fp32:
        op, args, kwargs = harness.args_maybe_kwargs(entry)
        yield "nn_fp32", op, run(op, args, FP32, FP16, module=torch._C._nn, kwargs=kwargs)
    for op, args in lists.linalg_fp16:
        yield "linalg_fp16", op, run(op, args, FP16, FP16, module=torch._C._linalg)
    for op, args in lists.methods_fp16:
        yield "methods_fp16", op, run(op, args, FP16, FP16, module=None)
    for op, args in lists.methods_fp32:
        yield "methods_fp32", op, run(op, args, FP32, FP16, module=None)
    for op, args, out_type in lists.methods_expect_builtin_promote:
        yield "methods_expect_builtin_promote", op, run(op, args, FP32, FP16, module=None, out_type=out_type)
    for op, args, module in lists.banned:
        def banned(op=op, args=args, module=module):
            with torch.autocast("cuda"), harness.assertRaises(RuntimeError):
                getattr(module, op)(*args)
        yield "banned", op, banned


def main() -> int:
    warnings.simplefilter("ignore")
    torch.manual_seed(0)
    passed, failures = 0, []
    for list_name, op, check in cases(AutocastTestLists(torch.device("cuda", 0))):
        try:
            check()
            passed += 1
        except Exception as error:  # noqa: BLE001 - recorded per op (AssertionError included)
            failures.append({"list": list_name, "op": op,
                             "message": f"{type(error).__name__}: {' '.join(str(error).split())}"[:300]})
    total = passed + len(failures)
    for f in failures:
        print(f"FAIL {f['list']} {f['op']}: {f['message']}", file=sys.stderr)
    print(json.dumps({"autocast_sweep": 1, "passed": passed, "failed": len(failures), "total": total,
                      "fraction": passed / max(total, 1), "failures": failures}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
