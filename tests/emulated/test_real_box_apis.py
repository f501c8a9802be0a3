"""torch.cuda beyond tensors, as frameworks call it: streams, NVTX, torch.cuda.comm, DataParallel."""

import copy
import os

import pytest
import torch
import torch.cuda.comm as comm
from torch import nn


def test_smoke_record_stream_and_stream_waits_are_accepted():
    """A smoke test, not one of ordering: work runs synchronously on the emulated device (README), so
    every event and stream is complete when queried; what it shows is that the calls FSDP / ZeRO-3
    make are accepted and the side stream's result is there."""
    side = torch.cuda.Stream()
    t = torch.ones(4, device="cuda")
    with torch.cuda.stream(side):
        t.mul_(3)
    torch.cuda.current_stream().wait_stream(side)
    t.record_stream(side)  # FSDP / ZeRO-3 prefetch
    event = side.record_event()
    torch.cuda.current_stream().wait_event(event)
    assert event.query() and side.query()
    assert torch.equal(t.cpu(), torch.full((4,), 3.0))


def test_stream_priorities_are_clamped_into_torchs_range_as_on_a_rocm_box():
    least, greatest = torch.cuda.Stream.priority_range()
    assert (least, greatest) == (0, -1)
    assert torch.cuda.Stream(priority=-1).priority == -1
    assert torch.cuda.Stream(priority=-100).priority == greatest
    assert torch.cuda.Stream(priority=7).priority == least


def test_an_external_stream_keeps_its_handle():
    stream = torch.cuda.ExternalStream(0xBEEF, device=1)
    assert stream.cuda_stream == 0xBEEF and stream.device == torch.device("cuda", 1)
    with torch.cuda.stream(stream):
        assert torch.cuda.current_stream().device_index == 1


def test_nvtx_ranges_nest_and_marks_are_accepted():
    assert torch.cuda.nvtx.range_push("outer") == 0
    assert torch.cuda.nvtx.range_push("inner") == 1
    assert torch.cuda.nvtx.range_pop() == 1
    assert torch.cuda.nvtx.range_pop() == 0
    torch.cuda.nvtx.mark("step")
    handle = torch.cuda.nvtx.range_start("across threads")
    torch.cuda.nvtx.range_end(handle)
    with torch.cuda.nvtx.range("step {}", 3):
        pass


def test_comm_broadcast_keeps_the_source_and_copies_elsewhere():
    source = torch.arange(6.0, device="cuda:1")
    copies = comm.broadcast(source, [1, 0, 3])
    assert copies[0] is source
    assert [c.device.index for c in copies] == [1, 0, 3]
    assert all(torch.equal(c.cpu(), source.cpu()) for c in copies)
    out = [torch.empty(6, device=f"cuda:{i}") for i in (2, 3)]
    comm.broadcast(source, out=out)
    assert all(torch.equal(o.cpu(), source.cpu()) for o in out)
    coalesced = comm.broadcast_coalesced([source, source * 2], [1, 2])
    assert coalesced[0][0] is source and torch.equal(coalesced[1][1].cpu(), source.cpu() * 2)


def test_comm_scatter_gather_and_reduce_add_equal_the_cpu_math():
    x = torch.arange(24.0).reshape(6, 4)
    parts = comm.scatter(x.cuda(0), [0, 1, 2], chunk_sizes=[1, 2, 3])
    assert [p.device.index for p in parts] == [0, 1, 2]
    assert [tuple(p.shape) for p in parts] == [(1, 4), (2, 4), (3, 4)]
    assert torch.equal(comm.gather(parts, dim=0, destination=3).cpu(), x)
    assert comm.gather(parts, destination="cpu").device == torch.device("cpu")
    summed = comm.reduce_add([x.cuda(0), (2 * x).cuda(1)], destination=1)
    assert summed.device == torch.device("cuda", 1) and torch.equal(summed.cpu(), 3 * x)
    with pytest.raises(RuntimeError, match="Expected all input tensors to be CUDA tensors"):
        comm.gather([x, x.cuda(0)])


