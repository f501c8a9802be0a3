"""Megatron's masked fused softmax extension on an emulated GPU (see _softmax_kernels.py)."""

from __future__ import annotations

import torch

from _softmax_kernels import batch_per_block, one_kernel, softmax_backward_, softmax_forward


def forward(inputs: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    """Softmax of scale x inputs [b, np, sq, sk], -10000 where the mask [b or 1, 1, sq, sk] is set."""
    size = inputs.numel() * inputs.element_size()
    with one_kernel("scaled_masked_softmax_forward", inputs.device,
                    2 * size + mask.numel() * mask.element_size(), inputs.dtype):
        return softmax_forward(inputs, float(scale), mask.bool(), -10000.0)  # the kernel's masked value


def backward(output_grads: torch.Tensor, softmax_results: torch.Tensor, scale: float) -> torch.Tensor:
    """The masked softmax's input gradient."""
    size = output_grads.numel() * output_grads.element_size()
    with one_kernel("scaled_masked_softmax_backward", output_grads.device, 3 * size, output_grads.dtype):
        return softmax_backward_(output_grads.contiguous(), softmax_results, float(scale))


def get_batch_per_block(query_seq_len: int, key_seq_len: int, batches: int, attn_heads: int) -> int:
    """Rows per thread block, which megatron-core checks the attention batch divides."""
    return batch_per_block(key_seq_len)
