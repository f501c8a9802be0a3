"""The rest of torch.cuda's runtime bindings a CPU build lacks: the CUDA runtime module
(`torch.cuda.cudart()`: error strings, profiler start/stop), the caching allocator's raw
alloc/delete, memory fraction, library handles, external streams, IPC collection, and
TunableOp's settings.

Each behaves as the CUDA (or ROCm) build's binding does where a program can observe it. Where
the emulated device has nothing behind it (a BLAS handle, a profiler to start, a GEMM to tune)
the call is accepted and does nothing, as it would look to the program on a GPU box with no
profiler attached and no tuning to do.
"""

from __future__ import annotations

import csv
import enum
import os
from types import ModuleType, SimpleNamespace

from mirage.profiles import Profile
from mirage.runtime import memory_pools

# cudaError_t / hipError_t values programs meet, and their runtime's error strings.
_ERRORS = {0: ("success", "no error"), 1: ("invalid_value", "invalid argument"),
           2: ("memory_allocation", "out of memory"), 3: ("initialization_error", "initialization error"),
           100: ("no_device", "no CUDA-capable device is detected"),
           101: ("invalid_device", "invalid device ordinal")}


def _cudart(is_amd: bool) -> SimpleNamespace:
    """What torch.cuda.cudart() returns: the runtime's Python bindings torch uses."""
    error = enum.IntEnum("cudaError", {name: code for code, (name, _) in _ERRORS.items()})

    def error_string(code) -> str:
        text = _ERRORS.get(int(code), (None, "unknown error"))[1]
        return text.replace("CUDA-capable", "ROCm-capable") if is_amd else text

    ok = error.success
    return SimpleNamespace(cudaError=error, cudaGetErrorString=error_string,
                           cudaProfilerStart=lambda: ok, cudaProfilerStop=lambda: ok,
                           cudaHostRegister=lambda ptr, size, flags: ok, cudaHostUnregister=lambda ptr: ok,
                           cudaStreamCreate=lambda ptr: ok, cudaStreamDestroy=lambda stream: ok)