def test_data_parallel_over_four_gpus_trains_with_the_cpu_gradients():
    torch.manual_seed(0)
    reference = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
    model = nn.DataParallel(copy.deepcopy(reference).cuda(0), device_ids=[0, 1, 2, 3])
    x, y = torch.randn(32, 8), torch.randn(32, 2)
    nn.functional.mse_loss(reference(x), y).backward()
    output = model(x.cuda(0))
    assert output.device == torch.device("cuda", 0)
    nn.functional.mse_loss(output, y.cuda(0)).backward()
    for ours, theirs in zip(model.module.parameters(), reference.parameters()):
        torch.testing.assert_close(ours.grad.cpu(), theirs.grad, rtol=1e-5, atol=1e-6)


def test_device_queries_answer_from_the_emulated_device_without_vendor_libraries():
    import time

    device = 2
    torch.cuda.utilization(device)  # opens a sample period
    time.sleep(0.2)  # a sample period in which the device runs nothing: 0 whatever its length
    assert torch.cuda.utilization(device) == 0
    assert torch.cuda.temperature(device) == 35
    assert torch.cuda.power_draw(device) == 150  # watts on AMD (amdsmi); 15% of the MI350X's 1000 W
    a = torch.randn(512, 512, device=f"cuda:{device}")
    for _ in range(20):  # a fixed amount of work, not a wall-clock share of 2 shared cores
        a = (a @ a).tanh()
    busy = torch.cuda.utilization(device)
    assert busy > 0, busy  # only busier than the idle period: the share depends on the scheduling
    assert torch.cuda.clock_rate(device) == 2200
    before, reserved = torch.cuda.device_memory_used(device), torch.cuda.memory_reserved(device)
    block = torch.empty(64 * 2**20, dtype=torch.uint8, device=f"cuda:{device}")  # a segment of its own
    assert torch.cuda.memory_reserved(device) - reserved == block.numel()
    assert torch.cuda.device_memory_used(device) - before == block.numel()
    # torch's printout of the GPU's processes (NVML's / amdsmi's list): this one, holding what the device has in use
    used_mb = torch.cuda.device_memory_used(device) / 2**20
    assert f"process {os.getpid():>10d} uses {used_mb:>12.3f} MB GPU memory" in torch.cuda.list_gpu_processes(device)
    assert torch.cuda.list_gpu_processes(device).startswith(f"GPU:{device}\n")


def test_per_process_memory_fraction_caps_what_the_process_may_allocate():
    device = 3
    torch.cuda.set_per_process_memory_fraction(1e-6, device)  # about 300 KiB of the MI350X's 288 GB
    try:
        assert torch.cuda.get_per_process_memory_fraction(device) == pytest.approx(1e-6)
        small = torch.empty(1024, device=f"cuda:{device}")
        with pytest.raises(torch.cuda.OutOfMemoryError, match="allowed; Of the allocated memory"):
            torch.empty(2**20, device=f"cuda:{device}")
        del small
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, device)
    torch.empty(2**20, device=f"cuda:{device}")


def test_caching_allocator_raw_blocks_and_runtime_error_strings():
    pointer = torch.cuda.caching_allocator_alloc(4096, device=1)
    assert torch.cuda.memory_allocated(1) >= 4096
    torch.cuda.caching_allocator_delete(pointer)
    assert str(torch.cuda.CudaError(2)) == "out of memory (2)"
    torch.cuda.check_error(0)
    with torch.cuda.profiler.profile():
        pass


def test_torch_says_it_was_built_with_gpu_support_as_a_rocm_or_cuda_build_does():
    assert torch.backends.cuda.is_built()  # inductor's cudagraph trees, among others, ask


def test_the_build_listing_is_a_gpu_builds():
    """torch.__config__.show() (torch.utils.collect_env, bug reports, PyTorch's own Magma probe)
    raised under mirage: ATen asks the CUDA hooks for their lines whenever a GPU is present."""
    listing = torch.__config__.show()
    settings = listing.rsplit("  - Build settings: ", 1)[1]
    if torch.version.hip:
        assert f"  - HIP Runtime {torch.version.hip.split('-')[0]}\n  - MIOpen 3.5.0\n" in listing
        assert "USE_ROCM=ON" in settings
    else:
        assert "  - CUDA Runtime 12.8\n" in listing and "  - CuDNN 91.0.2  (built against CUDA 12.9)\n" in listing
        arch = torch.cuda.get_arch_list()[0].removeprefix("sm_")
        assert f"  - NVCC architecture flags: -gencode;arch=compute_{arch},code=sm_{arch}\n" in listing
        assert "CUDA_VERSION=12.8, CUDNN_VERSION=9.10.2" in settings and "USE_CUDA=ON" in settings
    assert "USE_NCCL=1" in settings and "Magma" not in listing  # torch.cuda.has_magma is False


