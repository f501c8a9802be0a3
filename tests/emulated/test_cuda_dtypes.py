"""The dtypes the device's kernels take are a CUDA build's, not the CPU build's whose kernels run.

op_db gives each operator the dtypes its CPU kernels take and those its CUDA kernels take
(dtypesIfCUDA, read on the emulated device, where its capability checks see the profile's GPU).
Where they differ, a CPU build's kernel would run what a GPU refuses (an integer matmul) or
refuse, in CPU words, what a GPU runs (a float16 FFT, a bfloat16 3-D average pool, complex32
arithmetic). PyTorch's own check of those lists, test_ops.py's test_dtypes, runs each dtype's
samples and holds the lists to which of them raise; these tests hold the device to op_db's CUDA
lists: every dtype they give runs (its values within a rounding of a float64 reference and its
result's dtype the Meta kernel's where the CPU's lists differ), every dtype a CPU build takes and
they do not raises in words that name no CPU kernel (mirage/shim/cuda_dtypes.cpp).
"""

import itertools
import re

import pytest
import torch

from opinfo import op_db

# CUDA-only kernels mirage does not emulate, called directly (README: "CUDA-only operators"); the
# public APIs that reach a GPU's fused attention take the emulated device's own.
NOT_EMULATED = {"torch.ops.aten._efficient_attention_forward", "torch.ops.aten._flash_attention_forward"}
# Random ops: the device draws from its own generator, so only dtypes and shapes are compared.
RANDOM = {"nn.functional.rrelu"}
SAMPLES = 3
# The reference gradient cannot be taken: a sparse result's backward in bfloat16 and float16 fails
# on the CPU too (to(options) of its dense gradient); complex nansum's is refused by the CPU in
# float64 as in any dtype, so its gradients are compared by dtype and device only.
BACKWARD_ON_THE_CPU_FAILS = {"to_sparse"}
NO_FLOAT64_GRADIENT = {"nansum", "nanmean"}
# Where the device still differs from a GPU, and why.
KNOWN_DIFFERENCES = {
    **{name: "a GPU's integer convolution fails in cuDNN's (or MIOpen's) descriptor setup, which mirage does not "
             "reproduce; the device computes it" for name in (
        "nn.functional.conv1d", "nn.functional.conv2d", "nn.functional.conv3d", "nn.functional.conv_transpose1d",
        "nn.functional.conv_transpose2d", "nn.functional.conv_transpose3d")},
    **{name: "the architecture-specific float8 format checks of a GPU's scaled matmul are not reproduced" for name in (
        "torch._scaled_mm", "torch._scaled_mm_v2")},
    "norm": "op_db gives CUDA no complex32 norm: a GPU's kernel reduces it without an error, wrongly "
            "(pytorch/pytorch#132634); the device computes it right",
    "norm.inf": "as norm",
}


def _name(op) -> str:
    return op.name + ("." + op.variant_test_name if op.variant_test_name else "")


def _dtype_differences() -> tuple[list, list, list, list]:
    """(op, dtype) pairs a CUDA build's kernels take and the CPU's lack, the other way round, and
    those of the other way round that KNOWN_DIFFERENCES names, and the dtypes a CUDA build
    differentiates and the CPU's does not."""
    cuda_only, cpu_only, known_differences, backward = [], [], [], []
    for op in op_db():
        if _name(op) in NOT_EMULATED:
            continue
        cpu, cuda = set(op.supported_dtypes("cpu")), set(op.supported_dtypes("cuda"))
        cuda_only += [pytest.param(op, dtype, id=f"{_name(op)}-{dtype}") for dtype in sorted(cuda - cpu, key=str)]
        known = known_differences if _name(op) in KNOWN_DIFFERENCES else cpu_only
        known += [pytest.param(op, dtype, id=f"{_name(op)}-{dtype}") for dtype in sorted(cpu - cuda, key=str)]
        if op.supports_autograd and _name(op) not in BACKWARD_ON_THE_CPU_FAILS:
            cpu, cuda = set(op.supported_backward_dtypes("cpu")), set(op.supported_backward_dtypes("cuda"))
            backward += [pytest.param(op, dtype, id=f"{_name(op)}-{dtype}") for dtype in sorted(cuda - cpu, key=str)]
    return cuda_only, cpu_only, known_differences, backward


CUDA_ONLY, CPU_ONLY, STILL_DIFFERENT, CUDA_ONLY_BACKWARD = _dtype_differences()


