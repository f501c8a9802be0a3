"""The session's shared device-memory table: one file in /dev/shm that every process maps.

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

import mmap
import os
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


def shm_path(session_id: str) -> Path:
    """The table's path for a session (the owner's uid keeps users apart)."""
    return SHM_DIR / f"{PREFIX}{os.getuid()}-{session_id}"


@dataclass
class SlotView:
    pid: int
    node: int
    rank: int
    bytes_per_gpu: list[int]


class SharedTable:
    """A mapped table; the creator (the run process) also removes it."""

    def __init__(self, path: Path, words: mmap.mmap, num_nodes: int, gpus_per_node: int) -> None:
        self.path, self._map = path, words
        self.num_nodes, self.gpus_per_node = num_nodes, gpus_per_node

    @classmethod
    def create(cls, path: Path, num_nodes: int, gpus_per_node: int, capacity: int) -> "SharedTable":
        num_gpus = num_nodes * gpus_per_node
        words = HEADER_WORDS + num_gpus + MAX_SLOTS * (SLOT_HEAD_WORDS + gpus_per_node) + num_gpus
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, words * 8)
            mapped = mmap.mmap(fd, words * 8)
        finally:
            os.close(fd)
        struct.pack_into("<8q", mapped, 0, MAGIC, VERSION, num_nodes, gpus_per_node, MAX_SLOTS, capacity, 0, 0)
        return cls(path, mapped, num_nodes, gpus_per_node)

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

    def close(self, remove: bool = False) -> None:
        self._map.close()
        if remove:
            self.path.unlink(missing_ok=True)
            # Collective segments (mirage/nccl/shm_transport.cpp) are unlinked once mapped; one
            # remains only if a rank died while its group was setting up.
            for segment in self.path.parent.glob(self.path.name + ".*"):
                segment.unlink(missing_ok=True)
