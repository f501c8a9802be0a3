"""Sparse tensors (COO, CSR, CSC, BSR, BSC) and nested tensors on the emulated GPU, as a CUDA
build has them.

Each result is compared with the same op on the CPU; the kernels the device has are checked against
the dispatch table torch's own native_functions.yaml (shipped in the wheel with torchgen) gives a
CUDA build.
"""

import warnings

import pytest
import torch
from cuda_build_table import dispatch_keys_by_function

DEVICE = "cuda:3"
LAYOUTS = {
    "coo": lambda t: t.to_sparse(),
    "csr": lambda t: t.to_sparse_csr(),
    "csc": lambda t: t.to_sparse_csc(),
    "bsr": lambda t: t.to_sparse_bsr((2, 1)),
    "bsc": lambda t: t.to_sparse_bsc((1, 2)),
}


def _members(sparse: torch.Tensor) -> list[torch.Tensor]:
    if sparse.layout == torch.sparse_coo:
        return [sparse._indices(), sparse._values()]
    if sparse.layout in (torch.sparse_csr, torch.sparse_bsr):
        return [sparse.crow_indices(), sparse.col_indices(), sparse.values()]
    return [sparse.ccol_indices(), sparse.row_indices(), sparse.values()]


def _dense_with_zeros(*shape: int, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=generator)
    return x * (x > 0.3)


@pytest.fixture(autouse=True)
def _quiet_beta_warnings():
    with warnings.catch_warnings():  # "Sparse CSR tensor support is in beta state", on any device
        warnings.simplefilter("ignore", UserWarning)
        yield


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_a_device_tensor_made_sparse_stays_on_its_device_with_its_values(layout):
    x = _dense_with_zeros(4, 6)
    on_device = LAYOUTS[layout](x.to(DEVICE))
    on_cpu = LAYOUTS[layout](x)
    assert on_device.device == torch.device(DEVICE) and on_device.layout == on_cpu.layout
    for member, expected in zip(_members(on_device), _members(on_cpu), strict=True):
        assert member.device == torch.device(DEVICE)
        assert torch.equal(member.cpu(), expected)
    assert torch.equal(on_device.to_dense().cpu(), x)
    back = on_device.cpu()
    assert back.layout == on_cpu.layout and torch.equal(back.to_dense(), x)


def test_sparse_ops_compute_what_the_cpu_computes():
    a, d = _dense_with_zeros(5, 7), torch.randn(7, 3, generator=torch.Generator().manual_seed(1))
    coo, csr, dd = a.to_sparse().to(DEVICE), a.to_sparse_csr().to(DEVICE), d.to(DEVICE)
    assert coo.device == csr.device == torch.device(DEVICE)
    torch.testing.assert_close((coo @ dd).cpu(), a.to_sparse() @ d)
    torch.testing.assert_close((csr @ dd).cpu(), a.to_sparse_csr() @ d)
    torch.testing.assert_close(torch.sparse.sum(coo, dim=1).to_dense().cpu(), a.sum(1))
    torch.testing.assert_close((coo * 3 + coo).to_dense().cpu(), a * 4)
    torch.testing.assert_close(torch.sparse.softmax(coo, 1).to_dense().cpu(),
                               torch.sparse.softmax(a.to_sparse(), 1).to_dense())
    mask = _dense_with_zeros(5, 3, seed=2).to_sparse_csr()
    left, right = torch.randn(5, 4), torch.randn(4, 3)
    sampled = torch.sparse.sampled_addmm(mask.to(DEVICE), left.to(DEVICE), right.to(DEVICE))
    assert sampled.layout == torch.sparse_csr and sampled.device == torch.device(DEVICE)
    torch.testing.assert_close(sampled.to_dense().cpu(), torch.sparse.sampled_addmm(mask, left, right).to_dense())


def test_in_place_sparse_ops_change_the_device_tensor():
    x = _dense_with_zeros(4, 4)
    s = x.to_sparse().to(DEVICE)
    s.add_(s)  # new values, written back into the device tensor
    assert s.device == torch.device(DEVICE) and torch.equal(s.to_dense().cpu(), 2 * x)
    s.zero_()
    assert s._nnz() == 0 and s._values().device == torch.device(DEVICE)
    s.copy_(x.to_sparse())  # a host source, as copy_sparse_ takes it
    assert s.device == torch.device(DEVICE) and torch.equal(s.to_dense().cpu(), x)
    dense = torch.zeros(4, 4, device=DEVICE)
    dense.add_(s)
    assert torch.equal(dense.cpu(), x)


def test_a_sparse_embedding_trains_with_sparse_adam_as_on_the_cpu():
    torch.manual_seed(0)
    reference = torch.nn.Embedding(60, 8, sparse=True)
    on_device = torch.nn.Embedding(60, 8, sparse=True).to(DEVICE)
    on_device.load_state_dict(reference.state_dict())
    optimizers = [torch.optim.SparseAdam(m.parameters(), lr=0.1) for m in (reference, on_device)]
    for step in range(3):
        ids = torch.tensor([[1, 4, 4, 7], [9, 1, 30, 49]]) + step
        for module, optimizer, device in zip((reference, on_device), optimizers, ("cpu", DEVICE)):
            optimizer.zero_grad()
            module(ids.to(device)).pow(2).sum().backward()
            assert module.weight.grad.layout == torch.sparse_coo and module.weight.grad.device == torch.device(device)
            optimizer.step()
    torch.testing.assert_close(on_device.weight.detach().cpu(), reference.weight.detach())


