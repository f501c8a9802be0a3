"""FlexAttention's entries in PyTorch's higher-order-op database (torch.testing._internal.hop_db),
run on an emulated GPU as PyTorch's own suites run them on CUDA.

Run under `mirage run --gpus-per-node 1 -- python tests/workloads/flex_hop_sweep.py`. hop_db has
three FlexAttention OpInfos (flex_attention "simple"; flex_attention_backward "simple" and
"explicit_buffers"), CUDA-only, float16 and float32, one sample each. Every sample goes through:

- numerics (float16 and float32): the device's outputs (and, for the forward, the gradients of q,
  k and v for a backward of the output's sum) against a float64 run of the same sample on the
  CPU, by PyTorch's FlexAttention test rule (test/inductor/test_flex_attention.py): the mean
  error may be at most FUDGE times that of the same CPU run in the sample's dtype. The forward's
  CPU runs call the higher-order op (torch's dense code): the public API refuses a CPU backward.
- the harness checks of the PyTorch tests that consume hop_db, in float32 as they run them:
  compile[aot_eager], compile[inductor] (test/dynamo/test_higher_order_ops.py, test_hops_compile:
  eager against torch.compile(fullgraph=True)); export[strict], export[pre_dispatch],
  export[retrace], export[serialize] (test/export/test_hop.py: eager against the exported
  program); make_fx[real|fake|symbolic] (test/test_proxy_tensor.py) and aot_autograd_check
  (test/functorch/test_aotdispatch.py).

The harness checks are reported as they end: "pass", or the exception's type and message.
`python tests/workloads/flex_hop_sweep.py cpu`, without mirage,
runs the harness checks on CPU tensors (without gradients: the CPU has no FlexAttention backward).
Which outcome CUDA gives is the caller's to judge (tests/test_flex_attention.py holds PyTorch's
expected failures). The last line of stdout is one JSON object: {"flex_hop_sweep": 1, "results":
[{"op", "variant", "dtype", "check", "outcome", "message"}]}.
"""

from __future__ import annotations

import copy
import io
import json
import math
import sys
import warnings

import torch
import torch.utils._pytree as pytree
from torch._higher_order_ops.flex_attention import flex_attention as flex_attention_hop
from torch.export import export, load, save
from torch.export._trace import _export
from torch.fx.experimental.proxy_tensor import make_fx
from torch.testing._internal.hop_db import hop_db
from torch.testing._internal.optests import aot_autograd_check

# `python flex_hop_sweep.py cpu` (no mirage): the harness checks alone, on CPU tensors without
# gradients (the CPU has no FlexAttention backward), to tell torch's own failures from the device's
DEVICE = sys.argv[1] if len(sys.argv) > 1 else "cuda"
FUDGE = {torch.float32: 10.0, torch.float16: 1.1}  # test_flex_attention.py's _check_equal
HARNESS_DTYPES = (torch.float32,)  # the hop_db consumers' allowed_dtypes

warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")


def flex_entries() -> list:
    return [op for op in hop_db if op.name.startswith("flex_attention")]


def sample_on(op, device: str, dtype: torch.dtype, like=None):
    """op's (only) sample on `device` in `dtype`; with `like`, its tensors hold like's values (each
    device draws from its own generator, and the samples' closures capture their own device's
    tensors, so the sample is rebuilt there rather than moved)."""
    requires_grad = op.supports_autograd and device == "cuda"
    sample = next(iter(op.sample_inputs(device, dtype, requires_grad=requires_grad)))
    if like is not None:
        ours = pytree.tree_leaves((sample.input, sample.args))
        theirs = pytree.tree_leaves((like.input, like.args))
        with torch.no_grad():
            for mine, source in zip(ours, theirs, strict=True):
                if isinstance(mine, torch.Tensor):
                    mine.copy_(source.to(mine.dtype))
    return sample


def arguments(sample) -> tuple:
    inputs = sample.input if isinstance(sample.input, tuple) else (sample.input,)
    return (*inputs, *sample.args)


def forward_results(op, args: tuple, on_cpu: bool) -> list[torch.Tensor]:
    """The forward's output and the gradients of q, k, v for out.sum(). On the CPU, whose public
    flex_attention refuses a backward, through torch's higher-order op itself: its dense forward
    and its dense backward (which takes the forward's out and logsumexp, as CUDA's kernels do)."""
    q, k, v, score_mod, block_mask = args
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    if on_cpu:
        out = flex_attention_hop(*leaves, score_mod, block_mask.as_tuple(), 1 / math.sqrt(q.size(-1)), {})[0]
    else:
        out = op.op(*leaves, score_mod, block_mask)
    out.sum().backward()
    return [out.detach(), *(t.grad for t in leaves)]


