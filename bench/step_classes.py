"""Where a transformer training step's time goes, class of kernel by class: measured on a real
GPU with torch.profiler and predicted by clocked mode from the same script.

    # here (no GPU), once per profile: the prediction, by running this script under mirage
    python bench/step_classes.py --predict --profile h100      # writes bench/predictions/step_classes-h100.json
    # on the real GPU (CUDA or ROCm build of torch, no mirage): measure and compare
    python bench/step_classes.py --profile h100

Why it exists: every like-for-like end-to-end row of docs/validation.md is predicted too fast
(by about 10% on A100), while the held-out micro cases (GEMMs, attention, copies, each timed
alone) are not biased. What a step loses that kernels timed alone do not is the question one
GPU can answer and no published figure does: this script splits one real step into GEMMs,
fused attention, memory-bound kernels, the optimizer's kernels and copies, in situ (the
step's own shapes, back to back, at the clocks a full step runs at), with the GPU's idle time
between kernels, and sets each beside clocked mode's prediction of the same kernels. A
class measured slower than predicted is where the missing time is; idle time that the
prediction lacks says it is between kernels.

The step: Llama 3 8B's layer shapes (dim 4096, 32 heads, 8 KV heads, SwiGLU 14336, RoPE,
RMSNorm as eager PyTorch computes it), `--layers` of them (4 by default, so it fits one
80 GB GPU with the 128256-token vocabulary's head and loss), sequence 8192, one sequence,
bf16 parameters, fused AdamW, no activation checkpointing and no communication: the kernels
torchtitan's 8B rows run on each GPU, without FSDP. Nine steps on a GPU (not yet run on one); the
prediction takes about 20 s here (`--predict-only`: no kernel runs).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

from calibrate import measuring_a_gpu, predict_and_save  # bench/calibrate.py: the same two ends for micro-benchmarks

PREDICTIONS = Path(__file__).with_name("predictions")
OPS_SHOWN = 20

# Kernel classes by kernel name: CUDA's and ROCm's libraries' names, which clocked mode gives its
# predicted kernels too. The first class whose pattern matches a name is the kernel's.
CLASSES = [
    ("attention", re.compile(r"flash|fmha|attn|attention|bwd_kernel_d[kq]", re.I)),  # (AOTriton's bwd_kernel_dk_dv)
    ("gemm", re.compile(r"gemm|gemv|splitKreduce|cutlass|nvjet|xmma|sm\d\d_|Cijk_|wvSplitK", re.I)),
    ("collective", re.compile(r"nccl|rccl", re.I)),
    ("optimizer", re.compile(r"multi_tensor|adam", re.I)),
    # memcpys, and ATen's copy kernels (conversions, strided copies: direct_copy_kernel_cuda; cat)
    ("copy", re.compile(r"^Memcpy|^Memset|copy|aten::cat", re.I)),
    ("memory-bound", re.compile(r".")),
]


def kernel_class(name: str) -> str:
    """The class of a kernel, by its name (every name matches the last class)."""
    return next(label for label, pattern in CLASSES if pattern.search(name))


def build(layers: int, dim: int, heads: int, kv_heads: int, ffn: int, vocab: int, seq: int):
    """The model, its optimizer and one batch, on the GPU."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    head_dim = dim // heads

    class RMSNorm(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.ones(dim))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x32 = x.float()
            return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-5)).type_as(x) * self.weight

    def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        first, second = x.float().chunk(2, dim=-1)
        return torch.cat((first * cos - second * sin, second * cos + first * sin), dim=-1).type_as(x)

    class Layer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.attention_norm, self.ffn_norm = RMSNorm(), RMSNorm()
            self.wq = nn.Linear(dim, heads * head_dim, bias=False)
            self.wk = nn.Linear(dim, kv_heads * head_dim, bias=False)
            self.wv = nn.Linear(dim, kv_heads * head_dim, bias=False)
            self.wo = nn.Linear(heads * head_dim, dim, bias=False)
            self.w1, self.w3 = nn.Linear(dim, ffn, bias=False), nn.Linear(dim, ffn, bias=False)
            self.w2 = nn.Linear(ffn, dim, bias=False)

        def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
            b, t, _ = x.shape
            h = self.attention_norm(x)
            q = rotate(self.wq(h).view(b, t, heads, head_dim), cos, sin)
            k = rotate(self.wk(h).view(b, t, kv_heads, head_dim), cos, sin)
            v = self.wv(h).view(b, t, kv_heads, head_dim)
            k, v = (z.repeat_interleave(heads // kv_heads, dim=2) for z in (k, v))
            y = F.scaled_dot_product_attention(*(z.transpose(1, 2) for z in (q, k, v)), is_causal=True)
            x = x + self.wo(y.transpose(1, 2).reshape(b, t, dim))
            h = self.ffn_norm(x)
            return x + self.w2(F.silu(self.w1(h)) * self.w3(h))

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embedding = nn.Embedding(vocab, dim)
            self.layers = nn.ModuleList(Layer() for _ in range(layers))
            self.norm = RMSNorm()
            self.output = nn.Linear(dim, vocab, bias=False)

        def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
            angles = torch.outer(torch.arange(seq, device=tokens.device, dtype=torch.float32),
                                 1e4 ** (-torch.arange(0, head_dim, 2, device=tokens.device) / head_dim))
            cos, sin = angles.cos()[:, None, :], angles.sin()[:, None, :]
            x = self.embedding(tokens)
            for layer in self.layers:
                x = layer(x, cos, sin)
            logits = self.output(self.norm(x)).float()
            return F.cross_entropy(logits.view(-1, vocab), targets.view(-1))

    model = Model().to(device="cuda", dtype=torch.bfloat16)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    tokens = torch.randint(0, vocab, (1, seq), device="cuda")
    return model, optimizer, tokens, torch.roll(tokens, -1, dims=1)


def measure(args: argparse.Namespace) -> dict:
    """One step's kernels by class (torch.profiler) and the step's time (CUDA events, unprofiled)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    model, optimizer, tokens, targets = build(args.layers, args.dim, args.heads, args.kv_heads, args.ffn,
                                              args.vocab, args.seq)

    def step() -> None:
        model(tokens, targets).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    for _ in range(args.warmup):
        step()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(args.steps):
        step()
    end.record()
    end.synchronize()
    step_ms = start.elapsed_time(end) / args.steps
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True) as prof:
        step()
        torch.cuda.synchronize()
    classes: dict[str, dict] = {label: {"ms": 0.0, "kernels": 0} for label, _ in CLASSES}
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            entry = classes[kernel_class(event.name)]
            entry["ms"] += event.device_time / 1e3
            entry["kernels"] += 1
    busy = sum(entry["ms"] for entry in classes.values())
    # each operator with its input shapes, by the time of the kernels it launched itself: the same
    # GEMM, attention or norm measured and predicted in place
    ops = {f"{row.key} {row.input_shapes}": {"ms": row.self_device_time_total / 1e3, "calls": row.count}
           for row in prof.key_averages(group_by_input_shape=True)
           if row.device_type == torch.autograd.DeviceType.CPU and row.self_device_time_total > 0}
    return {"step_ms": step_ms, "busy_ms": busy, "classes": classes, "ops": ops,
            "peak_gib": torch.cuda.max_memory_allocated() / 2**30,
            "config": {k: getattr(args, k) for k in ("layers", "dim", "heads", "kv_heads", "ffn", "vocab", "seq")}}


def compare(measured: dict, predicted: dict) -> list[str]:
    """The table: each class's measured and predicted ms per step and its error (+: predicted slower)."""
    lines = [f"{'':<16} {'measured ms':>12} {'kernels':>8} {'predicted ms':>13} {'kernels':>8} {'error':>8}"]

    def row(label: str, m: float, p: float, mk: str = "", pk: str = "", width: int = 16) -> str:
        error = f"{100 * (p - m) / m:+.1f}%" if m else "-"
        return f"{label:<{width}} {m:>12.2f} {mk:>8} {p:>13.2f} {pk:>8} {error:>8}"

    for label, _ in CLASSES:
        m, p = measured["classes"][label], predicted["classes"][label]
        if m["kernels"] or p["kernels"]:
            lines.append(row(label, m["ms"], p["ms"], str(m["kernels"]), str(p["kernels"])))
    lines.append(row("kernels, all", measured["busy_ms"], predicted["busy_ms"]))
    lines.append(row("idle between", measured["step_ms"] - measured["busy_ms"],
                     predicted["step_ms"] - predicted["busy_ms"]))
    lines.append(row("step", measured["step_ms"], predicted["step_ms"]))
    lines.append(f"the {OPS_SHOWN} operators with the most kernel time, with their input shapes (ms per step):")
    top = sorted(measured["ops"].items(), key=lambda item: -item[1]["ms"])[:OPS_SHOWN]
    for key, m in top:
        p = predicted["ops"].get(key, {"ms": 0.0, "calls": 0})
        lines.append(f"  {row(key[:72], m['ms'], p['ms'], str(m['calls']), str(p['calls']), width=72)}")
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--profile", required=True, help="the mirage profile of this GPU (h100, h200, mi300x, ...)")
    ap.add_argument("--predict", action="store_true", help="predict with mirage (no GPU needed) and save the figures")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--dim", type=int, default=4096)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--ffn", type=int, default=14336)
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--seq", type=int, default=8192)
    ap.add_argument("--warmup", type=int, default=3, help="steps before the timed ones")
    ap.add_argument("--steps", type=int, default=5, help="steps timed by CUDA events")
    ap.add_argument("--output", type=Path, help="with --predict: where to write the prediction "
                    "(default bench/predictions/step_classes-PROFILE.json)")
    ap.add_argument("--inner", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    shape = ["--layers", str(args.layers), "--dim", str(args.dim), "--heads", str(args.heads), "--kv-heads",
             str(args.kv_heads), "--ffn", str(args.ffn), "--vocab", str(args.vocab), "--seq", str(args.seq)]
    if args.inner:
        print("RESULTS " + json.dumps(measure(args)))
        return 0
    saved = args.output or PREDICTIONS / f"step_classes-{args.profile}.json"
    if args.predict:
        return predict_and_save(["--timing", "--predict-only", "--profile", args.profile],
                                [__file__, "--profile", args.profile, "--inner", "--warmup", "1", "--steps", "1",
                                 *shape], saved)
    if not measuring_a_gpu(__file__, args.profile, saved):
        return 2
    import torch

    predicted = json.loads(saved.read_text())
    measured = measure(args)
    if predicted["config"] != measured["config"]:
        print(f"the prediction in {saved} is of another shape ({predicted['config']}); predict this one with the "
              "same options and --predict", file=sys.stderr)
        return 2
    name = torch.cuda.get_device_name(0)
    print(f"{name} (torch {torch.__version__}) against mirage's {args.profile} profile: one step of "
          f"{args.layers} Llama-3-8B-shaped layers, sequence {args.seq}")
    print("\n".join(compare(measured, predicted)))
    print("JSON " + json.dumps({"device": name, "torch": torch.__version__, "measured": measured,
                                "predicted": predicted}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
