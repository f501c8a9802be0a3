"""megatron-core's JIT-fused elementwise functions on an emulated GPU, each timed as the one kernel
a fuser makes of it.

2021's Megatron-LM scripted its bias + GeLU (forward and backward) and its bias + dropout +
residual add with TorchScript, whose CUDA fuser ran each as one kernel; megatron-core decorates
the same functions with torch.compile (megatron/core/jit.py), whose generated host kernels would
make a predict-only step of Table 1's sizes take hours here. Under mirage, `install` puts back each
function's Python original (what the decorator wrapped) inside bench/one_kernel.py's region: its
ops are not timed one by one, and the call is charged as one memory-bound kernel that reads each
tensor argument once and writes one output of the largest argument's size, plus the dropout's
bool mask where the function draws one. The backward of the bias + dropout + add is autograd's,
kernel by kernel, as TorchScript's autodiff gave it: the dropout's backward, the bias's gradient
(a sum over the tokens), and the residual's gradient passed through.
"""

from __future__ import annotations

import functools
import importlib
from typing import Callable

import torch

from _softmax_kernels import one_kernel

# (module, function) -> bytes the kernel also writes per output element: a dropout's bool mask
FUSED = {
    ("megatron.core.fusions.fused_bias_gelu", "bias_gelu"): 0,
    ("megatron.core.fusions.fused_bias_gelu", "bias_gelu_back"): 0,
    ("megatron.core.fusions.fused_bias_dropout", "bias_dropout_add_fused_train"): 1,
}


def _tensors(args: tuple) -> list[torch.Tensor]:
    """The tensors among the arguments, in tuples too (bias_dropout_add takes (x, bias))."""
    found = []
    for arg in args:
        if isinstance(arg, torch.Tensor):
            found.append(arg)
        elif isinstance(arg, (tuple, list)):
            found += _tensors(tuple(arg))
    return found


def as_one_kernel(function: Callable, mask_bytes: int) -> Callable:
    """`function` (elementwise, its output the size of its largest argument) timed as one kernel."""
    @functools.wraps(function)
    def call(*args):
        tensors = _tensors(args)
        largest = max(tensors, key=torch.Tensor.numel)
        moved = sum(t.numel() * t.element_size() for t in tensors) + largest.numel() * (largest.element_size() + mask_bytes)
        with one_kernel(function.__name__, largest.device, moved, largest.dtype):
            return function(*args)
    return call


def install() -> None:
    """Replaces megatron-core's compiled fused functions by their originals, each timed as one
    kernel; the modules' callers look them up by name at each call, so they take these."""
    for (module_name, name), mask_bytes in FUSED.items():
        module = importlib.import_module(module_name)
        compiled = getattr(module, name)
        original = getattr(compiled, "_torchdynamo_orig_callable", compiled)
        setattr(module, name, as_one_kernel(original, mask_bytes))
