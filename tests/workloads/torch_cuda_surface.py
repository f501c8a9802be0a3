"""Calls every public name of torch.cuda and its submodules with typical arguments, each one as
the FIRST CUDA call of a fresh process (a child forked before anything touched CUDA), and prints
one JSON line per name: {"name", "outcome": "ok" | "raised", "error", "value"}; "value" is what
the call returned, as JSON (see `described`), which the test compares with the device profile.

    mirage run --gpus-per-node 2 -- python tests/workloads/torch_cuda_surface.py

tests/test_torch_cuda_surface.py compares the outcomes with docs/torch-cuda.md's table.
"""

import json
import os
import sys

import torch
import torch.cuda.comm
import torch.cuda.gds
import torch.cuda.jiterator

cuda = torch.cuda
MODULES = {"torch.cuda": cuda, "torch.cuda.memory": cuda.memory, "torch.cuda.random": cuda.random,
           "torch.cuda.graphs": cuda.graphs, "torch.cuda.nvtx": cuda.nvtx, "torch.cuda.comm": cuda.comm,
           "torch.cuda.tunable": cuda.tunable, "torch.cuda.gds": cuda.gds, "torch.cuda.amp": cuda.amp}


def t(*shape, device="cuda"):
    return torch.ones(*shape or (4,), device=device)


def graphed():
    g = cuda.CUDAGraph()
    x = t()
    with cuda.graph(g):
        y = x * 2
    x.fill_(3)
    g.replay()
    assert y.cpu().tolist() == [6.0] * 4, y
    return g


def tune_results(tmp):
    cuda.tunable.set_filename(os.path.join(tmp, "tunableop_results.csv"))
    return cuda.tunable.get_results()


