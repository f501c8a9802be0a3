"""The torch.cuda Python API on top of the device shim.

A CPU build of torch has `torch.cuda` written against `torch._C._cuda_*` bindings that do not
exist. Most of torch.cuda looks those bindings up at call time, so the cheapest faithful fix
is to provide them (backed by the generic `torch._C._accelerator_*` API, which reaches the
shim's device guard and allocator) and leave torch's own Python in charge. Names torch.cuda
captured at import time (Stream, Event, the device-properties type) are replaced directly.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from types import FunctionType, ModuleType

from mirage import profiles
from mirage.runtime import (autograd_threads, build_config, cuda_comm, cuda_graphs, cuda_ipc, cuda_memory, cuda_runtime, cudnn,
                            device_queries, distributed, gpu_profiler, green_contexts, import_hooks, inductor, legacy_tensor_types,
                            nvtx, races, timing, triton_driver, visible_devices)
from mirage.runtime.unprofiled import unprofiled

# What a ROCm / CUDA build of torch 2.13 reports as its toolkit version.
_HIP_VERSION = "7.0.51831-a3e329ad8"
_CUDA_VERSION = "12.8"
_CUDA_DEVICE_TYPE = 1  # c10::DeviceType::CUDA


class DeviceProperties:
    """What torch.cuda.get_device_properties returns (the fields of torch's own type)."""

    def __init__(self, profile: profiles.Profile, node_gpu: int) -> None:
        self.name = profile.torch_name
        self.major, self.minor = profile.compute_capability
        self.total_memory = profile.memory_bytes
        self.multi_processor_count = profile.compute_units
        self.is_integrated = False
        self.is_multi_gpu_board = profile.name == "mi250x"
        self.max_threads_per_multi_processor = 2048
        self.warp_size = profile.warp_size
        self.regs_per_multiprocessor = 65536
        self.shared_memory_per_block = profile.shared_memory_per_block
        self.L2_cache_size = profile.l2_cache_bytes
        self.clock_rate = int(profile.clock_ghz * 1e6)  # kHz, as CUDA reports it
        self.gcnArchName = profile.gcn_arch_name
        self.uuid = visible_devices.gpu_uuid(node_gpu, int(os.environ.get("MIRAGE_NODE_RANK", "0")))
        self.pci_bus_id = visible_devices.pci_bus(node_gpu)
        self.pci_device_id = 0
        self.pci_domain_id = 0

    def __repr__(self) -> str:
        return (
            f"_CudaDeviceProperties(name='{self.name}', major={self.major}, minor={self.minor}"
            + (f", gcnArchName='{self.gcnArchName}'" if self.gcnArchName != "NVIDIA CUDA" else "")
            + f", total_memory={self.total_memory // 2**20}MB, multi_processor_count="
            f"{self.multi_processor_count}, uuid={self.uuid}, pci_bus_id={self.pci_bus_id}, "
            f"pci_device_id={self.pci_device_id}, pci_domain_id={self.pci_domain_id}, "
            f"L2_cache_size={self.L2_cache_size // 2**20}MB)"
        )


def _make_stream_and_event(torch: ModuleType, is_amd: bool) -> tuple[type, type, type]:
    """torch.cuda.Stream / ExternalStream / Event over the generic torch.Stream / torch.Event,
    which the shim's device guard already serves."""
    # What torch's CUDAStream::priority_range() reports: 0 down to the runtime's greatest
    # priority, capped at torch's 4 priority pools (CUDA gives -5, so -3; HIP gives -1).
    least, greatest = (0, -1) if is_amd else (0, -3)

    class Stream(torch.Stream):
        """A stream on an emulated GPU. Work is synchronous, so every stream is always idle."""

        def __new__(cls, device=None, priority=0, **kwargs):
            priority = min(max(priority, greatest), least)  # CUDA maps it to the nearest valid one
            if "stream_id" in kwargs:
                stream = super().__new__(cls, priority=priority, **kwargs)
            else:
                index = torch.cuda._utils._get_device_index(device, optional=True)
                stream = super().__new__(cls, device=torch.device("cuda", index), priority=priority)
            stream._priority = priority
            return stream

        @property
        def priority(self) -> int:
            return getattr(self, "_priority", 0)

        @staticmethod
        def priority_range() -> tuple[int, int]:
            return least, greatest

        @property
        def cuda_stream(self) -> int:
            return self.stream_id

        def wait_event(self, event) -> None:
            event.wait(self)

        def wait_stream(self, stream) -> None:
            self.wait_event(stream.record_event())

        def record_event(self, event=None):
            event = Event() if event is None else event
            event.record(self)
            return event

    class Event:
        """An event on an emulated GPU: records host time, so elapsed_time is wall time.

        Wraps a generic torch.Event rather than subclassing it: torch.Event.elapsed_time
        accepts only exact torch.Event instances."""

        def __init__(self, enable_timing=False, blocking=False, interprocess=False, external=False):
            self._event = torch.Event(
                device=torch.device("cuda", torch.cuda.current_device()),
                enable_timing=enable_timing, blocking=blocking, interprocess=interprocess,
            )

        @property
        def device(self):
            return self._event.device

        def record(self, stream=None) -> None:
            self._event.record(torch.cuda.current_stream() if stream is None else stream)

        def wait(self, stream=None) -> None:
            self._event.wait(torch.cuda.current_stream() if stream is None else stream)

        def query(self) -> bool:
            return self._event.query()

        def synchronize(self) -> None:
            self._event.synchronize()

        def elapsed_time(self, end_event) -> float:
            return self._event.elapsed_time(end_event._event)

    class ExternalStream(Stream):
        """A stream another library allocated (its handle is kept as `cuda_stream`); like every
        emulated stream it runs work at once."""

        def __new__(cls, stream_ptr, device=None, **kwargs):
            stream = super().__new__(cls, device=device)
            stream._handle = int(stream_ptr)
            return stream

        @property
        def cuda_stream(self) -> int:
            return self._handle

    return Stream, ExternalStream, Event


def _allow_device_storages(torch: ModuleType) -> None:
    """`torch.UntypedStorage(n, device="cuda")` and `.resize_()` of a device storage are
    compiled out of a CPU build; storage.cuda(), checkpoint loading and FSDP call them. Route
    them through a device tensor and the shim (same allocator, same accounting)."""
    storage_class = torch.UntypedStorage
    base_new = storage_class.__new__

    def new(cls, *args, device=None, **kwargs):
        if device is not None and torch.device(device).type == "cuda":
            content = args[0] if args else 0
            if isinstance(content, int):
                tensor = torch.empty(content, dtype=torch.uint8, device=device)
            else:
                tensor = torch.tensor(list(content), dtype=torch.uint8, device=device)
            return tensor.untyped_storage()
        if device is not None:
            kwargs["device"] = device
        return base_new(cls, *args, **kwargs)

    storage_class.__new__ = new
    base_resize = storage_class.resize_

    def resize_(self, size: int):
        if self.device.type != "cuda":
            return base_resize(self, size)
        holder = torch.empty(0, dtype=torch.uint8, device=self.device).set_(self)
        torch.ops.mirage.resize_storage_bytes_(holder, size)
        return self

    storage_class.resize_ = resize_


def install(torch: ModuleType) -> None:
    """Completes torch.cuda for the emulated devices. Called once, right after `import torch`.
    A dispatch mode torch enabled during its import (TORCH_CUDA_SANITIZER=1 enables the CUDA
    Sanitizer's) does not see the operators this calls: they are the device's set-up, not the
    program's work, and the mode would ask torch.cuda for streams before it is complete."""
    from torch.utils._python_dispatch import _disable_current_modes

    with _disable_current_modes():
        _install(torch, _disable_current_modes)


def _install(torch: ModuleType, _disable_current_modes: Callable) -> None:
    profile = profiles.load(os.environ["MIRAGE_PROFILE"])
    visible = [int(gpu) for gpu in os.environ.get("MIRAGE_VISIBLE_GPUS", "").split(",") if gpu]  # see boot.py
    count = len(visible)
    C = torch._C
    cuda = torch.cuda

    torch.version.hip = _HIP_VERSION if profile.is_amd else None
    torch.version.cuda = None if profile.is_amd else _CUDA_VERSION
    # A GPU wheel's version names its toolkit where the CPU wheel's says +cpu: 2.13.0+cu128 (PyPI's
    # and download.pytorch.org's CUDA 12.8 wheels), 2.13.0+rocm7.0. The package metadata keeps +cpu.
    toolkit = "rocm" + ".".join(_HIP_VERSION.split(".")[:2]) if profile.is_amd else "cu" + _CUDA_VERSION.replace(".", "")
    torch.__version__ = torch.version.__version__ = type(torch.__version__)(
        torch.__version__.split("+")[0] + "+" + toolkit)
    C._has_cuda = True  # torch.backends.cuda.is_built(): true on CUDA and ROCm builds alike

    def stream_tuple(stream) -> tuple[int, int, int]:
        return (stream.stream_id, stream.device_index, stream.device_type)

    def set_stream(stream_id: int, device_index: int, device_type: int) -> None:
        C._accelerator_setStream(
            torch.Stream(stream_id=stream_id, device_index=device_index, device_type=device_type)
        )

    def synchronize() -> None:
        """The host waits for the current device: in clocked mode its predicted work (work is
        done once issued); refused while a CUDA graph is captured, as on a GPU."""
        torch.ops.mirage.graph_check_not_capturing()
        torch.ops.mirage.clock_synchronize()

    def cuda_init() -> None:
        """torch._C._cuda_init: the allocator's configuration checked (PYTORCH_CUDA_ALLOC_CONF), and
        CUDA_MODULE_LOADING set to LAZY where the user left it unset (CUDAHooks::init, on CUDA and
        ROCm builds alike: collect_env reports it)."""
        torch.ops.mirage.apply_allocator_config()
        os.environ.setdefault("CUDA_MODULE_LOADING", "LAZY")

    bindings = {
        "_cuda_getDeviceCount": lambda: count,
        "_cuda_getDevice": C._accelerator_getDeviceIndex,
        "_cuda_setDevice": C._accelerator_setDeviceIndex,
        "_cuda_exchangeDevice": C._accelerator_exchangeDevice,
        "_cuda_maybeExchangeDevice": C._accelerator_maybeExchangeDevice,
        "_cuda_init": cuda_init,
        "_cuda_isInBadFork": lambda: False,  # host memory survives fork
        "_cuda_getArchFlags": lambda: profile.arch,
        "_cuda_getCompiledVersion": lambda: 70051831 if profile.is_amd else 12080,
        "_cuda_synchronize": synchronize,
        "_cuda_emptyCache": C._accelerator_emptyCache,
        "_cuda_memoryStats": C._accelerator_getDeviceStats,
        "_cuda_resetPeakMemoryStats": C._accelerator_resetPeakStats,
        "_cuda_resetAccumulatedMemoryStats": C._accelerator_resetAccumulatedStats,
        "_cuda_getCurrentStream": lambda index: stream_tuple(C._accelerator_getStream(index)),
        "_cuda_getDefaultStream": lambda index: (0, index, _CUDA_DEVICE_TYPE),
        "_cuda_setStream": set_stream,
        "_cuda_getCurrentRawStream": lambda index: C._accelerator_getStream(index).stream_id,
        "_cuda_canDeviceAccessPeer": lambda a, b: True,
        "_cuda_get_sync_debug_mode": lambda: 0,
        "_cuda_set_sync_debug_mode": lambda mode: None,
    }
    # torch._C's functions are built-ins: a Python profiler sees a call of one, not mirage's code
    # (unprofiled.py).
    for name, fn in bindings.items():
        setattr(C, name, unprofiled(fn, name) if isinstance(fn, FunctionType) else fn)

    properties = [DeviceProperties(profile, node_gpu) for node_gpu in visible]
    cuda._CudaDeviceProperties = DeviceProperties
    cuda._get_device_properties = unprofiled(lambda index: properties[index], "_get_device_properties")
    cuda._exchange_device = C._accelerator_exchangeDevice
    cuda._maybe_exchange_device = C._accelerator_maybeExchangeDevice
    cuda.default_generators = tuple(torch.ops.mirage.default_generator(i) for i in range(count))
    cuda.has_magma = False

    def lazy_init() -> None:
        """torch's _lazy_init insists on libcudart; ours checks the allocator's configuration
        and replays queued calls (seeds)."""
        if cuda._initialized or hasattr(cuda._tls, "is_initializing"):
            return
        with cuda._initialization_lock:
            if cuda._initialized:
                return
            # The allocator's configuration check is an operator: a dispatch mode active now (the
            # CUDA Sanitizer's) would see it and ask for the current stream, re-entering this
            # function under the lock. Initialisation is not the program's work: no mode sees it.
            with _disable_current_modes():
                C._cuda_init()
            cuda._tls.is_initializing = True
            calls = list(cuda._queued_calls)
            calls.extend(c for c in cuda._lazy_seed_tracker.get_calls() if c)
            try:
                for queued_call, _ in calls:
                    queued_call()
            finally:
                del cuda._tls.is_initializing
            cuda._initialized = True

    # torch.cuda.random and .memory imported torch's _lazy_init by name: they get ours too, or
    # get_rng_state() as the first CUDA call of a process would insist on libcudart. Only
    # torch.cuda's own submodules do (modules imported later find ours on torch.cuda); looking
    # through all of sys.modules would touch ~2,000 modules, whose pages a child of the fork
    # server would then copy (10 ms and 8 MB a rank).
    torchs_lazy_init, initialise = cuda._lazy_init, unprofiled(lazy_init, "_lazy_init")
    for module in [cuda, *(value for value in vars(cuda).values() if isinstance(value, ModuleType))]:
        if module.__name__.startswith("torch.cuda") and vars(module).get("_lazy_init") is torchs_lazy_init:
            module._lazy_init = initialise
    cuda.device_count = unprofiled(lambda: count, "device_count")

    def mem_get_info(device=None) -> tuple[int, int]:
        """Free and total bytes of the device, as cudaMemGetInfo reports them."""
        return C._accelerator_getMemoryInfo(cuda._utils._get_device_index(device, optional=True))

    cuda.mem_get_info = cuda.memory.mem_get_info = unprofiled(mem_get_info)

    _allow_device_storages(torch)

    Stream, ExternalStream, Event = _make_stream_and_event(torch, profile.is_amd)
    cuda.Stream = cuda.streams.Stream = Stream
    cuda.ExternalStream = cuda.streams.ExternalStream = ExternalStream
    cuda.Event = cuda.streams.Event = Event

    autograd_threads.install(torch)
    nvtx.install(torch)
    cuda_comm.install(torch)
    device_queries.install(torch, profile)
    cuda_runtime.install(torch, profile)
    cuda_memory.install(torch)
    cudnn.install(torch, profile.is_amd)
    build_config.install(torch, profile, _CUDA_VERSION, _HIP_VERSION)
    cuda_graphs.install(torch)
    if not profile.is_amd:
        green_contexts.install(torch, profile.compute_units)
    cuda_ipc.install(torch)
    legacy_tensor_types.install(torch)
    distributed.install(torch)
    inductor.install(torch)
    import_hooks.after_import("triton.runtime.driver", lambda module: triton_driver.install(torch, profile, module))
    timing.install(torch)
    gpu_profiler.install(torch, profile, properties)
    races.install(torch)
