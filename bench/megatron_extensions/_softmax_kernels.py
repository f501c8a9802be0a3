"""Megatron's fused softmax CUDA kernels on an emulated GPU, each timed as the one kernel it is.

Megatron builds these kernels as CUDA extensions (`scaled_upper_triang_masked_softmax_cuda`,
`scaled_masked_softmax_cuda`, from apex's or Megatron's csrc/megatron/), which cannot be compiled
on a machine without nvcc. megatron-core imports them by those names when masked-softmax fusion
is on (megatron/core/fusions/fused_softmax.py), so this directory, put on PYTHONPATH by
bench/megatron_sc21.py under mirage, provides them with the same functions and arguments.

Each function computes its result with PyTorch ops timed as the one kernel the CUDA kernel is
(bench/one_kernel.py), moving what it moves.
What it moves, read in apex's csrc/megatron/scaled_upper_triang_masked_softmax.h: the causal
forward reads only each row's unmasked prefix (row i reads i + 1 elements) and writes the whole
row (zeros past the prefix); its backward reads the gradient and the softmax output over the same
prefix and writes the whole row. The masked kernels read the whole input and the mask.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.append(str(Path(__file__).resolve().parents[1]))  # bench/, where the kernel region lives
from one_kernel import one_kernel  # noqa: E402  (the extensions take it from here)

__all__ = ["one_kernel", "causal_prefix_share", "softmax_forward", "softmax_backward_", "batch_per_block"]


def causal_prefix_share(seq: int) -> float:
    """The share of a square causal score matrix the kernels read: row i's first i + 1 elements."""
    return (seq + 1) / (2 * seq)


def softmax_forward(scores: torch.Tensor, scale: float, masked: torch.Tensor | None, fill: float) -> torch.Tensor:
    """softmax(scale * scores) over the last dimension, `fill` where `masked` is true, computed in
    the one output tensor the kernel writes (no temporaries of the scores' size, so the memory
    accounting sees what the CUDA kernel allocates)."""
    out = scores.mul(scale)
    if masked is not None:
        out.masked_fill_(masked, fill)
    out.sub_(out.amax(dim=-1, keepdim=True)).exp_()
    return out.div_(out.sum(dim=-1, keepdim=True))


def softmax_backward_(grad: torch.Tensor, probs: torch.Tensor, scale: float) -> torch.Tensor:
    """The gradient of softmax(scale * x), written into `grad` as the CUDA kernel writes it."""
    row_dots = (grad.unsqueeze(-2) @ probs.unsqueeze(-1)).squeeze(-1)  # sum(grad * probs) per row
    return grad.sub_(row_dots).mul_(probs).mul_(scale)


def batch_per_block(key_seq_len: int) -> int:
    """Rows one block of 128 threads computes (apex's get_batch_per_block): a warp of at most 32
    lanes per row, two rows per warp when the row fits in 128 elements."""
    next_power_of_two = 1 << max(key_seq_len - 1, 0).bit_length()
    warp_size = min(next_power_of_two, 32)
    batches_per_warp = 2 if next_power_of_two <= 128 else 1
    return (128 // warp_size) * batches_per_warp
