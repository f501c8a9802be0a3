"""Megatron's causal fused softmax extension on an emulated GPU (see _softmax_kernels.py)."""

from __future__ import annotations

import torch

from _softmax_kernels import causal_prefix_share, one_kernel, softmax_backward_, softmax_forward


def forward(inputs: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal softmax of scale x inputs, [attn_batches, sq, sk] with sq == sk <= 2048."""
    if inputs.dim() != 3 or inputs.size(1) != inputs.size(2) or inputs.size(1) > 2048:
        raise RuntimeError(f"scaled_upper_triang_masked_softmax_cuda.forward: expected [batches, seq, seq] with "
                           f"seq <= 2048, got {list(inputs.shape)}")
    seq, size = inputs.size(1), inputs.numel() * inputs.element_size()
    with one_kernel("scaled_upper_triang_masked_softmax_forward", inputs.device,
                    round(size * (causal_prefix_share(seq) + 1)), inputs.dtype):
        masked = torch.ones(seq, seq, dtype=torch.bool, device=inputs.device).triu(1)
        return softmax_forward(inputs, float(scale), masked, float("-inf"))  # the kernel never reads past the prefix


def backward(output_grads: torch.Tensor, softmax_results: torch.Tensor, scale: float) -> torch.Tensor:
    """The causal softmax's input gradient."""
    seq, size = output_grads.size(1), output_grads.numel() * output_grads.element_size()
    with one_kernel("scaled_upper_triang_masked_softmax_backward", output_grads.device,
                    round(size * (2 * causal_prefix_share(seq) + 1)), output_grads.dtype):
        return softmax_backward_(output_grads.contiguous(), softmax_results, float(scale))