def test_a_cuda_graph_replays_its_captured_work_on_new_input_values():
    static_in = torch.ones(4, device="cuda")
    weight = torch.full((4,), 2.0, device="cuda")
    state = torch.zeros(2, device="cuda")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=torch.cuda.graph_pool_handle()):
        assert torch.cuda.is_current_stream_capturing()
        static_out = (static_in * weight).relu()
        total = static_out.sum()
        state.add_(1)  # captured, not run: a GPU runs it once per replay
    assert not torch.cuda.is_current_stream_capturing()
    assert state.cpu().tolist() == [0.0, 0.0]
    static_in.copy_(torch.tensor([1.0, -2.0, 3.0, 4.0]))
    graph.replay()
    assert static_out.cpu().tolist() == [2.0, 0.0, 6.0, 8.0] and total.item() == 16.0
    static_in.fill_(5.0)
    graph.replay()
    assert static_out.cpu().tolist() == [10.0] * 4 and total.item() == 40.0
    assert state.cpu().tolist() == [2.0, 2.0]
    second = torch.cuda.CUDAGraph()
    with torch.cuda.graph(second, pool=graph.pool()):  # sharing the first graph's pool is accepted
        doubled = static_out * 2
    second.replay()
    assert doubled.cpu().tolist() == [20.0] * 4


def test_a_capture_allocates_from_its_graph_s_private_pool_which_outlives_the_captured_tensors():
    torch.cuda.empty_cache()
    x = torch.ones(1000, device="cuda")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        doubled = x * 2
        out = doubled + 1
    pool_segments = [s for s in torch.cuda.memory_snapshot() if s["segment_pool_id"] == graph.pool()]
    assert [[b["state"] for b in s["blocks"]] for s in pool_segments] == [
        ["active_allocated", "active_allocated", "inactive"]]  # one 2 MiB small-pool segment, split
    address = doubled.data_ptr()
    del doubled  # its block is free, its bytes still the pool's: the replay writes there safely
    x.fill_(3.0)
    graph.replay()
    assert out.cpu().tolist() == [7.0] * 1000
    second = torch.cuda.CUDAGraph()
    with torch.cuda.graph(second, pool=graph.pool()):  # graphs sharing a pool reuse its free blocks
        tripled = x * 3
    assert tripled.data_ptr() == address
    second.replay()
    assert tripled[:2].cpu().tolist() == [9.0, 9.0]
    reserved = torch.cuda.memory_reserved()
    del graph, second, out, tripled
    torch.cuda.empty_cache()  # the pool went with its last graph: its segment goes back
    assert torch.cuda.memory_reserved() == reserved - 2 * 1024 * 1024


def test_what_a_gpu_refuses_during_capture_raises_its_error():
    x = torch.ones(4, device="cuda")
    with pytest.raises(RuntimeError, match="operation failed due to a previous error during capture") as caught:
        with torch.cuda.graph(torch.cuda.CUDAGraph()):
            x.sum().item()  # a device-to-host copy and a sync
    assert "HIP error: operation not permitted when stream is capturing" in str(caught.value.__context__)
    with pytest.raises(RuntimeError, match="operation failed due to a previous error"):
        with torch.cuda.graph(torch.cuda.CUDAGraph()):
            torch.cuda.synchronize()
    assert not torch.cuda.is_current_stream_capturing()
    # torch.cuda.graph's __exit__ leaves its capture stream current when capture_end raises, as
    # on a GPU; later tests expect the default one.
    torch.cuda.set_stream(torch.cuda.default_stream())


def test_make_graphed_callables_trains_with_the_cpu_gradients():
    torch.manual_seed(0)
    reference = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    model = copy.deepcopy(reference).cuda()
    graphed = torch.cuda.make_graphed_callables(model, (torch.randn(3, 4, device="cuda"),))
    data = torch.randn(3, 4)
    out = graphed(data.cuda())
    out.sum().backward()
    reference(data).sum().backward()
    torch.testing.assert_close(out.cpu(), reference(data))
    for ours, theirs in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(ours.grad.cpu(), theirs.grad)


