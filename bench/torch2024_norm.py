"""A trainer run with F.rms_norm as the torch of its published run computed it (2024).

    torchrun ... bench/torch2024_norm.py -m torchtitan.train ARGS
    torchrun ... bench/torch2024_norm.py bench/torchtitan_llama2.py ARGS

A CUDA build of torch 2.13 runs F.rms_norm (nn.RMSNorm: torchtitan's norm) as one fused kernel,
`aten._fused_rms_norm`, and mirage emulates that. PyTorch got the kernel in 2025
(pytorch/pytorch#150576, "speeds up RMSNorm in eager mode by 2-5x for both the forward and
backward passes"). The torchtitan runs published in 2024 (docs/validation.md, E13-E32) ran on a
torch whose F.rms_norm was a composite of ATen ops, each a kernel of its own that autograd
records, saving float32 intermediates: the input upcast to float32, squared, averaged over the
normalized dimensions, eps added, rsqrt, the product with the upcast input and with the weight,
the cast back (rms_norm_symint in aten/src/ATen/native/layer_norm.cpp of that time). To predict
those runs like for like, this runs the trainer with F.rms_norm as that composite, then the
trainer as `python -m MODULE` or `python SCRIPT` would; nothing of the trainer is changed.
"""

import runpy
import sys

import torch
import torch.nn.functional as F


def rms_norm_of_2024(input: torch.Tensor, normalized_shape: list[int], weight: torch.Tensor | None = None,
                     eps: float | None = None) -> torch.Tensor:
    """F.rms_norm as torch of 2024 computed it on a GPU: in float32 for 16-bit inputs, op by op."""
    upcast = input.float() if input.dtype in (torch.float16, torch.bfloat16) else input
    dims = tuple(range(-len(normalized_shape), 0))
    eps = torch.finfo(upcast.dtype).eps if eps is None else eps
    result = upcast * torch.rsqrt(upcast.pow(2).mean(dims, keepdim=True).add(eps))
    if weight is not None:
        result = result * weight
    return result.type_as(input)


if __name__ == "__main__":
    F.rms_norm = rms_norm_of_2024
    if sys.argv[1] == "-m":
        sys.argv = [sys.argv[2], *sys.argv[3:]]
        runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
    else:
        sys.argv = sys.argv[1:]
        runpy.run_path(sys.argv[0], run_name="__main__")
