"""The torch.cuda API on 4 emulated MI350X GPUs, as an unmodified GPU script uses it."""

import copy
import os
import re
import time
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from mirage import profiles

GiB = 2**30
MI350X_MEMORY = 309237645312
CONTEXT_BYTES = profiles.load("mi350x").context_bytes


def test_devices_are_visible():
    assert torch.cuda.is_available()
    assert torch.cuda.device_count() == 4
    assert torch.cuda.is_initialized() or torch.cuda.current_device() == 0
    assert torch.accelerator.is_available()
    assert torch.accelerator.device_count() == 4
    assert torch.accelerator.current_accelerator() == torch.device("cuda")


def test_rocm_build_identity():
    assert torch.version.hip is not None
    assert torch.version.cuda is None
    assert torch.cuda.get_device_name(2) == "AMD Instinct MI350X"
    props = torch.cuda.get_device_properties(1)
    assert props.name == "AMD Instinct MI350X"
    assert props.total_memory == MI350X_MEMORY
    assert props.multi_processor_count == 256
    assert (props.major, props.minor) == (9, 5)
    assert props.gcnArchName == "gfx950:sramecc+:xnack-"  # the target with HIP's default features
    assert torch.cuda.get_device_capability(0) == (9, 5)
    assert torch.cuda.is_bf16_supported()


def test_tensors_live_on_the_device_they_were_put_on():
    x = torch.randn(8, 8, device="cuda:3")
    assert x.is_cuda and x.device == torch.device("cuda", 3)
    assert torch.ones(2, device="cuda").device == torch.device("cuda", 0)
    model = torch.nn.Linear(8, 4).cuda(3)
    assert model.weight.device == torch.device("cuda", 3)
    y = model(x)
    assert y.device == torch.device("cuda", 3)


def test_set_device_and_device_context():
    torch.cuda.set_device(2)
    try:
        assert torch.cuda.current_device() == 2
        assert torch.empty(1, device="cuda").device.index == 2
        with torch.cuda.device(1):
            assert torch.cuda.current_device() == 1
            assert torch.zeros(1, device="cuda").device.index == 1
        assert torch.cuda.current_device() == 2
    finally:
        torch.cuda.set_device(0)
    with pytest.raises(Exception, match="device"):
        torch.cuda.set_device(7)


def test_numbers_equal_cpu_forward_and_backward():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 1))
    data = torch.randn(64, 16)
    gpu_model = copy.deepcopy(model)
    cpu_loss = model(data).pow(2).mean()
    cpu_loss.backward()
    cpu_grads = [p.grad.clone() for p in model.parameters()]
    gpu_model = gpu_model.cuda(1)
    gpu_loss = gpu_model(data.cuda(1)).pow(2).mean()
    gpu_loss.backward()
    assert gpu_loss.device == torch.device("cuda", 1)
    assert torch.equal(gpu_loss.cpu(), cpu_loss)
    for cpu_grad, p in zip(cpu_grads, gpu_model.parameters()):
        assert p.grad.device == torch.device("cuda", 1)
        assert torch.equal(p.grad.cpu(), cpu_grad)


def test_mixing_devices_raises_pytorchs_error():
    a = torch.ones(3, device="cuda:0")
    with pytest.raises(RuntimeError, match="Expected all tensors to be on the same device.*cuda:0 and cuda:1"):
        a + torch.ones(3, device="cuda:1")
    with pytest.raises(RuntimeError, match="Expected all tensors to be on the same device"):
        a + torch.ones(3)
    # A CPU scalar tensor is allowed, as on a real GPU.
    assert torch.equal((a + torch.tensor(2.0)).cpu(), torch.full((3,), 3.0))


def peak_rss_kib() -> int:
    """This process's RSS high-water mark (VmHWM), in KiB."""
    status = Path("/proc/self/status").read_text()
    return int(re.search(r"^VmHWM:\s+(\d+) kB", status, re.M)[1])


