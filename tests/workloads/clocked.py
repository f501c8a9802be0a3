"""Workloads for tests/test_timing.py, run under `mirage run --timing`. MODE selects one; each
prints one JSON line of what the program itself measured (events, its own clocks)."""

import json
import os
import sys
import time
from pathlib import Path

import torch

MODE = sys.argv[1]


def gemm() -> None:
    """A bf16 GEMM timed with CUDA events, as a benchmark script times it."""
    n = int(os.environ.get("N", "1024"))  # larger ones under --predict-only: bf16 GEMMs are slow on CPUs without AVX512-BF16
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    host0 = time.perf_counter()
    start.record()
    for _ in range(5):
        a @ b
    end.record()
    end.synchronize()
    host = time.perf_counter() - host0
    x = torch.empty(2**24, device="cuda")
    start2, end2 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start2.record()
    x.mul_(2)
    end2.record()
    torch.cuda.synchronize()
    print(json.dumps({"gemm_ms": start.elapsed_time(end) / 5, "host_s": host, "mul_ms": start2.elapsed_time(end2)}))


def attention() -> None:
    """A causal bf16 scaled_dot_product_attention (the BACKEND the context enables: flash by
    default, or efficient) at head dim HEAD_DIM (128), its forward timed with events, then its
    backward; with ATTENTION_RATE, both as another implementation's kernels at that rate
    (torch.ops.mirage.attention_rate_begin, as bench/e2e_gpt.py's stand-ins time them), then the
    refusals of a rate that is not positive and of a second rate before the first ends."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    rate, head_dim = float(os.environ.get("ATTENTION_RATE", "1")), int(os.environ.get("HEAD_DIM", "128"))
    backend = {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION}[
        os.environ.get("BACKEND", "flash")]
    q, k, v = (torch.randn(2, 8, 1024, head_dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    grad = torch.randn(2, 8, 1024, head_dim, device="cuda", dtype=torch.bfloat16)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    if rate != 1:
        torch.ops.mirage.attention_rate_begin(rate)
    start.record()
    with sdpa_kernel(backend):
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    end.record()
    out.backward(grad)
    refused = []
    if rate != 1:
        for bad in (rate, 0.0, -1.0):  # a second rate while one is set; then, after its end, bad rates
            try:
                torch.ops.mirage.attention_rate_begin(bad)
            except RuntimeError as e:
                refused.append(str(e).splitlines()[0])
            torch.ops.mirage.attention_rate_end()
    torch.cuda.synchronize()
    print(json.dumps({"attention_ms": start.elapsed_time(end), "refused": refused}))


def flex() -> None:
    """FlexAttention forward and backward (bf16, causal and a 256-token sliding window): one kernel
    each on the trace, as on a GPU; prints each mask's block count."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    def causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    def window(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (q_idx - kv_idx < 256)

    blocks = {}
    for name, mask_mod in (("causal", causal), ("window", window)):
        mask = create_block_mask(mask_mod, None, None, 2048, 2048, device="cuda")
        q, k, v = (torch.randn(2, 8, 2048, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                   for _ in range(3))
        grad = torch.randn(2, 8, 2048, 128, device="cuda", dtype=torch.bfloat16)
        flex_attention(q, k, v, block_mask=mask).backward(grad)
        blocks[name] = {"blocks": int(mask.kv_num_blocks.sum() + mask.full_kv_num_blocks.sum())}
    print(json.dumps(blocks))


def timed(fn) -> float:
    """The time of `fn`'s device work, between two events."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def inplace() -> None:
    """Ops that update their arguments and return nothing (foreach in-place, a fused AdamW step)
    against ones that return their results: each timed with events, as the same traffic."""
    params = [torch.zeros(2**22, device="cuda") for _ in range(4)]
    grads = [torch.ones_like(p) for p in params]
    moments = [torch.zeros_like(p) for p in params] + [torch.zeros_like(p) for p in params]
    steps = [torch.zeros((), device="cuda") for _ in params]
    print(json.dumps({
        "foreach_add_ms": timed(lambda: torch._foreach_add(params, grads)),
        "foreach_add__ms": timed(lambda: torch._foreach_add_(params, grads)),
        "add_ms": timed(lambda: torch.add(params[0], grads[0])),
        "add__ms": timed(lambda: params[0].add_(grads[0])),
        "fused_adamw_ms": timed(lambda: torch._fused_adamw_(params, grads, moments[:4], moments[4:], [], steps, lr=1e-3,
                                                             beta1=0.9, beta2=0.999, weight_decay=0.0, eps=1e-8,
                                                             amsgrad=False, maximize=False)),
    }))


def general() -> None:
    """Elementwise kernels over the same bytes, on PyTorch's vectorized path (dense tensors of one
    size and layout, a transposed view beside another) and off it (a strided view, a broadcast
    operand, a row reduction, a strided copy, a transposed view beside a contiguous tensor, a copy
    that transposes)."""
    wide = torch.zeros(2**10, 2**13, device="cuda")
    half, other = wide[:, : 2**12], torch.zeros(2**10, 2**12, device="cuda")
    row = torch.zeros(2**10, 1, device="cuda")
    square, square_too = torch.zeros(2**11, 2**11, device="cuda"), torch.zeros(2**11, 2**11, device="cuda")
    print(json.dumps({
        "transposed_alike_ms": timed(lambda: torch.mul(square.t(), square_too.t())),
        "transposed_beside_contiguous_ms": timed(lambda: torch.mul(square.t(), square_too)),
        "transposing_copy_ms": timed(lambda: square_too.copy_(square.t())),
        "dense_ms": timed(lambda: torch.mul(other, other)),
        "strided_ms": timed(lambda: torch.mul(half, other)),
        "broadcast_ms": timed(lambda: torch.mul(other, row)),
        "sum_ms": timed(lambda: other.sum(-1)),
        "copy_ms": timed(lambda: other.copy_(other)),
        "strided_copy_ms": timed(lambda: other.copy_(half)),
    }))


def norm_backward() -> None:
    """LayerNorm's and RMSNorm's backward over a 4096 x 4096 bf16 input, with the weight's (and
    bias's) gradient and without it."""
    n = 4096
    x, grad = (torch.randn(n, n, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    weight, bias = torch.ones(n, device="cuda", dtype=torch.bfloat16), torch.zeros(n, device="cuda", dtype=torch.bfloat16)
    _, mean, rstd = torch.ops.aten.native_layer_norm(x, [n], weight, bias, 1e-5)
    _, rms_rstd = torch.ops.aten._fused_rms_norm(x, [n], weight, 1e-5)
    layer = torch.ops.aten.native_layer_norm_backward
    rms = torch.ops.aten._fused_rms_norm_backward
    print(json.dumps({
        "layer_norm_ms": timed(lambda: layer(grad, x, [n], mean, rstd, weight, bias, [True, True, True])),
        "layer_norm_input_only_ms": timed(lambda: layer(grad, x, [n], mean, rstd, weight, bias, [True, False, False])),
        "rms_norm_ms": timed(lambda: rms(grad, x, [n], rms_rstd, weight, [True, True])),
        "rms_norm_input_only_ms": timed(lambda: rms(grad, x, [n], rms_rstd, weight, [True, False])),
    }))


def nll_loss() -> None:
    """NLL loss over a 4096 x 50368 bf16 log-probability matrix (a language model's loss after its
    log-softmax), forward and backward, with the loss it computes checked."""
    rows, classes = 4096, 50368
    log_probs = torch.log_softmax(torch.randn(rows, classes, device="cuda", dtype=torch.bfloat16), -1)
    target = torch.randint(0, classes, (rows,), device="cuda")
    loss, total_weight = torch.ops.aten.nll_loss_forward(log_probs, target, None, 1, -100)
    one = torch.ones((), device="cuda", dtype=torch.bfloat16)
    print(json.dumps({
        "loss": loss.float().item(), "reference": -log_probs.float()[torch.arange(rows), target].mean().item(),
        "forward_ms": timed(lambda: torch.ops.aten.nll_loss_forward(log_probs, target, None, 1, -100)),
        "backward_ms": timed(lambda: torch.ops.aten.nll_loss_backward(one, log_probs, target, None, 1, -100,
                                                                      total_weight)),
    }))


def softmax_rows() -> None:
    """Log-softmax forward and backward over rows of several lengths and dtypes, and over dim 0
    (SoftMax.cu's spatial kernel): each timed with events, the result checked against float64
    (its largest error relative to the largest log-probability)."""
    cases = {"f32_4096": (512, 4096, torch.float32, -1), "f32_12288": (512, 12288, torch.float32, -1),
             "f32_16384": (512, 16384, torch.float32, -1), "bf16_16384": (512, 16384, torch.bfloat16, -1),
             "f32_dim0": (32768, 64, torch.float32, 0)}
    timings = {}
    for name, (rows, columns, dtype, dim) in cases.items():
        x = torch.randn(rows, columns, device="cuda", dtype=dtype)
        out = torch.ops.aten._log_softmax(x, dim, False)
        grad = torch.randn_like(out)
        reference = torch.log_softmax(x.double(), dim)
        timings[name] = {
            "error": ((out.double() - reference).abs().max() / reference.abs().max()).item(),
            "forward_ms": timed(lambda: torch.ops.aten._log_softmax(x, dim, False)),
            "backward_ms": timed(lambda: torch.ops.aten._log_softmax_backward_data(grad, out, dim, dtype)),
        }
    print(json.dumps(timings))


def fused_loss() -> None:
    """bench/e2e_gpt.py's stand-in for flash-attn's fused cross entropy (llm-foundry's loss) over
    1024 x 16384 bf16 logits: its loss and gradient beside PyTorch's, forward and backward."""
    sys.path.append(str(Path(__file__).resolve().parents[2] / "bench"))
    from e2e_gpt import FusedCrossEntropy

    logits = torch.randn(1024, 16384, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    targets = torch.randint(0, 16384, (1024,), device="cuda")
    loss = FusedCrossEntropy.apply(logits, targets)
    (grad,) = torch.autograd.grad(loss, logits)
    reference = torch.nn.functional.cross_entropy(logits.float(), targets)
    (reference_grad,) = torch.autograd.grad(reference, logits)
    print(json.dumps({"loss_error": abs(loss.item() - reference.item()),
                      "grad_error": (grad.float() - reference_grad.float()).abs().max().item(),
                      "grad_scale": reference_grad.float().abs().max().item()}))


def fused() -> None:
    """Kernels a GPU runs as one that mirage computes as several ops: dropout (CUDA's fused
    dropout kernel), a softmax that widens half to float (and its backward, which narrows),
    SyncBatchNorm's statistics and normalization and the fused LSTM cell (CUDA-only kernels), and
    Megatron's fused causal softmax (its CUDA extension, which
    bench/megatron_extensions stands in for); and a batched GEMM with beta=0, whose `self`
    cuBLAS does not read. Each timed with events; the results checked against PyTorch's."""
    sys.path.append(str(Path(__file__).resolve().parents[2] / "bench" / "megatron_extensions"))
    import scaled_upper_triang_masked_softmax_cuda as causal_softmax

    x = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    dropped, mask = torch.ops.aten.native_dropout(x, 0.25, True)
    a = torch.randn(16, 1024, 64, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(16, 64, 1024, device="cuda", dtype=torch.bfloat16)
    buffer = torch.empty(16, 1024, 1024, device="cuda", dtype=torch.bfloat16)
    scores = torch.randn(64, 512, 512, device="cuda", dtype=torch.half, requires_grad=True)
    causal = torch.ones(512, 512, dtype=torch.bool, device="cuda").triu(1)
    reference = torch.softmax((scores.float() * 0.5).masked_fill(causal, float("-inf")), dim=-1)
    grad = torch.randn(64, 512, 512, device="cuda", dtype=torch.half)
    reference.backward(grad.float())
    probs = causal_softmax.forward(scores.detach(), 0.5)
    images = torch.randn(16, 64, 64, 64, device="cuda")
    channel = torch.ones(64, device="cuda")
    gates = [torch.randn(4096, 4096, device="cuda") for _ in range(2)]
    cell, gate_bias = torch.randn(4096, 1024, device="cuda"), torch.zeros(4096, device="cuda")
    widened = torch.ops.aten._softmax(x, -1, True)  # F.softmax(x, -1, dtype=torch.float32)
    widened_grad = torch.randn_like(widened)
    print(json.dumps({
        "half_to_float_error": (widened - torch.softmax(x.float(), -1)).abs().max().item(),
        "half_to_float_dtype": str(widened.dtype),
        "half_to_float_ms": timed(lambda: torch.ops.aten._softmax(x, -1, True)),
        "half_to_float_backward_dtype": str(torch.ops.aten._softmax_backward_data(widened_grad, widened, -1,
                                                                                  torch.bfloat16).dtype),
        "half_to_float_backward_ms": timed(lambda: torch.ops.aten._softmax_backward_data(widened_grad, widened, -1,
                                                                                         torch.bfloat16)),
        "softmax_backward_bf16_ms": timed(lambda: torch.ops.aten._softmax_backward_data(x, x, -1, torch.bfloat16)),
        "log_softmax_backward_bf16_ms": timed(lambda: torch.ops.aten._log_softmax_backward_data(x, x, -1,
                                                                                                torch.bfloat16)),
        "dropout_ms": timed(lambda: torch.ops.aten.native_dropout(x, 0.25, True)),
        "batch_norm_stats_ms": timed(lambda: torch.batch_norm_stats(images, 1e-5)),
        "batch_norm_elemt_ms": timed(lambda: torch.batch_norm_elemt(images, channel, channel, channel, channel, 1e-5)),
        "lstm_cell_ms": timed(lambda: torch.ops.aten._thnn_fused_lstm_cell(gates[0], gates[1], cell, gate_bias, gate_bias)),
        "dropout_mask_dtype": str(mask.dtype), "dropout_kept": mask.float().mean().item(),
        "dropout_matches_mask": torch.allclose(dropped.float(), x.float() * mask / 0.75, rtol=1e-2, atol=1e-2),
        "baddbmm_beta0_ms": timed(lambda: torch.baddbmm(buffer, a, b, beta=0.0)),
        "baddbmm_beta1_ms": timed(lambda: torch.baddbmm(buffer, a, b, beta=1.0)),
        "softmax_forward_error": (probs.float() - reference).abs().max().item(),
        "softmax_backward_error": (causal_softmax.backward(grad.clone(), probs, 0.5).float()
                                   - scores.grad.float()).abs().max().item(),
        "softmax_forward_ms": timed(lambda: causal_softmax.forward(scores.detach(), 0.5)),
        "softmax_backward_ms": timed(lambda: causal_softmax.backward(grad, probs, 0.5)),
    }))


def two_ranks():
    """The NCCL group of two ranks, a GEMM operand and a buffer, both ranks' clocks joined by a
    first all_reduce."""
    import torch.distributed as dist

    dist.init_process_group("nccl")
    rank = dist.get_rank()
    torch.cuda.set_device(rank)
    a = torch.randn(1024, 1024, device="cuda", dtype=torch.bfloat16)
    t = torch.ones(2**20, device="cuda")
    dist.all_reduce(t)
    torch.cuda.synchronize()
    return dist, rank, a, t


def straggler() -> None:
    """Two ranks; rank 1 computes first: rank 0's all_reduce ends only after rank 1 reaches it."""
    dist, rank, a, t = two_ranks()
    start, mid, end = (torch.cuda.Event(enable_timing=True) for _ in range(3))
    start.record()
    if rank == 1:
        for _ in range(20):
            a @ a
    mid.record()
    dist.all_reduce(t)
    end.record()
    torch.cuda.synchronize()
    print(json.dumps({"rank": rank, "before_ms": start.elapsed_time(mid), "total_ms": start.elapsed_time(end)}))
    dist.destroy_process_group()


def overlap() -> None:
    """Two ranks; a GEMM and then a memory-bound in-place multiply issued while an async all_reduce
    runs on the communicator's stream, then the same two alone (after the wait), each timed with
    events; first the all_reduce alone, timed on the caller's stream."""
    dist, rank, _, _ = two_ranks()
    n = int(os.environ.get("N", "2048"))
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    big = torch.ones(2**24, device="cuda")
    streamed = torch.ones(2**22, device="cuda")

    def timed(work) -> float:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        work()
        end.record()
        end.synchronize()
        return start.elapsed_time(end)

    dist.all_reduce(big)  # joins the ranks' clocks
    times = {"all_reduce_ms": timed(lambda: dist.all_reduce(big))}
    work = dist.all_reduce(big, async_op=True)
    for when in ("beside", "alone"):
        times[f"{when}_ms"] = timed(lambda: a @ a)
        times[f"{when}_mul_ms"] = timed(lambda: streamed.mul_(2))
        work.wait()
        torch.cuda.synchronize()
    print(json.dumps({"rank": rank, **times}))
    dist.destroy_process_group()


def allreduce() -> None:
    """One rank per emulated node; a 64 MiB all_reduce across them, timed with events."""
    import torch.distributed as dist

    dist.init_process_group("nccl")
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    t = torch.ones(2**24, device="cuda")
    dist.all_reduce(t)  # joins the ranks' clocks
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    dist.all_reduce(t)
    end.record()
    torch.cuda.synchronize()
    print(json.dumps({"rank": dist.get_rank(), "all_reduce_ms": start.elapsed_time(end)}))
    dist.destroy_process_group()


def phantom() -> None:
    """Two ranks all-reduce a buffer each filled from the host with its rank + 1, written as its
    int32 bits (a host copy of integers moves its bytes in every mode); prints the all_reduce's
    predicted time, what the buffer holds after it (as a float, and its bits as an int32, which
    the host reads for real under --predict-only), what a host copy of floats left in a buffer of
    7s (its bits), what rank 1 received as floats (5s' bits) into a buffer of 8s, a loss no
    kernel computed, what all_gather_object (pickles in uint8 tensors) gathered, what
    recv_object_list received (sizes a kernel concatenates and sums on the device), and a sum of
    integers on the device."""
    dist, rank, _, t = two_ranks()
    objects = [None, None]
    dist.all_gather_object(objects, {"rank": rank})
    received = [None]
    if rank == 0:
        dist.send_object_list([{"from": 0, "pad": "x" * 100}], dst=1)
    else:
        dist.recv_object_list(received, src=0)
    counts = torch.tensor([3, 4], device="cuda")
    integer_sum = torch.cat([counts, counts * 2]).sum().item()
    stale = torch.ones(4096, dtype=torch.bool).cuda()  # from the host: True in every mode
    del stale  # its block is what the mask below is likely given
    mask_any = bool((t[:4096] > 1e9).any())  # no element is; under --predict-only a placeholder 0
    t.view(torch.int32).copy_(torch.full((2**20,), float(rank + 1)).view(torch.int32))
    sevens = torch.full((1024,), 7, dtype=torch.int32, device="cpu").cuda()
    sevens.view(torch.float32).copy_(torch.full((1024,), 5.0))
    eights = torch.full((1024,), 8, dtype=torch.int32, device="cpu").cuda()  # rank 1 receives floats into it
    if rank == 0:
        dist.send(torch.full((1024,), 5, dtype=torch.int32, device="cpu").cuda().view(torch.float32), dst=1)
    else:
        dist.recv(eights.view(torch.float32), src=0)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    dist.all_reduce(t)
    end.record()
    torch.cuda.synchronize()
    loss = (t.view(1024, 1024) @ t.view(1024, 1024)).mean()
    print(json.dumps({"rank": rank, "all_reduce_ms": start.elapsed_time(end), "first": t[0].item(),
                      "first_bits": t.view(torch.int32)[0].item(),
                      "host_float_copy_bits": sevens[0].item(), "received_float_bits": eights[0].item(),
                      "loss": loss.item(), "loss_on_host": loss.cpu().tolist(),
                      "objects": objects, "received": received[0] and received[0]["from"], "integer_sum": integer_sum,
                      "mask_any": mask_any}))
    dist.destroy_process_group()


class OptimizerOfOptimizers(torch.optim.Optimizer):
    """An Optimizer that steps others, as torchtitan's OptimizersContainer does (one per model part)."""

    def __init__(self, parts: list[torch.nn.Module]) -> None:
        self.inner = [torch.optim.SGD(part.parameters(), lr=0.1) for part in parts]
        super().__init__([p for part in parts for p in part.parameters()], {"lr": 0.1})

    def step(self, closure=None) -> None:
        for optimizer in self.inner:
            optimizer.step()


def steps() -> None:
    """A few optimizer steps, then steps marked by the program (the marker replaces them)."""
    model = torch.nn.Linear(256, 256, device="cuda")
    opt = OptimizerOfOptimizers([model]) if os.environ.get("NESTED") else torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(3):
        model(torch.randn(32, 256, device="cuda")).sum().backward()
        opt.step()
    if os.environ.get("MARK"):
        for _ in range(4):
            torch.cuda.nvtx.range_push("forward")
            model(torch.randn(32, 256, device="cuda")).sum().backward()
            torch.cuda.nvtx.range_pop()
            torch.cuda.nvtx.mark("mirage.step")
    print(json.dumps({"done": True}))


def pipeline() -> None:
    """Rank 0 computes, then sends; rank 1 receives at once: its receive ends after rank 0's work."""
    dist, rank, a, t = two_ranks()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    if rank == 0:
        for _ in range(20):
            a @ a
        dist.send(t, 1)
    else:
        dist.recv(t, 0)
    end.record()
    torch.cuda.synchronize()
    print(json.dumps({"rank": rank, "ms": start.elapsed_time(end)}))
    dist.destroy_process_group()


def graph() -> None:
    """Small kernels eagerly (launch-bound) and as a CUDA graph replay (launched once)."""
    x = torch.zeros(1024, device="cuda")

    def work() -> None:
        for _ in range(20):
            x.add_(1)

    work()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        work()
    times = {}
    for name, fn in (("eager_ms", work), ("graph_ms", g.replay)):
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times[name] = start.elapsed_time(end)
    print(json.dumps(times))


def sleeps() -> None:
    """Under --virtual-clock: the program's own sleep, then a background thread's sleep while the
    program waits for it, each as the program's perf_counter sees it."""
    import threading

    began = time.perf_counter()
    time.sleep(0.2)
    own = time.perf_counter() - began
    monitor = threading.Thread(target=time.sleep, args=(1.0,))  # as tqdm's monitor or a compile pool's timer
    began = time.perf_counter()
    monitor.start()
    monitor.join()
    print(json.dumps({"own_sleep_s": own, "beside_thread_s": time.perf_counter() - began}))


def compiled() -> None:
    """A compiled elementwise graph over a 512 MiB tensor (compiled for dynamic shapes on a small
    one first): its predicted time, the peak memory, and how much of the process's resident memory
    the call added (the output's pages, where its host kernel ran and wrote them)."""
    import resource

    page = resource.getpagesize()
    f = torch.compile(lambda x: torch.sin(x) * 2, dynamic=True)
    f(torch.empty(1024, device="cuda"))
    x = torch.empty(2**27, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = int(open("/proc/self/statm").read().split()[1]) * page
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    y = f(x)
    end.record()
    torch.cuda.synchronize()
    added = int(open("/proc/self/statm").read().split()[1]) * page - before
    print(json.dumps({"compiled_ms": start.elapsed_time(end), "peak": torch.cuda.max_memory_allocated(),
                      "resident_added": added, "output_bytes": y.numel() * y.element_size()}))


def compiled_kernels() -> None:
    """A matmul and the elementwise work after it, eager and compiled (inductor fuses the
    elementwise ops into one kernel after the matmul); and two sums of one product, compiled:
    both over the rows (reductions of the same ranges: one kernel), or one over the rows and one
    over the columns (a norm backward's input and weight gradients), at 4096 x 3072 (two kernels)
    and at 8192 x 2048 (one: inductor's mix-order reduction). Each timed with events."""
    x = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    functions = {"mm_sin": lambda x, w: (x @ w).sin(), "mm_sin_cos": lambda x, w: (x @ w).sin().cos()}
    times = {}
    for name, f in functions.items():
        for how, run in (("eager", f), ("compiled", torch.compile(f))):
            run(x, w)
            torch.cuda.synchronize()
            times[f"{how}_{name}_ms"] = timed(lambda: run(x, w))

    def same_ranges(g: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        product = g * x
        return product.sum(1), (product * product).sum(1)

    def rows_and_columns(g: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        product = g * x
        return product.sum(1), (product * product).sum(0)

    for rows, columns in ((4096, 3072), (8192, 2048)):
        g, x = (torch.randn(rows, columns, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        for name, f in (("same_ranges", same_ranges), ("rows_and_columns", rows_and_columns)):
            compiled = torch.compile(f)
            compiled(g, x)
            torch.cuda.synchronize()
            times[f"{name}_{rows}x{columns}_ms"] = timed(lambda: compiled(g, x))
    print(json.dumps(times))


{"gemm": gemm, "compiled": compiled, "compiled_kernels": compiled_kernels, "attention": attention, "flex": flex, "inplace": inplace, "general": general, "norm_backward": norm_backward, "nll_loss": nll_loss, "softmax_rows": softmax_rows, "fused_loss": fused_loss, "fused": fused, "straggler": straggler, "overlap": overlap, "allreduce": allreduce, "phantom": phantom, "steps": steps, "pipeline": pipeline, "graph": graph, "sleeps": sleeps}[MODE]()
