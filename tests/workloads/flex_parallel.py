"""Compiled FlexAttention under FSDP2 and tensor parallelism on 2 emulated GPUs, as torchtitan uses
it: a small transformer whose attention is torch.compile(flex_attention) with a causal mask that
stops at document boundaries, each block compiled. Rank 0 prints `ok <name>` for each part and
`flex_parallel_ok`.

The references attend with SDPA and the same mask made dense, an implementation independent of
mirage's FlexAttention. FSDP2: each rank trains on its half of a global batch; the reference model
trained on the whole batch on one device must have the same losses and final parameters (a
missing gradient reduction, or a wrong flex gradient, leaves them apart). Tensor parallel: q/k/v
column-sharded by heads, the output projection row-sharded, so each rank attends over its own
heads; output and gradients must equal the unsharded SDPA module's."""

import copy
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

from fsdp_reference import train_like_one_device

rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
device = torch.device("cuda", torch.cuda.current_device())
dist.init_process_group("nccl")
LENGTH, WIDTH, HEADS = 128, 64, 4
compiled_flex = torch.compile(flex_attention)
# documents of 50, 30 and 48 tokens: attention is causal within each
documents = torch.repeat_interleave(torch.arange(3), torch.tensor([50, 30, 48])).to(device)
block_mask = create_block_mask(lambda b, h, q, kv: (documents[q] == documents[kv]) & (q >= kv), None, None,
                               LENGTH, LENGTH, device=device, BLOCK_SIZE=32)
positions = torch.arange(LENGTH, device=device)
dense_mask = (documents[:, None] == documents[None, :]) & (positions[:, None] >= positions[None, :])


class Attention(nn.Module):
    def __init__(self, dense: bool = False):
        super().__init__()
        self.dense = dense  # the reference: SDPA with the dense mask
        self.q, self.k, self.v = (nn.Linear(WIDTH, WIDTH) for _ in range(3))
        self.out = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, _ = x.shape
        # under tensor parallelism q/k/v hold this rank's heads only
        q, k, v = (p(x).view(batch, length, -1, WIDTH // HEADS).transpose(1, 2) for p in (self.q, self.k, self.v))
        if self.dense:
            y = nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=dense_mask)
        else:
            y = compiled_flex(q, k, v, block_mask=block_mask)
        return self.out(y.transpose(1, 2).reshape(batch, length, -1))


class Block(nn.Module):
    def __init__(self, dense: bool):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(WIDTH), nn.LayerNorm(WIDTH)
        self.attn = Attention(dense)
        self.mlp = nn.Sequential(nn.Linear(WIDTH, 2 * WIDTH), nn.GELU(), nn.Linear(2 * WIDTH, WIDTH))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


def transformer(dense: bool = False) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(Block(dense), Block(dense), nn.Linear(WIDTH, 1)).to(device)


torch.manual_seed(1)
inputs, targets = torch.randn(world * 2, LENGTH, WIDTH), torch.randn(world * 2, LENGTH, 1)
reference = transformer(dense=True)
model = transformer()
for block in model[:2]:
    block.compile()
    fully_shard(block)
fully_shard(model)
losses = train_like_one_device(model, reference, inputs, targets, rank, world, steps=3)
if rank == 0:
    print(f"ok fsdp2 with compiled blocks and compiled flex attention: losses {losses} equal one device's")

mesh = init_device_mesh("cuda", (world,), mesh_dim_names=("tp",))
torch.manual_seed(0)
attention = Attention(dense=True).to(device)
plan = {"q": ColwiseParallel(), "k": ColwiseParallel(), "v": ColwiseParallel(), "out": RowwiseParallel()}
tp_attention = copy.deepcopy(attention)
tp_attention.dense = False
tp_attention = parallelize_module(tp_attention, mesh, plan)
x = torch.randn(2, LENGTH, WIDTH, device=device)  # the same on every rank (same seed)
expected, out = attention(x), tp_attention(x)
torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-5)
expected.square().sum().backward()
out.square().sum().backward()
for name, whole in attention.named_parameters():
    sharded = tp_attention.get_parameter(name)
    assert isinstance(sharded.grad, DTensor), name
    torch.testing.assert_close(sharded.grad.full_tensor(), whole.grad, rtol=1e-4, atol=1e-5,
                               msg=lambda m, name=name: f"{name}: {m}")
if rank == 0:
    print("ok tensor parallel over heads with compiled flex attention: output and gradients equal")
    print("flex_parallel_ok")
dist.destroy_process_group()