class _TunableOp:
    """TunableOp's settings and results file, as torch's TuningContext keeps them (the
    PYTORCH_TUNABLEOP_* variables give the defaults). Tuning itself finds nothing to tune on
    emulated GPUs: every GEMM runs PyTorch's CPU kernel, so results stay empty."""

    def __init__(self, profile: Profile) -> None:
        env = os.environ
        flag = lambda name, default: env.get(name, default) == "1"  # noqa: E731
        self.enabled = flag("PYTORCH_TUNABLEOP_ENABLED", "0")
        self.tuning = flag("PYTORCH_TUNABLEOP_TUNING", "1")
        self.record_untuned = flag("PYTORCH_TUNABLEOP_RECORD_UNTUNED", "0")
        self.max_duration_ms = int(env.get("PYTORCH_TUNABLEOP_MAX_TUNING_DURATION_MS", "30"))
        self.max_iterations = int(env.get("PYTORCH_TUNABLEOP_MAX_TUNING_ITERATIONS", "100"))
        self.rotating_buffer_mb = int(env.get("PYTORCH_TUNABLEOP_ROTATING_BUFFER_SIZE", "-1"))
        self.filename = env.get("PYTORCH_TUNABLEOP_FILENAME", "tunableop_results.csv")
        self.results: list[tuple[str, str, str, float]] = []
        # PT_VERSION is the release ("2.2.0" in torch.cuda.tunable's example), GCN_ARCH_NAME the
        # device property's whole string ("gfx942:sramecc+:xnack-").
        self.validators = (("PT_VERSION", _torch_version().split("+")[0]),
                           ("ROCM_VERSION" if profile.is_amd else "CUDA_VERSION", "emulated"),
                           ("GCN_ARCH_NAME", profile.gcn_arch_name) if profile.is_amd else ("DEVICE_ARCH", profile.arch))

    def read_file(self, filename: str | None) -> bool:
        """Loads results written by a real run (Validator lines are checked by the real
        runtime; here they are skipped). False if the file cannot be read."""
        try:
            with open(filename or self.filename, newline="") as f:
                rows = [r for r in csv.reader(f) if r and r[0] != "Validator"]
        except OSError:
            return False
        self.results = [(r[0], r[1], r[2], float(r[3])) for r in rows if len(r) >= 4]
        return True

    def bind(self, C) -> None:
        def setter(attribute: str):
            return lambda value: setattr(self, attribute, value)

        C._cuda_tunableop_enable, C._cuda_tunableop_is_enabled = setter("enabled"), lambda: self.enabled
        C._cuda_tunableop_tuning_enable, C._cuda_tunableop_tuning_is_enabled = setter("tuning"), lambda: self.tuning
        C._cuda_record_untuned_enable = setter("record_untuned")
        C._cuda_record_untuned_is_enabled = lambda: self.record_untuned
        C._cuda_tunableop_set_max_tuning_duration = setter("max_duration_ms")
        C._cuda_tunableop_get_max_tuning_duration = lambda: self.max_duration_ms
        C._cuda_tunableop_set_max_tuning_iterations = setter("max_iterations")
        C._cuda_tunableop_get_max_tuning_iterations = lambda: self.max_iterations
        C._cuda_tunableop_set_rotating_buffer_size = setter("rotating_buffer_mb")
        C._cuda_tunableop_get_rotating_buffer_size = lambda: self.rotating_buffer_mb
        C._cuda_tunableop_set_numerical_check_tolerances = lambda enable, atol=1e-5, rtol=1e-5: None
        C._cuda_tunableop_set_filename = lambda filename, insert_device_ordinal=False: setattr(
            self, "filename", filename)
        C._cuda_tunableop_get_filename = lambda: self.filename
        C._cuda_tunableop_get_results = lambda: tuple(self.results)
        C._cuda_tunableop_get_validators = lambda: self.validators
        C._cuda_tunableop_read_file = self.read_file
        C._cuda_tunableop_write_file = lambda filename=None: True


def _torch_version() -> str:
    import torch

    return torch.__version__