# How a program typically calls each name. Names whose typical use is only to be referred to
# (types, modules, flags) are checked for existence and, for classes, instantiation.
CALLS = {
    "BFloat16Storage": lambda: cuda.BFloat16Storage(2), "BFloat16Tensor": lambda: cuda.BFloat16Tensor(2),
    "BoolStorage": lambda: cuda.BoolStorage(2), "BoolTensor": lambda: cuda.BoolTensor(2),
    "ByteStorage": lambda: cuda.ByteStorage(2), "ByteTensor": lambda: cuda.ByteTensor(2),
    "CharStorage": lambda: cuda.CharStorage(2), "CharTensor": lambda: cuda.CharTensor(2),
    "ComplexDoubleStorage": lambda: cuda.ComplexDoubleStorage(2),
    "ComplexFloatStorage": lambda: cuda.ComplexFloatStorage(2),
    "DoubleStorage": lambda: cuda.DoubleStorage(2), "DoubleTensor": lambda: cuda.DoubleTensor(2),
    "FloatStorage": lambda: cuda.FloatStorage(2), "FloatTensor": lambda: cuda.FloatTensor(2),
    "HalfStorage": lambda: cuda.HalfStorage(2), "HalfTensor": lambda: cuda.HalfTensor(2),
    "IntStorage": lambda: cuda.IntStorage(2), "IntTensor": lambda: cuda.IntTensor(2),
    "LongStorage": lambda: cuda.LongStorage(2), "LongTensor": lambda: cuda.LongTensor(2),
    "ShortStorage": lambda: cuda.ShortStorage(2), "ShortTensor": lambda: cuda.ShortTensor(2),
    "CUDAGraph": graphed, "CudaError": lambda: cuda.CudaError(2),
    "DeferredCudaCallError": lambda: cuda.DeferredCudaCallError("x"),
    "Event": lambda: cuda.Event(enable_timing=True).record(), "ExternalStream": lambda: cuda.ExternalStream(0x1234),
    "Stream": lambda: cuda.Stream(priority=-1).query(), "StreamContext": lambda: cuda.StreamContext(cuda.Stream()),
    "GreenContext": lambda: cuda.GreenContext.create(num_sms=1, device_id=0),
    "amp": lambda: cuda.amp, "caching_allocator_alloc": lambda: cuda.caching_allocator_alloc(1024),
    "caching_allocator_delete": lambda: cuda.caching_allocator_delete(cuda.caching_allocator_alloc(1024)),
    "caching_allocator_disabled": lambda: cuda.caching_allocator_disabled().__enter__(),
    "caching_allocator_enable": lambda: cuda.caching_allocator_enable(True),
    "can_device_access_peer": lambda: cuda.can_device_access_peer(0, 1), "check_error": lambda: cuda.check_error(0),
    "cudaStatus": lambda: cuda.cudaStatus.SUCCESS, "cudart": lambda: cuda.cudart(),
    "current_blas_handle": cuda.current_blas_handle, "current_solver_handle": cuda.current_solver_handle,
    "current_device": cuda.current_device, "current_stream": cuda.current_stream,
    "default_generators": lambda: cuda.default_generators[0].initial_seed(), "default_stream": cuda.default_stream,
    "device": lambda: cuda.device(1).__enter__(), "device_count": cuda.device_count,
    "device_memory_used": cuda.device_memory_used, "device_of": lambda: cuda.device_of(t()).__enter__(),
    "empty_cache": cuda.empty_cache, "get_allocator_backend": cuda.get_allocator_backend,
    "CUDAPluggableAllocator": lambda: cuda.CUDAPluggableAllocator("/nonexistent.so", "alloc", "free"),
    "change_current_allocator": lambda: cuda.change_current_allocator(None),
    "get_arch_list": cuda.get_arch_list, "get_device_capability": cuda.get_device_capability,
    "get_device_name": cuda.get_device_name, "get_device_properties": lambda: cuda.get_device_properties(1),
    "get_gencode_flags": cuda.get_gencode_flags,
    "get_per_process_memory_fraction": cuda.get_per_process_memory_fraction,
    "get_rng_state": cuda.get_rng_state, "get_rng_state_all": cuda.get_rng_state_all,
    "get_stream_from_external": lambda: cuda.get_stream_from_external(0x1234),
    "get_sync_debug_mode": cuda.get_sync_debug_mode, "graph": lambda: cuda.graph(cuda.CUDAGraph()),
    "graph_pool_handle": cuda.graph_pool_handle, "graphs": lambda: cuda.graphs, "has_half": lambda: cuda.has_half,
    "has_magma": lambda: cuda.has_magma, "host_memory_stats": cuda.host_memory_stats,
    "host_memory_stats_as_nested_dict": cuda.host_memory_stats_as_nested_dict, "init": cuda.init,
    "initial_seed": cuda.initial_seed, "ipc_collect": cuda.ipc_collect, "is_available": cuda.is_available,
    "is_bf16_supported": cuda.is_bf16_supported, "is_current_stream_capturing": cuda.is_current_stream_capturing,
    "is_initialized": cuda.is_initialized, "is_tf32_supported": cuda.is_tf32_supported,
    "jiterator": lambda: cuda.jiterator._create_jit_fn("template <typename T> T f(T x) { return x * 2; }")(t()),
    "list_gpu_processes": cuda.list_gpu_processes,
    "make_graphed_callables": lambda: cuda.make_graphed_callables(torch.nn.Linear(4, 4).cuda(), (t(2, 4),)),
    "manual_seed": lambda: cuda.manual_seed(1), "manual_seed_all": lambda: cuda.manual_seed_all(1),
    "max_memory_allocated": cuda.max_memory_allocated, "max_memory_cached": cuda.max_memory_cached,
    "max_memory_reserved": cuda.max_memory_reserved, "mem_get_info": cuda.mem_get_info, "memory": lambda: cuda.memory,
    "memory_allocated": cuda.memory_allocated, "memory_cached": cuda.memory_cached,
    "memory_reserved": cuda.memory_reserved, "memory_snapshot": cuda.memory_snapshot,
    "memory_stats": cuda.memory_stats, "memory_stats_as_nested_dict": cuda.memory_stats_as_nested_dict,
    "memory_summary": cuda.memory_summary, "memory_usage": cuda.memory_usage, "MemPool": lambda: cuda.MemPool(),
    "use_mem_pool": lambda: cuda.use_mem_pool(cuda.MemPool()).__enter__(), "temperature": cuda.temperature,
    "power_draw": cuda.power_draw, "clock_rate": cuda.clock_rate, "nccl": lambda: cuda.nccl.version(),
    "nvtx": lambda: cuda.nvtx, "profiler": lambda: cuda.profiler.start(), "random": lambda: cuda.random,
    "reset_accumulated_host_memory_stats": cuda.reset_accumulated_host_memory_stats,
    "reset_accumulated_memory_stats": cuda.reset_accumulated_memory_stats,
    "reset_max_memory_allocated": cuda.reset_max_memory_allocated,
    "reset_max_memory_cached": cuda.reset_max_memory_cached,
    "reset_peak_host_memory_stats": cuda.reset_peak_host_memory_stats,
    "reset_peak_memory_stats": cuda.reset_peak_memory_stats, "seed": cuda.seed, "seed_all": cuda.seed_all,
    "set_device": lambda: cuda.set_device(1), "set_per_process_memory_fraction": lambda: cuda.set_per_process_memory_fraction(0.5),
    "set_rng_state": lambda: cuda.set_rng_state(cuda.get_rng_state()),
    "set_rng_state_all": lambda: cuda.set_rng_state_all(cuda.get_rng_state_all()),
    "set_stream": lambda: cuda.set_stream(cuda.Stream()), "set_sync_debug_mode": lambda: cuda.set_sync_debug_mode(1),
    "sparse": lambda: cuda.sparse, "stream": lambda: cuda.stream(cuda.Stream()).__enter__(), "streams": lambda: cuda.streams,
    "synchronize": cuda.synchronize, "tunable": lambda: cuda.tunable, "utilization": cuda.utilization,
    # torch.cuda.graphs, .nvtx, .comm
    "torch.cuda.nvtx.range_push": lambda: cuda.nvtx.range_push("r"), "torch.cuda.nvtx.range_pop": cuda.nvtx.range_pop,
    "torch.cuda.nvtx.range_start": lambda: cuda.nvtx.range_start("r"),
    "torch.cuda.nvtx.range_end": lambda: cuda.nvtx.range_end(cuda.nvtx.range_start("r")),
    "torch.cuda.nvtx.mark": lambda: cuda.nvtx.mark("m"), "torch.cuda.nvtx.range": lambda: cuda.nvtx.range("r").__enter__(),
    "torch.cuda.comm.broadcast": lambda: cuda.comm.broadcast(t(), [0, 1]),
    "torch.cuda.comm.broadcast_coalesced": lambda: cuda.comm.broadcast_coalesced([t()], [0, 1]),
    "torch.cuda.comm.reduce_add": lambda: cuda.comm.reduce_add([t(), t(device="cuda:1")]),
    "torch.cuda.comm.reduce_add_coalesced": lambda: cuda.comm.reduce_add_coalesced([[t()], [t(device="cuda:1")]]),
    "torch.cuda.comm.scatter": lambda: cuda.comm.scatter(t(), [0, 1]),
    "torch.cuda.comm.gather": lambda: cuda.comm.gather([t(), t(device="cuda:1")]),
    # torch.cuda.tunable
    "torch.cuda.tunable.enable": lambda: cuda.tunable.enable(True), "torch.cuda.tunable.is_enabled": cuda.tunable.is_enabled,
    "torch.cuda.tunable.tuning_enable": lambda: cuda.tunable.tuning_enable(True),
    "torch.cuda.tunable.tuning_is_enabled": cuda.tunable.tuning_is_enabled,
    "torch.cuda.tunable.record_untuned_enable": lambda: cuda.tunable.record_untuned_enable(True),
    "torch.cuda.tunable.record_untuned_is_enabled": cuda.tunable.record_untuned_is_enabled,
    "torch.cuda.tunable.set_max_tuning_duration": lambda: cuda.tunable.set_max_tuning_duration(10),
    "torch.cuda.tunable.get_max_tuning_duration": cuda.tunable.get_max_tuning_duration,
    "torch.cuda.tunable.set_max_tuning_iterations": lambda: cuda.tunable.set_max_tuning_iterations(10),
    "torch.cuda.tunable.get_max_tuning_iterations": cuda.tunable.get_max_tuning_iterations,
    "torch.cuda.tunable.set_filename": lambda: cuda.tunable.set_filename("results.csv"),
    "torch.cuda.tunable.get_filename": cuda.tunable.get_filename, "torch.cuda.tunable.get_results": cuda.tunable.get_results,
    "torch.cuda.tunable.get_validators": cuda.tunable.get_validators,
    "torch.cuda.tunable.read_file": lambda: cuda.tunable.read_file("nonexistent.csv"),
    "torch.cuda.tunable.tune_gemm_in_file": lambda: cuda.tunable.tune_gemm_in_file("nonexistent.csv"),
    "torch.cuda.tunable.mgpu_tune_gemm_in_file": lambda: cuda.tunable.mgpu_tune_gemm_in_file("nonexistent*.csv", 1),
    "torch.cuda.tunable.set_rotating_buffer_size": lambda: cuda.tunable.set_rotating_buffer_size(0),
    "torch.cuda.tunable.get_rotating_buffer_size": cuda.tunable.get_rotating_buffer_size,
    "torch.cuda.tunable.set_numerical_check_tolerances": lambda: cuda.tunable.set_numerical_check_tolerances(True),
    # torch.cuda.gds
    "torch.cuda.gds.gds_register_buffer": lambda: cuda.gds.gds_register_buffer(torch.empty(4, device="cuda").untyped_storage()),
    "torch.cuda.gds.gds_deregister_buffer": lambda: cuda.gds.gds_deregister_buffer(torch.empty(4, device="cuda").untyped_storage()),
    "torch.cuda.gds.GdsFile": lambda: cuda.gds.GdsFile("/tmp/mirage-gds-probe", os.O_CREAT | os.O_RDWR),
    # torch.cuda.amp
    "torch.cuda.amp.amp_definitely_not_available": cuda.amp.amp_definitely_not_available,
    "torch.cuda.amp.autocast": lambda: cuda.amp.autocast().__enter__(),
    "torch.cuda.amp.custom_bwd": lambda: cuda.amp.custom_bwd(lambda ctx, g: g),
    "torch.cuda.amp.custom_fwd": lambda: cuda.amp.custom_fwd(lambda ctx, x: x),
    "torch.cuda.amp.GradScaler": lambda: cuda.amp.GradScaler().scale(t()),
}


