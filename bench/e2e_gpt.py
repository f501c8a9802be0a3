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
The attention: PyTorch's scaled_dot_product_attention (FlashAttention-2's kernels), or
(--attn-impl triton) llm-foundry's Triton FlashAttention, which its MPT runs took (TritonFlashAttention).
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
import tomllib
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from one_kernel import attention_at_rate, one_kernel
from torch import nn

FLASH_ATTENTION_FIGURES = Path(__file__).with_name("flash_attention_figures.toml")


def triton_flash_attention_rate(gpu_name: str, head_dim: int, seq: int) -> float:
    """The speed of llm-foundry's Triton FlashAttention kernel (causal, forward + backward) over
    FlashAttention-2's on this GPU at this shape: FlashAttention v1's measured rate over
    FlashAttention-2's, side by side in FlashAttention-2's release figures, v1 being what the
    kernel's own notes say it is slightly slower than (bench/flash_attention_figures.toml)."""
    table = tomllib.loads(FLASH_ATTENTION_FIGURES.read_text())
    gpu = next((name for name in ("a100", "h100") if name in gpu_name.lower()), None)
    for figure in table["figure"]:
        if (figure["gpu"], figure["causal"], figure["head_dim"]) == (gpu, True, head_dim) and seq in table["seqs"]:
            v1, v2 = (figure[key][table["seqs"].index(seq)] for key in ("flash_attention", "flash_attention_2"))
            if v1 and v2:
                return v1 / v2
    raise SystemExit(f"e2e_gpt.py: --attn-impl triton has no published figure of FlashAttention v1 beside "
                     f"FlashAttention-2 for {gpu_name}, head dim {head_dim}, seq {seq} (causal); "
                     f"{FLASH_ATTENTION_FIGURES.name} has A100 and H100 at head dims 64 and 128, seq 512 to 16384")


class TritonFlashAttention(torch.autograd.Function):
    """Causal attention as llm-foundry's MPT runs computed it (`attn_impl: triton`): Tri Dao's
    pre-MLIR Triton FlashAttention kernel (llmfoundry/models/layers/flash_attn_triton.py), one
    forward kernel and one backward kernel doing FlashAttention's work. It cannot run without a
    GPU, so it is computed by scaled_dot_product_attention, whose flash kernels clocked mode times
    as FlashAttention-2's, at `rate` of their speed (one_kernel.attention_at_rate); off mirage it
    is scaled_dot_product_attention itself."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rate: float) -> torch.Tensor:
        ctx.inputs = [t.detach().requires_grad_() for t in (q, k, v)]
        with torch.enable_grad(), attention_at_rate(rate):
            ctx.out = F.scaled_dot_product_attention(*ctx.inputs, is_causal=True)
        ctx.rate = rate
        return ctx.out.detach()

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        with attention_at_rate(ctx.rate):
            torch.autograd.backward(ctx.out, grad_out)
        grads = tuple(t.grad for t in ctx.inputs)
        ctx.inputs = ctx.out = None  # what the kernel saved, freed as autograd frees saved tensors
        return (*grads, None)


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, triton_rate: float | None = None) -> None:
        super().__init__()
        self.heads, self.triton_rate = heads, triton_rate
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.fc, self.out = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        if self.triton_rate is None:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            y = TritonFlashAttention.apply(q, k, v, self.triton_rate)
        y = y.transpose(1, 2).reshape(b, t, d)
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
    def __init__(self, layers: int, dim: int, heads: int, vocab: int, seq: int, fused_loss: bool = False,
                 triton_rate: float | None = None) -> None:
        super().__init__()
        self.fused_loss = fused_loss
        self.wte, self.wpe = nn.Embedding(vocab, dim), nn.Embedding(seq, dim)
        self.blocks = nn.ModuleList(Block(dim, heads, triton_rate) for _ in range(layers))
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
    ap.add_argument("--attn-impl", choices=("sdpa", "triton"), default="sdpa",
                    help="the attention kernels: PyTorch's scaled_dot_product_attention, or llm-foundry's Triton "
                         "FlashAttention, which its MPT runs took (`attn_impl: triton`), at its published speed")
    ap.add_argument("--mp", choices=("DEFAULT", "PURE"), default="DEFAULT",
                    help="with --fsdp or --fsdp1, Composer's mixed precision: DEFAULT = bf16 parameters, fp32 "
                         "reductions; PURE = bf16 parameters and reductions")
    args = ap.parse_args()
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    triton_rate = None
    if args.attn_impl == "triton":
        triton_rate = triton_flash_attention_rate(torch.cuda.get_device_name(), args.dim // args.heads, args.seq)
    gpt_args = (args.layers, args.dim, args.heads, args.vocab, args.seq, args.fused_loss, triton_rate)
    if args.fsdp1:
        from torch.distributed.fsdp import BackwardPrefetch, MixedPrecision, ShardingStrategy
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        with torch.device("meta"):
            model = GPT(*gpt_args)
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
            model = GPT(*gpt_args)
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
        model = GPT(*gpt_args).cuda()
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
