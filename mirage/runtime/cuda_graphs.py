"""CUDA graphs on emulated GPUs: torch.cuda.CUDAGraph, torch.cuda.graph, graph_pool_handle,
make_graphed_callables and is_current_stream_capturing, as torch defines them, over the shim's
capture (mirage_shim.cpp, "CUDA graph capture": captured work is recorded, not run; a replay
runs it again on the captured memory).

A CPU build's `torch._C._CUDAGraph` is a dummy class that refuses to be instantiated; torch's
own `torch.cuda.graphs.CUDAGraph` (the documented class, with its checks and docstrings)
derives from it. Giving that class the emulated base below makes every torch path that builds
graphs work unchanged. Memory pools are accepted; captured results simply stay allocated while
their graph lives (the emulated allocator has no pool to share). Collectives issued during a
capture run when issued, not on replay (the emulated NCCL backend is not recorded).
"""

from __future__ import annotations

import itertools
from types import ModuleType

_pool_ids = itertools.count(1)


def install(torch: ModuleType) -> None:
    ops = torch.ops.mirage
    graphs = torch.cuda.graphs

    class EmulatedGraph:
        """The native half of torch.cuda.CUDAGraph (what torch._C._CUDAGraph is on a GPU build)."""

        def __new__(cls, keep_graph: bool = False):
            graph = object.__new__(cls)
            graph._id = None
            graph._captured = False
            graph._pool = None
            return graph

        def capture_begin(self, pool=None, capture_error_mode: str = "global") -> None:
            if capture_error_mode not in ("global", "thread_local", "relaxed"):
                raise RuntimeError(f"Unknown capture error mode. Expected `global`, `thread_local`, or `relaxed`, "
                                   f"got {capture_error_mode}")
            self._pool = tuple(pool) if pool is not None else (next(_pool_ids), 0)
            self._id = ops.graph_capture_begin()

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
            self._id, self._captured = None, False

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
            if getattr(self, "_id", None) is not None:
                try:
                    ops.graph_reset(self._id)
                except Exception:
                    pass  # never raise under GC

    graphs.CUDAGraph.__bases__ = (EmulatedGraph,)
    graphs._graph_pool_handle = lambda: (next(_pool_ids), 0)
    graphs._cuda_isCurrentStreamCapturing = ops.graph_capturing
    torch._C._cuda_isCurrentStreamCapturing = ops.graph_capturing