def _map(value, fn):
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, (list, tuple)):
        return type(value)(_map(v, fn) for v in value)
    if isinstance(value, dict):
        return {k: _map(v, fn) for k, v in value.items()}
    return value


def _reference(op, sample, dtype: torch.dtype):
    """The op on the CPU with float64 (complex128) copies of the tensors of the dtype under test
    (integers and bools too: the CPU's histc counts floating types only), or, where the CPU
    refuses those (complex nansum), op_db's NumPy reference."""
    def wide(t: torch.Tensor) -> torch.Tensor:
        if t.dtype != dtype and not (t.dtype.is_complex and dtype == torch.float16):
            return t.cpu()
        return t.cpu().to(torch.complex128 if t.is_complex() else torch.float64)

    args, kwargs = _map((sample.input, *sample.args), wide), _map(sample.kwargs, wide)
    try:
        return op(*args, **kwargs)
    except (RuntimeError, NotImplementedError):
        if op.ref is None:
            raise
    numpy = _map(args, lambda t: t.numpy()), _map(kwargs, lambda t: t.numpy())
    return torch.as_tensor(op.ref(*numpy[0], **numpy[1]))


def _outputs(result) -> list[torch.Tensor]:
    return [r for r in (result if isinstance(result, (list, tuple)) else [result]) if isinstance(r, torch.Tensor)]


def _tolerance(dtype: torch.dtype) -> dict:
    # a float16/complex32 result is the float reference rounded once: within half an ulp of the
    # float64 one, plus what float32 accumulation adds; bfloat16 has 8 bits
    # (float32 and complex64: torch.testing's own tolerance for them; integers exact)
    eps = {torch.float16: 1e-3, torch.complex32: 1e-3, torch.bfloat16: 8e-3}.get(dtype)
    if eps:
        return {"rtol": 2 * eps, "atol": 2 * eps}
    if dtype in (torch.float32, torch.complex64):
        return {"rtol": 1.3e-6, "atol": 1e-5}
    return {"rtol": 1e-7, "atol": 1e-7} if dtype.is_floating_point or dtype.is_complex else {"rtol": 0, "atol": 0}


@pytest.mark.parametrize(("op", "dtype"), CUDA_ONLY)
def test_the_dtypes_a_cuda_kernel_takes_and_a_cpu_kernel_lacks_run_as_on_a_gpu(op, dtype):
    samples = list(op.sample_inputs("cuda", dtype, requires_grad=False))[:SAMPLES]
    assert samples, f"op_db gives {_name(op)} no {dtype} sample"
    for sample in samples:
        args = (sample.input, *sample.args)
        got = op(*args, **sample.kwargs)
        meta = op(*_map(args, lambda t: t.to("meta")), **_map(sample.kwargs, lambda t: t.to("meta")))
        for g, m in zip(_outputs(got), _outputs(meta), strict=True):
            assert g.is_cuda and (g.dtype, g.shape) == (m.dtype, m.shape), f"{_name(op)} {dtype}: {g.dtype} {g.shape}, a GPU's {m.dtype} {m.shape}"
        if _name(op) in RANDOM:
            continue
        for g, r in zip(_outputs(got), _outputs(_reference(op, sample, dtype)), strict=True):
            scale = max(1.0, r.abs().max().item()) if r.numel() and (r.is_floating_point() or r.is_complex()) else 1.0
            tolerance = _tolerance(g.dtype)
            torch.testing.assert_close(g.cpu().to(r.dtype), r.to(g.dtype).to(r.dtype), rtol=tolerance["rtol"],
                                       atol=tolerance["atol"] * scale, equal_nan=True, msg=lambda m: f"{_name(op)} {dtype}: {m}")


def _gradients(op, sample, inputs: list[torch.Tensor]) -> tuple:
    outputs = [o for o in _outputs(op(sample.input, *sample.args, **sample.kwargs)) if o.requires_grad]
    loss = sum((o.real if o.is_complex() else o).sum() for o in outputs)
    return torch.autograd.grad(loss, inputs, allow_unused=True)


