"""Device memory other processes can map, as GPUs map each other's (P2P / CUDA IPC): device blocks
from 1 MiB live in the process's shared arena, which the emulated NCCL's peers map to copy a
message once, straight from its tensor."""

import ctypes
import os
import subprocess
import sys
import traceback

import torch

MiB = 2**20
DEVICE = torch.device("cuda", 1)


class SharedArena(ctypes.Structure):
    """The shim's MirageSharedArena (mirage/shim/shared_device_memory.h)."""
    _fields_ = [("pid", ctypes.c_int64), ("fd", ctypes.c_int32), ("padding", ctypes.c_int32),
                ("id", ctypes.c_uint64), ("base", ctypes.c_uint64), ("capacity", ctypes.c_uint64)]


def shared_arena() -> SharedArena:
    describe = ctypes.CDLL(None).mirage_shared_arena  # the shim is loaded with RTLD_GLOBAL
    describe.restype = SharedArena
    return describe()


def in_arena(t: torch.Tensor, arena: SharedArena) -> bool:
    return arena.base <= t.data_ptr() < arena.base + arena.capacity


def arena_rss_bytes(arena: SharedArena) -> int:
    """Resident bytes of this process's mapping of the arena (its pages that are host memory)."""
    lines = open("/proc/self/smaps").read().splitlines()
    start = f"{arena.base:x}-"
    at = next(i for i, line in enumerate(lines) if line.startswith(start))
    rss = next(line for line in lines[at + 1:] if line.startswith("Rss:"))
    return int(rss.split()[1]) * 1024


def test_large_device_blocks_are_shared_memory_another_process_reads():
    big = torch.arange(MiB // 4, dtype=torch.int32, device=DEVICE)  # exactly 1 MiB
    small = torch.arange(1000, dtype=torch.int32, device=DEVICE)
    arena = shared_arena()
    assert arena.pid == os.getpid() and arena.capacity > 0
    assert in_arena(big, arena) and not in_arena(small, arena)
    # A plain process of the same user maps the arena by its descriptor, as a peer rank does,
    # checks the arena's id, and reads the tensor's last 16 bytes where the owner put them.
    offset = big.data_ptr() - arena.base + big.nbytes - 16
    reader = (
        "import mmap, os, struct, sys\n"
        "pid, fd, offset, capacity = map(int, sys.argv[1:])\n"
        "f = os.open(f'/proc/{pid}/fd/{fd}', os.O_RDONLY)\n"
        "m = mmap.mmap(f, capacity, mmap.MAP_SHARED, mmap.PROT_READ)\n"
        "print(struct.unpack('<Q', m[:8])[0], list(struct.unpack('<4i', m[offset:offset + 16])))\n")
    out = subprocess.run([sys.executable, "-c", reader, str(arena.pid), str(arena.fd), str(offset),
                          str(arena.capacity)], capture_output=True, text=True, check=True).stdout.split(maxsplit=1)
    assert int(out[0]) == arena.id
    assert out[1].strip() == str(big[-4:].tolist())


def test_a_freed_block_of_32_mib_gives_its_pages_back_at_once():
    arena = shared_arena()
    block = torch.ones(64 * MiB // 4, device=DEVICE)  # written: its pages are host memory now
    assert in_arena(block, arena)
    resident = arena_rss_bytes(arena)
    assert resident >= 64 * MiB
    del block
    assert arena_rss_bytes(arena) <= resident - 64 * MiB


def test_a_kernel_result_stays_heap_memory():
    """Results of host kernels are the heap's memory (adopted without a copy): the emulated NCCL
    stages them instead (tests/workloads/collectives.py: peer_memory_broadcast_from_heap)."""
    arena = shared_arena()
    source = torch.ones(MiB, device=DEVICE)
    assert in_arena(source, arena) and not in_arena(source * 2, arena)


def test_a_forked_child_leaves_its_parents_device_memory_alone():
    """The child inherits the arena mapped shared; freeing its copy of a tensor there must not
    give the parent's pages back (they would read as zeros), nor may it carve the arena."""
    block = torch.full((64 * MiB // 4,), 3.0, device=DEVICE)
    pid = os.fork()
    if pid == 0:
        code = 1  # what the child exits with unless its check ran to the end: an exception fails the test
        try:
            del block  # the child's reference: its deleter runs here, in the child
            fresh = torch.empty(2 * MiB, dtype=torch.uint8, device=DEVICE)
            code = 3 if in_arena(fresh, shared_arena()) or shared_arena().capacity else 0
        except BaseException:
            traceback.print_exc()
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert block[0].item() == 3.0 and block[-1].item() == 3.0
