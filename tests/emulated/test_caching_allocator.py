"""Device memory figures follow PyTorch's CUDA caching allocator rules (512-byte blocks, 2 MiB
small segments, 20 MiB large ones, splitting, merging, empty_cache), whoever allocates: a factory
function, a kernel's result, autograd."""

import pytest
import torch

MiB = 2**20
DEVICE = torch.device("cuda", 2)


@pytest.fixture
def fresh_device():
    """Device 2 with nothing cached: what the tests below measure starts from zero."""
    torch.cuda.synchronize(DEVICE)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(DEVICE)
    torch.cuda.reset_accumulated_memory_stats(DEVICE)
    if torch.cuda.memory_reserved(DEVICE) != 0:
        pytest.fail(f"device 2 still holds {torch.cuda.memory_allocated(DEVICE)} allocated bytes from another test")
    yield
    torch.cuda.empty_cache()


def stat(name: str) -> int:
    return torch.cuda.memory_stats(DEVICE)[name]


def test_small_requests_round_to_512_bytes_in_2_mib_segments(fresh_device):
    a = torch.empty(4000, dtype=torch.uint8, device=DEVICE)
    assert torch.cuda.memory_allocated(DEVICE) == 4096
    assert torch.cuda.memory_reserved(DEVICE) == 2 * MiB
    b = torch.empty(1, dtype=torch.uint8, device=DEVICE)  # the minimum block is 512 bytes
    assert torch.cuda.memory_allocated(DEVICE) == 4096 + 512
    c = torch.empty(MiB, dtype=torch.uint8, device=DEVICE)  # exactly 1 MiB is still small
    assert stat("segment.small_pool.current") == 1 and stat("segment.large_pool.current") == 0
    d = torch.empty(MiB, dtype=torch.uint8, device=DEVICE)  # does not fit what is left: a new segment
    assert torch.cuda.memory_reserved(DEVICE) == 4 * MiB
    assert stat("requested_bytes.all.current") == 4000 + 1 + 2 * MiB
    del a, b, c, d


def test_large_requests_get_20_mib_segments_below_10_mib_and_their_size_rounded_to_2_mib_above(fresh_device):
    medium = torch.empty(MiB + 1, dtype=torch.uint8, device=DEVICE)
    assert torch.cuda.memory_allocated(DEVICE) == MiB + 512
    assert torch.cuda.memory_reserved(DEVICE) == 20 * MiB
    big = torch.empty(11 * MiB + 1, dtype=torch.uint8, device=DEVICE)  # 11 MiB + 512 fits the rest: split
    assert torch.cuda.memory_reserved(DEVICE) == 20 * MiB
    bigger = torch.empty(13 * MiB, dtype=torch.uint8, device=DEVICE)  # a segment of its own, 14 MiB
    assert torch.cuda.memory_reserved(DEVICE) == 34 * MiB
    assert stat("segment.large_pool.current") == 2
    del medium, big, bigger


def test_freed_blocks_are_cached_reused_merged_and_released_by_empty_cache(fresh_device):
    x = torch.empty(5 * MiB, dtype=torch.uint8, device=DEVICE)
    y = torch.empty(5 * MiB, dtype=torch.uint8, device=DEVICE)
    assert torch.cuda.memory_reserved(DEVICE) == 20 * MiB and stat("num_device_alloc") == 1
    del x
    assert torch.cuda.memory_allocated(DEVICE) == 5 * MiB
    assert torch.cuda.memory_reserved(DEVICE) == 20 * MiB  # cached, not returned
    assert stat("inactive_split.large_pool.current") == 2  # the hole before y and the rest after it
    torch.cuda.empty_cache()
    assert torch.cuda.memory_reserved(DEVICE) == 20 * MiB  # y keeps its segment
    z = torch.empty(4 * MiB, dtype=torch.uint8, device=DEVICE)  # best fit: the 5 MiB hole
    assert stat("num_device_alloc") == 1
    del y, z
    assert stat("inactive_split.large_pool.current") == 0  # merged back into one block
    torch.cuda.empty_cache()
    assert torch.cuda.memory_reserved(DEVICE) == 0
    assert stat("num_device_free") == 1


def test_kernel_results_and_autograd_are_counted_like_factory_tensors(fresh_device):
    w = torch.randn(256, 256, device=DEVICE, requires_grad=True)  # 256 KiB
    y = (w @ w).relu().sum()
    y.backward()
    assert w.grad.device == DEVICE
    # w, its gradient and the loss stay; every temporary went back to the cache
    assert torch.cuda.memory_allocated(DEVICE) == 2 * 256 * 1024 + 512
    assert torch.cuda.max_memory_allocated(DEVICE) > 2 * 256 * 1024
    assert torch.cuda.memory_reserved(DEVICE) % (2 * MiB) == 0
    del w, y


def test_blocks_of_a_side_stream_are_not_reused_on_the_default_stream(fresh_device):
    side = torch.cuda.Stream(DEVICE)
    with torch.cuda.stream(side):
        x = torch.empty(4096, dtype=torch.uint8, device=DEVICE)
    del x
    y = torch.empty(4096, dtype=torch.uint8, device=DEVICE)  # the cached block is the side stream's
    assert torch.cuda.memory_reserved(DEVICE) == 4 * MiB
    del y


def test_memory_summary_and_snapshot_show_the_segments(fresh_device):
    x = torch.empty(3 * MiB, dtype=torch.uint8, device=DEVICE)
    summary = torch.cuda.memory_summary(DEVICE)
    assert "GPU reserved memory" in summary and "20480 KiB" in summary
    segments = [s for s in torch.cuda.memory_snapshot() if s["device"] == DEVICE.index]
    assert len(segments) == 1
    (segment,) = segments
    assert segment["total_size"] == 20 * MiB and segment["segment_type"] == "large"
    assert segment["allocated_size"] == 3 * MiB
    assert [b["state"] for b in segment["blocks"]] == ["active_allocated", "inactive"]
    assert [b["size"] for b in segment["blocks"]] == [3 * MiB, 17 * MiB]
    del x


