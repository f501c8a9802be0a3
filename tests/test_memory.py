"""The caching allocator as a process meets it: PYTORCH_*_ALLOC_CONF, freeing the cache before it
gives up, the point of out-of-memory on a small GPU (its context included)."""

import os

from conftest import mirage
from test_session import tiny_profile

MiB = 2**20


def run(script: str, *options: str, alloc_conf: dict[str, str] | None = None):
    env = {k: v for k, v in os.environ.items() if not k.endswith("ALLOC_CONF")}
    env.update(alloc_conf or {})
    return mirage("run", "--gpus-per-node", "1", "--quiet", *options, "--", "python", "-c", script, env=env)


def test_an_unknown_allocator_setting_fails_at_the_first_cuda_use_with_pytorchs_error():
    result = run("import torch\nprint('imported', flush=True)\ntorch.ones(1, device='cuda')\n",
                 alloc_conf={"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:64,bogus_key:1"})
    assert result.returncode == 1
    assert "imported" in result.stdout
    assert "ValueError: Unrecognized key 'bogus_key' in CUDA allocator config." in result.stderr


def free_then_allocate(first_mib: int, second_mib: int, *stats: str) -> str:
    """A script that allocates and frees `first_mib`, allocates `second_mib`, and prints the
    reserved MiB and the named memory_stats."""
    return ("import torch\n"
            f"x = torch.empty({first_mib} * 2**20, dtype=torch.uint8, device='cuda'); del x\n"
            f"y = torch.empty({second_mib} * 2**20, dtype=torch.uint8, device='cuda')\n"
            "s = torch.cuda.memory_stats()\n"
            f"print(torch.cuda.memory_reserved() // 2**20, *(s[k] for k in {list(stats)!r}))\n")


def test_max_split_size_keeps_oversize_blocks_for_oversize_requests():
    script = free_then_allocate(30, 10, "num_device_alloc", "max_split_size")
    # without the setting the 10 MiB request splits the cached 30 MiB block
    assert run(script).stdout.split() == ["30", "1", "-1"]  # max_split_size: unlimited (SIZE_MAX), as on a GPU
    limited = run(script, alloc_conf={"PYTORCH_HIP_ALLOC_CONF": "max_split_size_mb:20"})  # AMD's own variable
    assert limited.stdout.split() == ["40", "2", str(20 * MiB)], limited.stderr


def test_a_failed_segment_reservation_frees_the_cache_and_retries(tmp_path):
    script = free_then_allocate(600, 700, "num_alloc_retries", "num_ooms")
    result = run(script, "--profile", tiny_profile(tmp_path))
    assert result.stdout.split() == ["700", "1", "0"], result.stderr


def test_out_of_memory_counts_the_context_and_the_fraction_set_in_the_allocator_config(tmp_path):
    script = ("import torch\n"
              "try:\n"
              "    torch.empty(600 * 2**20, dtype=torch.uint8, device='cuda')\n"
              "except torch.cuda.OutOfMemoryError as e:\n"
              "    print(e)\n"
              "print('ooms', torch.cuda.memory_stats()['num_ooms'])\n")
    # 1 GiB GPU, 64 MiB context: 600 MiB fits, but not within half of the GPU
    result = run(script, "--profile", tiny_profile(tmp_path),
                 alloc_conf={"PYTORCH_CUDA_ALLOC_CONF": "per_process_memory_fraction:0.5"})
    assert result.returncode == 0, result.stderr
    assert "Tried to allocate 600.00 MiB. GPU 0 has a total capacity of 1024.00 MiB of which 960.00 MiB" in result.stdout
    assert "512.00 MiB allowed;" in result.stdout
    assert "ooms 1" in result.stdout
    result = run(script, "--profile", tiny_profile(tmp_path, context_bytes=500 * MiB))
    assert "of which 524.00 MiB is free" in result.stdout  # the context alone holds the rest
    assert "this process has 500.00 MiB memory in use" in result.stdout


def test_expandable_segments_turn_a_fragmentation_oom_into_success(tmp_path):
    # 1 GiB GPU, 64 MiB context: 960 MiB free. x's segment is split by s when z comes: without
    # expandable segments nothing of it can be given back; with them its free pages are unmapped.
    script = ("import torch\n"
              "MiB = 2**20\n"
              "x = torch.empty(500 * MiB, dtype=torch.uint8, device='cuda')\n"
              "y = torch.empty(100 * MiB, dtype=torch.uint8, device='cuda')\n"
              "del x\n"
              "s = torch.empty(200 * MiB, dtype=torch.uint8, device='cuda')\n"
              "try:\n"
              "    z = torch.empty(400 * MiB, dtype=torch.uint8, device='cuda')\n"
              "    print('fits', torch.cuda.memory_reserved() // MiB, torch.cuda.memory_stats()['num_alloc_retries'])\n"
              "except torch.cuda.OutOfMemoryError as e:\n"
              "    print(e)\n")
    plain = run(script, "--profile", tiny_profile(tmp_path))
    assert "Tried to allocate 400.00 MiB" in plain.stdout, plain.stderr
    assert "300.00 MiB is reserved by PyTorch but unallocated" in plain.stdout
    expandable = run(script, "--profile", tiny_profile(tmp_path),
                     alloc_conf={"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"})
    assert expandable.stdout.split() == ["fits", "700", "1"], expandable.stderr


