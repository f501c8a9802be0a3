"""A CUDA kernel that a benchmark's workload computes as several PyTorch ops, timed as the one
kernel it is under mirage's clocked mode; and an attention kernel of another implementation than
the one clocked mode models, timed at its published speed (attention_at_rate).

Stand-ins for compiled CUDA extensions (Megatron's fused softmax, bench/megatron_extensions;
flash-attn's fused cross entropy, bench/e2e_gpt.py) compute their results with PyTorch ops inside
mirage's fused-kernel region (torch.ops.mirage.fused_kernel_begin / fused_kernel_end_named): the
ops are not timed one by one, and the region is charged as one memory-bound kernel moving what
the CUDA kernel moves. Off mirage (a real GPU) the ops run and are timed as themselves.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch


def _clocked() -> bool:
    """Whether this process runs under mirage's clocked mode (mirage's ops exist only under mirage)."""
    return hasattr(torch.ops.mirage, "clock_enabled") and torch.ops.mirage.clock_enabled()


@contextlib.contextmanager
def one_kernel(name: str, device: torch.device, bytes_moved: int, dtype: torch.dtype) -> Iterator[None]:
    """Times what runs inside as one kernel named `name` that moves `bytes_moved` (clocked mode
    only; otherwise the ops run and are timed as themselves)."""
    if not _clocked():
        yield
        return
    torch.ops.mirage.fused_kernel_begin()
    try:
        yield
    finally:
        torch.ops.mirage.fused_kernel_end_named(name, device.index, bytes_moved, dtype)


@contextlib.contextmanager
def attention_at_rate(rate: float) -> Iterator[None]:
    """Times the fused attention kernels placed inside as another implementation's, which runs
    at `rate` times the speed of flash-attn's FlashAttention-2 (the kernel the profile's attention
    efficiencies describe; SDPA's own flash kernels run at the profile's torch_flash_attention_rate
    of it), `rate` being what a publication measured the two at side by side (clocked mode only)."""
    if not _clocked():
        yield
        return
    torch.ops.mirage.attention_rate_begin(rate)
    try:
        yield
    finally:
        torch.ops.mirage.attention_rate_end()
