"""Clocked mode (mirage run --timing): predictions that follow the profile's model, the
timeline's rules (events, synchronisation, collectives from the last rank), steps, the report,
the trace, the virtual clock, and the refusals of bad input."""

from __future__ import annotations

import functools
import json
import math
import struct
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from mirage import profiles

ROOT = Path(__file__).resolve().parent.parent
WORKLOAD = ROOT / "tests" / "workloads" / "clocked.py"
DDP = ROOT / "tests" / "fixtures" / "ml" / "ddp_mlp.py"


def mirage(*args: str, env: dict | None = None, timeout: int = 300) -> subprocess.CompletedProcess:
    import os

    return subprocess.run([sys.executable, "-m", "mirage", *args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})


def last_json(stdout: str) -> dict:
    return json.loads([line for line in stdout.splitlines() if line.startswith("{")][-1].split("] ", 1)[-1])


def model(name: str) -> dict[str, float]:
    return {n.key: n.value for n in profiles.timing_numbers(profiles.load(name))}


def expected_gemm_ms(name: str, n: int, beside_collective: bool = False, **tuned: float) -> float:
    """The cost model's formula for an n x n x n bf16 GEMM, from the profile's numbers (and `tuned`):
    its output tiles (split along K when too few to fill the compute units, no split shorter than
    gemm_split_k_min) in whole waves over the units, each wave a tile's FLOPs at one unit's share of
    the GEMM efficiency plus the epilogue (gemm_epilogue_share of one wave's output tiles stored at
    the HBM bandwidth); beside a collective the waves run over the units NCCL's kernel leaves."""
    m = {**model(name), **tuned}
    hbm_bytes_per_ns = m["memory_bandwidth_gbs"] * m["memory_efficiency"]
    tiles = math.ceil(n / m["gemm_tile_m"]) * math.ceil(n / m["gemm_tile_n"])
    units = m["compute_units"] - (m["nccl_compute_units"] if beside_collective else 0)
    splits = max(1, min(units // tiles, n // int(m["gemm_split_k_min"]))) if tiles < units else 1
    unit_flops_per_ns = m["peak_tflops.bf16"] * 1e3 * m["gemm_efficiency"] / m["compute_units"]
    epilogue_ns = m["gemm_epilogue_share"] * m["compute_units"] * m["gemm_tile_m"] * m["gemm_tile_n"] * 2 / hbm_bytes_per_ns
    compute_ns = math.ceil(tiles * splits / units) * (2 * n**3 / (tiles * splits) / unit_flops_per_ns + epilogue_ns)
    memory_ns = 3 * n * n * 2 / hbm_bytes_per_ns
    return (max(compute_ns, memory_ns) + m["kernel_overhead_us"] * 1e3) / 1e6


def waves(name: str, n: int) -> float:
    """How many waves of tiles an n x n GEMM makes on the profile's compute units."""
    m = model(name)
    return math.ceil(n / m["gemm_tile_m"]) * math.ceil(n / m["gemm_tile_n"]) / m["compute_units"]


@pytest.mark.parametrize("name, n, predict_only", [
    ("h100", 1024, []), ("h100", 4096, ["--predict-only"]),
    ("mi300x", 1024, []), ("mi300x", 8192, ["--predict-only"]),
])
def test_events_time_kernels_by_the_profiles_model(name, n, predict_only):
    """1024 runs its kernels and under-fills the GPU (under one wave of tiles: on H100 it is split
    along K); the larger shape fills it (several waves, the last one partial: 4096 on H100's 132
    units, 8192 on MI300X's 304) and is
    only predicted (--predict-only: bf16 GEMMs of that size take minutes on a CPU without
    AVX512-BF16), as a large model's prediction runs."""
    assert (waves(name, n) < 1) == (n == 1024)
    run = mirage("run", "--quiet", "--timing", *predict_only, "--profile", name, "--gpus-per-node", "1", "--",
                 sys.executable, str(WORKLOAD), "gemm", env={"N": str(n)})
    assert run.returncode == 0, run.stderr
    measured = last_json(run.stdout)
    assert measured["gemm_ms"] == pytest.approx(expected_gemm_ms(name, n), rel=1e-3)
    m = model(name)
    mul_bytes = 2 * 4 * 2**24  # read and write 2^24 floats in place
    expected_mul = (mul_bytes / (m["memory_bandwidth_gbs"] * m["memory_efficiency"]) + m["kernel_overhead_us"] * 1e3) / 1e6
    assert measured["mul_ms"] == pytest.approx(expected_mul, rel=1e-3)
    assert "predicted timing on " + name in run.stderr


@pytest.mark.parametrize("rate, head_dim, backend", [(1.0, 128, "flash"), (0.5, 128, "flash"), (1.0, 64, "flash"),
                                                   (1.0, 128, "efficient")])
def test_fused_attention_runs_at_the_profiles_attention_efficiencies(tmp_path, rate, head_dim, backend):
    """The flash kernel's forward at attention_efficiency; its backward, 2.5x the forward's FLOPs
    (the scores recomputed), at attention_backward_efficiency (FlashAttention-2's backward is
    slower than its forward, docs/validation.md); being causal, each at its causal factor
    (attention_causal_factor, attention_backward_causal_factor) of those rates (FlashAttention-2's
    causal forward computes its blocks slower than a non-causal one, its backward about as fast).
    Each block of query rows pays a fixed share (attention_block_overhead, the backward's own), in
    steps of keys swept: a causal block sweeps (r + 1) / 2 of r on average; and at head dim 64 the
    scores' exponentials and rescaling weigh more against their matmuls
    (attention_softmax_head_dims) than at 128, where the efficiencies were measured. The forward is
    timed with events; the backward kernel on the trace (the events around backward() also hold
    the gradients' copies). Those speeds are flash-attn's FlashAttention-2; SDPA's flash kernels
    are PyTorch's own build of it, at torch_flash_attention_causal_rate of them here (measured on
    H100); its memory-efficient kernels, another implementation, are not. Between
    attention_rate_begin(rate) and attention_rate_end, a benchmark's stand-in for another
    implementation (bench/e2e_gpt.py's --attn-impl triton), both compute at `rate` of flash-attn's
    speeds instead; a second rate before the first ends, and a rate that is not positive, are
    refused."""
    trace = tmp_path / "trace.json"
    run = mirage("run", "--quiet", "--timing", "--trace", str(trace), "--profile", "h100", "--gpus-per-node", "1",
                 "--", sys.executable, str(WORKLOAD), "attention",
                 env={"ATTENTION_RATE": str(rate), "HEAD_DIM": str(head_dim), "BACKEND": backend})
    assert run.returncode == 0, run.stderr
    m = model("h100")
    b, h, s, d = 2, 8, 1024, head_dim
    rows = s // m["attention_block_rows"]
    # causal: the fused kernel skips the blocks above the diagonal, and computes whole the blocks
    # of rows the diagonal crosses: (rows + 1) / 2 rows' worth of rows x s scores, each block at
    # the causal factor of a non-causal kernel's rate (below, the forward's or the backward's)
    flops = 4 * b * h * s * s * d * (rows + 1) / (2 * rows)
    swept = (rows + 1) / 2
    besides_matmuls = (1 + m["attention_softmax_head_dims"] / d) / (1 + m["attention_softmax_head_dims"] / 128)
    backward = [e["dur"] / 1e3 for e in json.loads(trace.read_text())["traceEvents"]
                if e.get("ph") == "X" and e["name"] == f"aten::_scaled_dot_product_{backend}_attention_backward"]
    timed = {"forward": last_json(run.stdout)["attention_ms"], "backward": backward[0] if len(backward) == 1 else None}
    for key, work, efficiency, overhead, causal_factor in (
            ("forward", flops, "attention_efficiency", "attention_block_overhead", "attention_causal_factor"),
            ("backward", 2.5 * flops, "attention_backward_efficiency", "attention_backward_block_overhead",
             "attention_backward_causal_factor")):
        work *= (swept + m[overhead]) / swept * besides_matmuls / m[causal_factor]
        # a stand-in's rate, or PyTorch's flash build's
        speed = rate if rate != 1 else m["torch_flash_attention_causal_rate"] if backend == "flash" else 1.0
        compute_ns = work / (m["peak_tflops.bf16"] * 1e3 * m[efficiency] * speed)
        assert timed[key] == pytest.approx((compute_ns + m["kernel_overhead_us"] * 1e3) / 1e6, rel=1e-2), key
    refused = last_json(run.stdout)["refused"]
    if rate == 1:
        assert refused == []
    else:
        assert len(refused) == 3 and "already set" in refused[0], refused
        assert all("must be a positive number" in message for message in refused[1:]), refused


def test_a_norms_backward_is_two_kernels_that_each_read_the_gradient_and_the_input():
    """CUDA's LayerNorm and RMSNorm backward compute the input's gradient in one kernel and the
    weight's (and bias's) in a second, which reads the output's gradient and the input again
    (aten/src/ATen/native/cuda/layer_norm_kernel.cu); asked for the input's gradient alone, only
    the first runs. The difference is the second kernel: those two reads, its own results, and a
    kernel's fixed cost (on PyTorch's general path: its tensors differ in size). Under
    --predict-only the gradients not asked for come back undefined, as on a GPU (autograd asks so
    for a frozen norm's weight); mirage used to fail on them there (2026-12-05). A full run times
    them alike (until 2026-12-06 it timed the first kernel alone: the op path kept a call's
    arguments only for ops with a FLOP formula)."""
    m = model("h100")
    general_bytes_per_ns = m["memory_bandwidth_gbs"] * m["memory_efficiency_general"]
    n, fixed_ns = 4096, m["kernel_overhead_us"] * 1e3
    reread = 2 * n * n * 2  # the output's gradient and the input, bf16
    for mode in (["--predict-only"], []):
        run = mirage("run", "--quiet", "--timing", *mode, "--profile", "h100", "--gpus-per-node", "1", "--",
                     sys.executable, str(WORKLOAD), "norm_backward")
        assert run.returncode == 0, run.stderr
        timed = last_json(run.stdout)
        for norm, weight_results in (("layer_norm", 2), ("rms_norm", 1)):
            second_kernel_ns = (reread + weight_results * n * 2) / general_bytes_per_ns + fixed_ns
            difference = timed[f"{norm}_ms"] - timed[f"{norm}_input_only_ms"]
            assert difference == pytest.approx(second_kernel_ns / 1e6, rel=1e-2), (norm, mode)


def test_nll_loss_reads_the_input_at_the_targets_and_its_backward_fills_the_gradient():
    """CUDA's NLL loss (aten/src/ATen/native/cuda/Loss.cu) reads one entry of the input per target,
    not the whole [rows, classes] matrix; its backward never reads the input: it zeroes the
    gradient (a vectorized fill over the whole matrix) and writes the targets' entries in a second
    kernel. mirage timed both as kernels reading the whole input on PyTorch's general path (a
    language model's loss over 50k classes: 2.4x the backward's time, the forward 10^3 x). Full
    runs and --predict-only alike."""
    m = model("h100")
    bytes_per_ns = m["memory_bandwidth_gbs"] * m["memory_efficiency"]
    general_bytes_per_ns = m["memory_bandwidth_gbs"] * m["memory_efficiency_general"]
    fixed_ns = m["kernel_overhead_us"] * 1e3
    rows, classes = 4096, 50368
    forward_bytes = rows * 8 + rows * 2 + 2 * 2  # the targets (int64), their entries, the loss and total weight
    backward_bytes = rows * classes * 2 + rows * 8 + 2 * 2  # the gradient's fill, the targets, two scalars
    for mode in (["--predict-only"], []):
        run = mirage("run", "--quiet", "--timing", *mode, "--profile", "h100", "--gpus-per-node", "1", "--",
                     sys.executable, str(WORKLOAD), "nll_loss")
        assert run.returncode == 0, run.stderr
        timed = last_json(run.stdout)
        # a few microseconds: the host's launch of it outlasts the kernel (the whole input would take 0.23 ms)
        forward_kernel_ms = (forward_bytes / general_bytes_per_ns + fixed_ns) / 1e6
        assert forward_kernel_ms <= timed["forward_ms"] <= forward_kernel_ms + m["launch_us"] / 1e3
        assert timed["forward_ms"] < rows * classes * 2 / general_bytes_per_ns / 1e6 / 20
        assert timed["backward_ms"] == pytest.approx((backward_bytes / bytes_per_ns + 2 * fixed_ns) / 1e6, rel=1e-2)
        if not mode:  # (bf16: a loss near 11 is exact to 0.06)
            assert timed["loss"] == pytest.approx(timed["reference"], rel=1e-2)


@pytest.mark.parametrize("name", ["h100", "mi300x"])
def test_softmax_reads_a_row_again_where_it_fits_neither_registers_nor_shared_memory(name):
    """CUDA's softmax and log-softmax (aten/src/ATen/native/cuda/SoftMax.cu) keep a row in
    registers (up to 9 x 1024 elements) or in a block's shared memory (sharedMemPerBlock: 48 KiB
    on NVIDIA, 64 KiB on AMD) and read it from memory once; a longer row is read three times by
    the forward (maximum, sum of exponentials, output) and the gradient twice by the backward, and
    softmax over another dim than the last (the spatial kernel) always is. A language model's loss
    over 32k-128k float classes is such a row: Liger-Kernel's published A100 timings of eager cross
    entropy take four passes over 65536 float classes, two over 4096-8192 (docs/validation.md).
    mirage read every row once. 12288 floats fit an AMD block's shared memory, not an NVIDIA
    one's. Full runs and --predict-only alike (the AMD profile: --predict-only)."""
    m = model(name)
    bytes_per_ns, fixed_ns = m["memory_bandwidth_gbs"] * m["memory_efficiency"], m["kernel_overhead_us"] * 1e3
    # case: (elements, bytes per element, forward's extra reads of the input, backward's of the gradient)
    rereads = {"f32_4096": (512 * 4096, 4, 0, 0), "f32_16384": (512 * 16384, 4, 2, 1),
               "f32_12288": (512 * 12288, 4, 2 if name == "h100" else 0, 1 if name == "h100" else 0),
               "bf16_16384": (512 * 16384, 2, 0, 0), "f32_dim0": (32768 * 64, 4, 2, 1)}
    for mode in (["--predict-only"], []) if name == "h100" else (["--predict-only"],):
        run = mirage("run", "--quiet", "--timing", *mode, "--profile", name, "--gpus-per-node", "1", "--",
                     sys.executable, str(WORKLOAD), "softmax_rows")
        assert run.returncode == 0, run.stderr
        timed = last_json(run.stdout)
        for case, (elements, size, forward_extra, backward_extra) in rereads.items():
            tensor = elements * size
            forward_ms = ((2 + forward_extra) * tensor / bytes_per_ns + fixed_ns) / 1e6  # input in, output out
            backward_ms = ((3 + backward_extra) * tensor / bytes_per_ns + fixed_ns) / 1e6  # gradient, output, result
            assert timed[case]["forward_ms"] == pytest.approx(forward_ms, rel=1e-3), (case, mode)
            assert timed[case]["backward_ms"] == pytest.approx(backward_ms, rel=1e-3), (case, mode)
            if not mode:
                assert timed[case]["error"] < 1e-2, case


def test_the_fused_loss_llm_foundrys_rows_run_is_two_kernels_over_the_logits(tmp_path):
    """llm-foundry's runs (the end-to-end set's E01-E12) take their loss with flash-attn's fused
    cross entropy, apex's xentropy kernels: the forward reads the logits twice and writes a float
    loss and log-sum-exp per row, the backward reads them once and writes their gradient.
    bench/e2e_gpt.py --fused-loss stands in for them: on the trace each is one kernel moving
    that (eager PyTorch's log_softmax and nll_loss move more than twice as much), and it computes
    what PyTorch's cross entropy does."""
    m = model("h100")
    bytes_per_ns, fixed_ns = m["memory_bandwidth_gbs"] * m["memory_efficiency"], m["kernel_overhead_us"] * 1e3
    rows, logits = 1024, 1024 * 16384 * 2
    moved = {"xentropy_forward": 2 * logits + rows * 8 + 2 * rows * 4,  # the logits twice, targets, two floats a row
             "xentropy_backward": 2 * logits + rows * 8 + rows * 4}  # the logits, the gradient, targets, log-sum-exp
    for mode in (["--predict-only"], []):
        trace = tmp_path / f"trace{len(mode)}.json"
        run = mirage("run", "--quiet", "--timing", *mode, "--trace", str(trace), "--profile", "h100",
                     "--gpus-per-node", "1", "--", sys.executable, str(WORKLOAD), "fused_loss")
        assert run.returncode == 0, run.stderr
        events = json.loads(trace.read_text())["traceEvents"]
        for name, bytes_moved in moved.items():
            kernels = [e["dur"] / 1e3 for e in events if e.get("ph") == "X" and e["name"] == name]
            assert kernels == [pytest.approx((bytes_moved / bytes_per_ns + fixed_ns) / 1e6, rel=1e-2)], (name, mode)
        if not mode:  # bf16 logits: the loss near 10.2 to bf16's precision, the gradient's to a few ulps
            checked = last_json(run.stdout)
            assert checked["loss_error"] < 0.05 and checked["grad_error"] < 0.05 * checked["grad_scale"]


def test_kernels_a_gpu_fuses_are_one_kernel_and_a_beta_zero_gemm_does_not_read_its_input():
    """CUDA's dropout is one kernel (fused_dropout_kernel: it reads the input and writes the output
    and a bool mask), which mirage computes as a Bernoulli draw and two multiplies: it was timed as
    those three kernels and a mask conversion, 17 bytes per bf16 element instead of 5 (found
    2026-12-06 on Megatron's attention dropout, 3.4x its time). A softmax that widens bf16 to float
    (F.softmax(x, dim, dtype=torch.float32), as Hugging Face's eager attention calls it) is one
    CUDA kernel reading bf16 and writing float, its backward one reading float and writing bf16:
    mirage's conversions around PyTorch's float kernel were timed as kernels of their own. Every
    softmax backward on CUDA is two kernels (SoftMax.cu multiplies the gradient by the output
    first, then runs the backward kernel on that product and the output), log-softmax's one.
    SyncBatchNorm's kernels and the fused LSTM cell, CUDA-only kernels mirage writes as ATen ops,
    were timed as those ops (batch_norm_elemt: four passes over the input where CUDA makes one).
    Megatron's fused causal softmax,
    as bench/megatron_extensions stands in for its CUDA extension, is one kernel that reads each
    row's unmasked prefix and writes the whole row (its backward reads two such prefixes), and
    computes what PyTorch's softmax does. A baddbmm with beta=0 (Megatron's attention scores,
    into an empty buffer) does not read `self`: cuBLAS reads C only when beta is not 0."""
    run = mirage("run", "--quiet", "--timing", "--profile", "h100", "--gpus-per-node", "1", "--",
                 sys.executable, str(WORKLOAD), "fused")
    assert run.returncode == 0, run.stderr
    timed, m = last_json(run.stdout), model("h100")
    bytes_per_ns, fixed_ns = m["memory_bandwidth_gbs"] * m["memory_efficiency"], m["kernel_overhead_us"] * 1e3

    def ms(moved: float, kernels: int = 1) -> float:
        return (moved / bytes_per_ns + kernels * fixed_ns) / 1e6

    elements = 4096 * 4096
    assert timed["dropout_ms"] == pytest.approx(ms(elements * (2 + 2 + 1)), rel=1e-3)
    assert timed["half_to_float_ms"] == pytest.approx(ms(elements * (2 + 4)), rel=1e-3)  # bf16 in, float out
    # the product (float gradient x float output -> float), then the backward kernel (product and output in, bf16 out)
    assert timed["half_to_float_backward_ms"] == pytest.approx(ms(elements * (4 + 4 + 4 + 4 + 4 + 2), 2), rel=1e-3)
    assert timed["softmax_backward_bf16_ms"] == pytest.approx(ms(elements * (2 + 2 + 2 + 2 + 2 + 2), 2), rel=1e-3)
    assert timed["log_softmax_backward_bf16_ms"] == pytest.approx(ms(elements * (2 + 2 + 2)), rel=1e-3)
    assert timed["half_to_float_dtype"] == "torch.float32" and timed["half_to_float_backward_dtype"] == "torch.bfloat16"
    assert timed["half_to_float_error"] < 1e-6
    images, channel = 16 * 64 * 64 * 64 * 4, 64 * 4  # float32
    assert timed["batch_norm_stats_ms"] == pytest.approx(ms(images + 2 * channel), rel=1e-3)  # mean and invstd out
    assert timed["batch_norm_elemt_ms"] == pytest.approx(ms(2 * images + 4 * channel), rel=1e-3)
    gates, cell, bias = 4096 * 4096 * 4, 4096 * 1024 * 4, 4096 * 4
    # in: both gates, cx, both biases; out: hy, cy and the workspace (the activated gates)
    assert timed["lstm_cell_ms"] == pytest.approx(ms(2 * gates + cell + 2 * bias + 2 * cell + gates), rel=1e-3)
    assert timed["dropout_mask_dtype"] == "torch.bool" and timed["dropout_matches_mask"]
    assert 0.74 < timed["dropout_kept"] < 0.76
    scores = 64 * 512 * 512 * 2
    prefix = 513 / 1024  # row i of 512 reads i + 1 elements
    assert timed["softmax_forward_ms"] == pytest.approx(ms(scores * (prefix + 1)), rel=1e-3)
    assert timed["softmax_backward_ms"] == pytest.approx(ms(scores * (2 * prefix + 1)), rel=1e-3)
    assert timed["softmax_forward_error"] < 1e-3 and timed["softmax_backward_error"] < 1e-2
    unread = 16 * 1024 * 1024 * 2
    assert timed["baddbmm_beta1_ms"] - timed["baddbmm_beta0_ms"] == pytest.approx(unread / bytes_per_ns / 1e6, rel=1e-2)
    # --predict-only computes none of them (only their results' shapes) and times them alike
    predicted = mirage("run", "--quiet", "--timing", "--predict-only", "--profile", "h100", "--gpus-per-node", "1",
                       "--", sys.executable, str(WORKLOAD), "fused")
    assert predicted.returncode == 0, predicted.stderr
    assert {k: v for k, v in last_json(predicted.stdout).items() if k.endswith("_ms")} == \
        {k: v for k, v in timed.items() if k.endswith("_ms")}


def test_an_op_that_updates_its_arguments_is_timed_for_what_it_reads_and_writes():
    """A foreach in-place add moves what the out-of-place one does (each tensor read twice, one
    written), as add_ and add do; a fused AdamW step reads parameters, gradients and both moments
    and writes back three of them: 7 x its parameters' bytes. Such ops return nothing, so what
    they write must be counted from their arguments (a result's bytes are counted as written)."""
    run = mirage("run", "--quiet", "--timing", "--profile", "h100", "--gpus-per-node", "1", "--",
                 sys.executable, str(WORKLOAD), "inplace")
    assert run.returncode == 0, run.stderr
    timed = last_json(run.stdout)
    m = model("h100")
    assert timed["add__ms"] == pytest.approx(timed["add_ms"], rel=1e-3)
    assert timed["foreach_add__ms"] == pytest.approx(timed["foreach_add_ms"], rel=1e-3)
    adamw_bytes = 7 * 4 * 4 * 2**22  # 7 accesses of 4 lists of 2^22 floats
    expected = (adamw_bytes / (m["memory_bandwidth_gbs"] * m["memory_efficiency"]) + m["kernel_overhead_us"] * 1e3) / 1e6
    assert timed["fused_adamw_ms"] == pytest.approx(expected, rel=1e-2)


def test_kernels_off_pytorchs_vectorized_path_run_at_the_general_efficiency():
    """A memory-bound kernel whose tensors are all dense, of one size and laid out alike streams at
    memory_efficiency; a strided view (a chunk), a broadcast operand, a reduction or a transposed
    view beside a contiguous tensor takes PyTorch's general path, at memory_efficiency_general
    (measured on H100 from eager SwiGLU over chunks, docs/validation.md), and so does a copy from a
    strided view or one that transposes, where a dense one of one layout is a memcpy."""
    run = mirage("run", "--quiet", "--timing", "--profile", "h100", "--gpus-per-node", "1", "--",
                 sys.executable, str(WORKLOAD), "general")
    assert run.returncode == 0, run.stderr
    timed = last_json(run.stdout)
    m = model("h100")
    fixed = m["kernel_overhead_us"] * 1e3

    def ms(moved: int, efficiency: str) -> float:
        return (moved / (m["memory_bandwidth_gbs"] * m[efficiency]) + fixed) / 1e6

    floats = 4 * 2**22  # the bytes of one 1024 x 4096 float32 operand
    assert m["memory_efficiency_general"] < m["memory_efficiency"]
    assert timed["dense_ms"] == pytest.approx(ms(3 * floats, "memory_efficiency"), rel=1e-3)
    assert timed["strided_ms"] == pytest.approx(ms(3 * floats, "memory_efficiency_general"), rel=1e-3)
    assert timed["broadcast_ms"] == pytest.approx(ms(2 * floats + 2 * 4 * 2**10, "memory_efficiency_general"), rel=1e-3)
    assert timed["sum_ms"] == pytest.approx(ms(floats + 4 * 2**10, "memory_efficiency_general"), rel=1e-3)
    assert timed["copy_ms"] == pytest.approx(ms(2 * floats, "memory_efficiency"), rel=1e-3)
    assert timed["strided_copy_ms"] == pytest.approx(ms(2 * floats, "memory_efficiency_general"), rel=1e-3)
    assert timed["transposed_alike_ms"] == pytest.approx(ms(3 * floats, "memory_efficiency"), rel=1e-3)
    assert timed["transposed_beside_contiguous_ms"] == pytest.approx(ms(3 * floats, "memory_efficiency_general"),
                                                                     rel=1e-3)
    assert timed["transposing_copy_ms"] == pytest.approx(ms(2 * floats, "memory_efficiency_general"), rel=1e-3)


def test_flex_attention_is_one_kernel_costed_by_the_blocks_it_visits(tmp_path):
    """FlexAttention's Triton kernel visits the blocks its BlockMask lists, whole: mirage's
    block-sparse implementation (many ops) is timed as that one kernel, by the attention model,
    forward and backward (2.5x the forward's FLOPs, at the backward's efficiency), so a sliding
    window costs what it visits; each block of query rows pays the fixed share of the blocks it
    sweeps (attention_block_overhead, the backward's own).
    The trace shows each kernel (the events around a call also time torch's own small ops)."""
    trace = tmp_path / "trace.json"
    run = mirage("run", "--quiet", "--timing", "--trace", str(trace), "--profile", "h100", "--gpus-per-node", "1",
                 "--", sys.executable, str(WORKLOAD), "flex")
    assert run.returncode == 0, run.stderr
    m = model("h100")
    blocks = {case: timed["blocks"] for case, timed in last_json(run.stdout).items()}
    assert blocks == {"causal": 16 * 17 // 2, "window": 1 + 2 + 14 * 3}  # of 128 x 128 tokens, at 2048
    kernels = sorted((e for e in json.loads(trace.read_text())["traceEvents"]
                      if e.get("ph") == "X" and e["name"].startswith("flex_attention")), key=lambda e: e["ts"])
    assert [e["name"] for e in kernels] == ["flex_attention", "flex_attention_backward"] * 2
    for case, (forward, backward) in zip(("causal", "window"), (kernels[:2], kernels[2:])):
        forward_flops = 4 * blocks[case] * 128 * 128 * 2 * 8 * 128  # 4 x D per pair, batch 2 x 8 heads
        swept = blocks[case] / 16  # key blocks per block of query rows, 16 of them at 2048
        for kernel, flops, efficiency, overhead in (
                (forward, forward_flops, "attention_efficiency", "attention_block_overhead"),
                (backward, 2.5 * forward_flops, "attention_backward_efficiency", "attention_backward_block_overhead")):
            flops *= (swept + m[overhead]) / swept
            compute_us = flops / (m["peak_tflops.bf16"] * 1e6 * m[efficiency])
            assert kernel["dur"] == pytest.approx(compute_us + m["kernel_overhead_us"], rel=0.01), (case, kernel)


def test_virtual_clock_makes_the_programs_own_timer_report_the_prediction():
    run = mirage("run", "--quiet", "--timing", "--virtual-clock", "--profile", "h100", "--gpus-per-node", "1", "--",
                 sys.executable, str(WORKLOAD), "gemm")
    assert run.returncode == 0, run.stderr
    measured = last_json(run.stdout)
    # the host waited for the five GEMMs: its own perf_counter saw their predicted time
    assert measured["host_s"] * 1e3 == pytest.approx(5 * measured["gemm_ms"], rel=0.02)


def test_only_the_programs_own_sleep_moves_the_virtual_clock():
    """The program's time.sleep advances its predicted clock; a background thread's (a monitor, a
    timer of inductor's compile pool) does not, though the program really waited for it."""
    run = mirage("run", "--quiet", "--timing", "--virtual-clock", "--profile", "h100", "--gpus-per-node", "1", "--",
                 sys.executable, str(WORKLOAD), "sleeps")
    assert run.returncode == 0, run.stderr
    measured = last_json(run.stdout)
    assert measured["own_sleep_s"] == pytest.approx(0.2, abs=0.01)
    assert measured["beside_thread_s"] < 0.05


def test_a_collective_starts_when_the_last_rank_reaches_it():
    run = mirage("run", "--quiet", "--timing", "--profile", "h100", "--gpus-per-node", "2", "--nproc-per-node", "2",
                 "--", sys.executable, str(WORKLOAD), "straggler")
    assert run.returncode == 0, run.stderr
    lines = [json.loads(line.split("] ", 1)[1]) for line in run.stdout.splitlines() if "{" in line]
    by_rank = {line["rank"]: line for line in lines}
    busy = by_rank[1]["before_ms"]
    assert busy > 20 * expected_gemm_ms("h100", 1024) * 0.99
    assert by_rank[0]["before_ms"] < busy / 10
    # rank 0 waited in the all_reduce for rank 1's GEMMs: both end at the same predicted time
    assert by_rank[0]["total_ms"] == pytest.approx(by_rank[1]["total_ms"], rel=1e-3)
    assert by_rank[0]["total_ms"] > busy


def test_work_beside_a_collective_gets_the_compute_units_and_memory_bandwidth_it_leaves():
    """2048 x 2048 on H100: 128 tiles fill one wave of 132 units alone, two waves of the 108 an
    all_reduce's kernel leaves (nccl_compute_units 24), so it takes twice as long beside it. A
    memory-bound multiply beside it gets the HBM bandwidth the collective's traffic leaves: the
    all_reduce's links carry 2 (n - 1) / n of its 64 MiB each way in the time it takes, which its
    sends read from HBM and its receives write there."""
    run = mirage("run", "--quiet", "--timing", "--predict-only", "--profile", "h100", "--gpus-per-node", "2",
                 "--nproc-per-node", "2", "--", sys.executable, str(WORKLOAD), "overlap")
    assert run.returncode == 0, run.stderr
    m = model("h100")
    hbm_bytes_per_ns = m["memory_bandwidth_gbs"] * m["memory_efficiency"]
    mul_bytes, fixed_ns = 2 * 4 * 2**22, m["kernel_overhead_us"] * 1e3
    for line in (json.loads(l.split("] ", 1)[1]) for l in run.stdout.splitlines() if "{" in l):
        assert line["alone_ms"] == pytest.approx(expected_gemm_ms("h100", 2048), rel=1e-3)
        assert line["beside_ms"] == pytest.approx(expected_gemm_ms("h100", 2048, beside_collective=True), rel=1e-3)
        assert line["beside_ms"] > 1.9 * line["alone_ms"]
        assert line["alone_mul_ms"] == pytest.approx((mul_bytes / hbm_bytes_per_ns + fixed_ns) / 1e6, rel=1e-3)
        share = 2 * (2 * 4 * 2**24 * (2 - 1) / 2) / (line["all_reduce_ms"] * 1e6) / hbm_bytes_per_ns
        assert 0.1 < share < 0.5
        assert line["beside_mul_ms"] == pytest.approx((mul_bytes / hbm_bytes_per_ns / (1 - share) + fixed_ns) / 1e6,
                                                      rel=1e-3)


def test_a_receive_ends_after_the_senders_work():
    run = mirage("run", "--quiet", "--timing", "--profile", "h100", "--gpus-per-node", "2", "--nproc-per-node", "2",
                 "--", sys.executable, str(WORKLOAD), "pipeline")
    assert run.returncode == 0, run.stderr
    by_rank = {line["rank"]: line for line in
               (json.loads(l.split("] ", 1)[1]) for l in run.stdout.splitlines() if "{" in l)}
    work = 20 * expected_gemm_ms("h100", 1024)
    assert by_rank[0]["ms"] > work
    assert by_rank[1]["ms"] > work  # rank 1's receive waited for rank 0's GEMMs and send
    assert by_rank[1]["ms"] == pytest.approx(by_rank[0]["ms"], rel=0.05)


def test_a_cuda_graph_replay_pays_one_launch():
    run = mirage("run", "--quiet", "--timing", "--profile", "h100", "--gpus-per-node", "1", "--",
                 sys.executable, str(WORKLOAD), "graph")
    assert run.returncode == 0, run.stderr
    times = last_json(run.stdout)
    m = model("h100")
    # eagerly the 20 tiny kernels wait for the host's launches; replayed they run back to back
    assert times["eager_ms"] == pytest.approx(20 * m["launch_us"] / 1e3, rel=0.1)
    assert times["graph_ms"] < 0.7 * times["eager_ms"]


def test_ddp_report_is_identical_twice_and_splits_the_step(tmp_path):
    reports = []
    for i in range(2):
        summary = tmp_path / f"summary{i}.json"
        run = mirage("run", "--quiet", "--timing", "--summary-json", str(summary), "--profile", "mi300x",
                     "--gpus-per-node", "2", "--", "torchrun", "--standalone", "--nproc_per_node=2", str(DDP),
                     env={"STEPS": "12"})
        assert run.returncode == 0, run.stderr
        reports.append(json.loads(summary.read_text())["timing"])
    assert reports[0] == reports[1]  # predictions do not depend on this machine
    ranks = reports[0]["ranks"]
    assert [r["rank"] for r in ranks] == [0, 1] and all(r["steps"] == 12 for r in ranks)
    split = ranks[0]["split_ms"]
    assert split["collective"] > 0 and split["compute"] + split["memory"] > 0
    assert 0 <= split["exposed"] <= split["collective"] + 1e-9
    assert ranks[0]["step_ms"] >= split["compute"] + split["memory"]


def test_predict_only_predicts_what_the_full_run_predicts(tmp_path):
    reports = {}
    for mode in ("full", "predict-only"):
        summary = tmp_path / f"{mode}.json"
        extra = ["--predict-only"] if mode == "predict-only" else []
        run = mirage("run", "--quiet", "--timing", *extra, "--summary-json", str(summary), "--profile", "h100",
                     "--gpus-per-node", "1", "--", sys.executable, str(WORKLOAD), "gemm")
        assert run.returncode == 0, run.stderr
        reports[mode] = (last_json(run.stdout), json.loads(summary.read_text())["timing"]["ranks"][0])
    (full_events, full), (predicted_events, predicted) = reports["full"], reports["predict-only"]
    assert predicted_events["gemm_ms"] == full_events["gemm_ms"] and predicted_events["mul_ms"] == full_events["mul_ms"]
    assert predicted["split_ms"] == full["split_ms"] and predicted["step_ms"] == full["step_ms"]


def test_the_gpu_check_splits_a_predicted_step_into_the_kernel_classes_a_cuda_profile_has(tmp_path):
    """bench/step_classes.py, the step a lent GPU measures (docs/validation.md, "Real GPU"),
    predicted here and split by kernel name as the real profile will be: each linear layer's three
    GEMMs (forward, input and weight gradients), one fused attention kernel each way per layer, the
    fused AdamW, RMSNorm's and the loss's conversions among the copies; the classes add up to the
    kernels' time, and so do the operators (each with its input shapes) that launched them. Without a GPU, measuring is refused and says what to run instead."""
    shape = ["--layers", "2", "--dim", "256", "--heads", "4", "--kv-heads", "2", "--ffn", "512", "--vocab", "1000",
             "--seq", "256"]
    for profile in ("h100", "mi300x"):  # cuBLAS and FlashAttention-2's kernel names; hipBLASLt's and AOTriton's
        saved = tmp_path / f"{profile}.json"
        run = subprocess.run([sys.executable, str(ROOT / "bench" / "step_classes.py"), "--predict", "--profile",
                              profile, "--output", str(saved), *shape], capture_output=True, text=True, timeout=600)
        assert run.returncode == 0, run.stderr
        predicted = json.loads(saved.read_text())
        classes = {label: entry["kernels"] for label, entry in predicted["classes"].items()}
        assert classes["gemm"] == 2 * 7 * 3 + 3, profile  # seven linears a layer and the head, three GEMMs each
        assert classes["attention"] == 2 * 2 and classes["optimizer"] == 1 and classes["collective"] == 0, profile
        assert classes["copy"] > 0 and classes["memory-bound"] > 0
        assert predicted["busy_ms"] == pytest.approx(sum(e["ms"] for e in predicted["classes"].values()))
        # the same kernels by operator and input shapes: every GEMM kernel is an aten::mm's
        mm_calls = sum(op["calls"] for key, op in predicted["ops"].items() if key.startswith("aten::mm "))
        assert mm_calls == classes["gemm"]
        assert sum(op["ms"] for op in predicted["ops"].values()) == pytest.approx(predicted["busy_ms"], rel=1e-6)
        assert predicted["step_ms"] >= predicted["busy_ms"] > 0
    refused = subprocess.run([sys.executable, str(ROOT / "bench" / "step_classes.py"), "--profile", "h100", *shape],
                             capture_output=True, text=True, timeout=300)
    assert refused.returncode == 2 and "--predict" in refused.stderr


def test_predict_only_runs_no_kernel_of_a_compiled_graph_yet_times_and_allocates_it_as_the_full_run():
    """A compiled graph's generated code runs its host kernels in a full run (they write its
    output's 512 MiB, which the process then holds); under --predict-only it allocates the same
    buffers and is placed on the timeline the same, but no kernel runs, so no page is written."""
    def run(extra: list[str]) -> dict:
        done = mirage("run", "--quiet", "--timing", *extra, "--lazy-device-memory", "--profile", "h100",
                      "--gpus-per-node", "1", "--", sys.executable, str(WORKLOAD), "compiled")
        assert done.returncode == 0, done.stderr
        return last_json(done.stdout)

    with ThreadPoolExecutor(2) as runs:  # side by side: each mostly compiles, on one core
        full, predicted = runs.map(run, ([], ["--predict-only"]))
    assert predicted["compiled_ms"] == full["compiled_ms"] > 0
    assert predicted["peak"] == full["peak"] >= 2 * full["output_bytes"]  # the input and the output
    assert full["resident_added"] >= 0.9 * full["output_bytes"]
    assert predicted["resident_added"] < 0.1 * predicted["output_bytes"]


@functools.cache
def compiled_kernels_times() -> dict[str, float]:
    """The compiled_kernels workload's event timings, predicted once for the tests that read them
    (each torch.compile in a fresh process costs seconds)."""
    run = mirage("run", "--quiet", "--timing", "--predict-only", "--profile", "h100", "--gpus-per-node", "1", "--",
                 sys.executable, str(WORKLOAD), "compiled_kernels")
    assert run.returncode == 0, run.stderr
    return last_json(run.stdout)


def test_a_compiled_graphs_matmul_and_fused_kernels_run_one_after_another():
    """Inductor makes (x @ w).sin() a matmul kernel and an elementwise kernel, as eager runs it, so
    both take the same time (but the host's launch of the first: 5 us of 200); (x @ w).sin().cos()
    is still those two kernels compiled (one fused elementwise kernel reads the matmul's result and
    writes the output), where eager runs three."""
    t = compiled_kernels_times()
    assert t["compiled_mm_sin_ms"] == pytest.approx(t["eager_mm_sin_ms"], rel=0.05)
    assert t["compiled_mm_sin_cos_ms"] == pytest.approx(t["compiled_mm_sin_ms"], rel=1e-3)
    assert t["eager_mm_sin_cos_ms"] > t["compiled_mm_sin_cos_ms"] * 1.05


def test_a_compiled_graphs_reductions_over_different_ranges_are_kernels_that_each_read_the_inputs():
    """Inductor fuses reductions into one kernel only over the same ranges (SIMDScheduling.can_fuse
    compares (numel, rnumel)): two sums over the rows of one product g * x (of it and of its
    square) are one kernel reading g and x once; a sum over the rows and one over the columns (a
    norm backward's input and weight gradients) are two kernels at 4096 x 3072, each reading both,
    and one kernel at 8192 x 2048, where torch 2.13's mix-order reduction takes them (at least
    twice as many rows as columns, 4096 rows, 5 x 2^20 elements). The differences: a second read
    and the results' sizes, then the results' sizes alone."""
    timed, m = compiled_kernels_times(), model("h100")
    bytes_per_ns = m["memory_bandwidth_gbs"] * m["memory_efficiency"]
    for (rows, columns), reads in (((4096, 3072), 2), ((8192, 2048), 1)):
        second_read = (reads - 1) * 2 * rows * columns * 2  # bf16 g and x
        results = (rows + columns - 2 * rows) * 2
        difference = timed[f"rows_and_columns_{rows}x{columns}_ms"] - timed[f"same_ranges_{rows}x{columns}_ms"]
        assert difference == pytest.approx((second_read + results) / bytes_per_ns / 1e6, abs=1e-4), (rows, columns)


def test_predict_only_collectives_move_no_payload_and_take_the_full_runs_time():
    """--predict-only: a collective's ranks meet and agree on the clock, but its floating-point
    payload (data no kernel computed) does not move (README: an output keeps what it held, which
    its bits read as integers show; read as floats, such data is the placeholder 0); its
    predicted time is the full run's. Integer collectives, which carry what steers the program
    (all_gather_object's pickles and sizes), still move their bytes, and small kernels of
    integers still run (send_object_list concatenates its sizes on the device); small integer
    results of kernels that did not run read as 0. Desyncs are still caught
    (tests/test_distributed.py's desync test runs under --predict-only too)."""
    results = {}
    for mode in ("full", "predict-only"):
        extra = ["--predict-only"] if mode == "predict-only" else []
        run = mirage("run", "--quiet", "--timing", *extra, "--profile", "h100", "--gpus-per-node", "2",
                     "--nproc-per-node", "2", "--", sys.executable, str(WORKLOAD), "phantom")
        assert run.returncode == 0, run.stderr
        results[mode] = {line["rank"]: line for line in
                         (json.loads(l.split("] ", 1)[1]) for l in run.stdout.splitlines() if "{" in l)}
    full, predicted = results["full"], results["predict-only"]
    bits = {value: struct.unpack("<i", struct.pack("<f", value))[0] for value in (1.0, 2.0, 3.0)}
    assert [full[r]["first"] for r in (0, 1)] == [3.0, 3.0]  # 1 + 2: the payload moved
    assert [full[r]["first_bits"] for r in (0, 1)] == [bits[3.0], bits[3.0]]
    assert [predicted[r]["first_bits"] for r in (0, 1)] == [bits[1.0], bits[2.0]]  # each rank's own: none moved
    # a host copy of floating-point data moves its bytes in a full run, none under --predict-only
    assert [full[r]["host_float_copy_bits"] for r in (0, 1)] == [struct.unpack("<i", struct.pack("<f", 5.0))[0]] * 2
    assert [predicted[r]["host_float_copy_bits"] for r in (0, 1)] == [7, 7]
    # a send of floating-point data carries its bytes in a full run, its size only under --predict-only
    assert full[1]["received_float_bits"] == 5 and predicted[1]["received_float_bits"] == 8
    # what the host reads of floating-point data no kernel computed is the placeholder 0 (README)
    assert [predicted[r][key] for r in (0, 1) for key in ("first", "loss", "loss_on_host")] == [0.0] * 6
    assert full[0]["loss"] == full[0]["loss_on_host"] == 9.0 * 1024
    assert all(full[r]["all_reduce_ms"] > 0 for r in (0, 1))
    for results_of_mode in (full, predicted):
        assert all(results_of_mode[r]["objects"] == [{"rank": 0}, {"rank": 1}] for r in (0, 1))
        # small kernels of integers run: send/recv_object_list's sizes, a sum the host reads
        assert results_of_mode[1]["received"] == 0 and results_of_mode[0]["received"] is None
        assert [results_of_mode[r]["integer_sum"] for r in (0, 1)] == [21, 21]
        # a mask no kernel computed reads as 0, not as what its memory held before
        assert [results_of_mode[r]["mask_any"] for r in (0, 1)] == [False, False]
    assert [predicted[r]["all_reduce_ms"] for r in (0, 1)] == [full[r]["all_reduce_ms"] for r in (0, 1)]


def _steps_of_the_steps_workload(tmp_path, env: dict[str, str]) -> tuple[int, str]:
    summary = tmp_path / "summary.json"
    run = mirage("run", "--quiet", "--timing", "--summary-json", str(summary), "--profile", "h100",
                 "--gpus-per-node", "1", "--", sys.executable, str(WORKLOAD), "steps", env=env)
    assert run.returncode == 0, run.stderr
    rank = json.loads(summary.read_text())["timing"]["ranks"][0]
    return rank["steps"], rank["steps_from"]


def test_an_optimizer_that_steps_optimizers_ends_one_step(tmp_path):
    """torchtitan steps an Optimizer holding one optimizer per model part: 3 training steps are 3
    steps, not 6 (half of them empty), or the report's median step is wrong."""
    assert _steps_of_the_steps_workload(tmp_path, {"NESTED": "1"}) == (3, "optimizer")


def test_steps_come_from_the_users_marker_once_it_marks(tmp_path):
    assert _steps_of_the_steps_workload(tmp_path, {"MARK": "1"}) == (4, "marker")


def test_trace_has_every_ranks_kernels_collectives_ranges_and_memory(tmp_path):
    trace = tmp_path / "run.json"
    run = mirage("run", "--quiet", "--timing", "--trace", str(trace), "--profile", "h100", "--gpus-per-node", "2",
                 "--", "torchrun", "--standalone", "--nproc_per_node=2", str(DDP), env={"STEPS": "5"})
    assert run.returncode == 0, run.stderr
    events = json.loads(trace.read_text())["traceEvents"]
    slices = [e for e in events if e["ph"] == "X"]
    assert {e["pid"] for e in slices} == {0, 1}
    kernels = [e for e in slices if e["name"] == "aten::addmm"]
    collectives = [e for e in slices if e["cat"] == "collective"]
    assert kernels and all(e["dur"] > 0 for e in kernels)
    assert any(e["name"] == "nccl:all_reduce" and e["args"]["bytes"] > 0 for e in collectives)
    assert {e["tid"] for e in collectives}.isdisjoint({e["tid"] for e in kernels})  # the communicator's stream
    assert any(e["ph"] == "C" and e["args"]["bytes"] > 0 for e in events)
    # what Perfetto and chrome://tracing read: the Trace Event Format's JSON object form
    assert trace_event_format_errors(json.loads(trace.read_text())) == []


METADATA_NAMES = {"process_name", "process_labels", "process_sort_index", "thread_name", "thread_sort_index"}


def trace_event_format_errors(document: object) -> list[str]:
    """Where a document departs from the Trace Event Format (Google's "Trace Event Format" document,
    the JSON Object Format) for the phases a timeline uses: complete slices (X), counters (C) and
    metadata (M). Checked in-process, so it runs where Perfetto's trace_processor binary is absent."""
    def number(value: object) -> bool:
        return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)

    if not isinstance(document, dict) or not isinstance(document.get("traceEvents"), list):
        return ["not an object with a traceEvents list"]
    errors = [] if document.get("displayTimeUnit", "ms") in ("ms", "ns") else ["displayTimeUnit not ms or ns"]
    for i, event in enumerate(document["traceEvents"]):
        where = f"event {i} {event!r:.120}"
        if not isinstance(event, dict) or event.get("ph") not in ("X", "C", "M"):
            errors.append(f"{where}: not an X, C or M event")
            continue
        if not isinstance(event.get("name"), str) or not isinstance(event.get("pid"), int):
            errors.append(f"{where}: needs a string name and an integer pid")
        if not isinstance(event.get("args", {}), dict) or not isinstance(event.get("cat", ""), str):
            errors.append(f"{where}: args must be an object, cat a string")
        if event["ph"] != "M" and not number(event.get("ts")):
            errors.append(f"{where}: needs a numeric ts (microseconds)")
        if event["ph"] == "X" and (not isinstance(event.get("tid"), int) or not number(event.get("dur"))
                                   or event["dur"] < 0):
            errors.append(f"{where}: a complete event needs an integer tid and a duration >= 0")
        if event["ph"] == "C" and not (event.get("args") and all(number(v) for v in event["args"].values())):
            errors.append(f"{where}: a counter needs numeric args")
        if event["ph"] == "M" and (event["name"] not in METADATA_NAMES or not isinstance(event.get("args"), dict)
                                   or (event["name"].startswith("thread") and not isinstance(event.get("tid"), int))):
            errors.append(f"{where}: metadata needs a known name, args, and a tid for a thread's")
    return errors


def test_clocked_flags_are_refused_before_anything_starts(tmp_path):
    for flag in ("--virtual-clock", "--predict-only"):
        run = mirage("run", flag, "--", sys.executable, "-c", "print('ran')")
        assert run.returncode == 2 and "add --timing" in run.stderr and "ran" not in run.stdout
    run = mirage("run", "--timing", "--trace", "/nonexistent-dir/run.json", "--", sys.executable, "-c", "print('ran')")
    assert run.returncode == 2 and "cannot write there" in run.stderr and "ran" not in run.stdout
    tuning = tmp_path / "tuning.toml"
    tuning.write_text("gemm_efficency = 0.7\n")
    run = mirage("run", "--timing", "--timing-tuning", str(tuning), "--", sys.executable, "-c", "print('ran')")
    assert run.returncode == 2 and "did you mean 'gemm_efficiency'" in run.stderr and "ran" not in run.stdout


def test_a_tuning_file_overrides_the_model_and_is_shown_with_its_source(tmp_path):
    tuning = tmp_path / "tuning.toml"
    tuning.write_text('gemm_efficiency = { value = 0.5, kind = "measured", source = "my H100" }\n')
    shown = mirage("profiles", "show", "h100", "--timing", "--timing-tuning", str(tuning), "--json")
    assert shown.returncode == 0, shown.stderr
    numbers = {n["key"]: n for n in json.loads(shown.stdout)}
    assert set(profiles.TIMING_KEYS) <= set(numbers)
    assert numbers["gemm_efficiency"] == {"key": "gemm_efficiency", "value": 0.5, "kind": "measured", "source": "my H100"}
    assert all(n["kind"] in profiles.PROVENANCE_KINDS and n["source"] for n in numbers.values())
    # a GEMM of 4096, only predicted, whose time is the compute the efficiency divides (at 1024 the
    # kernel's fixed overhead is a larger share, so halving the efficiency shows less)
    run = mirage("run", "--quiet", "--timing", "--predict-only", "--timing-tuning", str(tuning), "--profile", "h100",
                 "--gpus-per-node", "1", "--", sys.executable, str(WORKLOAD), "gemm", env={"N": "4096"})
    assert run.returncode == 0, run.stderr
    slower = last_json(run.stdout)["gemm_ms"]
    assert slower == pytest.approx(expected_gemm_ms("h100", 4096, gemm_efficiency=0.5), rel=1e-3)
    assert slower > expected_gemm_ms("h100", 4096) * 1.5


def test_an_out_dtype_matmul_is_timed_as_the_gemm_it_is():
    """mm, addmm and baddbmm with out_dtype= (cuBLAS's float-accumulating GEMMs of the halves,
    F.linear_cross_entropy's on a CUDA device) carry their out_dtype where flop_counter's formula
    takes the output's shape: clocked mode counts their FLOPs as the plain GEMM's (it raised)."""
    script = (
        "import json, torch\n"
        "a, b = (torch.randn(4096, 4096, device='cuda', dtype=torch.bfloat16) for _ in range(2))\n"
        "def ms(f):\n"
        "    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)\n"
        "    s.record(); f(); e.record(); e.synchronize(); return s.elapsed_time(e)\n"
        "print(json.dumps({'mm': ms(lambda: a @ b), 'mm_dtype': ms(lambda: torch.mm(a, b, out_dtype=torch.float32)),\n"
        "    'addmm_dtype': ms(lambda: torch.addmm(a, a, b, out_dtype=torch.float32)),\n"
        "    'baddbmm_dtype': ms(lambda: torch.baddbmm(a[None], a[None], b[None], out_dtype=torch.float32))}))\n")
    run = mirage("run", "--quiet", "--timing", "--predict-only", "--profile", "h100", "--gpus-per-node", "1", "--",
                 sys.executable, "-c", script)
    assert run.returncode == 0, run.stderr
    timed = last_json(run.stdout)
    flops_ms = 2 * 4096**3 / (model("h100")["peak_tflops.bf16"] * 1e9)  # at peak: the least a GEMM can take
    assert timed["mm"] > flops_ms
    for name in ("mm_dtype", "addmm_dtype", "baddbmm_dtype"):
        assert timed["mm"] <= timed[name] < 1.2 * timed["mm"], (name, timed)