def allocate_for_the_history():
    return torch.empty(3 * MiB, dtype=torch.uint8, device=DEVICE)


def test_memory_history_records_each_action_with_its_python_stack(fresh_device, tmp_path):
    from torch.cuda import _memory_viz

    torch.cuda.memory._record_memory_history(max_entries=1000)
    try:
        x = allocate_for_the_history()
        del x
        torch.cuda.empty_cache()
        kept = allocate_for_the_history()
        path = tmp_path / "snapshot.pickle"
        torch.cuda.memory._dump_snapshot(str(path))
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    with open(path, "rb") as f:
        snapshot = torch.serialization.pickle.load(f)
    trace = snapshot["device_traces"][DEVICE.index]
    assert [e["action"] for e in trace] == ["segment_alloc", "alloc", "free_requested", "free_completed",
                                             "segment_free", "segment_alloc", "alloc"]
    assert trace[1]["size"] == 3 * MiB and trace[1]["frames"][0]["name"] == "allocate_for_the_history"
    (segment,) = [s for s in snapshot["segments"] if s["device"] == DEVICE.index]
    assert segment["blocks"][0]["frames"][0]["name"] == "allocate_for_the_history"
    assert "total_reserved: 20.0MiB" in _memory_viz.segsum(snapshot)  # PyTorch's own tool reads it
    assert torch.cuda.memory._snapshot()["device_traces"][DEVICE.index] == []  # disabling clears it
    del kept


def test_a_mem_pool_keeps_its_own_segments_until_it_is_gone(fresh_device):
    with torch.cuda.device(DEVICE):
        x = torch.empty(MiB, dtype=torch.uint8, device=DEVICE)
        pool = torch.cuda.MemPool()
        with torch.cuda.use_mem_pool(pool):
            y = torch.empty(MiB, dtype=torch.uint8, device=DEVICE)  # would fit x's segment; the pool has its own
        assert torch.cuda.memory_reserved(DEVICE) == 4 * MiB and pool.use_count() == 1
        (segment,) = pool.snapshot()
        assert segment["segment_pool_id"] == pool.id and segment["blocks"][0]["state"] == "active_allocated"
        del y
        torch.cuda.empty_cache()
        assert torch.cuda.memory_reserved(DEVICE) == 4 * MiB  # the pool's cached segment stays
        z = torch.empty(MiB, dtype=torch.uint8, device=DEVICE)  # outside the pool: x's segment
        assert torch.cuda.memory_reserved(DEVICE) == 4 * MiB
        del pool
        assert torch.cuda.memory_reserved(DEVICE) == 2 * MiB
        del x, z


@pytest.fixture
def expandable_segments(fresh_device):
    """expandable_segments:True for one test (set at run time, as torch.cuda.memory._set_allocator_settings does)."""
    torch._C._accelerator_setAllocatorSettings("expandable_segments:True")
    yield
    torch._C._accelerator_setAllocatorSettings("expandable_segments:False")


def test_an_expandable_segment_grows_by_20_mib_pages_and_unmaps_wholly_free_pages(expandable_segments):
    torch.cuda.memory._record_memory_history(max_entries=100)
    a = torch.empty(11 * MiB, dtype=torch.uint8, device=DEVICE)
    assert torch.cuda.memory_reserved(DEVICE) == 20 * MiB  # one page, not an 12 MiB segment of its own
    b = torch.empty(11 * MiB, dtype=torch.uint8, device=DEVICE)  # the 9 MiB left and a second page
    assert torch.cuda.memory_reserved(DEVICE) == 40 * MiB
    assert stat("segment.all.current") == 0 and stat("num_device_alloc") == 2  # mappings are not segments
    (segment,) = [s for s in torch.cuda.memory_snapshot() if s["device"] == DEVICE.index]
    assert segment["is_expandable"] and segment["total_size"] == 40 * MiB
    assert [(blk["size"] // MiB, blk["state"]) for blk in segment["blocks"]] == [
        (11, "active_allocated"), (11, "active_allocated"), (18, "inactive")]
    del a
    torch.cuda.empty_cache()  # a's 11 MiB and the last 18 MiB share pages with b: nothing to unmap
    assert torch.cuda.memory_reserved(DEVICE) == 40 * MiB
    del b
    torch.cuda.empty_cache()
    assert torch.cuda.memory_reserved(DEVICE) == 0 and stat("num_device_free") == 1
    trace = torch.cuda.memory._snapshot()["device_traces"][DEVICE.index]
    torch.cuda.memory._record_memory_history(enabled=None)
    assert [e["action"] for e in trace if e["action"].startswith("segment")] == [
        "segment_map", "segment_map", "segment_unmap"]


def test_small_requests_map_2_mib_pages_and_large_blocks_split_down_to_512_bytes(expandable_segments):
    x = torch.empty(4000, dtype=torch.uint8, device=DEVICE)
    assert torch.cuda.memory_reserved(DEVICE) == 2 * MiB
    big = torch.empty(19 * MiB + MiB // 2, dtype=torch.uint8, device=DEVICE)
    assert torch.cuda.memory_reserved(DEVICE) == 2 * MiB + 20 * MiB
    # the half MiB left of the page is split off (an ordinary segment keeps rests of 1 MiB or less)
    assert torch.cuda.memory_allocated(DEVICE) == 4096 + 19 * MiB + MiB // 2
    assert stat("inactive_split.all.current") == 0  # expandable segments are left out, as on CUDA
    del x, big