def test_garbage_collection_frees_the_oldest_cached_segment_past_the_threshold(tmp_path):
    # 1 GiB GPU; 10% of it allowed, collection past half of that (51.2 MiB reserved)
    script = ("import torch\n"
              "MiB = 2**20\n"
              "x = torch.empty(30 * MiB, dtype=torch.uint8, device='cuda'); del x\n"
              "y = torch.empty(40 * MiB, dtype=torch.uint8, device='cuda'); del y\n"
              "z = torch.empty(44 * MiB, dtype=torch.uint8, device='cuda')\n"
              "print(torch.cuda.memory_reserved() // MiB, torch.cuda.memory_stats()['num_alloc_retries'])\n")
    fraction = "per_process_memory_fraction:0.1"
    collected = run(script, "--profile", tiny_profile(tmp_path),
                    alloc_conf={"PYTORCH_CUDA_ALLOC_CONF": f"{fraction},garbage_collection_threshold:0.5"})
    assert collected.stdout.split() == ["84", "0"], collected.stderr  # x went, y stayed cached
    uncollected = run(script, "--profile", tiny_profile(tmp_path), alloc_conf={"PYTORCH_CUDA_ALLOC_CONF": fraction})
    assert uncollected.stdout.split() == ["44", "1"], uncollected.stderr  # the cache emptied at the limit


# Host memory a process holds for device memory: its private pages and the shared ones (the P2P
# arena is a memfd), before and after reading a never-written GiB, and after freeing written
# blocks under the 32 MiB from which the shared arena gives pages back at once.
HOST_MEMORY_SCRIPT = """
import torch
MiB = 2**20
def held():
    status = open('/proc/self/status').read().splitlines()
    return sum(int(line.split()[1]) * 1024 for line in status if line.startswith(('RssAnon:', 'RssShmem:')))
start = held()
x = torch.empty(512 * MiB, dtype=torch.uint8, device='cuda')
x[:64 * MiB].fill_(1)
print('allocated', torch.cuda.memory_allocated() // MiB, 'sum', int(x.sum()) // MiB, 'read', (held() - start) // MiB)
del x
start = held()
blocks = [torch.ones(16 * MiB, dtype=torch.uint8, device='cuda') for _ in range(16)]
del blocks
print('reserved', torch.cuda.memory_reserved() // MiB, 'freed', (held() - start) // MiB)
"""


def test_lazy_device_memory_holds_on_the_host_only_what_is_live_and_written():
    lazy = run(HOST_MEMORY_SCRIPT, "--lazy-device-memory")
    assert lazy.returncode == 0, lazy.stderr
    default = run(HOST_MEMORY_SCRIPT)
    assert default.returncode == 0, default.stderr
    figures = {}
    for name, result in (("lazy", lazy), ("default", default)):
        words = result.stdout.split()
        figures[name] = {key: int(value) for key, value in zip(words[::2], words[1::2])}
    for f in figures.values():
        # the GPU's figures whatever the host holds (x's segment cached, the blocks split from it,
        # a small segment for the sum); never-written device memory reads as zeros
        assert (f["allocated"], f["sum"], f["reserved"]) == (512, 64, 512 + 2), figures
    # lazy: the 64 MiB written (and a little of the process's own); the never-written rest costs
    # nothing though read, and freed blocks give their pages back
    assert figures["lazy"]["read"] < 64 + 48 and figures["lazy"]["freed"] < 48, figures
    # default: reading shared memory allocates it, and freed blocks keep their pages for the next
    assert figures["default"]["read"] >= 480 and figures["default"]["freed"] >= 240, figures


def test_lazy_device_memory_collectives_stage_through_shared_memory():
    # peers cannot map private device memory: the emulated NCCL copies through shared memory
    script = ("import torch, torch.distributed as dist\n"
              "dist.init_process_group('nccl')\n"
              "r = dist.get_rank()\n"
              "torch.cuda.set_device(r)\n"
              "x = torch.full((4 * 2**20,), float(r + 1), device='cuda')\n"
              "dist.all_reduce(x)\n"
              "out = torch.empty(2 * 4 * 2**20, device='cuda')\n"
              "dist.all_gather_into_tensor(out, x)\n"
              "print('sums', x[0].item(), out.sum().item() / 2**20)\n"
              "dist.destroy_process_group()\n")
    result = mirage("run", "--gpus-per-node", "2", "--nproc-per-node", "2", "--quiet", "--lazy-device-memory",
                    "--env", "NCCL_DEBUG=INFO", "--", "python", "-c", script)
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("sums 3.0 24.0") == 2, result.stdout
    init_lines = [line for line in result.stderr.splitlines() if "Init COMPLETE" in line]
    assert len(init_lines) == 2 and all(line.endswith("transport shared memory)") for line in init_lines), init_lines
