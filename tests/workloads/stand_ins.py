"""A data-parallel job for --stand-ins (tests/test_stand_ins.py), launched by torchrun on every
node. Prints what each running rank was told of the world and what integer collectives answered,
then trains a few steps (clocked, --predict-only).

    mirage run --timing --predict-only --num-nodes N --gpus-per-node G [--stand-ins K] -- \\
        torchrun --nnodes=$MIRAGE_NUM_NODES --node-rank=$MIRAGE_NODE_RANK --nproc-per-node=G \\
        --rdzv-endpoint=$MASTER_ADDR:$MASTER_PORT tests/workloads/stand_ins.py [STAGES DP TP]

Without arguments: FSDP2 over the whole world. With STAGES DP TP: a mesh laid out as torchtitan
lays out pipeline x data x tensor parallelism (stages outermost): the model is sharded over DP,
each stage sends its activations to the next (send/recv), and each activation is all-reduced over
TP, as tensor parallelism does.
"""

import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

WIDTH, LAYERS, BATCH, STEPS = 1024, 4, 8, 4

torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
dist.init_process_group("nccl")
rank, world = dist.get_rank(), dist.get_world_size()
stages, dp, tp = map(int, sys.argv[1:4]) if len(sys.argv) > 1 else (1, world, 1)
mesh = init_device_mesh("cuda", (stages, dp, tp), mesh_dim_names=("pp", "dp", "tp"))
ones = torch.tensor([1], device="cuda")  # from the host: under --predict-only no kernel fills memory
dist.all_reduce(ones)
ranks = [None] * world
dist.all_gather_object(ranks, rank % int(os.environ["LOCAL_WORLD_SIZE"]))
if rank == 0:
    print(f"world {world} WORLD_SIZE {os.environ['WORLD_SIZE']} ones {ones.item()} local ranks {ranks}", flush=True)

model = torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)]).cuda()
for layer in model:
    fully_shard(layer, mesh=mesh["dp"])
fully_shard(model, mesh=mesh["dp"])
shard = next(model.parameters()).to_local()
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
stage, stage_ranks = mesh["pp"].get_local_rank(), dist.get_process_group_ranks(mesh["pp"].get_group())
for _ in range(STEPS):
    activation = torch.randn(BATCH, WIDTH, device="cuda")
    if stage > 0:
        dist.recv(activation, stage_ranks[stage - 1])
    activation = model(activation)
    if tp > 1:
        dist.all_reduce(activation, group=mesh["tp"].get_group())
    if stage < stages - 1:
        dist.send(activation.detach(), stage_ranks[stage + 1])
    activation.sum().backward()
    optimizer.step()
    optimizer.zero_grad()
if rank == 0:
    print(f"shard rows {shard.shape[0]} of {WIDTH}", flush=True)
dist.destroy_process_group()