@pytest.mark.parametrize(("op", "dtype"), CUDA_ONLY_BACKWARD)
def test_the_gradients_a_cuda_build_takes_in_dtypes_the_cpu_lacks_are_a_gpus(op, dtype):
    for sample in list(op.sample_inputs("cuda", dtype, requires_grad=True))[:SAMPLES]:
        inputs = [t for t in (sample.input, *sample.args) if isinstance(t, torch.Tensor) and t.requires_grad]
        if not inputs:
            continue
        if _name(op) in NO_FLOAT64_GRADIENT:
            for got, given in zip(_gradients(op, sample, inputs), inputs, strict=True):
                assert got is not None and got.is_cuda and got.dtype == given.dtype
            continue
        wide = sample.transform(lambda t: t.detach().cpu().to(torch.complex128 if t.is_complex() else torch.float64)
                                .requires_grad_(t.requires_grad) if isinstance(t, torch.Tensor) and t.dtype == dtype else
                                t.detach().cpu() if isinstance(t, torch.Tensor) else t)
        wide_inputs = [t for t in (wide.input, *wide.args) if isinstance(t, torch.Tensor) and t.requires_grad]
        for got, expected, given in zip(_gradients(op, sample, inputs), _gradients(op, wide, wide_inputs), inputs, strict=True):
            assert got is None or (got.is_cuda and got.dtype == given.dtype), f"{_name(op)} {dtype}: {got}"
            if got is None or _name(op) in RANDOM:
                continue
            # a backward formula of several ops in float16 or complex32 overflows where float64 does
            # not, on a GPU too (pow's, logaddexp's, polygamma's): compared where it did not
            finite = got.cpu().isfinite()
            got, expected = got.cpu()[finite], expected[finite]
            scale = max(1.0, expected.abs().max().item()) if expected.numel() else 1.0
            tolerance = _tolerance(dtype)
            torch.testing.assert_close(got.cpu().to(expected.dtype), expected, rtol=4 * tolerance["rtol"],
                                       atol=4 * tolerance["atol"] * scale, equal_nan=True,
                                       msg=lambda m: f"{_name(op)} {dtype} gradient: {m}")


@pytest.mark.parametrize(("op", "dtype"), CPU_ONLY)
def test_the_dtypes_a_cpu_kernel_takes_and_a_cuda_kernel_lacks_raise_as_on_a_gpu(op, dtype):
    """As test_dtypes counts it: a dtype is unsupported when a sample raises (some samples never
    reach the kernel that refuses: an einsum that is a sum, an empty matmul)."""
    for sample in op.sample_inputs("cuda", dtype, requires_grad=False):
        try:
            op(sample.input, *sample.args, **sample.kwargs)
        except (RuntimeError, NotImplementedError) as error:
            # (the dispatcher's own message for an op a CUDA build lacks lists the backends it has: CPU)
            assert not re.search(r"\w_cpu|cpu_\w|on CPU|MKL", str(error)), f"{_name(op)} {dtype}: {error}"
            return
    pytest.fail(f"{_name(op)} ran every {dtype} sample, which a GPU refuses")


@pytest.mark.parametrize(("op", "dtype"), STILL_DIFFERENT)
def test_the_known_differences_are_still_there(op, dtype):
    """Each of KNOWN_DIFFERENCES still runs its first sample where a GPU refuses it: one that is
    mended leaves the list."""
    sample = next(iter(op.sample_inputs("cuda", dtype, requires_grad=False)))
    op(sample.input, *sample.args, **sample.kwargs)


def test_a_float16_fft_of_a_size_cufft_cannot_plan_raises_cuffts_error():
    """cuFFT computes float16 and complex32 in power-of-two sizes only (PyTorch's
    test_spectral_ops.py holds a GPU to that message); a size it can plan runs and comes back
    complex32, as users of AMP meet it (an FFT under autocast keeps its float16 input)."""
    odd = torch.randn(13, 13, device="cuda").half()
    for transform in (torch.fft.fft, torch.fft.rfft, torch.fft.ifft, torch.fft.fft2, torch.fft.rfftn, torch.fft.hfft):
        with pytest.raises(RuntimeError, match=r"cuFFT only supports dimensions whose sizes are powers of two when "
                                               r"computing in half precision, but got a signal size of\[\d"):
            transform(odd)  # (hfft's signal is its output: 24 points)
    with pytest.raises(RuntimeError, match=r"but got a signal size of\[13, 13\]"):
        torch.fft.fft2(odd)
    with pytest.raises(RuntimeError, match=r"but got a signal size of\[12\]"):
        torch.fft.irfft(torch.randn(4, 16, device="cuda").half(), n=12)
    x = torch.randn(4, 16, device="cuda", dtype=torch.half, requires_grad=True)
    spectrum = torch.fft.rfft(x)
    assert spectrum.dtype == torch.complex32 and spectrum.shape == (4, 9)
    expected = torch.fft.rfft(x.detach().cpu().double())
    torch.testing.assert_close(spectrum.cpu().to(torch.complex128), expected, rtol=2e-3, atol=2e-2)
    restored = torch.fft.irfft(spectrum, n=16)
    assert restored.dtype == torch.half
    restored.float().square().sum().backward()
    assert x.grad.dtype == torch.half and x.grad.is_cuda
    torch.testing.assert_close(x.grad.cpu().float(), 2 * x.detach().cpu().float(), rtol=1e-2, atol=1e-2)


