"""End-to-end case for clocked mode's validation: a GPT-2-style model trained data-parallel, as
published runs configure it (bench/validate.py's end-to-end cases run this under
`mirage run --timing --predict-only`; on a real GPU box it runs as is, under torchrun).

    torchrun --nproc_per_node=8 bench/e2e_gpt.py --layers 12 --dim 768 --heads 12 --seq 1024 --batch 64

A nanoGPT-shaped transformer (pre-LayerNorm blocks, causal scaled_dot_product_attention, GELU
MLP of 4x, tied embeddings; MPT's shapes with --dim/--layers/--heads/--vocab), bf16 autocast,
AdamW, DDP over NCCL, FSDP1 as Composer configured it for llm-foundry's MPT runs (--fsdp1:
flat parameters, BACKWARD_POST prefetch, limit_all_gathers) or FSDP2 (--fsdp), with Composer's
mixed precision modes (--mp DEFAULT: bf16 parameters, fp32 gradient reductions, as llm-foundry's
benchmarking table ran; PURE: bf16 both). The loss: eager PyTorch's cross entropy over the bf16
logits, or (--fused-loss) the fused kernels llm-foundry's runs took it with (FusedCrossEntropy).
Prints one JSON line from rank 0: the median step time its own CUDA events measured and the
tokens per second per GPU.

No --compile: under `--predict-only` a torch.compile'd graph still runs inductor's host kernels
(mirage/runtime/inductor.py, HostCompiledGraph), so a compiled step of these sizes cannot be
predicted in minutes on a few cores; the cases are eager PyTorch.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

import torch
import torch.distributed as dist
import torch.nn.functional as F
from one_kernel import one_kernel
from torch import nn


class Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.fc, self.out = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d)
        x = x + self.proj(y)
        return x + self.out(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))


class FusedCrossEntropy(torch.autograd.Function):
    """The mean cross entropy of [rows, classes] logits, as llm-foundry's runs took their loss:
    flash-attn's CrossEntropyLoss (`loss_fn: fused_crossentropy`), whose CUDA kernels are apex's
    xentropy ones (csrc/xentropy/xentropy_kernel.cu). The forward kernel reads the logits twice
    (their maximum and sum, then the sum of exponentials) and writes each row's loss and
    log-sum-exp in float; the backward kernel reads the logits once and writes their gradient.
    Eager PyTorch's log_softmax and nll_loss move more than twice that (a written log-probability
    matrix, its re-reads, a zero-filled gradient). Under clocked mode each kernel is timed as one
    (bench/one_kernel.py); the math runs in chunks of rows, so that no logits-sized temporary exists that
    the CUDA kernels do not allocate (the memory accounting sees theirs)."""

    ROWS_PER_CHUNK = 1024

    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        rows, chunk = logits.size(0), FusedCrossEntropy.ROWS_PER_CHUNK
        lse = torch.empty(rows, device=logits.device, dtype=torch.float32)
        moved = 2 * logits.numel() * logits.element_size() + targets.numel() * targets.element_size() + 2 * lse.nbytes
        with one_kernel("xentropy_forward", logits.device, moved, logits.dtype):
            for start in range(0, rows, chunk):
                torch.logsumexp(logits[start:start + chunk].float(), -1, out=lse[start:start + chunk])
            losses = lse - logits.gather(1, targets[:, None]).squeeze(1).float()
        ctx.save_for_backward(logits, lse, targets)
        return losses.mean()

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor) -> tuple[torch.Tensor, None]:
        logits, lse, targets = ctx.saved_tensors
        rows, chunk = logits.size(0), FusedCrossEntropy.ROWS_PER_CHUNK
        grad = torch.empty_like(logits)
        moved = 2 * logits.numel() * logits.element_size() + targets.numel() * targets.element_size() + lse.nbytes
        with one_kernel("xentropy_backward", logits.device, moved, logits.dtype):
            for start in range(0, rows, chunk):
                part = grad[start:start + chunk]  # softmax(logits) - one_hot(targets), scaled by the mean's gradient
                torch.sub(logits[start:start + chunk], lse[start:start + chunk, None], out=part)
                part.exp_()
                part.scatter_add_(1, targets[start:start + chunk, None],
                                  torch.full((part.size(0), 1), -1.0, device=part.device, dtype=part.dtype))
                part.mul_(grad_loss / rows)
        return grad, None


class GPT(nn.Module):
    def __init__(self, layers: int, dim: int, heads: int, vocab: int, seq: int, fused_loss: bool = False) -> None:
        super().__init__()
        self.fused_loss = fused_loss
        self.wte, self.wpe = nn.Embedding(vocab, dim), nn.Embedding(seq, dim)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.wte.weight

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln(x)).view(-1, self.head.out_features)
        # The loss over the bf16 logits, outside autocast: its cross_entropy would copy them to
        # fp32 (12.3 GiB for MPT-350m's 32 x 2048 x 50368, past llm-foundry's micro-batch's memory).
        with torch.autocast("cuda", enabled=False):
            if self.fused_loss:
                return FusedCrossEntropy.apply(logits, targets.view(-1))
            return F.cross_entropy(logits, targets.view(-1))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--dim", type=int, default=768)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--vocab", type=int, default=50304)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=64, help="sequences per GPU per micro-step")
    ap.add_argument("--accumulate", type=int, default=1, help="micro-steps per optimizer step")
    ap.add_argument("--steps", type=int, default=4)
    sharding = ap.add_mutually_exclusive_group()  # neither: DDP
    sharding.add_argument("--fsdp", action="store_true",
                          help="FSDP2 (fully_shard) per block, initialised on the meta device")
    sharding.add_argument("--fsdp1", action="store_true",
                          help="FSDP1 (FullyShardedDataParallel) as Composer configured it for llm-foundry's "
                               "runs: FULL_SHARD per block, flat parameters, BACKWARD_POST prefetch (Composer's "
                               "default), limit_all_gathers (the MPT yamls'), initialised from the meta device")
    ap.add_argument("--fused-loss", action="store_true",
                    help="the loss by flash-attn's fused cross-entropy kernels, as llm-foundry's runs took it "
                         "(`loss_fn: fused_crossentropy`), not eager PyTorch's log_softmax and nll_loss")
    ap.add_argument("--mp", choices=("DEFAULT", "PURE"), default="DEFAULT",
                    help="with --fsdp or --fsdp1, Composer's mixed precision: DEFAULT = bf16 parameters, fp32 "
                         "reductions; PURE = bf16 parameters and reductions")
    args = ap.parse_args()
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if args.fsdp1:
        from torch.distributed.fsdp import BackwardPrefetch, MixedPrecision, ShardingStrategy
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        with torch.device("meta"):
            model = GPT(args.layers, args.dim, args.heads, args.vocab, args.seq, args.fused_loss)
        reduce_dtype = torch.float32 if args.mp == "DEFAULT" else torch.bfloat16
        precision = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=reduce_dtype, buffer_dtype=torch.bfloat16)

        def materialize(module: nn.Module) -> None:  # each rank its own values, as llm-foundry's param_init_fn
            module.to_empty(device=torch.device("cuda"), recurse=False)
            with torch.no_grad():
                for p in module.parameters(recurse=False):
                    p.normal_(std=0.02)

        model = FSDP(model, sharding_strategy=ShardingStrategy.FULL_SHARD, auto_wrap_policy=ModuleWrapPolicy({Block}),
                     mixed_precision=precision, backward_prefetch=BackwardPrefetch.BACKWARD_POST,
                     limit_all_gathers=True, device_id=torch.cuda.current_device(), param_init_fn=materialize)
        ddp = model
    elif args.fsdp:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        with torch.device("meta"):
            model = GPT(args.layers, args.dim, args.heads, args.vocab, args.seq, args.fused_loss)
        reduce_dtype = torch.float32 if args.mp == "DEFAULT" else torch.bfloat16
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=reduce_dtype)
        for block in model.blocks:
            fully_shard(block, mp_policy=policy)
        fully_shard(model, mp_policy=policy)
        model.to_empty(device="cuda")
        with torch.no_grad():
            for p in model.parameters():
                p.to_local().normal_(std=0.02)  # each rank its shard
        ddp = model
    else:
        model = GPT(args.layers, args.dim, args.heads, args.vocab, args.seq, args.fused_loss).cuda()
        ddp = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.AdamW(model.parameters(), lr=6e-4, weight_decay=0.1)
    idx = torch.randint(0, args.vocab, (args.batch, args.seq), device="cuda")
    times = []
    for _ in range(args.steps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for micro in range(args.accumulate):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = ddp(idx, idx) / args.accumulate
            if micro < args.accumulate - 1 and not (args.fsdp or args.fsdp1):
                with ddp.no_sync():
                    loss.backward()
            else:
                loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    step_ms = statistics.median(times[1:] if len(times) > 1 else times)
    tokens = args.batch * args.seq * args.accumulate
    if rank == 0:
        print("E2E " + json.dumps({"step_ms": step_ms, "tokens_per_s_per_gpu": tokens / (step_ms / 1e3)}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