def test_ops_do_not_copy_their_inputs():
    """A copying fallback would double peak host memory for an op on a large tensor."""
    big = torch.ones(64 * 2**20, device="cuda")  # 256 MiB
    big.mul_(2)  # touch every page
    # the peak from here on, whatever an earlier test in this process reached: writing 5 to clear_refs
    # resets the kernel's RSS high-water mark (VmHWM) to the current RSS (proc(5))
    Path("/proc/self/clear_refs").write_text("5")
    before = peak_rss_kib()
    total = big.sum()
    big.add_(1)
    view = big[::2]
    view.mul_(0)
    after = peak_rss_kib()
    assert total.item() == 2.0 * big.numel()
    assert (after - before) * 1024 < 32 * 2**20, f"peak RSS grew by {(after - before) / 1024:.0f} MiB"
    assert big[0].item() == 0 and big[1].item() == 3  # the view wrote into the same memory
    assert view.data_ptr() == big.data_ptr()


def test_each_device_has_its_own_generator():
    torch.manual_seed(123)
    a0 = torch.randn(5, device="cuda:0")
    torch.manual_seed(123)
    torch.randn(100)  # consuming the CPU generator must not move the device's
    b0 = torch.randn(5, device="cuda:0")
    assert torch.equal(a0.cpu(), b0.cpu())
    torch.manual_seed(123)
    c1 = torch.randn(5, device="cuda:1")
    assert torch.equal(a0.cpu(), c1.cpu())  # every device seeded alike by manual_seed
    torch.cuda.manual_seed(7)
    d = torch.rand(4, device="cuda:0")
    torch.cuda.manual_seed(7)
    assert torch.equal(d.cpu(), torch.rand(4, device="cuda:0").cpu())


def test_rng_state_roundtrip_and_dropout_uses_device_generator():
    state = torch.cuda.get_rng_state(2)
    first = torch.rand(6, device="cuda:2")
    torch.cuda.set_rng_state(state, 2)
    assert torch.equal(first.cpu(), torch.rand(6, device="cuda:2").cpu())
    torch.cuda.manual_seed_all(3)
    mask_a = torch.nn.functional.dropout(torch.ones(100, device="cuda"), 0.5)
    torch.cuda.manual_seed_all(3)
    torch.rand(10)  # CPU draw in between
    mask_b = torch.nn.functional.dropout(torch.ones(100, device="cuda"), 0.5)
    assert torch.equal(mask_a.cpu(), mask_b.cpu())
    assert 0 < (mask_a == 0).sum().item() < 100


def test_memory_accounting_tracks_live_tensors():
    device = torch.device("cuda", 3)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    x = torch.empty(1024, 1024, device=device)  # 4 MiB
    assert torch.cuda.memory_allocated(device) == base + 4 * 2**20
    y = x * 2  # a result of a kernel counts too
    assert torch.cuda.memory_allocated(device) == base + 8 * 2**20
    assert torch.cuda.memory_reserved(device) >= torch.cuda.memory_allocated(device)
    del x, y
    assert torch.cuda.memory_allocated(device) == base
    assert torch.cuda.max_memory_allocated(device) == base + 8 * 2**20
    torch.cuda.reset_peak_memory_stats(device)
    assert torch.cuda.max_memory_allocated(device) == base
    free, total = torch.cuda.mem_get_info(device)
    # what the device has in use: this process's context and its allocator's segments
    assert total == MI350X_MEMORY and free == total - CONTEXT_BYTES - torch.cuda.memory_reserved(device)
    stats = torch.cuda.memory_stats(device)
    assert stats["allocated_bytes.all.current"] == base


def c10_format_size(size: int) -> str:
    """Sizes as the caching allocator's messages print them (c10's format_size)."""
    for limit, unit, scale in ((1024, "bytes", 1), (2**20, "KiB", 1024), (2**30, "MiB", 2**20)):
        if size <= limit:
            return f"{size} bytes" if unit == "bytes" else f"{size / scale:.2f} {unit}"
    return f"{size / 2**30:.2f} GiB"


def test_out_of_memory_is_catchable_and_in_the_real_form():
    torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated(1)
    keep = torch.empty(GiB, dtype=torch.uint8, device="cuda:1")
    reserved = torch.cuda.memory_reserved(1)
    with pytest.raises(torch.cuda.OutOfMemoryError) as info:
        torch.empty(300 * GiB, dtype=torch.uint8, device="cuda:1")
    message = str(info.value)
    assert "HIP out of memory. Tried to allocate 300.00 GiB. GPU 1 has a total capacity of 288.00 GiB" in message
    assert f"this process has {c10_format_size(CONTEXT_BYTES + reserved)} memory in use" in message
    assert f"Of the allocated memory {c10_format_size(before + GiB)} is allocated by PyTorch" in message
    # The process goes on, and the failed allocation was not charged.
    assert torch.cuda.memory_allocated(1) == before + GiB
    assert torch.cuda.memory_stats(1)["num_ooms"] >= 1
    del keep
    assert torch.ones(4, device="cuda:1").sum().item() == 4