def test_the_allocator_counts_a_sparse_tensors_members():
    torch.cuda.synchronize(DEVICE)
    before = torch.cuda.memory_allocated(DEVICE)
    dense = torch.ones(1000, device=DEVICE)
    with_dense = torch.cuda.memory_allocated(DEVICE)
    sparse = dense.to_sparse()  # 1000 int64 indices and 1000 float values: 12,000 bytes
    held = torch.cuda.memory_allocated(DEVICE) - with_dense
    assert 12_000 <= held <= 2 * 12_000, held
    del sparse, dense
    assert torch.cuda.memory_allocated(DEVICE) == before


def test_the_device_has_the_sparse_and_nested_kernels_a_cuda_build_has():
    has_kernel = torch._C._dispatch_has_kernel_for_dispatch_key
    differences, checked = [], 0
    for name, keys in dispatch_keys_by_function().items():
        for cpu, cuda in (("SparseCPU", "SparseCUDA"), ("SparseCsrCPU", "SparseCsrCUDA"),
                          ("NestedTensorCPU", "NestedTensorCUDA")):
            if cpu not in keys:
                continue  # (a CUDA-only sparse kernel has no CPU kernel the device could run)
            checked += 1
            if has_kernel(name, cuda) != (cuda in keys):
                differences.append(f"{name}: {cuda} {'missing' if cuda in keys else 'present on the device only'}")
    assert checked > 350 and differences == []


def test_an_op_with_a_sparse_cpu_kernel_only_refuses_as_on_cuda():
    csr = _dense_with_zeros(4, 4).to_sparse_csr().to(DEVICE)
    with pytest.raises(NotImplementedError, match="'aten::_sparse_mm_reduce_impl' with arguments from the 'SparseCsrCUDA'"):
        torch.sparse.mm(csr, torch.ones(4, 2, device=DEVICE), "sum")


def _ragged(seed: int = 0) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(length, 6, generator=generator) for length in (2, 5, 3)]


def test_nested_tensors_compute_on_the_device_what_the_cpu_computes():
    on_cpu = torch.nested.nested_tensor(_ragged())
    on_device = torch.nested.nested_tensor(_ragged(), device=DEVICE)
    assert on_device.is_nested and on_device.device == torch.device(DEVICE)
    weight = torch.randn(6, 4, generator=torch.Generator().manual_seed(3)).contiguous()
    for compute in (lambda t: t * 2 + t, lambda t: torch.nn.functional.softmax(t, -1),
                    lambda t: torch.nn.functional.linear(t, weight.T.to(t.device)),
                    lambda t: t.transpose(1, 2).contiguous()):
        got, expected = compute(on_device), compute(on_cpu)
        assert got.is_nested and got.device == torch.device(DEVICE)
        torch.testing.assert_close(got.to_padded_tensor(0.0).cpu(), expected.to_padded_tensor(0.0))
    pieces = on_device.unbind()
    assert [p.device for p in pieces] == [torch.device(DEVICE)] * 3
    assert all(torch.equal(p.cpu(), e) for p, e in zip(pieces, _ragged(), strict=True))


def test_a_transformer_encoder_with_a_padding_mask_takes_the_nested_fast_path_as_on_a_gpu(monkeypatch):
    """nn.TransformerEncoder in eval mode turns padded batches into nested tensors
    (torch._nested_tensor_from_mask) and runs the fused encoder layer on them."""
    made_nested = []
    from_mask = torch._nested_tensor_from_mask
    monkeypatch.setattr(torch, "_nested_tensor_from_mask",
                        lambda *args, **kwargs: made_nested.append(args[0].device) or from_mask(*args, **kwargs))
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(8, 2, 16, batch_first=True)
    encoder = torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=True).eval()
    x = torch.randn(3, 5, 8)
    padding = torch.zeros(3, 5, dtype=torch.bool)
    padding[0, 3:] = True
    padding[2, 1:] = True
    with torch.no_grad():
        expected = encoder(x, src_key_padding_mask=padding)
        got = encoder.to(DEVICE)(x.to(DEVICE), src_key_padding_mask=padding.to(DEVICE))
    assert made_nested == [torch.device("cpu"), torch.device(DEVICE)]  # the fast path, on both
    assert got.device == torch.device(DEVICE) and not got.is_nested
    torch.testing.assert_close(got.cpu(), expected)


def test_the_allocator_counts_a_nested_tensors_storage():
    torch.cuda.synchronize(DEVICE)
    before = torch.cuda.memory_allocated(DEVICE)
    nested = torch.nested.nested_tensor([torch.ones(1000), torch.ones(500)], device=DEVICE)  # 6,000 bytes
    held = torch.cuda.memory_allocated(DEVICE) - before
    assert 6_000 <= held <= 2 * 6_000, held
    doubled = nested * 2
    assert torch.cuda.memory_allocated(DEVICE) - before >= 2 * 6_000
    del nested, doubled
    assert torch.cuda.memory_allocated(DEVICE) == before
