"""The op path's shortcuts keep device semantics: where backward runs, and results re-labelled in place."""

import threading

import pytest
import torch
from cuda_build_table import dispatch_keys_by_function


class _RecordThread(torch.autograd.Function):
    """Identity whose backward notes the thread it runs on."""

    threads: list[int] = []

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        _RecordThread.threads.append(threading.get_ident())
        return grad


def _backward_thread(device: str) -> int:
    _RecordThread.threads.clear()
    x = torch.randn(8, device=device, requires_grad=True)
    _RecordThread.apply(x * 2).sum().backward()
    assert x.grad is not None and x.grad.device == x.device
    return _RecordThread.threads[-1]


def test_backward_of_a_device_graph_runs_on_the_calling_thread_and_leaves_the_flag_alone():
    assert torch.autograd.is_multithreading_enabled()
    assert _backward_thread("cuda:1") == threading.get_ident()
    assert torch.autograd.is_multithreading_enabled()  # restored after the pass
    with torch.autograd.set_multithreading_enabled(False):  # the user's own choice still holds
        assert _backward_thread("cuda") == threading.get_ident()
        assert not torch.autograd.is_multithreading_enabled()
    assert torch.autograd.is_multithreading_enabled()


def test_backward_under_use_mem_pool_stays_on_the_device_thread_as_on_a_gpu():
    pool = torch.cuda.MemPool()
    with torch.cuda.use_mem_pool(pool):
        thread = _backward_thread("cuda")
    assert thread != threading.get_ident()  # autograd's pt_autograd_0: its allocations skip the pool
    assert _backward_thread("cuda") == threading.get_ident()


def test_fresh_results_are_device_tensors_with_the_device_keys():
    a = torch.randn(16, 16, device="cuda:2")
    fresh = a.relu()  # a kernel result re-labelled in place
    assert fresh.is_cuda and fresh.device == torch.device("cuda", 2)
    assert fresh.untyped_storage().device == torch.device("cuda", 2)
    assert torch.equal(fresh.cpu(), a.cpu().relu())
    with torch.autocast("cuda", dtype=torch.float16):  # autocast sees it as a CUDA tensor
        assert (fresh @ fresh).dtype == torch.float16
    with torch.autocast("cpu", dtype=torch.bfloat16):  # and not as a CPU one
        assert (fresh @ fresh).dtype == torch.float32
    fresh.requires_grad_()
    (fresh * 3).sum().backward()
    assert fresh.grad.device == fresh.device and torch.equal(fresh.grad.cpu(), torch.full((16, 16), 3.0))


def test_results_sharing_a_storage_and_in_place_results_keep_their_identity():
    a = torch.randn(6, 4, device="cuda")
    parts = (a + 1).split(2)  # three views of one fresh storage
    assert all(p.is_cuda for p in parts)
    assert len({p.untyped_storage().data_ptr() for p in parts}) == 1
    parts[0].zero_()
    assert torch.equal(parts[0].cpu(), torch.zeros(2, 4))
    b = a.clone()
    assert b.add_(1) is b  # an in-place result is the device tensor itself
    assert torch.equal(b.cpu(), a.cpu() + 1)
    allocated = torch.cuda.memory_allocated()
    fresh = a.exp()
    assert torch.cuda.memory_allocated() - allocated == 512  # one 96-byte result, one 512-byte block
    del fresh
    assert torch.cuda.memory_allocated() == allocated


def test_aliases_recycled_across_dtypes_and_conjugate_views():
    z = torch.randn(4, dtype=torch.complex64, device="cuda")
    assert torch.equal(z.conj().abs().cpu(), z.cpu().conj().abs())
    assert torch.equal((z.conj() * 2).cpu(), z.cpu().conj() * 2)
    ints = torch.arange(10, device="cuda")
    assert torch.equal((ints * 3).cpu(), torch.arange(10) * 3)
    doubles = torch.linspace(0, 1, 5, dtype=torch.float64, device="cuda")
    assert torch.equal(doubles.sqrt().cpu(), torch.linspace(0, 1, 5, dtype=torch.float64).sqrt())


# torch.compile's own ops, which a CUDA build's compiled graphs never reach with device tensors,
# and the CPU flash attention kernels, which are the emulated device's flash attention
STILL_RUN = {"aten::_functional_assert_async.msg", "aten::_make_dep_token",
             "aten::_scaled_dot_product_flash_attention_for_cpu",
             "aten::_scaled_dot_product_flash_attention_for_cpu_backward"}


def test_the_operators_a_cuda_build_runs_only_on_the_cpu_are_the_ones_the_device_refuses():
    composite = {"CompositeExplicitAutograd", "CompositeExplicitAutogradNonFunctional", "CompositeImplicitAutograd"}
    cpu_only = {name for name, keys in dispatch_keys_by_function().items()
                if "CPU" in keys and "CUDA" not in keys and not keys & composite}
    refused = {"aten::" + name for name in torch.ops.mirage.cpu_only_in_a_cuda_build()}
    assert len(refused) > 30 and refused == cpu_only - STILL_RUN


@pytest.mark.parametrize("call, op", [
    (lambda x: torch.histogram(x, bins=4), "aten::histogram.bin_ct"),
    (lambda x: x.to_mkldnn(), "aten::to_mkldnn"),
    (lambda x: torch.sparse.spdiags(x[:3].reshape(1, 3), torch.tensor([0]), (3, 3)), "aten::_spdiags"),
    (lambda x: torch.ops.aten._add_relu(x, x), "aten::_add_relu.Tensor"),
])
def test_a_cpu_only_operator_on_a_device_tensor_raises_the_dispatchers_error_as_on_a_gpu(call, op):
    x = torch.rand(16, device="cuda")
    with pytest.raises(NotImplementedError, match=f"Could not run '{op}' with arguments from the 'CUDA' backend"):
        call(x)
    assert torch.histc(x, bins=4).sum().item() == 16  # the GPU's histogram
