"""The session's shared device-memory table: one memfd that every process maps.

The run process holds the memfd and hands out `/proc/<run pid>/fd/<n>` (MIRAGE_SHM), which a
workload process opens at boot. It has no name in /dev/shm, so it goes when the last process
that maps it does: a run killed with SIGKILL (or by the OOM killer) leaves no table behind.

Each process claims a slot and adds to it alone (atomic adds in the device shim: no round
trip to the service); a GPU's use is the sum over the slots on its node. The service reads
the table for `mirage smi` and the summary, and frees the slot of a process that died, which
returns its memory (no live process writes a dead one's slot, so that needs no atomics).
Layout, all little-endian int64 (mirage/shim/session_table.h's SharedTable mirrors it):

    header  [magic, version, num_nodes, gpus_per_node, max_slots, capacity, slot high-water, 0]
    gpus    num_nodes * gpus_per_node x [peak bytes]
    slots   max_slots x [pid, node, rank, 0, bytes in use on each GPU of its node...]
    busy    num_nodes * gpus_per_node x [ns spent running kernels, by all processes]
"""

from __future__ import annotations

import fcntl
import mmap
import os
import shutil
import struct
from dataclasses import dataclass
from pathlib import Path

MAGIC = 0x6D6972616765  # "mirage"
VERSION = 2
HEADER_WORDS = 8
SLOT_HEAD_WORDS = 4
MAX_SLOTS = 256
SHM_DIR = Path("/dev/shm")
PREFIX = "mirage-"


def segments(session_id: str) -> list[Path]:
    """The session's named /dev/shm segments that remain: collective segments a rank left by dying
    before every peer mapped them (mirage/nccl/shm_transport.cpp) and CUDA IPC segments
    (mirage/shim/cuda_ipc.cpp), all named after the session (the owner's uid keeps users apart);
    with --image, each node's /dev/shm folder (`.node<k>`) too."""
    return sorted(SHM_DIR.glob(f"{PREFIX}{os.getuid()}-{session_id}.*"))


def remove(segment: Path) -> None:
    """Removes one of segments(): a file, or a folder (a node's /dev/shm under --image,
    launcher/containers.py) with everything in it."""
    if segment.is_dir() and not segment.is_symlink():
        shutil.rmtree(segment, ignore_errors=True)
    else:
        segment.unlink(missing_ok=True)


@dataclass
class SlotView:
    pid: int
    node: int
    rank: int
    bytes_per_gpu: list[int]


class SharedTable:
    """A mapped table; the creator (the run process) also holds the memfd others open."""

    def __init__(self, path: Path, words: mmap.mmap, num_nodes: int, gpus_per_node: int,
                 fd: int | None = None) -> None:
        self.path, self._map, self._fd = path, words, fd
        self.num_nodes, self.gpus_per_node = num_nodes, gpus_per_node

    @classmethod
    def create(cls, session_id: str, num_nodes: int, gpus_per_node: int, capacity: int) -> "SharedTable":
        """A new table in a memfd of this process, opened by others through its /proc path. Its
        size is sealed: a table shrunk under them would crash every process that maps it."""
        num_gpus = num_nodes * gpus_per_node
        words = HEADER_WORDS + num_gpus + MAX_SLOTS * (SLOT_HEAD_WORDS + gpus_per_node) + num_gpus
        fd = os.memfd_create(f"{PREFIX}{os.getuid()}-{session_id}", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(fd, words * 8)
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
            mapped = mmap.mmap(fd, words * 8)
        except OSError:
            os.close(fd)
            raise
        struct.pack_into("<8q", mapped, 0, MAGIC, VERSION, num_nodes, gpus_per_node, MAX_SLOTS, capacity, 0, 0)
        return cls(Path(f"/proc/{os.getpid()}/fd/{fd}"), mapped, num_nodes, gpus_per_node, fd)

    @classmethod
    def open(cls, path: Path) -> "SharedTable":
        fd = os.open(path, os.O_RDWR)
        try:
            mapped = mmap.mmap(fd, os.fstat(fd).st_size)
        finally:
            os.close(fd)
        magic, _, num_nodes, gpus_per_node = struct.unpack_from("<4q", mapped, 0)
        if magic != MAGIC:
            raise ValueError(f"{path} is not a mirage device table")
        return cls(path, mapped, num_nodes, gpus_per_node)

    def _word(self, index: int) -> int:
        return struct.unpack_from("<q", self._map, index * 8)[0]

    def _set(self, index: int, value: int) -> None:
        struct.pack_into("<q", self._map, index * 8, value)

    def _slot_base(self, slot: int) -> int:
        return HEADER_WORDS + self.num_nodes * self.gpus_per_node + slot * (SLOT_HEAD_WORDS + self.gpus_per_node)

    def slots(self) -> list[tuple[int, SlotView]]:
        """The occupied slots, with their index."""
        found = []
        for slot in range(self._word(6)):
            base = self._slot_base(slot)
            pid = self._word(base)
            if pid:
                usage = [self._word(base + SLOT_HEAD_WORDS + g) for g in range(self.gpus_per_node)]
                found.append((slot, SlotView(pid, self._word(base + 1), self._word(base + 2), usage)))
        return found

    def gpu_usage(self, node: int, gpu: int) -> tuple[int, int]:
        """(bytes in use, peak bytes) of one emulated GPU, all processes together."""
        used = sum(v.bytes_per_gpu[gpu] for _, v in self.slots() if v.node == node)
        return used, self._word(HEADER_WORDS + node * self.gpus_per_node + gpu)

    def gpu_busy_ns(self, node: int, gpu: int) -> int:
        """Nanoseconds one emulated GPU has spent running kernels, all processes together."""
        return self._word(self._slot_base(MAX_SLOTS) + node * self.gpus_per_node + gpu)

    def release(self, slot: int) -> None:
        """Frees a dead process's slot, which returns its memory to its GPUs."""
        base = self._slot_base(slot)
        for gpu in range(self.gpus_per_node):
            self._set(base + SLOT_HEAD_WORDS + gpu, 0)
        self._set(base, 0)

    def close(self) -> None:
        """Unmaps the table; the creator also closes its memfd, after which no process can open
        it anew (those that map it keep it until they exit)."""
        self._map.close()
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
