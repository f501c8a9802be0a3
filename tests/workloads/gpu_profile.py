"""A data-parallel training step under the user's torch.profiler with ProfilerActivity.CUDA and
profile_memory=True, as a performance engineer profiles one on a GPU box: a Linear, fused
attention, DDP's gradient all_reduce, a send from rank 0 to 1, a copy to the host. Run by torchrun under `mirage run`
(tests/test_user_profiler.py); each rank writes its Chrome trace to argv[1]/rank<N>.json and,
to argv[1]/rank<N>.report.json, what its key_averages() says of aten::mm and the predicted time
of its GEMM where clocked mode is on."""

import json
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel
from torch.profiler import ProfilerActivity, profile, supported_activities

M, K, N = 256, 512, 512


def main(out_dir: str) -> None:
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    torch.manual_seed(0)
    model = DistributedDataParallel(torch.nn.Linear(K, N, bias=False, device="cuda", dtype=torch.bfloat16))
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    q, k, v = (torch.randn(2, 4, 128, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], profile_memory=True) as prof:
        attention = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        loss = model(x).float().square().mean() + attention.float().mean()
        loss.backward()
        handoff = torch.full((4096,), float(rank), device="cuda")  # a pipeline's hand-off, rank 0 to 1
        if rank == 0:
            dist.send(handoff, 1)
        else:
            dist.recv(handoff, 0)
        total = loss.detach().cpu()
        torch.cuda.synchronize()
    prof.export_chrome_trace(os.path.join(out_dir, f"rank{rank}.json"))
    mm = [e for e in prof.key_averages() if e.key == "aten::mm"]
    predicted = torch.ops.mirage.clock_predict_gemm_ns(M, N, K, torch.bfloat16) if torch.ops.mirage.clock_enabled() else 0
    report = os.path.join(out_dir, f"rank{rank}.report.json")
    with open(report, "w", encoding="utf-8") as f:
        json.dump({
            "rank": rank,
            "supported": sorted(str(a) for a in supported_activities()),
            "mm_count": mm[0].count if mm else 0,
            "mm_device_us": mm[0].device_time_total if mm else 0.0,
            "gemm_predicted_ns": predicted,
            "loss_is_finite": bool(torch.isfinite(total)),
        }, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
