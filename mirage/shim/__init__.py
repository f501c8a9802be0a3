"""The device shim: a small C++ library that gives a CPU-only PyTorch a `cuda` device.

Pure Python cannot make torch report `cuda` tensors (autograd asks the C++ side for a CUDA
device guard), so this one part is native. It is built with torch.utils.cpp_extension against
the installed torch on first use and cached; see `build.py`. One concern a file, as
torch_openreg's runtime is split:

    config.h             what the node is (GPUs seen, capacity, vendor), from the environment
    hooks.cpp            the CUDA hooks and DDP's timer: what torch asks a CUDA build for
    device_guard.*       current device and stream per thread; streams and events
    op_path.*            the one path every device op takes (PyTorch's CPU kernel, zero copy)
                         and the observers it calls
    explicit_kernels.cpp the device's own kernels where the CPU kernel is not what CUDA does
    host_views.*         CPU views of device memory; CPU results adopted as device memory
    cpu_allocator.*      torch's CPU allocator, except for a device kernel's own allocations
    device_memory.*      capacity, accounting, the CUDA allocator over caching_allocator.*
    session_table.*      the session's shared per-GPU table in /dev/shm
    memory_history.*     torch.cuda.memory._record_memory_history
    private_pools.cpp    MemPool / use_mem_pool and cudagraph trees' pool checkpoints
    graph_capture.*      CUDA graph capture and replay
    busy_time.*          utilization: how long each device ran work
    pinned_memory.*      pinned host memory and its statistics
    generators.*         each device's random generator
    cuda_ipc.cpp         device tensors shared between processes
    shared_device_memory.*  device memory peers can map (the arena)
    faults.*             faults on purpose: an op, allocation or collective that kills, stalls
                         or runs out of memory (mirage run --fault)
    cuda_only_kernels.cpp, fused_attention.cpp  CUDA-only operators written over ATen
    race_checker.*       mirage run --check-races: each kernel's reads and writes checked
                         against a shadow of device memory and the streams' vector clocks
    profiler_activities.*  torch.profiler's GPU side: kernels, memcpys and launches handed to
                         Kineto through its plugin interface, as CUPTI hands a CUDA build's
"""