def test_a_bfloat16_3d_average_pool_trains_under_autocast():
    """A video model's pooling in bfloat16 (the CPU build's kernel has float and double only)."""
    x = torch.randn(2, 3, 4, 8, 8, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    pooled = torch.nn.functional.avg_pool3d(x, 2)
    assert pooled.dtype == torch.bfloat16
    torch.testing.assert_close(pooled.cpu().float(), torch.nn.functional.avg_pool3d(x.detach().cpu().float(), 2),
                               rtol=1e-2, atol=1e-2)
    pooled.sum().backward()
    assert x.grad.dtype == torch.bfloat16
    torch.testing.assert_close(x.grad.cpu().float(), torch.full(x.shape, 1 / 8), rtol=0, atol=0)


def test_an_in_place_complex32_op_writes_its_argument():
    z = torch.randn(5, device="cuda", dtype=torch.complex64).to(torch.complex32)
    before = z.cpu().to(torch.complex128)
    out = z.exp_()
    assert out is z and z.dtype == torch.complex32
    torch.testing.assert_close(z.cpu().to(torch.complex128), before.exp(), rtol=2e-3, atol=2e-3)
    total = torch.empty(0, device="cuda", dtype=torch.complex32)
    torch.sum(z, 0, out=total)
    torch.testing.assert_close(total.cpu().to(torch.complex128), z.cpu().to(torch.complex128).sum(), rtol=2e-3, atol=2e-3)


# Where op_db gives CUDA a dtype the device still does not run, and why (README: "CUDA-only operators").
CLAIMED_BUT_NOT_RUN = {
    "jiterator_": "torch.cuda.jiterator compiles CUDA C++ with NVRTC, which an emulated GPU cannot (every "
                  "jiterator_ entry)",
    "sparse.mm.reduce": "a CUDA build has no SparseCsrCUDA kernel for _sparse_mm_reduce_impl either",
    "_softmax_backward_data": "op_db's sample passes a float16 softmax output with a float gradient, which no "
                              "autograd graph makes (a half_to_float softmax's output is float, and that runs)",
}


def _claimed_but_not_run(name: str) -> bool:
    return name in NOT_EMULATED or any(name == known or (known.endswith("_") and name.startswith(known))
                                       for known in CLAIMED_BUT_NOT_RUN)


@pytest.mark.parametrize("samples", [pytest.param(1, id="first-sample"),
                                     pytest.param(SAMPLES, id="three-samples", marks=pytest.mark.slow)])
def test_every_dtype_op_db_gives_cuda_runs_on_the_device(samples):
    """test_dtypes' other half: each dtype op_db says a CUDA build's kernels take runs the op's
    first samples on the device (PyTorch's own test counts a dtype supported when they run). The
    default suite runs each dtype's first sample; MIRAGE_SLOW_TESTS=1 three."""
    failing = []
    for op in op_db():
        if _claimed_but_not_run(_name(op)):
            continue
        for dtype in sorted(op.supported_dtypes("cuda"), key=str):
            # (op_db's own sample function: op.sample_inputs wraps it in a tracker that walks the
            # caller's stack with inspect for every sample, minutes under pytest)
            for sample in itertools.islice(op.sample_inputs_func(op, "cuda", dtype, False), samples):
                try:
                    op(sample.input, *sample.args, **sample.kwargs)
                except Exception as error:  # noqa: BLE001 - every failure is reported with its op and dtype
                    failing.append(f"{_name(op)} {dtype}: {type(error).__name__}: {str(error)[:200]}")
                    break
    assert not failing, "\n".join(failing)


def test_an_integer_histc_takes_its_range_in_the_inputs_type():
    """CUDA's histc converts min and max to the input's type (min.to<scalar_t>()): an int64
    histogram over [0.5, 4.5] counts over [0, 4]; the CPU build has no integer histc at all."""
    counts = torch.histc(torch.tensor([0, 1, 2, 3, 4], device="cuda"), bins=4, min=0.5, max=4.5)
    assert counts.dtype == torch.int64
    assert counts.tolist() == [1, 1, 1, 2]
