"""A data-parallel job for --stand-ins (tests/test_stand_ins.py): FSDP2 over the whole world,
launched by torchrun on every node. Prints what each running rank was told of the world and what
integer collectives answered, then trains a few steps (clocked, --predict-only).

    mirage run --timing --predict-only --num-nodes N --gpus-per-node G [--stand-ins K] -- \\
        torchrun --nnodes=$MIRAGE_NUM_NODES --node-rank=$MIRAGE_NODE_RANK --nproc-per-node=G \\
        --rdzv-endpoint=$MASTER_ADDR:$MASTER_PORT tests/workloads/stand_ins.py
"""

import os

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

WIDTH, LAYERS, BATCH, STEPS = 1024, 4, 8, 4

torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
dist.init_process_group("nccl")
rank, world = dist.get_rank(), dist.get_world_size()
mesh = init_device_mesh("cuda", (world,))
ones = torch.tensor([1], device="cuda")  # from the host: under --predict-only no kernel fills memory
dist.all_reduce(ones)
ranks = [None] * world
dist.all_gather_object(ranks, rank % int(os.environ["LOCAL_WORLD_SIZE"]))
if rank == 0:
    print(f"world {world} WORLD_SIZE {os.environ['WORLD_SIZE']} ones {ones.item()} local ranks {ranks}", flush=True)

model = torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)]).cuda()
for layer in model:
    fully_shard(layer, mesh=mesh)
fully_shard(model, mesh=mesh)
shard = next(model.parameters()).to_local()
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
for _ in range(STEPS):
    model(torch.randn(BATCH, WIDTH, device="cuda")).sum().backward()
    optimizer.step()
    optimizer.zero_grad()
if rank == 0:
    print(f"shard rows {shard.shape[0]} of {WIDTH}", flush=True)
dist.destroy_process_group()