def test_streams_and_events():
    assert torch.cuda.current_stream() == torch.cuda.default_stream()
    s = torch.cuda.Stream()
    assert s.device == torch.device("cuda", 0)
    with torch.cuda.stream(s):
        assert torch.cuda.current_stream() == s
        x = torch.ones(4, device="cuda") * 3
    assert torch.cuda.current_stream() == torch.cuda.default_stream()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    time.sleep(0.02)
    end.record()
    end.synchronize()
    assert end.query() and s.query()
    # events time the wall clock between the records: at least the 20 ms slept (less a little for the
    # clock's rounding), with no upper bound, which only a loaded machine's scheduling would decide
    assert start.elapsed_time(end) >= 20 * 0.9
    torch.cuda.current_stream().wait_stream(s)
    s.wait_event(end)
    torch.cuda.synchronize()
    assert x.sum().item() == 12


def test_a_stream_of_the_device_without_an_index_is_the_current_devices():
    # torch.Stream(device="cuda") (what TorchFT's checkpoint transport makes) is on the current GPU, as with CUDA
    with torch.cuda.device(1):
        stream = torch.Stream(device="cuda")
        assert stream.device == torch.device("cuda", 1)
        with stream:
            assert torch.cuda.current_stream(1) == stream
            y = torch.ones(3, device="cuda") * 2
    assert torch.cuda.current_stream(1) == torch.cuda.default_stream(1)
    assert y.device == torch.device("cuda", 1) and y.sum().item() == 6


def test_autocast_bf16():
    model = torch.nn.Linear(8, 8).cuda()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out = model(torch.randn(2, 8, device="cuda"))
    assert out.dtype == torch.bfloat16 and out.device.type == "cuda"


def test_pin_memory_and_non_blocking_copies():
    host = torch.arange(10.0).pin_memory()
    assert host.is_pinned()
    dev = host.to("cuda:2", non_blocking=True)
    assert dev.device == torch.device("cuda", 2)
    back = dev.to("cpu", non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(back, torch.arange(10.0))
    assert torch.equal(dev.to("cuda:0").cpu(), host)  # device to device


def test_backend_flags_reach_the_state_torchs_kernels_read():
    """The emulated GPU runs CPU kernels, which have no TF32 and no cuDNN autotuner, so a flag's effect
    on a result cannot show; what can is that the flag reaches the global state torch's matmuls and
    convolutions read (float32 matmul precision, the cuDNN benchmark switch in torch._C)."""
    torch.backends.cuda.matmul.allow_tf32 = True
    assert torch.get_float32_matmul_precision() == "high"
    torch.backends.cuda.matmul.allow_tf32 = False
    assert torch.get_float32_matmul_precision() == "highest"
    torch.backends.cudnn.benchmark = True
    assert torch._C._get_cudnn_benchmark()
    torch.backends.cudnn.benchmark = False
    assert not torch._C._get_cudnn_benchmark()


def test_save_and_load_with_map_location(tmp_path):
    state = {"w": torch.randn(3, 3, device="cuda:0"), "step": 5}
    path = tmp_path / "ckpt.pt"
    torch.save(state, path)
    back = torch.load(path, map_location="cuda:1")
    assert back["w"].device == torch.device("cuda", 1)
    assert torch.equal(back["w"].cpu(), state["w"].cpu())
    same = torch.load(path)
    assert same["w"].device == torch.device("cuda", 0)


def _spawned_worker(rank: int, results) -> None:
    torch.cuda.set_device(rank)
    x = torch.full((2,), float(rank), device="cuda")
    results[rank] = (torch.cuda.current_device(), str(x.device), x.sum().item(), os.getpid())


def test_multiprocessing_spawn_one_process_per_device():
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_spawned_worker, args=(results,), nprocs=4, join=True)
        got = dict(results)
    assert sorted(got) == [0, 1, 2, 3]
    for rank, (current, device, total, pid) in got.items():
        assert current == rank and device == f"cuda:{rank}" and total == 2.0 * rank
        assert pid != os.getpid()
