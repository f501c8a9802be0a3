"""torch.backends.cudnn as a CUDA or ROCm build of torch 2.13 answers it: available, with the
cuDNN (NVIDIA) or MIOpen (AMD) version such a build ships, and every flag settable and read back.

A CPU build has no torch._C._cudnn and _has_cudnn is False, so RNNs warn that PyTorch "was
compiled without cuDNN/MIOpen" and code that checks for cuDNN takes other paths. The emulated
device has no cuDNN kernels: ATen's own backend choice (conv, batch norm, RNN, CTC) still picks the
native kernels, whose numerics are the CPU's, as a GPU build does with cudnn.enabled = False.
"""

from types import ModuleType, SimpleNamespace

# cuDNN 9.10.2 is what torch's CUDA 12.8 wheels pin (nvidia-cudnn-cu12); ROCm 7.0 ships MIOpen
# 3.5.0. getVersionInt's encodings: cuDNN major*10000 + minor*100 + patch, MIOpen the same.
CUDNN_VERSION = (9, 10, 2)
MIOPEN_VERSION = (3, 5, 0)


def install(torch: ModuleType, amd: bool) -> None:
    """Gives torch._C a _cudnn module and points torch.backends.cudnn at it."""
    major, minor, patch = MIOPEN_VERSION if amd else CUDNN_VERSION
    version_int = major * 10000 + minor * 100 + patch
    binding = SimpleNamespace(
        getVersionInt=lambda: version_int,
        getRuntimeVersion=lambda: (major, minor, patch),
        getCompileVersion=lambda: (major, minor, patch),
        is_cuda=not amd,
    )
    C = torch._C
    C._cudnn = binding
    C._has_cudnn = True
    # The cuDNN settings a CPU build lacks: the benchmark limit (cudnn.flags() saves and restores
    # it) and inductor's switch for the conv benchmark cache; each keeps what it is given.
    settings = {"benchmark_limit": 10, "conv_benchmark_empty_cache": True}
    C._cuda_get_cudnn_benchmark_limit = lambda: settings["benchmark_limit"]
    C._cuda_set_cudnn_benchmark_limit = lambda limit: settings.update(benchmark_limit=int(limit))
    C._cudnn_set_conv_benchmark_empty_cache = lambda enable: settings.update(conv_benchmark_empty_cache=bool(enable))
    C._cuda_get_conv_benchmark_empty_cache = lambda: settings["conv_benchmark_empty_cache"]
    # torch.backends.cudnn.benchmark_limit is a property only where cuDNN was found at import
    type(torch.backends.cudnn).benchmark_limit = torch.backends.ContextProp(
        C._cuda_get_cudnn_benchmark_limit, C._cuda_set_cudnn_benchmark_limit)
    # torch.backends.cudnn chose its _init when it was imported (a CPU build: "return False");
    # its functions read the module's globals, so they see these.
    cudnn_globals = torch.backends.cudnn.version.__globals__
    cudnn_globals["_cudnn"] = binding

    def init() -> bool:
        cudnn_globals["__cudnn_version"] = version_int
        return True

    cudnn_globals["_init"] = init