def public_names() -> list[str]:
    """Every name in torch.cuda's and its submodules' __all__, qualified outside torch.cuda;
    a name a submodule re-exports from torch.cuda counts once."""
    names = list(cuda.__all__)
    for qualified, module in MODULES.items():
        if module is cuda:
            continue
        for name in getattr(module, "__all__", []):
            if name in cuda.__all__ and getattr(cuda, name, None) is getattr(module, name):
                continue
            names.append(f"{qualified}.{name}")
    return names


# The fields of torch's _CudaDeviceProperties a program reads (torch/csrc/cuda/Module.cpp binds them).
PROPERTIES = ("name", "major", "minor", "total_memory", "multi_processor_count", "is_integrated",
              "is_multi_gpu_board", "max_threads_per_multi_processor", "warp_size", "regs_per_multiprocessor",
              "shared_memory_per_block", "L2_cache_size", "gcnArchName", "uuid", "pci_bus_id")


def described(value, depth: int = 0):
    """A returned value as JSON: plain values as they are; tuples and lists as lists; dicts with their
    values; a tensor or storage as {"type", "dtype", "device", "shape"/"size"}; device properties as
    their fields; anything else as {"type": its class name}."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if depth > 3:
        return {"type": type(value).__name__}
    if isinstance(value, (tuple, list)):
        return [described(v, depth + 1) for v in value]
    if isinstance(value, dict):
        return {str(k): described(v, depth + 1) for k, v in value.items()}
    if isinstance(value, torch.Tensor):
        return {"type": "Tensor", "dtype": str(value.dtype), "device": str(value.device), "shape": list(value.shape)}
    if isinstance(value, (torch.TypedStorage, torch.UntypedStorage)):
        dtype = str(value.dtype) if isinstance(value, torch.TypedStorage) else None
        return {"type": type(value).__name__, "dtype": dtype, "device": str(value.device), "size": value.size()}
    if all(hasattr(value, field) for field in PROPERTIES):  # torch's _CudaDeviceProperties, or its like
        return {"type": "device properties", **{f: described(getattr(value, f), depth + 1) for f in PROPERTIES}}
    return {"type": type(value).__name__}


def outcome(name: str) -> dict:
    call = CALLS.get(name)
    if call is None:
        return {"name": name, "outcome": "no typical call", "error": ""}
    try:
        value = call()
        return {"name": name, "outcome": "ok", "error": "", "value": described(value)}
    except Exception as error:  # the point is to record what each raises
        return {"name": name, "outcome": "raised", "error": f"{type(error).__name__}: {str(error).splitlines()[0][:200]}"
                if str(error) else type(error).__name__}


def main() -> None:
    for name in public_names():
        read, write = os.pipe()
        child = os.fork()
        if child == 0:
            os.close(read)
            os.write(write, json.dumps(outcome(name)).encode())
            os._exit(0)
        os.close(write)
        with os.fdopen(read) as pipe:
            line = pipe.read()
        _, status = os.waitpid(child, 0)
        if not line:
            line = json.dumps({"name": name, "outcome": "crashed", "error": f"wait status {status}"})
        print(line, flush=True)


if __name__ == "__main__":
    sys.exit(main())
