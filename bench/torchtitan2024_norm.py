"""torchtitan with the RMSNorm its published runs of 2024 used, then the trainer.

    torchrun ... bench/torchtitan2024_norm.py --norm rmsnorm -m torchtitan.train ARGS
    torchrun ... bench/torchtitan2024_norm.py --norm fused_rmsnorm bench/torchtitan_llama2.py ARGS

torchtitan 0.2.2 builds its norm as nn.RMSNorm, whose F.rms_norm a CUDA build of torch 2.13 runs
as one fused kernel (`aten._fused_rms_norm`, pytorch/pytorch#150576, 2025), and mirage emulates
that. The runs torchtitan published in 2024 (docs/validation.md, E13-E32) chose their norm with
`model.norm_type` in their train config, and neither choice was that kernel:

- `rmsnorm` (torchtitan's configs from 2024-07 on, so the H100 benchmark of 2024-12; the Llama 3
  and Llama 2 70B configs of 2024-04): torchtitan's own RMSNorm module, in eager ops:
  `(x.float() * rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)).type_as(x) * weight`, each
  op a kernel that autograd records, keeping float32 intermediates for the backward;
- `fused_rmsnorm` (the Llama 3 8B and Llama 2 13B configs of 2024-04, when docs/performance.md
  was written): torchtitan's Triton kernel, one fused kernel forward and one backward that save
  the input and rstd, which is what torch 2.13's fused kernel does: F.rms_norm is left as it is.

So `--norm rmsnorm` sets F.rms_norm (what nn.RMSNorm calls) to the module's formula of then, and
`--norm fused_rmsnorm` changes nothing; then the trainer runs as `python -m MODULE` or `python
SCRIPT` would. Nothing of torchtitan is changed. (torchtitan's git history: train_configs/*.toml,
torchtitan/models/norms.py.)
"""

import runpy
import sys

import torch
import torch.nn.functional as F


def torchtitan_rmsnorm_of_2024(input: torch.Tensor, normalized_shape: list[int], weight: torch.Tensor | None = None,
                               eps: float | None = None) -> torch.Tensor:
    """torchtitan's RMSNorm module of 2024 (norm_type "rmsnorm"): normalised in float32 over the
    last dimension, cast back, then scaled by the weight."""
    x = input.float()
    normed = (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + (1e-6 if eps is None else eps))).type_as(input)
    return normed if weight is None else normed * weight


if __name__ == "__main__":
    norm, trainer = sys.argv[2], sys.argv[3:]
    if sys.argv[1] != "--norm" or norm not in ("rmsnorm", "fused_rmsnorm"):
        sys.exit("usage: torchtitan2024_norm.py --norm {rmsnorm,fused_rmsnorm} (-m MODULE | SCRIPT) ARGS")
    if norm == "rmsnorm":
        F.rms_norm = torchtitan_rmsnorm_of_2024
    if trainer[0] == "-m":
        sys.argv = [trainer[1], *trainer[2:]]
        runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
    else:
        sys.argv = trainer
        runpy.run_path(sys.argv[0], run_name="__main__")
