"""Eager PyTorch modules whose published timings check clocked mode's memory-bound kernels.

bench/validate.py's `module` cases: linkedin/Liger-Kernel publishes, beside its own kernels, the
time of the eager PyTorch code they replace (benchmark/data/all_benchmark_data.csv: the
`huggingface` and `torch` providers), on A100 80GB and H100 80GB, timed with
triton.testing.do_bench (the median of many calls, the L2 cache cleared before each, CUDA events
around the call). Each module here is that eager code, rewritten from the formula it computes,
with the input shapes of the published row; `time_ms` times it the same way on the emulated GPU
of a `mirage run --timing --predict-only` process, so the kernels are PyTorch's own, counted by
the op path, and only their predicted time is compared.

The modes are Liger's: `forward` (the module), `backward` (backward from a kept output with a
random gradient made once, parameters' gradients accumulating; the inputs' gradients reset
before each call) and `full` (forward, then backward with that gradient; a scalar loss backward
from its implicit 1; the inputs' gradients reset as in `backward`, except where the module's
source keeps them). `peak_mib` is Liger's memory figure: the peak device memory allocated
during `full`, the inputs and gradients made before it included.
"""

from __future__ import annotations

import statistics
from typing import Callable

import torch
import torch.nn.functional as F

DEVICE = "cuda"


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class _RMSNorm(torch.nn.Module):
    """transformers' LlamaRMSNorm as Liger's benchmark copies it: normalised in float32, cast back
    to the input's dtype, scaled by a float32 weight (so a bfloat16 input gives a float32 output)."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(hidden))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.to(torch.float32)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
        return self.weight * x.to(dtype)


def _layer_norm(size: int) -> tuple[list[torch.Tensor], Callable[[], torch.Tensor]]:
    """torch.nn.LayerNorm over `size` features of 4096 float32 rows."""
    x = torch.randn(4096, size, device=DEVICE, requires_grad=True)
    norm = torch.nn.LayerNorm(size, eps=1e-6, device=DEVICE)
    return [x], lambda: norm(x)


def _rms_norm(size: int) -> tuple[list[torch.Tensor], Callable[[], torch.Tensor]]:
    """LlamaRMSNorm over `size` features of 2048 bfloat16 rows."""
    x = torch.randn(2048, size, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
    norm = _RMSNorm(size).to(DEVICE)
    return [x], lambda: norm(x)


def _add_rms_norm(size: int) -> tuple[list[torch.Tensor], Callable[[], torch.Tensor]]:
    """The residual add before an RMSNorm, in float32 (Liger's naive fused_add_rms_norm), 2048 rows."""
    x = torch.randn(2048, size, device=DEVICE, requires_grad=True)
    residual = torch.randn(2048, size, device=DEVICE, requires_grad=True)
    norm = _RMSNorm(size).to(DEVICE)
    return [x], lambda: norm(x.to(torch.float32) + residual.to(torch.float32))


def _relu_squared(size: int) -> tuple[list[torch.Tensor], Callable[[], torch.Tensor]]:
    """square(relu(x)) over 4096 bfloat16 rows of `size`."""
    x = torch.randn(4096, size, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
    return [x], lambda: torch.square(F.relu(x))


def _swiglu(size: int) -> tuple[list[torch.Tensor], Callable[[], torch.Tensor]]:
    """silu of one torch.chunk half times the other (Megatron's unfused SwiGLU), a 2048 x 4 x 2*size
    bfloat16 input: both kernels read strided views."""
    y = torch.randn(2048, 4, 2 * size, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)

    def forward() -> torch.Tensor:
        gate, up = torch.chunk(y, 2, -1)
        return F.silu(gate) * up
    return [y], forward


def _rope(seq: int) -> tuple[list[torch.Tensor], Callable[[], tuple[torch.Tensor, torch.Tensor]]]:
    """transformers' apply_rotary_pos_emb (rotate-half) on q (32 heads) and k (8 heads) of hidden size
    8192, laid out (batch, seq, heads, dim) and transposed, bfloat16; cos/sin computed outside."""
    head_dim = 8192 // 32
    q = torch.randn(1, seq, 32, head_dim, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(1, seq, 8, head_dim, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
    angle = torch.randn(1, seq, head_dim, device=DEVICE)
    cos, sin = angle.cos().to(torch.bfloat16).unsqueeze(1), angle.sin().to(torch.bfloat16).unsqueeze(1)

    def forward() -> tuple[torch.Tensor, torch.Tensor]:
        qt, kt = q.transpose(1, 2), k.transpose(1, 2)
        return qt * cos + _rotate_half(qt) * sin, kt * cos + _rotate_half(kt) * sin
    return [q, k], forward


def _cross_entropy(vocab: int) -> tuple[list[torch.Tensor], Callable[[], torch.Tensor]]:
    """torch.nn.CrossEntropyLoss on 8 x 2048 float32 logits over `vocab` classes."""
    logits = torch.randn(8 * 2048, vocab, device=DEVICE, requires_grad=True)
    target = torch.randint(vocab, (8 * 2048,), device=DEVICE)
    loss = torch.nn.CrossEntropyLoss()
    return [logits], lambda: loss(logits, target)


# name -> (size -> (the inputs whose gradients are reset, the forward call))
MODULES: dict[str, Callable[[int], tuple[list[torch.Tensor], Callable[[], object]]]] = {
    "layer_norm": _layer_norm, "rms_norm": _rms_norm, "add_rms_norm": _add_rms_norm, "relu_squared": _relu_squared,
    "swiglu": _swiglu, "rope": _rope, "cross_entropy": _cross_entropy}


# Modules whose source differentiates with torch.autograd.grad (no .grad kept between calls).
_GRAD_ONLY = {"rope"}
# Modules whose source times `full` without resetting the inputs' gradients (no grad_to_none:
# Liger's benchmark_cross_entropy.py at b5672a15, the script of the published A100 rows), so each
# call's backward adds into the .grad the calls before it left.
_INPUT_GRAD_KEPT_IN_FULL = {"cross_entropy"}


def _call(module: str, size: int, mode: str) -> tuple[list[torch.Tensor], Callable[[], object]]:
    """The module's inputs and its call in `mode`. The output gradients are made once beforehand,
    in the input's dtype as the sources make them (`torch.randn_like(x)`: a bfloat16 gradient of
    RMSNorm's float32 output is cast by autograd on every call); the forward that gave their shapes
    is kept only for `backward`, which runs from it."""
    inputs, forward = MODULES[module](size)

    def outputs() -> tuple[torch.Tensor, ...]:
        out = forward()
        return out if isinstance(out, tuple) else (out,)

    def differentiate(out: tuple[torch.Tensor, ...], **kwargs: bool) -> None:
        if module in _GRAD_ONLY:
            torch.autograd.grad(out, inputs, grads, **kwargs)
        else:
            torch.autograd.backward(out, grads, **kwargs)
    kept = outputs()
    dtype = inputs[0].dtype
    grads = None if kept[0].dim() == 0 else [torch.randn_like(t, dtype=dtype) for t in kept]  # a loss: its implicit 1
    if mode == "forward":
        return inputs, forward
    if mode == "backward":
        return inputs, lambda: differentiate(kept, retain_graph=True)
    del kept
    return inputs, lambda: differentiate(outputs())


def time_ms(module: str, size: int, mode: str, repeats: int = 3) -> float:
    """The median time of one call in `mode`, as triton.testing.do_bench takes it: a 256 MB buffer
    zeroed before each call (do_bench's L2 flush), CUDA events around the call alone."""
    inputs, call = _call(module, size, mode)
    flush = torch.empty(256 * 2**20, dtype=torch.int8, device=DEVICE)
    call()
    times = []
    for _ in range(repeats):
        for t in inputs:
            if not (mode == "full" and module in _INPUT_GRAD_KEPT_IN_FULL):
                t.grad = None
        flush.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        call()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def peak_mib(module: str, size: int, repeats: int = 3) -> float:
    """The median, over calls of `full`, of the peak memory allocated during the call (MiB), as
    Liger's _test_memory takes it (the peak statistics reset before each call, gradients kept)."""
    _, full = _call(module, size, "full")
    peaks = []
    for _ in range(repeats):
        torch.cuda.reset_peak_memory_stats()
        full()
        peaks.append(torch.cuda.max_memory_allocated() / 2**20)
    return statistics.median(peaks)
