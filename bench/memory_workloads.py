"""The reference training steps of the memory table (bench/memory_table.py on mirage,
bench/calibrate_memory.py on a real GPU): the same models, batches and optimizer on both, so
their memory figures compare."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint


class Block(nn.Module):
    """A pre-norm GPT block: causal self-attention (SDPA) and a 4x MLP."""

    def __init__(self, width: int, heads: int):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, width = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(batch, seq, 3, self.heads, width // self.heads).unbind(2)
        attended = nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        x = x + self.proj(attended.transpose(1, 2).reshape(batch, seq, width))
        return x + self.mlp(self.norm2(x))


class GPT(nn.Module):
    def __init__(self, vocab: int, width: int, depth: int, heads: int, seq: int, checkpointed: bool):
        super().__init__()
        self.embed, self.position = nn.Embedding(vocab, width), nn.Embedding(seq, width)
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(depth))
        self.norm, self.head = nn.LayerNorm(width), nn.Linear(width, vocab, bias=False)
        self.checkpointed = checkpointed

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.position(torch.arange(tokens.shape[1], device=tokens.device))
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False) if self.checkpointed else block(x)
        return self.head(self.norm(x))


# name: (description, builder of (model, batch, loss function) on a device)
Workload = Callable[[torch.device], tuple[nn.Module, torch.Tensor, Callable]]


def _mlp(device: torch.device):
    layers: list[nn.Module] = []
    for i in range(4):
        layers += [nn.Linear(2048, 2048)] + ([nn.ReLU()] if i < 3 else [])
    model = nn.Sequential(*layers).to(device)
    batch = torch.randn(256, 2048, device=device)
    return model, batch, lambda out: out.float().pow(2).mean()


def _gpt(width: int, depth: int, seq: int, batch_size: int, checkpointed: bool) -> Workload:
    def build(device: torch.device):
        vocab = 8192
        model = GPT(vocab, width, depth, max(1, width // 64), seq, checkpointed).to(device)
        tokens = torch.randint(0, vocab, (batch_size, seq), device=device)
        targets = tokens.roll(-1, dims=1)
        return model, tokens, lambda logits: nn.functional.cross_entropy(logits.view(-1, vocab), targets.view(-1))
    return build


WORKLOADS: dict[str, tuple[str, Workload]] = {
    "mlp": ("4 x Linear(2048, 2048), batch 256 (bench/train_step.py's)", _mlp),
    "gpt-s": ("GPT 4 x 256 wide, seq 128, batch 8", _gpt(256, 4, 128, 8, False)),
    "gpt-s-ckpt": ("gpt-s with activation checkpointing", _gpt(256, 4, 128, 8, True)),
    "gpt-m": ("GPT 6 x 512 wide, seq 256, batch 4", _gpt(512, 6, 256, 4, False)),
    "gpt-m-ckpt": ("gpt-m with activation checkpointing", _gpt(512, 6, 256, 4, True)),
}


def train(name: str, device: torch.device, steps: int = 2) -> None:
    """`steps` AdamW steps of the workload from seed 0 (the second step is the steady state:
    the optimizer's state exists)."""
    torch.manual_seed(0)
    model, batch, loss_of = WORKLOADS[name][1](device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    # The math attention kernel on both sides: mirage runs SDPA's CPU path, and a GPU's fused
    # kernels allocate otherwise (their workspaces are not what this table checks).
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
        for _ in range(steps):
            optimizer.zero_grad(set_to_none=True)
            loss_of(model(batch)).backward()
            optimizer.step()
    torch.cuda.synchronize(device)