def results(op, args: tuple, on_cpu: bool = False) -> list[torch.Tensor]:
    if op.name == "flex_attention":
        return forward_results(op, args, on_cpu)
    return [t for t in pytree.tree_leaves(op.op(*args)) if isinstance(t, torch.Tensor)]


def numerics(op, dtype: torch.dtype) -> None:
    device_sample = sample_on(op, DEVICE, dtype)
    device = [t.cpu().double() for t in results(op, arguments(device_sample))]
    golden = [t.double() for t in results(op, arguments(sample_on(op, "cpu", torch.float64, device_sample)), True)]
    same_dtype = [t.double() for t in results(op, arguments(sample_on(op, "cpu", dtype, device_sample)), True)]
    assert len(device) == len(golden), f"{len(device)} results, the CPU's {len(golden)}"
    for index, (result, gold, ref) in enumerate(zip(device, golden, same_dtype)):
        assert result.shape == gold.shape, f"result {index}: shape {tuple(result.shape)}, the CPU's {tuple(gold.shape)}"
        error = (result - gold).abs().mean().item()
        ref_error = (ref - gold).abs().mean().item()
        allowed = max(FUDGE[dtype] * ref_error, 1e-12)
        assert error <= allowed, f"result {index}: mean error {error:.3g} > {FUDGE[dtype]} x the CPU's {ref_error:.3g}"


def compiled(op, args: tuple, backend: str) -> None:
    torch._dynamo.reset()
    call = lambda a: op.op(*a)  # noqa: E731
    expected = call(copy.deepcopy(args))
    actual = torch.compile(call, backend=backend, fullgraph=True)(copy.deepcopy(args))
    torch.testing.assert_close(actual, expected)


class Calls(torch.nn.Module):
    def __init__(self, op):
        super().__init__()
        self.op = op

    def forward(self, *args):
        return self.op.op(*args)


def exported(op, args: tuple, how: str) -> None:
    model = Calls(op)
    if how == "strict":
        program = export(model, args, strict=True)
    else:
        program = _export(model, args, pre_dispatch=True)
        if how in ("retrace", "serialize"):
            program = program.run_decompositions()
        if how == "serialize":
            buffer = io.BytesIO()
            save(program, buffer)
            buffer.seek(0)
            program = load(buffer)
    expected = pytree.tree_leaves(model(*copy.deepcopy(args)))
    actual = pytree.tree_leaves(program.module()(*copy.deepcopy(args)))
    torch.testing.assert_close(actual, expected)
    torch._dynamo.reset()


def traced(op, args: tuple, mode: str) -> None:
    graph = make_fx(lambda *a: op.op(*a), tracing_mode=mode)(*args)
    torch.testing.assert_close(graph(*args), op.op(*args))


def aot_checked(op, args: tuple) -> None:
    aot_autograd_check(op.op, args, {}, dynamic=False, check_gradients=op.supports_autograd)


HARNESS = {
    "compile[aot_eager]": lambda op, args: compiled(op, args, "aot_eager"),
    "compile[inductor]": lambda op, args: compiled(op, args, "inductor"),
    "export[strict]": lambda op, args: exported(op, args, "strict"),
    "export[pre_dispatch]": lambda op, args: exported(op, args, "pre_dispatch"),
    "export[retrace]": lambda op, args: exported(op, args, "retrace"),
    "export[serialize]": lambda op, args: exported(op, args, "serialize"),
    "make_fx[real]": lambda op, args: traced(op, args, "real"),
    "make_fx[fake]": lambda op, args: traced(op, args, "fake"),
    "make_fx[symbolic]": lambda op, args: traced(op, args, "symbolic"),
    "aot_autograd_check": aot_checked,
}


def outcome(check) -> tuple[str, str]:
    try:
        check()
    except Exception as error:  # every failure is an outcome to report, not a crash
        return type(error).__name__, " ".join(str(error).split())[:300]
    return "pass", ""


def main() -> None:
    rows = []
    for op in flex_entries():
        for dtype in sorted(op.supported_dtypes("cuda"), key=str):
            checks = {"numerics": lambda: numerics(op, dtype)} if DEVICE == "cuda" else {}
            if dtype in HARNESS_DTYPES:
                checks.update({name: (lambda run=run: run(op, arguments(sample_on(op, DEVICE, dtype))))
                               for name, run in HARNESS.items()})
            for name, check in checks.items():
                result, message = outcome(check)
                row = {"op": op.name, "variant": op.variant_test_name, "dtype": str(dtype).removeprefix("torch."),
                       "check": name, "outcome": result, "message": message}
                print(f"{op.name}.{op.variant_test_name} {row['dtype']} {name}: {result} {message[:120]}",
                      flush=True)
                rows.append(row)
    print(json.dumps({"flex_hop_sweep": 1, "results": rows}))


if __name__ == "__main__":
    main()
