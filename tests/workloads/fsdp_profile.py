"""FSDP2 training steps profiled as torchtitan's --profiling flags profile them: torch.profiler
with a schedule (warm up over one step, record the next), CPU and CUDA activity, one Chrome trace per
rank written by on_trace_ready to argv[1]/rank<N>.json. Run by torchrun under `mirage run
--timing` (tests/test_user_profiler.py), which reads the traces with Holistic Trace Analysis.
Each rank also writes argv[1]/rank<N>.step.json: mirage's own split of the recorded step (its
collectives and the part of them no kernel overlapped), for the test to hold HTA's figures to."""

import json
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from torch.profiler import ProfilerActivity, profile, schedule

WIDTH, LAYERS, TOKENS = 1024, 4, 2048


def main(out_dir: str) -> None:
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Sequential(torch.nn.Linear(WIDTH, 4 * WIDTH), torch.nn.GELU(),
                                                      torch.nn.Linear(4 * WIDTH, WIDTH)) for _ in range(LAYERS)))
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    model.cuda()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    x = torch.randn(TOKENS, WIDTH, device="cuda")

    def write_trace(prof: profile) -> None:
        prof.export_chrome_trace(os.path.join(out_dir, f"rank{rank}.json"))

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], schedule=schedule(wait=0, warmup=1, active=1, repeat=1),
                 on_trace_ready=write_trace) as prof:
        for _ in range(3):
            model(x).square().mean().backward()
            optimizer.step()
            optimizer.zero_grad()
            prof.step()
    torch.cuda.synchronize()
    # the steps mirage split (one per optimizer step): [device, end, duration, compute, memory,
    # collective, exposed, idle] ns; the recorded one is the second
    rows, _ = torch.ops.mirage.clock_steps()
    device, end, duration, compute, memory, collective, exposed, idle = rows[1]
    with open(os.path.join(out_dir, f"rank{rank}.step.json"), "w", encoding="utf-8") as f:
        json.dump({"rank": rank, "collective_ns": collective, "exposed_ns": exposed, "duration_ns": duration}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
