"""Kernels a CUDA build has and a CPU build lacks, reached by ordinary training code: the fused
LSTM / GRU cells nn.LSTM / nn.GRU / nn.LSTMCell / nn.GRUCell run on a CUDA device."""

import copy

import pytest
import torch
from torch import nn


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


def test_a_cuda_only_operator_that_is_not_emulated_says_so():
    a = torch.randn(4, 4, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(NotImplementedError, match=r"mirage: aten::mm\.dtype has a CUDA kernel in a CUDA build"):
        torch.ops.aten.mm.dtype(a, a, torch.float32)
