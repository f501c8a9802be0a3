"""Which path a collective took, as something a test can see rather than the backend's word.

`PeerMemory.counting(name)` records the kB of its peers' device memory (their arenas: the
`mirage-device-memory` memfds it maps from /proc/<pid>/fd) this rank touched inside the block.
A direct copy (NCCL's P2P transport) touches them; a staged copy, or a transport without P2P,
touches none. `report` prints, on rank 0, `peer_memory_kb <name> [kB on rank 0, ...]`.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
from collections.abc import Iterator

import torch
import torch.distributed as dist

MADV_DONTNEED = 4
libc = ctypes.CDLL(None, use_errno=True)
libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]


class PeerMemory:
    def __init__(self, device: torch.device) -> None:
        # As large as the arena's smallest block (1 MiB): it lies in this process's own arena, if any.
        self.own_arena_block = torch.empty(1 << 20, dtype=torch.uint8, device=device)
        self.touched: dict[str, int] = {}

    def peer_arena_rss_kb(self) -> dict[tuple[int, int], int]:
        """Rss (kB) of each mapping of a peer's arena: an arena memfd other than this process's own."""
        mine = self.own_arena_block.data_ptr()
        spans, span = {}, None
        with open("/proc/self/smaps") as smaps:
            for line in smaps:
                fields = line.split()
                if "-" in fields[0] and not fields[0].endswith(":"):  # a mapping's header line
                    start, end = (int(x, 16) for x in fields[0].split("-"))
                    peer = "/memfd:mirage-device-memory" in line and not start <= mine < end
                    span = (start, end) if peer else None
                elif span and fields[0] == "Rss:":
                    spans[span] = int(fields[1])
        return spans

    @contextlib.contextmanager
    def counting(self, name: str) -> Iterator[None]:
        """Records in touched[name] the kB of peers' arenas this rank touches in the block. Their
        mappings are emptied first: MADV_DONTNEED on a shared mapping drops only this process's
        page-table entries (the memory stays in the peer's memfd), so the Rss afterwards is what
        the block touched, however often earlier collectives used the same addresses."""
        for start, end in self.peer_arena_rss_kb():
            assert libc.madvise(start, end - start, MADV_DONTNEED) == 0, os.strerror(ctypes.get_errno())
        yield
        self.touched[name] = sum(self.peer_arena_rss_kb().values())

    def report(self, group: dist.ProcessGroup | None = None) -> None:
        """Gathers every rank's figures (over `group`, a gloo group where there is one) and prints them on rank 0."""
        every_rank = [None] * dist.get_world_size()
        dist.all_gather_object(every_rank, self.touched, group=group)
        if dist.get_rank() == 0:
            for name in self.touched:
                print(f"peer_memory_kb {name} {[touched[name] for touched in every_rank]}", flush=True)
