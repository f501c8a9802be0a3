"""CUDA graphs on emulated GPUs: torch.cuda.CUDAGraph, torch.cuda.graph, graph_pool_handle,
make_graphed_callables and is_current_stream_capturing, as torch defines them, over the shim's
capture (mirage/shim/graph_capture.cpp: captured work is recorded, not run; a replay
runs it again on the captured memory).

A CPU build's `torch._C._CUDAGraph` is a dummy class that refuses to be instantiated; torch's
own `torch.cuda.graphs.CUDAGraph` (the documented class, with its checks and docstrings)
derives from it. Giving that class the emulated base below makes every torch path that builds
graphs work unchanged. As on a GPU, a capture allocates from a private memory pool (its own, or
the one passed in, which graphs may share); the graph holds the pool until it is reset, and
replays into the pool's memory, which a captured result keeps while its graph lives even when
the tensor dies. Collectives issued during a capture run when issued, not on replay (the
emulated NCCL backend is not recorded).

Inductor's cudagraph trees (torch.compile mode="reduce-overhead") also checkpoint and restore a
pool's allocator state, and take ownership of graph outputs' memory away from and back to
storages; the torch._C entry points they use are bound here to the shim's allocator model.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any, Callable

from mirage.runtime import memory_pools

# Called with a graph's id when it is reset: what was recorded for it from Python (compiled
# graphs' calls, inductor.py) goes with it.
reset_listeners: list[Callable[[int], None]] = []


def install(torch: ModuleType) -> None:
    ops = torch.ops.mirage
    graphs = torch.cuda.graphs
    pools = memory_pools.holders(torch)

    class EmulatedGraph:
        """The native half of torch.cuda.CUDAGraph (what torch._C._CUDAGraph is on a GPU build)."""

        def __new__(cls, keep_graph: bool = False):
            graph = object.__new__(cls)
            graph._id = None
            graph._captured = False
            graph._pool = None
            graph._holds_pool = False
            return graph

        def capture_begin(self, pool=None, capture_error_mode: str = "global") -> None:
            if capture_error_mode not in ("global", "thread_local", "relaxed"):
                raise RuntimeError(f"Unknown capture error mode. Expected `global`, `thread_local`, or `relaxed`, "
                                   f"got {capture_error_mode}")
            self._pool = tuple(pool) if pool is not None else memory_pools.new_pool_id(user_created=False)
            device = torch.cuda.current_device()
            self._id = ops.graph_capture_begin(device, *self._pool)
            pools.hold(self._pool, device)
            self._holds_pool = True

        def capture_end(self) -> None:
            ops.graph_capture_end(self._id)
            self._captured = True

        def instantiate(self) -> None:
            if not self._captured:
                raise RuntimeError("CUDAGraph::instantiate called without a preceding successful capture.")

        def replay(self) -> None:
            if not self._captured:
                raise RuntimeError("Called CUDAGraph::replay without a preceding successful capture.")
            ops.graph_replay(self._id)

        def reset(self) -> None:
            if self._id is not None:
                ops.graph_reset(self._id)
                for listener in reset_listeners:
                    listener(self._id)
            self._id, self._captured = None, False
            if self._holds_pool:  # after the graph: what it replays into may go with the pool
                self._holds_pool = False
                pools.let_go(self._pool)

        def pool(self):
            if self._pool is None:
                raise RuntimeError("Called CUDAGraph::pool without a preceding successful capture.")
            return self._pool

        def enable_debug_mode(self) -> None:
            """Accepted; debug_dump then writes a description instead of CUDA's DOT graph."""

        def debug_dump(self, debug_path: str) -> None:
            with open(debug_path, "w") as out:
                out.write(f"// emulated CUDA graph {self._id}: recorded ops replayed in order\n")

        def raw_cuda_graph(self) -> int:
            return 0

        def raw_cuda_graph_exec(self) -> int:
            return 0

        def __del__(self) -> None:
            try:
                self.reset()
            except Exception:
                pass  # never raise under GC (nor for a graph whose __new__ did not finish)

    graphs.CUDAGraph.__bases__ = (EmulatedGraph,)
    # a finalizer reached through a new base is not installed on the class: set it there too
    graphs.CUDAGraph.__del__ = EmulatedGraph.__del__
    graphs._graph_pool_handle = lambda: memory_pools.new_pool_id(user_created=True)
    graphs._cuda_isCurrentStreamCapturing = ops.graph_capturing
    torch._C._cuda_isCurrentStreamCapturing = ops.graph_capturing
    _bind_cudagraph_tree_entry_points(torch)


class AllocatorState:
    """A private pool's allocator state (torch._C._cuda_CUDAAllocator_AllocatorState): its
    segments and their blocks, as the shim's pool_checkpoint lists them."""

    def __init__(self, pool: tuple[int, int], blocks: list[int]):
        self.pool = pool
        self.blocks = blocks


def _bind_cudagraph_tree_entry_points(torch: ModuleType) -> None:
    ops = torch.ops.mirage
    C = torch._C

    def get_checkpoint_state(device: int, pool) -> AllocatorState:
        return AllocatorState(tuple(pool), ops.pool_checkpoint(device, *pool))

    def set_checkpoint_pool_state(device: int, state: AllocatorState, stale_storages, storages_to_add_deleters_to=()):
        ops.pool_restore(device, *state.pool, state.blocks, list(stale_storages), list(storages_to_add_deleters_to))

    def check_pool_live_allocations(device: int, pool, expected_live_allocations) -> bool:
        live = ops.pool_live_allocations(device, *pool)
        return len(live) == len(expected_live_allocations) and all(p in expected_live_allocations for p in live)

    def construct_tensor(metadata: dict[str, Any], storage) -> torch.Tensor:
        tensor = torch.empty((0,), dtype=metadata["dtype"], device=storage.device)
        return tensor.set_(storage, metadata["storage_offset"], metadata["size"], metadata["stride"])

    def data_ptrs_equal(tensors, data_ptrs, indices) -> bool:
        return all(tensors[i].data_ptr() == data_ptrs[i] for i in indices)

    C._cuda_CUDAAllocator_AllocatorState = AllocatorState
    C._cuda_getCheckpointState = get_checkpoint_state
    C._cuda_setCheckpointPoolState = set_checkpoint_pool_state
    C._cuda_checkPoolLiveAllocations = check_pool_live_allocations
    C._has_Standard_Deleter = ops.storage_has_standard_deleter
    C._free_And_Remove_DeleterFn = ops.storage_free_and_remove_deleter
    C._set_storage_access_error_msg = ops.set_storage_access_error_msg
    C._set_storage_data_ptr_access_error_msg = ops.set_storage_data_ptr_access_error_msg
    C._construct_CUDA_Tensor_From_Storage_And_Metadata = construct_tensor
    C._tensors_data_ptrs_at_indices_equal = data_ptrs_equal
    C._cuda_isHistoryEnabled = ops.memory_history_enabled
