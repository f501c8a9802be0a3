"""torch.__config__.show() as a CUDA or ROCm build of torch 2.13 prints it.

ATen's show_config asks the CUDA hooks for their lines whenever a GPU is present; a CPU build's
hooks have none to give and raise ("Cannot query detailed CUDA version without ATen_cuda
library"), so under mirage torch.__config__.show() raised, and with it torch.utils.collect_env
and PyTorch's own test helpers (common_cuda's Magma probe, which op_db's linear-algebra samples
call). The shim's hooks return the lines set here (hooks.cpp), and the build settings read as a
GPU build's: USE_CUDA / USE_ROCM on, the toolkit and cuDNN versions, NCCL on. No Magma line:
mirage reports torch.cuda.has_magma False, and linear algebra on the device is the CPU's.
"""

from __future__ import annotations

import re
from types import ModuleType

from mirage.runtime import cudnn
from mirage.runtime.unprofiled import unprofiled

# cuDNN 9.10.2's wheel (nvidia-cudnn-cu12) is built against CUDA 12.9: a cu128 build of torch
# prints "CuDNN 91.0.2  (built against CUDA 12.9)".
_CUDNN_BUILT_AGAINST_CUDA = "12.9"


def hook_lines(profile, cuda_version: str, hip_version: str) -> str:
    """The CUDA hooks' part of the listing (ATen's CUDAHooks::showConfig)."""
    if profile.is_amd:
        major, minor, patch = cudnn.MIOPEN_VERSION
        return f"  - HIP Runtime {hip_version.split('-')[0]}\n  - MIOpen {major}.{minor}.{patch}\n"
    compute = profile.arch.removeprefix("sm_")
    major, minor, patch = cudnn.CUDNN_VERSION
    version = major * 10000 + minor * 100 + patch  # cudnnGetVersion, printed as v/1000 . v/100%10 [. v%100]
    cudnn_text = f"{version // 1000}.{version // 100 % 10}" + (f".{version % 100}" if version % 100 else "")
    return (f"  - CUDA Runtime {cuda_version}\n"
            f"  - NVCC architecture flags: -gencode;arch=compute_{compute},code=sm_{compute}\n"
            f"  - CuDNN {cudnn_text}  (built against CUDA {_CUDNN_BUILT_AGAINST_CUDA})\n")


def _gpu_build_settings(listing: str, settings: dict[str, str]) -> str:
    """The listing with its "Build settings" line's keys set as `settings` says (the line lists
    caffe2's build options, a std::map, so in key order)."""
    def rewrite(match: re.Match) -> str:
        options = dict(pair.split("=", 1) for pair in re.split(r", (?=[A-Z0-9_]+=)", match.group(1)))
        options.update(settings)
        return "  - Build settings: " + ", ".join(f"{key}={options[key]}" for key in sorted(options)) + ","
    return re.sub(r"  - Build settings: (.*),", rewrite, listing, count=1)


def install(torch: ModuleType, profile, cuda_version: str, hip_version: str) -> None:
    """Gives the shim's CUDA hooks their lines and torch._C._show_config a GPU build's settings."""
    torch.ops.mirage.set_cuda_build_config(hook_lines(profile, cuda_version, hip_version))
    if profile.is_amd:
        settings = {"USE_ROCM": "ON", "USE_NCCL": "1"}
    else:
        major, minor, patch = cudnn.CUDNN_VERSION
        settings = {"USE_CUDA": "ON", "USE_CUDNN": "ON", "USE_NCCL": "1", "USE_CUSPARSELT": "1",
                    "CUDA_VERSION": cuda_version, "CUDNN_VERSION": f"{major}.{minor}.{patch}"}
    cpu_build_listing = torch._C._show_config
    torch._C._show_config = unprofiled(lambda: _gpu_build_settings(cpu_build_listing(), settings), "_show_config")
