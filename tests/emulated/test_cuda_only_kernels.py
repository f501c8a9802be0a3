"""Kernels a CUDA build has and a CPU build lacks, reached by ordinary training code: the fused
LSTM / GRU cells nn.LSTM / nn.GRU / nn.LSTMCell / nn.GRUCell run on a CUDA device."""

import contextlib
import copy

import pytest
import torch
from torch import nn

from opinfo import op_db


@pytest.mark.parametrize("cls", [nn.LSTM, nn.GRU])
@pytest.mark.parametrize("bias", [True, False])
def test_recurrent_layers_train_on_the_device_with_the_cpu_gradients(cls, bias):
    torch.manual_seed(0)
    cpu = cls(8, 16, num_layers=2, batch_first=True, bias=bias)
    device = copy.deepcopy(cpu).cuda()
    x = torch.randn(4, 5, 8)
    expected, _ = cpu(x)
    expected.square().sum().backward()
    got, _ = device(x.cuda())
    got.square().sum().backward()
    torch.testing.assert_close(got.cpu(), expected, rtol=1e-5, atol=1e-6)
    for a, b in zip(cpu.parameters(), device.parameters()):
        assert b.grad.is_cuda
        torch.testing.assert_close(b.grad.cpu(), a.grad, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("cls", [nn.LSTMCell, nn.GRUCell])
def test_recurrent_cells_run_their_fused_cuda_kernels(cls):
    torch.manual_seed(0)
    cpu = cls(8, 16)
    device = copy.deepcopy(cpu).cuda()
    x = torch.randn(3, 8)
    expected = cpu(x)
    got = device(x.cuda())
    expected, got = (expected[0], got[0]) if cls is nn.LSTMCell else (expected, got)
    torch.testing.assert_close(got.cpu(), expected, rtol=1e-5, atol=1e-6)
    got.sum().backward()
    expected.sum().backward()
    torch.testing.assert_close(device.weight_hh.grad.cpu(), cpu.weight_hh.grad, rtol=1e-4, atol=1e-5)


def test_an_lstm_under_autocast_computes_in_half():
    lstm = nn.LSTM(8, 16).cuda()
    with torch.autocast("cuda", dtype=torch.float16):
        out, (h, c) = lstm(torch.randn(5, 3, 8, device="cuda"))
    assert out.dtype == torch.float16 and out.is_cuda


def test_cudnn_is_reported_as_a_rocm_build_reports_miopen():
    import warnings

    assert torch.backends.cudnn.is_available() and torch.backends.cudnn.enabled
    assert torch.backends.cudnn.version() == 30500  # MIOpen 3.5.0, as torch.version.hip's ROCm 7.0 ships
    assert torch.backends.cudnn.is_acceptable(torch.ones(1, device="cuda"))
    with torch.backends.cudnn.flags(enabled=True, benchmark=True, deterministic=True, allow_tf32=False):
        assert torch.backends.cudnn.benchmark and torch.backends.cudnn.benchmark_limit == 10
    torch.backends.cudnn.benchmark_limit = 4
    assert torch.backends.cudnn.benchmark_limit == 4 and not torch.backends.cudnn.benchmark
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "compiled without cuDNN/MIOpen" warning
        nn.LSTM(4, 8).cuda()(torch.randn(3, 2, 4, device="cuda"))


def test_forcing_a_fused_attention_backend_runs_that_backend():
    from torch.nn.attention import SDPBackend, sdpa_kernel

    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 4, 40, 32, dtype=torch.float16) for _ in range(3))
    expected = nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True)
    for backend, node in ((SDPBackend.FLASH_ATTENTION, "ScaledDotProductFlashAttentionBackward0"),
                          (SDPBackend.EFFICIENT_ATTENTION, "ScaledDotProductEfficientAttentionBackward0")):
        qd, kd, vd = (t.cuda().requires_grad_() for t in (q, k, v))
        with sdpa_kernel(backend):
            out = nn.functional.scaled_dot_product_attention(qd, kd, vd, is_causal=True)
        assert type(out.grad_fn).__name__ == node
        torch.testing.assert_close(out.float().cpu(), expected, rtol=2e-3, atol=2e-3)
        out.sum().backward()
        assert qd.grad.shape == q.shape and qd.grad.dtype == torch.float16
    # the output and logsumexp as torch's meta kernels give them; they read torch.version.hip, set
    # as the profile's build sets it (memory-efficient's logsumexp is rounded up to 32 rows on CUDA,
    # (B, H, L) on ROCm)
    qd, qm = q.cuda(), q.to("meta")
    for op, args in ((torch.ops.aten._scaled_dot_product_flash_attention, ()),
                     (torch.ops.aten._scaled_dot_product_efficient_attention, (None, True))):
        got, expected = op(qd, qd, qd, *args)[:2], op(qm, qm, qm, *args)[:2]
        assert [(t.shape, t.dtype) for t in got] == [(t.shape, t.dtype) for t in expected], op
    lse = torch.ops.aten._scaled_dot_product_efficient_attention(qd, qd, qd, None, True)[1]
    assert lse.shape == ((2, 4, 40) if torch.version.hip else (2, 4, 64))  # the meta kernel's own rule, held fixed
    # flash takes half precision only: with only flash allowed, a float32 call has no kernel, as on a GPU
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION), pytest.raises(RuntimeError, match="No available kernel"):
        nn.functional.scaled_dot_product_attention(*(t.float().cuda() for t in (q, k, v)))
    assert torch._fused_sdp_choice(qd, qd, qd) == SDPBackend.FLASH_ATTENTION.value  # a GPU's default choice


