"""DeepSpeed ZeRO-3 trains a small MLP on emulated GPUs: parameters partitioned across the ranks,
gathered by DeepSpeed's prefetcher on its own stream before each layer, gradients reduce-scattered
as buckets fill, with a torch AdamW (DeepSpeed's fused Adam needs nvcc). Rank 0 prints
`zero3 losses ...`; the loss falls."""

import os

import deepspeed
import torch
from torch import nn

torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
deepspeed.init_distributed("nccl")
torch.manual_seed(0)
model = nn.Sequential(*[nn.Sequential(nn.Linear(128, 128), nn.GELU()) for _ in range(6)], nn.Linear(128, 1))
config = {
    "train_micro_batch_size_per_gpu": 16,
    "gradient_accumulation_steps": 1,
    "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0, "reduce_bucket_size": 20000,
                          "stage3_prefetch_bucket_size": 20000, "overlap_comm": True},
    "steps_per_print": 1000,
}
engine, _, _, _ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3),
                                       config=config)
generator = torch.Generator().manual_seed(int(os.environ["RANK"]))
inputs = torch.randn(16, 128, generator=generator).cuda()
targets = inputs[:, :1].clone()
losses = []
for _ in range(8):
    loss = nn.functional.mse_loss(engine(inputs), targets)
    engine.backward(loss)
    engine.step()
    losses.append(loss.item())
if int(os.environ["RANK"]) == 0:
    print("zero3 losses", " ".join(f"{x:.4f}" for x in losses))