def test_a_mem_pool_routes_allocations_inside_use_mem_pool():
    pool = torch.cuda.MemPool()
    assert pool.id[0] == 0 and pool.use_count() == 1
    with torch.cuda.use_mem_pool(pool):
        assert pool.use_count() == 2
        inside = torch.ones(16, device="cuda")
    assert pool.use_count() == 1 and inside.sum().item() == 16


def _add_ten_in_place(queue, done) -> None:
    tensor = queue.get()
    tensor.add_(10)  # in the sender's memory, as with CUDA IPC
    done.set()


def test_a_device_tensor_sent_to_another_process_shares_its_memory():
    import glob
    import os

    import torch.multiprocessing as mp

    context = mp.get_context("spawn")
    queue, done = context.Queue(), context.Event()
    sent = torch.arange(4.0, device="cuda:1")
    allocated = torch.cuda.memory_allocated(1)
    receiver = context.Process(target=_add_ten_in_place, args=(queue, done))
    receiver.start()
    queue.put(sent)
    assert done.wait(120)
    receiver.join(120)
    assert receiver.exitcode == 0
    assert sent.cpu().tolist() == [10.0, 11.0, 12.0, 13.0]
    assert torch.cuda.memory_allocated(1) == allocated  # the sender owns the memory, charged once
    del sent
    assert not glob.glob(f"/dev/shm/*.ipc-{os.getpid()}-*")  # the segment went with the sender's tensor


def test_legacy_tensor_types_construct_on_the_device_and_keep_their_checks():
    sized = torch.cuda.FloatTensor(2, 3)
    assert sized.shape == (2, 3) and sized.device == torch.device("cuda", 0) and sized.dtype == torch.float32
    data = torch.cuda.LongTensor([1, 2], device=1)
    assert data.device == torch.device("cuda", 1) and data.cpu().tolist() == [1, 2]
    assert isinstance(data, torch.cuda.LongTensor) and not isinstance(data, torch.cuda.FloatTensor)
    assert torch.cuda.HalfTensor(torch.Size([4])).shape == (4,) and torch.cuda.BoolTensor().shape == (0,)
    assert torch.ones(2).type(torch.cuda.DoubleTensor).dtype == torch.float64
    assert sized.type() == "torch.cuda.FloatTensor" and torch.cuda.FloatTensor(sized) is sized


def test_host_memory_stats_count_pinned_blocks_as_the_caching_host_allocator_rounds_them():
    torch.cuda.reset_accumulated_host_memory_stats()
    before = torch.cuda.host_memory_stats()["allocations.current"]
    pinned = torch.empty(1000, pin_memory=True)  # 4000 bytes, counted as 4096
    stats = torch.cuda.host_memory_stats()
    assert stats["allocations.current"] == before + 1 and stats["allocated_bytes.allocated"] >= 4096
    del pinned
    assert torch.cuda.host_memory_stats()["allocations.freed"] >= 1


def test_cuda_initialisation_sets_lazy_module_loading_unless_the_user_chose():
    """CUDAHooks::init sets CUDA_MODULE_LOADING=LAZY when it is unset (collect_env prints it); a
    user's own value stays. Fresh processes of the session, each initialising CUDA."""
    import subprocess
    import sys

    script = "import os, torch; torch.cuda.init(); print(os.environ.get('CUDA_MODULE_LOADING'))"
    unset = {k: v for k, v in os.environ.items() if k != "CUDA_MODULE_LOADING"}
    for env, expected in ((unset, "LAZY"), ({**unset, "CUDA_MODULE_LOADING": "EAGER"}, "EAGER")):
        done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
        assert done.stdout.strip() == expected, done.stderr[-2000:]


def test_torch_version_names_the_toolkit_as_a_gpu_wheel_does():
    """2.13.0+rocm7.0 on AMD profiles (2.13.0+cu128 on NVIDIA ones), where the CPU wheel says +cpu;
    comparisons and the release are the installed torch's."""
    import importlib.metadata

    release = importlib.metadata.version("torch").split("+")[0]
    assert torch.__version__ == torch.version.__version__ == f"{release}+rocm7.0"
    assert torch.__version__ >= release and torch.__version__ < "99"