def install(torch: ModuleType, profile: Profile) -> None:
    C = torch._C
    cuda = torch.cuda
    cuda._cudart = _cudart(profile.is_amd)

    raw_blocks: dict[int, object] = {}  # caching_allocator_alloc's blocks, by address

    def raw_alloc(size: int, stream: int) -> int:
        block = torch.empty(size, dtype=torch.uint8, device=torch.device("cuda", cuda.current_device()))
        raw_blocks[block.data_ptr()] = block
        return block.data_ptr()

    def raw_delete(pointer: int) -> None:
        if raw_blocks.pop(pointer, None) is None:  # else a private pool's block (cudagraph trees free them so)
            torch.ops.mirage.raw_delete(pointer)  # or "invalid device pointer", as CUDA

    caching = {"enabled": True}
    C._cuda_cudaCachingAllocator_raw_alloc, C._cuda_cudaCachingAllocator_raw_delete = raw_alloc, raw_delete
    C._cuda_cudaCachingAllocator_enable = lambda value: caching.__setitem__("enabled", bool(value))
    C._cuda_cudaCachingAllocator_is_enabled = lambda: caching["enabled"]
    C._cuda_getAllocatorBackend = lambda: "native"
    C._cuda_setMemoryFraction = lambda fraction, device: torch.ops.mirage.set_memory_fraction(device, fraction)
    C._cuda_getMemoryFraction = lambda device: torch.ops.mirage.memory_fraction(device)
    C._cuda_ipc_collect = lambda: None
    C._host_emptyCache = lambda: None  # pinned host memory is not cached

    def host_memory_stats() -> dict:
        """The caching host allocator's statistics over the shim's pinned-memory counts (no block
        is cached, so allocations are active requests and no alloc/free time is spent waiting)."""
        counts = torch.ops.mirage.host_memory_counts()
        blocks, counted = counts[:4], counts[4:]
        stat = lambda v: dict(zip(("current", "peak", "allocated", "freed"), v))  # noqa: E731
        timing = {"total": 0, "max": 0, "min": 0, "count": 0, "avg": 0}
        return {"allocations": stat(blocks), "allocated_bytes": stat(counted), "active_requests": stat(blocks),
                "active_bytes": stat(counted), "num_host_alloc": blocks[2], "num_host_free": blocks[3],
                "host_alloc_time": dict(timing, count=blocks[2]), "host_free_time": dict(timing, count=blocks[3])}

    C._cuda_hostMemoryStats = host_memory_stats
    C._cuda_resetPeakHostMemoryStats = lambda: torch.ops.mirage.reset_host_memory_counts(True)
    C._cuda_resetAccumulatedHostMemoryStats = lambda: torch.ops.mirage.reset_host_memory_counts(False)

    def jiterator_launch(*args, **kwargs):
        raise RuntimeError("mirage: torch.cuda.jiterator kernels are CUDA C++ that a GPU build compiles with NVRTC "
                           "when first called; emulated GPUs cannot run them (write the operation with torch ops)")

    C._cuda_jiterator_compile_and_launch_kernel = jiterator_launch

    # Opaque library handles, one per device, stable for the process (as cuBLAS/cuSOLVER's are).
    C._cuda_getCurrentBlasHandle = lambda: 0x10000 + cuda.current_device()
    C._cuda_getCurrentSolverHandle = lambda: 0x20000 + cuda.current_device()

    def stream_from_external(data_ptr: int, device_index: int):
        stream = cuda.ExternalStream(data_ptr, device=device_index)
        return stream.stream_id, stream.device_index, stream.device_type

    C._cuda_getStreamFromExternal = stream_from_external
    _TunableOp(profile).bind(C)
    _give_mem_pools(torch)


def _give_mem_pools(torch: ModuleType) -> None:
    """torch.cuda.MemPool and use_mem_pool: a pool has its id and use count, and what a thread
    allocates inside `use_mem_pool` comes from the pool's own segments in the shim's allocator
    model (MemPool.snapshot lists them); a pool given up (releasePool) returns its cached
    segments. A custom allocator (CUDAPluggableAllocator) is kept but not called."""
    memory = torch.cuda.memory
    pools = memory_pools.holders(torch)

    class EmulatedMemPool:
        """The native half of torch.cuda.MemPool (torch._C._MemPool on a GPU build)."""

        def __init__(self, allocator=None, is_user_created=True, use_on_oom=False, no_split=False):
            self._id = memory_pools.new_pool_id(user_created=is_user_created)
            self._allocator = allocator
            pools.hold(self._id, torch.cuda.current_device())

        def __del__(self) -> None:
            if getattr(self, "_id", None) is not None:
                pools.let_go(self._id)

        @property
        def id(self) -> tuple[int, int]:
            return self._id

        @property
        def allocator(self):
            return self._allocator

        def use_count(self) -> int:
            return pools.count(self._id)

    def begin(device: int, pool_id) -> None:
        pools.hold(tuple(pool_id), device)
        torch.ops.mirage.begin_pool(device, *pool_id)

    def end(device: int, pool_id) -> None:
        torch.ops.mirage.end_pool(device, *pool_id)

    def release(device: int, pool_id) -> None:
        pools.let_go(tuple(pool_id))

    torch._C._cuda_clearCublasWorkspaces = lambda: None  # the CPU kernels keep no BLAS workspaces
    memory.MemPool.__bases__ = (EmulatedMemPool,)
    for module in (torch._C, memory):  # torch.cuda.memory imported these by name
        module._cuda_beginAllocateCurrentThreadToPool = begin
        module._cuda_endAllocateToPool = end
        module._cuda_releasePool = release
