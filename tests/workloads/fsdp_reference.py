"""FSDP2 held to one device: the check tests/workloads/parallelisms.py and flex_parallel.py share."""

import torch
import torch.distributed as dist
from torch import nn


def train_like_one_device(model: nn.Module, reference: nn.Module, inputs: torch.Tensor, targets: torch.Tensor,
                          rank: int, world: int, steps: int) -> list[float]:
    """Trains the fully_shard-ed `model` on this rank's share of a global batch and `reference` on
    the whole batch on one device, with SGD (lr 0.1) and MSE. The mean over ranks of each rank's
    mean loss is the global mean, so the losses must match every step, and the final parameters
    too; a missing gradient reduction leaves them apart. Returns the reference's losses."""
    device = next(reference.parameters()).device
    opt, ref_opt = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(reference.parameters(), lr=0.1)
    share = len(inputs) // world
    shard = slice(rank * share, (rank + 1) * share)
    losses = []
    for _ in range(steps):
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
        losses.append(round(ref_loss.item(), 4))
    for sharded, whole in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(sharded.full_tensor(), whole.detach(), rtol=1e-4, atol=1e-5)
    return losses
