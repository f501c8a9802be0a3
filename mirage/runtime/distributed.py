"""Emulated NCCL/RCCL in torch.distributed: mirage's backend where ProcessGroupNCCL would be.

A CPU build of torch has no ProcessGroupNCCL; `distributed_c10d` then refuses "nccl" ("Distributed
package doesn't have NCCL built in"). Here the emulated backend (mirage/nccl, a c10d Backend in
C++) takes that place: `distributed_c10d.ProcessGroupNCCL` is its class and NCCL counts as
available, so torch's own NCCL code path builds it wherever NCCL was asked for (`"nccl"`, the
cuda default, `"cuda:nccl,cpu:gloo"`, new_group, DeviceMesh...), with torch's own options,
checks and defaults; `dist.get_backend()` says nccl and `pg._get_backend(torch.device("cuda"))`
is the emulated backend. It is the one place every collective on device tensors passes (torch's
c10d CUDA kernels hand them to it), so the flight recorder, desync checks and the summary hook in
there, not here.

Also completed here, from what an NCCL build has beyond the backend: `torch.cuda.nccl.version()`,
NCCL's default timeout (10 minutes; a CPU build would give gloo's 30), `_hash_tensors` and
`_dump_nccl_trace` (the recorder in NCCL's trace format).

Gloo in torch 2.13 can abort a correct program at interpreter exit if a process group is still
alive (see the shim design notes); `_tear_down_at_exit` destroys them before Python finalizes.
"""

from __future__ import annotations

import atexit
import ctypes
import functools
import gc
import hashlib
import importlib.machinery
import importlib.util
import json
import os
import pickle
from datetime import timedelta
from types import ModuleType

from mirage.runtime import session

_NCCL_DEFAULT_TIMEOUT = timedelta(minutes=10)  # torch's default_pg_nccl_timeout in a CUDA build
# What torch 2.13's own builds report from torch.cuda.nccl.version(): the NCCL its CUDA wheels
# ship, and the RCCL of its ROCm wheels (RCCL reports the NCCL API version it implements).
_NCCL_VERSION = (2, 27, 5)
_RCCL_VERSION = (2, 26, 6)


