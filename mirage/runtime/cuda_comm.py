"""torch.cuda.comm's bindings (`torch._C._broadcast`, `_scatter`, `_gather`...): copies between
the GPUs of one process, which nn.DataParallel is built on.

A CPU build lacks them. Here each is what torch/csrc/cuda/comm.cpp does, expressed as tensor
copies between emulated devices (each one a copy in host memory, through the shim): the same
outputs, the same aliasing (a result on the source's own device is the source tensor itself,
as on a GPU), and the same refusals, word for word where users meet them.
"""

from __future__ import annotations

from types import ModuleType


def install(torch: ModuleType) -> None:
    C = torch._C

    def cuda_device(index: int):
        return torch.device("cuda", index)

    def check_cuda(tensors, what: str) -> None:
        for i, t in enumerate(tensors):
            if not t.is_cuda:
                name = "output tensor" if what == "output" else "tensor"
                raise RuntimeError(f"Expected all {what} tensors to be CUDA tensors, but {name} at index {i} has "
                                   f"device '{t.device}'")

    def broadcast(tensor, devices):
        """One tensor per device; on the tensor's own device, the tensor itself."""
        return [tensor if tensor.is_cuda and tensor.get_device() == d else tensor.to(cuda_device(d), copy=True)
                for d in devices]

    def broadcast_out(tensor, out):
        check_cuda(out, "output")
        for o in out:
            if o.shape != tensor.shape:
                raise RuntimeError(f"output and input must have the same shape, but got {tuple(o.shape)} and "
                                   f"{tuple(tensor.shape)}")
            o.copy_(tensor)
        return list(out)

    def broadcast_coalesced(tensors, devices, buffer_size):
        """outputs[i][j]: tensor j on devices[i]; the first device must hold the inputs, whose
        entries are the inputs themselves."""
        for t in tensors:
            if t.get_device() != devices[0]:
                raise RuntimeError(f"All tensors must be on devices[0]: {devices[0]}")
        return [list(tensors)] + [[t.to(cuda_device(d), copy=True) for t in tensors] for d in devices[1:]]

    def scatter(tensor, devices, chunk_sizes, dim, streams):
        chunks = (tensor.split_with_sizes(list(chunk_sizes), dim) if chunk_sizes is not None
                  else tensor.chunk(len(devices), dim))
        return [chunk.to(cuda_device(d)) for chunk, d in zip(chunks, devices)]

    def scatter_out(tensor, out, dim, streams):
        check_cuda(out, "output")
        pieces = tensor.split_with_sizes([o.size(dim) for o in out], dim)
        for piece, o in zip(pieces, out):
            o.copy_(piece)
        return list(out)

    def gather(tensors, dim, destination):
        check_cuda(tensors, "input")
        where = torch.device("cpu") if destination == -1 else cuda_device(
            tensors[0].get_device() if destination is None else destination)
        return torch.cat([t.to(where) for t in tensors], dim)

    def gather_out(tensors, out, dim):
        check_cuda(tensors, "input")
        return torch.cat([t.to(out.device) for t in tensors], dim, out=out)

    C._broadcast, C._broadcast_out, C._broadcast_coalesced = broadcast, broadcast_out, broadcast_coalesced
    C._scatter, C._scatter_out, C._gather, C._gather_out = scatter, scatter_out, gather, gather_out
