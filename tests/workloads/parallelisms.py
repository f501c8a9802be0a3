"""FSDP2, tensor parallel and DTensor on emulated GPUs (4 ranks), plus DDP with many small
buckets and gradient accumulation under no_sync. Rank 0 prints `ok <name>` for each and
`parallelisms_ok`. FSDP2's losses must equal the same model trained on one device."""

import copy
import os
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
device = torch.device("cuda", torch.cuda.current_device())
dist.init_process_group("nccl")
done = []


class Block(nn.Module):
    def __init__(self, width=32):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.attn = nn.MultiheadAttention(width, 4, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x):
        h = self.norm(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.mlp(x)


def transformer():
    torch.manual_seed(0)
    return nn.Sequential(Block(), Block(), nn.Linear(32, 1))


if not os.environ.get("DDP_ONLY"):  # DDP_ONLY=1: just the DDP part, at any world size
    # FSDP2: each rank trains on its shard of a global batch; the reference trains on the whole
    # batch on one device. Mean-of-means equals the global mean, so losses must match.
    torch.manual_seed(1)
    inputs, targets = torch.randn(world * 4, 8, 32), torch.randn(world * 4, 8, 1)
    reference = transformer().to(device)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    model = transformer().to(device)
    for block in model[:2]:
        fully_shard(block)
    fully_shard(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    shard = slice(rank * 4, (rank + 1) * 4)
    for step in range(5):
        loss = nn.functional.mse_loss(model(inputs[shard].to(device)), targets[shard].to(device))
        opt.zero_grad()
        loss.backward()
        opt.step()
        global_loss = loss.detach().clone()
        dist.all_reduce(global_loss, op=dist.ReduceOp.AVG)
        ref_loss = nn.functional.mse_loss(reference(inputs.to(device)), targets.to(device))
        ref_opt.zero_grad()
        ref_loss.backward()
        ref_opt.step()
        torch.testing.assert_close(global_loss.cpu(), ref_loss.detach().cpu(), rtol=1e-4, atol=1e-5)
    done.append("fsdp2 losses equal single-device training")

    # Tensor parallel on a 2x2 mesh (dp x tp).
    mesh = init_device_mesh("cuda", (2, 2), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 16)).to(device)
    expected = mlp(torch.ones(2, 16, device=device))
    tp_mlp = parallelize_module(copy.deepcopy(mlp), mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
    out = tp_mlp(torch.ones(2, 16, device=device))
    torch.testing.assert_close(out, expected)
    out.sum().backward()
    done.append("tensor parallel on a 2x2 mesh")

    # DTensor on a cuda mesh.
    flat = init_device_mesh("cuda", (world,))
    full = torch.arange(world * 4.0, device=device).reshape(world * 2, 2)
    d = distribute_tensor(full, flat, [Shard(0)])
    assert isinstance(d, DTensor) and d.to_local().shape == (2, 2) and d.to_local().device == device
    assert torch.equal(d.redistribute(flat, [Replicate()]).to_local(), full)
    assert torch.equal((d * 2).full_tensor(), full * 2)
    done.append("dtensor shard/replicate on a cuda mesh")

# DDP with many 1 MB buckets and gradient accumulation under no_sync.
torch.manual_seed(0)
deep = nn.Sequential(*[nn.Linear(64, 64) for _ in range(24)]).to(device)
ddp = nn.parallel.DistributedDataParallel(deep, bucket_cap_mb=1)
opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
steps = int(os.environ.get("DDP_STEPS", "50"))
for step in range(steps):
    x = torch.randn(8, 64, device=device)
    if step % 2 == 0:
        with ddp.no_sync():
            ddp(x).pow(2).mean().backward()
    else:
        ddp(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
checksum = torch.stack([p.detach().sum() for p in deep.parameters()]).sum().reshape(1)
all_sums = [torch.zeros_like(checksum) for _ in range(world)]
dist.all_gather(all_sums, checksum)
assert all(torch.equal(s, all_sums[0]) for s in all_sums)
done.append(f"ddp 24 params, bucket_cap_mb=1, no_sync, {steps} steps")

if rank == 0:
    for name in done:
        print(f"ok {name}")
    print("parallelisms_ok")
dist.destroy_process_group()
sys.exit(0)
