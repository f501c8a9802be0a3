"""torchtitan as its published runs of 2024 had it (their RMSNorm, their grouped-query attention),
then the trainer.

    torchrun ... bench/torchtitan2024.py --norm rmsnorm -m torchtitan.train ARGS
    torchrun ... bench/torchtitan2024.py --norm fused_rmsnorm bench/torchtitan_llama2.py ARGS

The runs torchtitan published in 2024 (docs/validation.md, E13-E32; torchtitan 0413364 of 2024-04
and 9dec370 of 2024-12) differ from torchtitan 0.2.2, which mirage runs, in two places that change
the kernels a step runs:

- The norm. torchtitan 0.2.2 builds it as nn.RMSNorm, whose F.rms_norm a CUDA build of torch 2.13
  runs as one fused kernel (`aten._fused_rms_norm`, pytorch/pytorch#150576, 2025), and mirage
  emulates that. The 2024 runs chose their norm with `model.norm_type` in their train config:
  `rmsnorm` (torchtitan's configs from 2024-07 on, so the H100 benchmark of 2024-12; the Llama 3
  and Llama 2 70B configs of 2024-04): torchtitan's own RMSNorm module, in eager ops:
  `(x.float() * rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)).type_as(x) * weight`, each
  op a kernel that autograd records, keeping float32 intermediates for the backward;
  `fused_rmsnorm` (the Llama 3 8B and Llama 2 13B configs of 2024-04): torchtitan's Triton kernel,
  one fused kernel forward and one backward that save the input and rstd, which is what torch
  2.13's fused kernel does. `--norm rmsnorm` sets F.rms_norm (what nn.RMSNorm calls) to the
  module's formula of then; `--norm fused_rmsnorm` leaves it.
- Grouped-query attention. torchtitan 0.2.2 passes the key and value heads to SDPA as they are
  (`enable_gqa`, torchtitan PR 2259 of 2026-01); the 2024 runs repeated them to the query heads
  first (`repeat_kv`: unsqueeze, expand and reshape on the (batch, seq, heads, dim) layout, a copy
  of each, whose backward sums the repeats), and SDPA saved the repeated tensors for its backward.
  F.scaled_dot_product_attention is set to do that when it is asked for grouped-query attention.

Then the trainer runs as `python -m MODULE` or `python SCRIPT` would. Nothing of torchtitan is
changed. (torchtitan's git history: train_configs/*.toml, torchtitan/models/norms.py,
torchtitan/models/llama/model.py.)
"""

import runpy
import sys

import torch
import torch.nn.functional as F

SDPA = F.scaled_dot_product_attention


def torchtitan_rmsnorm_of_2024(input: torch.Tensor, normalized_shape: list[int], weight: torch.Tensor | None = None,
                               eps: float | None = None) -> torch.Tensor:
    """torchtitan's RMSNorm module of 2024 (norm_type "rmsnorm"): normalised in float32 over the
    last dimension, cast back, then scaled by the weight."""
    x = input.float()
    normed = (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + (1e-6 if eps is None else eps))).type_as(input)
    return normed if weight is None else normed * weight


def repeat_kv_of_2024(heads: torch.Tensor, repeats: int) -> torch.Tensor:
    """torchtitan's repeat_kv of 2024 on keys or values given as (batch, heads, seq, dim), the
    transposed view of its (batch, seq, heads, dim) layout: each head repeated `repeats` times on
    that layout (a copy), then transposed back."""
    x = heads.transpose(1, 2)
    batch, seq, kv_heads, dim = x.shape
    return x.unsqueeze(3).expand(batch, seq, kv_heads, repeats, dim).reshape(batch, seq, kv_heads * repeats, dim) \
        .transpose(1, 2)


def sdpa_with_kv_repeated(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *args, enable_gqa: bool = False,
                          **kwargs) -> torch.Tensor:
    """F.scaled_dot_product_attention as torchtitan's 2024 attention reached it: grouped-query
    attention's keys and values repeated to the query heads beforehand."""
    if enable_gqa and key.size(-3) != query.size(-3):
        repeats = query.size(-3) // key.size(-3)
        key, value = repeat_kv_of_2024(key, repeats), repeat_kv_of_2024(value, repeats)
    return SDPA(query, key, value, *args, **kwargs)


if __name__ == "__main__":
    norm, trainer = sys.argv[2], sys.argv[3:]
    if sys.argv[1] != "--norm" or norm not in ("rmsnorm", "fused_rmsnorm"):
        sys.exit("usage: torchtitan2024.py --norm {rmsnorm,fused_rmsnorm} (-m MODULE | SCRIPT) ARGS")
    # The functions set come from this file imported under its own name: the trainer becomes
    # __main__, and torch.compile reads a function's globals through its module's name.
    import torchtitan2024
    if norm == "rmsnorm":
        F.rms_norm = torchtitan2024.torchtitan_rmsnorm_of_2024
    F.scaled_dot_product_attention = torchtitan2024.sdpa_with_kv_repeated
    if trainer[0] == "-m":
        sys.argv = [trainer[1], *trainer[2:]]
        runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
    else:
        sys.argv = trainer
        runpy.run_path(sys.argv[0], run_name="__main__")
