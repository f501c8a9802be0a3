"""torch.compile in distributed training on emulated GPUs (2 ranks under torchrun): compiled DDP
(DDPOptimizer splits the graph at bucket boundaries), FSDP2 + compile, and a functional collective
inside a compiled graph. Each rank prints `ok <name>` per check, then `compiled_training_ok`."""

import os

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import nn
from torch._dynamo.utils import counters
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP

rank = int(os.environ["RANK"])
torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
dist.init_process_group("nccl")


class MLP(nn.Module):
    """A model of the user's own (dynamo compiles the frames of user code, not torch.nn's)."""

    def __init__(self, layers: int, width: int = 256):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(layers))
        self.head = nn.Linear(width, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.relu(layer(x))
        return self.head(x)


def mlp(layers: int = 6) -> nn.Module:
    torch.manual_seed(0)
    return MLP(layers).cuda()


def train(model: nn.Module, forward, steps: int = 3) -> list[float]:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    generator = torch.Generator().manual_seed(1 + rank)
    losses = []
    for _ in range(steps):
        loss = forward(torch.randn(16, 256, generator=generator).cuda()).square().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def check(name: str, condition: bool, detail: str = "") -> None:
    if not condition:
        raise SystemExit(f"[{rank}] FAILED {name} {detail}")
    print(f"[{rank}] ok {name}", flush=True)


# compiled DDP: 1.5 MiB of parameters in 1 MiB buckets, against eager DDP
eager_model, compiled_model = mlp(), mlp()
eager_ddp, compiled_ddp = DDP(eager_model, bucket_cap_mb=1), DDP(compiled_model, bucket_cap_mb=1)
eager_losses = train(eager_model, eager_ddp)
compiled_losses = train(compiled_model, torch.compile(compiled_ddp))
replicas = [torch.empty_like(flat(compiled_model)) for _ in range(2)]
dist.all_gather(replicas, flat(compiled_model))
check("compiled ddp replicas identical", torch.equal(replicas[0], replicas[1]))
check("compiled ddp equals eager ddp", torch.allclose(flat(compiled_model), flat(eager_model), rtol=1e-4, atol=1e-5)
      and torch.allclose(torch.tensor(compiled_losses), torch.tensor(eager_losses), rtol=1e-4, atol=1e-6),
      f"{compiled_losses} vs {eager_losses}")
inductor_graphs = sum(counters["inductor"][f"fxgraph_cache_{k}"] for k in ("hit", "miss", "bypass"))
check("ddp graph split at bucket boundaries", inductor_graphs >= 4, str(dict(counters["inductor"])))  # 2 x (fw, bw)


# FSDP2 + compile, against eager FSDP2
def sharded() -> nn.Module:
    model = mlp(layers=3)
    for layer in model.layers:
        fully_shard(layer)
    return fully_shard(model)


eager_fsdp, compiled_fsdp = sharded(), sharded()
eager_losses = train(eager_fsdp, eager_fsdp)
compiled_losses = train(compiled_fsdp, torch.compile(compiled_fsdp))
check("fsdp2 + compile equals eager fsdp2",
      torch.allclose(torch.tensor(compiled_losses), torch.tensor(eager_losses), rtol=1e-4, atol=1e-6),
      f"{compiled_losses} vs {eager_losses}")


# a functional collective inside a compiled graph goes through the emulated NCCL backend
@torch.compile(fullgraph=True)
def reduce_in_graph(x: torch.Tensor) -> torch.Tensor:
    return funcol.all_reduce(x * 2, "sum", dist.group.WORLD) + 1


x = torch.arange(8.0, device="cuda") + rank
out = reduce_in_graph(x)
expected = sum((torch.arange(8.0) + r) * 2 for r in range(2)) + 1
check("functional all_reduce in a compiled graph", out.device.type == "cuda" and torch.equal(out.cpu(), expected))

print(f"[{rank}] compiled_training_ok", flush=True)
dist.destroy_process_group()
