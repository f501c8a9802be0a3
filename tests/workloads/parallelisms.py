"""FSDP2, tensor parallel and DTensor on emulated GPUs (4 ranks), plus DDP with many small
buckets and gradient accumulation under no_sync. Rank 0 prints `ok <name>` for each and
`parallelisms_ok`.

Each parallel model is held to the same model trained on one device: FSDP2's losses and final
parameters, tensor parallel's output and gradients, DDP's parameters. FSDP2 and DDP train on
different data on every rank, so a missing gradient reduction leaves the ranks' models apart
from the reference (and DDP's from each other)."""

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

from fsdp_reference import train_like_one_device

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
    # batch on one device.
    torch.manual_seed(1)
    inputs, targets = torch.randn(world * 4, 8, 32), torch.randn(world * 4, 8, 1)
    reference = transformer().to(device)
    model = transformer().to(device)
    for block in model[:2]:
        fully_shard(block)
    fully_shard(model)
    train_like_one_device(model, reference, inputs, targets, rank, world, steps=5)
    done.append("fsdp2 losses equal single-device training")

    # Tensor parallel on a 2x2 mesh (dp x tp).
    mesh = init_device_mesh("cuda", (2, 2), mesh_dim_names=("dp", "tp"))
    # The same seed on every rank: a tensor parallel group takes the same input on each of its ranks.
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 16)).to(device)
    tp_mlp = parallelize_module(copy.deepcopy(mlp), mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
    x = torch.randn(2, 16, device=device)
    expected = mlp(x)
    out = tp_mlp(x)
    torch.testing.assert_close(out, expected)
    expected.sum().backward()
    out.sum().backward()
    for name, whole in mlp.named_parameters():
        sharded = tp_mlp.get_parameter(name)
        assert isinstance(sharded.grad, DTensor), name
        torch.testing.assert_close(sharded.grad.full_tensor(), whole.grad, msg=lambda m, name=name: f"{name}: {m}")
    done.append("tensor parallel on a 2x2 mesh, gradients equal the unsharded module's")

    # DTensor on a cuda mesh.
    flat = init_device_mesh("cuda", (world,))
    full = torch.arange(world * 4.0, device=device).reshape(world * 2, 2)
    d = distribute_tensor(full, flat, [Shard(0)])
    assert isinstance(d, DTensor) and d.to_local().shape == (2, 2) and d.to_local().device == device
    assert torch.equal(d.redistribute(flat, [Replicate()]).to_local(), full)
    assert torch.equal((d * 2).full_tensor(), full * 2)
    done.append("dtensor shard/replicate on a cuda mesh")

# DDP with many 1 MB buckets and gradient accumulation under no_sync, each rank on its own data.
# The reference replays the schedule on one device with every rank's batch at once: the mean
# over ranks of each rank's mean loss is the mean over the whole batch, so DDP's averaged
# gradients must equal the reference's. A copy trained on this rank's data alone (no all-reduce)
# must end elsewhere, or the comparison could not tell DDP from no DDP.
torch.manual_seed(0)
deep = nn.Sequential(*[nn.Linear(64, 64) for _ in range(24)]).to(device)
reference, alone = copy.deepcopy(deep), copy.deepcopy(deep)
ddp = nn.parallel.DistributedDataParallel(deep, bucket_cap_mb=1)
optimizers = [torch.optim.SGD(m.parameters(), lr=0.01) for m in (ddp, reference, alone)]
batches = [torch.Generator().manual_seed(1000 + r) for r in range(world)]  # rank r's data
steps = int(os.environ.get("DDP_STEPS", "50"))
for step in range(steps):
    xs, ys = zip(*((torch.randn(8, 64, generator=g).to(device), torch.randn(8, 64, generator=g).to(device))
                   for g in batches))
    if step % 2 == 0:
        with ddp.no_sync():
            nn.functional.mse_loss(ddp(xs[rank]), ys[rank]).backward()
    else:
        nn.functional.mse_loss(ddp(xs[rank]), ys[rank]).backward()
    nn.functional.mse_loss(reference(torch.cat(xs)), torch.cat(ys)).backward()
    nn.functional.mse_loss(alone(xs[rank]), ys[rank]).backward()
    if step % 2 == 1:
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()
for name, trained in deep.named_parameters():
    torch.testing.assert_close(trained, reference.get_parameter(name), rtol=1e-4, atol=1e-6,
                               msg=lambda m, name=name: f"rank {rank}: DDP's {name} is not the reference's: {m}")
assert any(not torch.allclose(p, q, rtol=1e-3, atol=1e-5) for p, q in zip(deep.parameters(), alone.parameters())), \
    "training without DDP ends where DDP does: the comparison cannot tell them apart"
checksum = torch.stack([p.detach().sum() for p in deep.parameters()]).sum().reshape(1)
all_sums = [torch.zeros_like(checksum) for _ in range(world)]
dist.all_gather(all_sums, checksum)
assert all(torch.equal(s, all_sums[0]) for s in all_sums)
done.append(f"ddp 24 params, bucket_cap_mb=1, no_sync, {steps} steps, equal to one device on every rank's data")

if rank == 0:
    for name in done:
        print(f"ok {name}")
    print("parallelisms_ok")
dist.destroy_process_group()
sys.exit(0)