@functools.cache
def load_backend_module() -> ModuleType:
    """The emulated NCCL extension (built with the shim; MIRAGE_NCCL_PATH names it), loaded
    once: the fork server loads it before forking (mirage/forkserver), so its ranks do not each
    map and relocate it."""
    path = os.environ["MIRAGE_NCCL_PATH"]
    loader = importlib.machinery.ExtensionFileLoader("mirage_nccl", path)
    spec = importlib.util.spec_from_file_location("mirage_nccl", path, loader=loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def _tear_down_at_exit(c10d: ModuleType) -> None:
    """Destroys every process group before the interpreter finalizes (see module docstring)."""
    if not c10d.is_initialized():
        return
    try:
        c10d.destroy_process_group()
    except Exception:
        pass
    gc.collect()


def _hash_tensors(tensors) -> int:
    """NCCL builds' c10d._hash_tensors: one 64-bit digest of the tensors' bytes, the same on every
    rank for the same data (TORCH_DISTRIBUTED_DEBUG=DETAIL compares them across ranks)."""
    import torch

    digest = hashlib.blake2b(digest_size=8)
    for tensor in tensors:
        host = tensor.detach().contiguous().view(-1).view(torch.uint8).cpu()
        digest.update(ctypes.string_at(host.data_ptr(), host.numel()))
    return int.from_bytes(digest.digest(), "little")


def _add_single_process_nccl(torch: ModuleType) -> None:
    """torch.cuda.nccl's bindings: collectives among one process's GPUs (a tensor per device),
    as nn.DataParallel-era code calls them. Emulated GPUs share the host's memory, so each is a
    few tensor operations; results land on each tensor's own device."""
    C = torch._C
    # ncclRedOp_t: ncclSum, ncclProd, ncclMax, ncclMin, ncclAvg
    reducers = {0: torch.sum, 1: torch.prod, 2: lambda t, dim: t.amax(dim), 3: lambda t, dim: t.amin(dim),
                4: torch.mean}

    def reduced(inputs, op: int):
        stacked = torch.stack([t.to(inputs[0].device) for t in inputs])
        return reducers[int(op)](stacked, dim=0).to(inputs[0].dtype)

    def all_reduce(inputs, outputs, op, streams=None, comms=None):
        total = reduced(inputs, op)
        for out in outputs:
            out.copy_(total)

    def reduce(inputs, output, root, op, streams=None, comms=None):
        (output if output is not None else inputs[root]).copy_(reduced(inputs, op))

    def broadcast(inputs, root, streams=None, comms=None):
        for i, t in enumerate(inputs):
            if i != root:
                t.copy_(inputs[root])

    def all_gather(inputs, outputs, streams=None, comms=None):
        whole = torch.cat([t.reshape(-1).to(outputs[0].device) for t in inputs])
        for out in outputs:
            out.view(-1).copy_(whole)

    def reduce_scatter(inputs, outputs, op, streams=None, comms=None):
        total = reduced([t.reshape(-1) for t in inputs], op)
        for i, out in enumerate(outputs):
            out.view(-1).copy_(total[i * out.numel():(i + 1) * out.numel()])

    C._nccl_all_reduce, C._nccl_reduce, C._nccl_broadcast = all_reduce, reduce, broadcast
    C._nccl_all_gather, C._nccl_reduce_scatter = all_gather, reduce_scatter


def _add_nccl_build_functions(torch: ModuleType, module: ModuleType, is_amd: bool) -> None:
    """What an NCCL build of torch has outside the backend, which library code calls."""
    C = torch._C
    _add_single_process_nccl(torch)
    c10d_bindings = C._distributed_c10d
    version = _RCCL_VERSION if is_amd else _NCCL_VERSION
    module._set_nccl_version(".".join(map(str, version)))  # for NCCL's error messages
    C._nccl_version = lambda: (version[0] << 32) | (version[1] << 16) | version[2]
    C._nccl_version_suffix = lambda: b""
    c10d_bindings._hash_tensors = _hash_tensors

    def dump_nccl_trace(includeCollectives: bool = True, includeStackTraces: bool = True,
                        onlyActive: bool = False) -> bytes:
        return module._trace_pickle(includeCollectives, onlyActive)

    def dump_nccl_trace_json(includeCollectives: bool = True, onlyActive: bool = False) -> str:
        return json.dumps(pickle.loads(module._trace_pickle(includeCollectives, onlyActive)))

    c10d_bindings._dump_nccl_trace = dump_nccl_trace
    c10d_bindings._dump_nccl_trace_json = dump_nccl_trace_json


def _give_gloo_device_tensors(c10d: ModuleType, module: ModuleType) -> None:
    """A gloo group serves cuda too (as a CUDA build's gloo does); a CPU build's gloo cannot take
    device tensors, so its cuda registration gets the adapter that hands it host aliases of
    them (mirage/nccl/gloo_on_device.cpp)."""
    ProcessGroup = c10d.ProcessGroup
    register = ProcessGroup._register_backend

    def register_backend(pg, device, backend_type, backend):
        if device.type == "cuda" and isinstance(backend, c10d.ProcessGroupGloo):
            # A group holds one backend per type: the adapter needs a type of its own.
            backend, backend_type = module.GlooOnDevice(backend), ProcessGroup.BackendType.CUSTOM
        return register(pg, device, backend_type, backend)

    ProcessGroup._register_backend = register_backend


def install(torch: ModuleType) -> None:
    """Wires emulated NCCL into torch.distributed. Called right after `import torch`."""
    import torch.distributed as dist

    if not dist.is_available() or not os.environ.get("MIRAGE_NCCL_PATH"):
        return
    c10d = dist.distributed_c10d
    module = load_backend_module()
    backend_class = module.ProcessGroupNCCL
    backend_class.__module__ = "torch.distributed.distributed_c10d"
    c10d.ProcessGroupNCCL = dist.ProcessGroupNCCL = torch._C._distributed_c10d.ProcessGroupNCCL = backend_class
    c10d._NCCL_AVAILABLE = True
    if "ProcessGroupNCCL" not in c10d.__all__:
        c10d.__all__.append("ProcessGroupNCCL")
    # A CPU build has no NCCL default timeout (it warns and gives gloo's 30 minutes); emulated
    # NCCL gets what a CUDA build's NCCL gets, so a hang surfaces when it would on the real box.
    c10d.default_pg_nccl_timeout = _NCCL_DEFAULT_TIMEOUT
    dist.constants.default_pg_nccl_timeout = _NCCL_DEFAULT_TIMEOUT
    _add_nccl_build_functions(torch, module, bool(torch.version.hip))
    _give_gloo_device_tensors(c10d, module)
    connection = session.connection_fd()
    if connection is not None:
        module._set_session_fd(connection)
    atexit.register(_tear_down_at_exit, c10d)
