"""DTensor's offset-based RNG on emulated GPUs: a tensor initialised after sharding equals the
same initialisation on one GPU. Run with 4 ranks; rank 0 prints one `ok <op>` line per check.

Every rank seeds alike (as torchtitan does), shards a 64 x 32 tensor by rows over 4 GPUs,
initialises it in place (normal_, uniform_, and nn.init's trunc_normal_, which draws through
uniform_), gathers it, and compares it with the same call on one GPU from the same RNG state.
"""

import os

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

rank = int(os.environ["RANK"])
torch.cuda.set_device(rank)
mesh = init_device_mesh("cuda", (int(os.environ["WORLD_SIZE"]),))
torch.manual_seed(1234)
INITS = {"normal_": lambda t: t.normal_(0.0, 0.02), "uniform_": lambda t: t.uniform_(-1.0, 1.0),
         "trunc_normal_": lambda t: torch.nn.init.trunc_normal_(t, std=0.02)}
for name, init in INITS.items():
    before = torch.cuda.get_rng_state()
    sharded = distribute_tensor(torch.zeros(64, 32, device="cuda"), mesh, [Shard(0)])
    init(sharded)
    full = sharded.full_tensor()
    after = torch.cuda.get_rng_state()
    torch.cuda.set_rng_state(before)
    reference = init(torch.zeros(64, 32, device="cuda"))
    assert torch.equal(full, reference), f"{name}: sharded differs from one GPU on rank {rank}"
    local = sharded.to_local()
    assert not torch.equal(local, full[:16]) or rank == 0  # each shard has values of its own
    torch.cuda.set_rng_state(after)  # as DTensor left it: past the whole tensor on every rank
    if rank == 0:
        print(f"ok {name} sharded over {mesh.size()} equals one GPU", flush=True)
dist.destroy_process_group()
