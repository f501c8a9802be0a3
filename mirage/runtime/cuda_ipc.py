"""CUDA IPC: device tensors sent to another process (torch.multiprocessing queues and pipes,
torch.multiprocessing.reductions) share their memory, as on a GPU, so what the receiver
writes the sender sees.

torch's own reductions (torch/multiprocessing/reductions.py) do the pickling and the receiver's
cache; they call the storage's CUDA IPC methods, which a CPU build compiles out. Those are
given here over the shim's shared segments (mirage/shim/cuda_ipc.cpp). The reference
counters and events CUDA IPC passes along have nothing to count or wait for (the segment lives
while the sender's storage does; work is complete once issued), so they travel empty.
"""

from __future__ import annotations

from types import ModuleType


def install(torch: ModuleType) -> None:
    ops = torch.ops.mirage
    storage_class = torch.UntypedStorage

    def share_cuda(self) -> tuple:
        """What cudaIpcGetMemHandle gives torch's reduce_tensor: (device, handle, size, offset,
        ref-counter handle, its offset, event handle, event sync needed)."""
        view = torch.empty(0, dtype=torch.uint8, device=self.device).set_(self)
        name = ops.share_storage_memory(view)
        return self.device.index, name.encode(), self.nbytes(), 0, b"", 0, b"", False

    def new_shared_cuda(device, handle, size_bytes, offset_bytes, ref_counter_handle, ref_counter_offset,
                        event_handle, event_sync_required):
        """The receiver's side: a storage over the sender's memory."""
        return ops.open_shared_storage(handle.decode(), size_bytes + offset_bytes, device).untyped_storage()

    storage_class._share_cuda_ = share_cuda
    storage_class._new_shared_cuda = staticmethod(new_shared_cuda)
    storage_class._release_ipc_counter_cuda = classmethod(lambda cls, *args, **kwargs: None)
