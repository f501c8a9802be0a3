"""Private memory pools' use counts, shared by torch.cuda.MemPool / use_mem_pool
(cuda_runtime.py) and CUDA graph captures (cuda_graphs.py), as the real allocator's PrivatePool
use_count: a MemPool object holds its pool, so does each `use_mem_pool` context until its
releasePool and each captured graph until it is reset. At zero the pool's cached segments go back
(the rest as their blocks are freed)."""

from __future__ import annotations

import itertools
from types import ModuleType

PoolId = tuple[int, int]

# As c10's MemPool ids: user-created pools (MemPool(), graph_pool_handle()) are (0, n), the pool a
# capture makes for itself (n, 0); the counters are the process's.
_user_ids = itertools.count(1)
_internal_ids = itertools.count(1)


def new_pool_id(user_created: bool) -> PoolId:
    return (0, next(_user_ids)) if user_created else (next(_internal_ids), 0)


class PoolHolders:
    def __init__(self, torch: ModuleType):
        self._release = torch.ops.mirage.release_pool
        self._holders: dict[PoolId, int] = {}
        self._devices: dict[PoolId, int] = {}

    def hold(self, pool_id: PoolId, device: int) -> None:
        pool_id = tuple(pool_id)
        self._holders[pool_id] = self._holders.get(pool_id, 0) + 1
        self._devices.setdefault(pool_id, device)

    def let_go(self, pool_id: PoolId) -> None:
        pool_id = tuple(pool_id)
        if pool_id not in self._holders:
            return
        self._holders[pool_id] -= 1
        if self._holders[pool_id] == 0:
            del self._holders[pool_id]
            self._release(self._devices.pop(pool_id), *pool_id)

    def count(self, pool_id: PoolId) -> int:
        return self._holders.get(tuple(pool_id), 0)


_holders: PoolHolders | None = None


def holders(torch: ModuleType) -> PoolHolders:
    """The process's pool holders (one registry, whoever asks first creates it)."""
    global _holders
    if _holders is None:
        _holders = PoolHolders(torch)
    return _holders