def test_grouped_query_attention_takes_the_fused_kernels_a_gpu_build_gives_it():
    """Fewer key/value heads than query heads (Llama 3's 8 for 32) under enable_gqa: flash attention
    takes them on both vendors and memory-efficient attention on CUDA only (sdp_utils.cpp), so a
    Llama's attention never falls back to math, whose (batch, heads, length, length) float32 scores
    are 16 GiB for Llama 3 8B at 8k tokens and would make a job that fits a GPU run out of memory."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    torch.manual_seed(0)
    q = torch.randn(2, 8, 40, 32, dtype=torch.float16)
    k, v = (torch.randn(2, 2, 40, 32, dtype=torch.float16) for _ in range(2))
    upstream = torch.randn(2, 8, 40, 32)
    leaves = [t.float().requires_grad_() for t in (q, k, v)]
    expected = nn.functional.scaled_dot_product_attention(*leaves, is_causal=True, enable_gqa=True)
    expected_grads = torch.autograd.grad(expected, leaves, upstream)
    fused = [(None, "ScaledDotProductFlashAttentionBackward0")]
    if not torch.version.hip:
        fused.append((SDPBackend.EFFICIENT_ATTENTION, "ScaledDotProductEfficientAttentionBackward0"))
    for backend, node in fused:
        qd, kd, vd = (t.cuda().requires_grad_() for t in (q, k, v))
        with sdpa_kernel(backend) if backend else contextlib.nullcontext():
            out = nn.functional.scaled_dot_product_attention(qd, kd, vd, is_causal=True, enable_gqa=True)
        assert type(out.grad_fn).__name__ == node
        torch.testing.assert_close(out.float().cpu(), expected, rtol=2e-3, atol=2e-3)
        out.backward(upstream.half().cuda())
        for got, want in zip((qd.grad, kd.grad, vd.grad), expected_grads):
            assert got.shape == want.shape
            torch.testing.assert_close(got.float().cpu(), want, rtol=1e-2, atol=1e-2)
    if torch.version.hip:  # ROCm's memory-efficient kernel takes no grouped-query attention
        with sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION), pytest.raises(RuntimeError, match="No available kernel"):
            nn.functional.scaled_dot_product_attention(q.cuda(), k.cuda(), v.cuda(), enable_gqa=True)


def test_a_cuda_only_operator_that_is_not_emulated_says_so():
    a = torch.randn(4, 4, device="cuda")
    with pytest.raises(NotImplementedError, match=r"mirage: aten::_fused_dropout has a CUDA kernel in a CUDA build"):
        torch.ops.aten._fused_dropout(a, 0.5)


def test_a_quantized_device_tensor_is_refused_rather_than_made_a_plain_one():
    with pytest.raises(NotImplementedError, match=r"mirage: quantized tensors \(QuantizedCUDA.*Fix: quantize on the CPU"):
        torch.quantize_per_tensor(torch.randn(6, device="cuda"), 0.1, 0, torch.qint8)


# PyTorch's test_transformers.py (test_mem_efficient_attention_attn_mask_vs_math_ref_grads) judges
# a GPU's memory-efficient attention with a mask that requires grad against a float64 math
# reference, allowing a multiple ("fudge factor") of how far the same-precision math backend
# lands from that reference; these are its CUDA factors (ROCm's are larger).
FUDGE = {"out": 4.0, "grad_query": 160.0, "grad_key": 25.0, "grad_value": 8.0, "grad_attn_mask": 45.0}


def test_memory_efficient_attention_with_a_mask_gradient_is_as_close_as_a_gpus():
    """The op sweep's known SDPA failure (tests/test_op_sweep.py, OP_SWEEP_SAMPLES=all): with a mask
    that requires grad the device takes memory-efficient attention, as a GPU does, the CPU math, and
    on op_db's large-valued samples they end up to 3e-4 apart in the gradients. This holds each such
    op_db sample to the criterion PyTorch's own GPU test uses: every output and gradient of the
    device within FUDGE x (float32 math's own largest deviation from a float64 math reference) of
    that reference (absolute), plus float32's default relative tolerance. Measured 2026-12-04 on
    op_db's one such sample (device / float32 math / allowed, largest absolute deviation): out
    1.1e-5 / 1.1e-5 / 4.4e-5, grad_query 7.5e-5 / 7.4e-5 / 1.2e-2, grad_key 8.0e-5 / 4.2e-5 / 1.0e-3,
    grad_value 8.1e-6 / 1.0e-6 / 8.4e-6, grad_attn_mask 2.7e-5 / 2.0e-5 / 9.2e-4."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    op = next(o for o in op_db() if o.name == "nn.functional.scaled_dot_product_attention")
    torch.manual_seed(0)
    checked = 0
    for sample in op.sample_inputs("cpu", torch.float32, requires_grad=True):
        mask = sample.kwargs.get("attn_mask")
        if mask is None or not mask.requires_grad or sample.kwargs.get("dropout_p", 0.0) > 0:
            continue
        inputs = (sample.input, *sample.args[:2], mask)
        kwargs = {k: v for k, v in sample.kwargs.items() if k != "attn_mask"}
        upstream = None
        results = {}
        for name, device, dtype in (("device", "cuda", torch.float32), ("lp_ref", "cpu", torch.float32),
                                    ("ref", "cpu", torch.float64)):
            leaves = [t.detach().to(device, dtype).requires_grad_() for t in inputs]
            if name == "device":
                out = nn.functional.scaled_dot_product_attention(*leaves[:3], attn_mask=leaves[3], **kwargs)
                assert type(out.grad_fn).__name__ == "ScaledDotProductEfficientAttentionBackward0"
            else:
                with sdpa_kernel(SDPBackend.MATH):
                    out = nn.functional.scaled_dot_product_attention(*leaves[:3], attn_mask=leaves[3], **kwargs)
            if upstream is None:
                upstream = torch.rand(out.shape, dtype=torch.float64)
            grads = torch.autograd.grad(out, leaves, upstream.to(device, dtype))
            results[name] = dict(zip(FUDGE, (t.detach().cpu().double() for t in (out, *grads))))
        for what, fudge in FUDGE.items():
            ref = results["ref"][what]
            atol = fudge * (results["lp_ref"][what] - ref).abs().max().item()
            torch.testing.assert_close(results["device"][what], ref, atol=atol, rtol=1.3e-6,
                                       msg=lambda m, what=what: f"{what}: {m}")
        checked += 1
    assert checked > 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("affine", [True, False])
def test_rms_norm_runs_the_fused_kernel_a_cuda_build_runs(dtype, affine):
    """F.rms_norm (nn.RMSNorm) calls aten._fused_rms_norm, which a CUDA build has a kernel for:
    one op forward and one backward, the autograd node of that op (which saves the input and
    rstd, not the float32 intermediates the composite would), the composite's values."""
    torch.manual_seed(0)
    x = torch.randn(4, 6, 32, dtype=dtype)
    w = torch.randn(32, dtype=dtype) if affine else None
    xd = x.cuda().requires_grad_()
    wd = w.cuda().requires_grad_() if affine else None
    with torch.profiler.profile() as prof:
        y = torch.nn.functional.rms_norm(xd, (32,), wd, 1e-5)
    ops = [e.name for e in prof.events() if e.name.startswith("aten::")]
    assert ops[:2] == ["aten::rms_norm", "aten::_fused_rms_norm"] and "aten::pow" not in ops
    assert type(y.grad_fn).__name__ == "FusedRmsNormBackward0"
    xc = x.clone().requires_grad_()
    wc = w.clone().requires_grad_() if affine else None
    expected = torch.nn.functional.rms_norm(xc, (32,), wc, 1e-5)  # the CPU build's composite
    torch.testing.assert_close(y.cpu(), expected)
    grad = torch.randn_like(x)
    y.backward(grad.cuda())
    expected.backward(grad)
    tolerance = {"rtol": 1e-2, "atol": 1e-2} if dtype == torch.bfloat16 else {"rtol": 1e-5, "atol": 1e-5}
    torch.testing.assert_close(xd.grad.cpu(), xc.grad, **tolerance)
    if affine:
        torch.testing.assert_close(wd.grad.cpu(), wc.grad, **tolerance)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_out_dtype_matmuls_accumulate_the_halves_in_float(dtype):
    """mm/bmm/addmm/baddbmm with out_dtype=float32 (cuBLAS: float16 or bfloat16 inputs, float
    accumulation, a float result), functional and out=, with their CUDA checks."""
    torch.manual_seed(0)
    a, b = torch.randn(8, 16, dtype=dtype), torch.randn(16, 4, dtype=dtype)
    c = torch.randn(8, 4, dtype=dtype)
    a3, b3, c3 = torch.randn(2, 8, 16, dtype=dtype), torch.randn(2, 16, 4, dtype=dtype), torch.randn(2, 8, 4, dtype=dtype)
    cases = {
        "mm": (lambda *t, **k: torch.mm(*t, **k), (a, b), a.float() @ b.float()),
        "bmm": (lambda *t, **k: torch.bmm(*t, **k), (a3, b3), a3.float() @ b3.float()),
        "addmm": (lambda *t, **k: torch.addmm(*t, beta=0.5, alpha=2, **k), (c, a, b), 0.5 * c.float() + 2 * (a.float() @ b.float())),
        "baddbmm": (lambda *t, **k: torch.baddbmm(*t, beta=0.5, alpha=2, **k), (c3, a3, b3),
                    0.5 * c3.float() + 2 * (a3.float() @ b3.float())),
    }
    for name, (fn, args, expected) in cases.items():
        got = fn(*[t.cuda() for t in args], out_dtype=torch.float32)
        assert got.dtype == torch.float32 and got.is_cuda, name
        torch.testing.assert_close(got.cpu(), expected, rtol=1e-5, atol=1e-5, msg=name)
        out = torch.empty(0, device="cuda", dtype=torch.float32)
        assert fn(*[t.cuda() for t in args], out_dtype=torch.float32, out=out) is out
        torch.testing.assert_close(out.cpu(), expected, rtol=1e-5, atol=1e-5, msg=name)
    with pytest.raises(RuntimeError, match="out_dtype must be the same as input dtype or fp32 for fp16/bf16 inputs"):
        torch.mm(a.float().cuda(), b.float().cuda(), out_dtype=dtype)
    with pytest.raises(RuntimeError, match="out_dtype must be the same as the dtype of the provided out tensor"):
        torch.mm(a.cuda(), b.cuda(), out_dtype=torch.float32, out=torch.empty(0, device="cuda", dtype=dtype))
    with pytest.raises(RuntimeError, match=r"mat1 and mat2 shapes cannot be multiplied \(8x16 and 4x16\)"):
        torch.mm(a.cuda(), b.T.contiguous().cuda(), out_dtype=torch.float32)


def test_linear_cross_entropy_trains_in_bfloat16_as_on_a_gpu():
    """torch 2.13's F.linear_cross_entropy takes cuBLAS's out_dtype matmul on a CUDA device for
    bfloat16 inputs (its chunks' logits in float): forward and gradients as the float reference."""
    torch.manual_seed(0)
    x = torch.randn(64, 32, dtype=torch.bfloat16)
    w = torch.randn(1000, 32, dtype=torch.bfloat16) * 0.1
    target = torch.randint(0, 1000, (64,))
    xd, wd = x.cuda().requires_grad_(), w.cuda().requires_grad_()
    loss = torch.nn.functional.linear_cross_entropy(xd, wd, target.cuda())
    loss.backward()
    xr, wr = x.float().requires_grad_(), w.float().requires_grad_()
    expected = torch.nn.functional.cross_entropy(xr @ wr.T, target)
    expected.backward()
    torch.testing.assert_close(loss.float().cpu(), expected, rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(xd.grad.float().cpu(), xr.grad, rtol=2e-2, atol=2e-3)
    torch.testing.assert_close(wd.grad.float().cpu(), wr.grad, rtol=2e-2, atol=2e-3)
