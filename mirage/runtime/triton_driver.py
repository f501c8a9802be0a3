"""Triton's driver on an emulated GPU: what `triton.runtime.driver.active` answers on a real box.

Triton picks its driver by vendor (torch.version.cuda or .hip), and the vendor's driver loads
libcuda or libamdhip64 when it is created. A machine with no GPU has neither, so every
torch.compile on an NVIDIA profile failed once the triton package was installed: inductor's
cache key (torch.utils._triton.triton_hash_with_backend) asks the driver for its target, and
Triton's CUDA driver asserts that libcuda exists, an AssertionError inductor does not expect.
User code that sizes its kernels from the driver (`driver.active.get_current_target()`,
`driver.active.utils.get_device_properties(i)["multiprocessor_count"]`) failed on every
profile.

So the vendor's own driver class is kept, with its utilities (the C module that would load the
vendor's library) replaced by the emulated device's answers, taken from torch.cuda (itself the
profile's). mirage runs Triton kernels in Triton's interpreter (TRITON_INTERPRET=1, set by
`mirage run`), which needs no driver to launch; a compiled GPU binary cannot run on an
emulated device, and asking to load or launch one says so.
"""

from __future__ import annotations

import os
from types import ModuleType
from typing import Any

from mirage import profiles

# The backend Triton would pick on the real box, by vendor.
_BACKEND = {"nvidia": "nvidia", "amd": "amd"}


class EmulatedDeviceUtils:
    """What the vendor driver's C utilities answer, for an emulated GPU."""

    def __init__(self, torch: ModuleType, profile: profiles.Profile) -> None:
        self._torch = torch
        self._profile = profile

    def get_device_properties(self, device: int) -> dict[str, Any]:
        """The dict Triton's driver reads from the vendor's runtime (cudaDeviceProp/hipDeviceProp)."""
        props = self._torch.cuda.get_device_properties(device)
        properties = {
            "max_shared_mem": props.shared_memory_per_block,
            "max_num_regs": props.regs_per_multiprocessor,
            "multiprocessor_count": props.multi_processor_count,
            "warpSize": props.warp_size,
            "sm_clock_rate": props.clock_rate,
            "mem_clock_rate": self._profile.memory_clock_khz,
            "mem_bus_width": self._profile.memory_bus_width_bits,
        }
        if self._profile.is_amd:
            properties["arch"] = props.gcnArchName
        return properties

    def get_device_capability(self, device: int) -> tuple[int, int]:
        return self._torch.cuda.get_device_capability(device)

    def get_current_device(self) -> int:
        return self._torch.cuda.current_device()

    def set_current_device(self, device: int) -> None:
        self._torch.cuda.set_device(device)

    def __getattr__(self, name: str) -> Any:
        """Loading, launching or describing a GPU binary (load_binary, launch, TMA descriptors...)."""
        if name.startswith("__"):
            raise AttributeError(name)
        raise _no_gpu_binaries(f"Triton's driver utility {name!r}")


def _no_gpu_binaries(what: str) -> RuntimeError:
    return RuntimeError(
        f"{what} needs a compiled GPU binary, which an emulated GPU cannot run: mirage runs Triton kernels in "
        f"Triton's interpreter, and TRITON_INTERPRET is {os.environ.get('TRITON_INTERPRET')!r} here. "
        "Fix: leave TRITON_INTERPRET unset (mirage run sets it to 1)")


def _refused_launcher(*args: Any, **kwargs: Any) -> Any:
    raise _no_gpu_binaries("launching a compiled Triton kernel")


def _emulated_driver(torch: ModuleType, profile: profiles.Profile) -> Any:
    """An instance of the vendor's driver class whose utilities are the emulated device's."""
    from triton.backends import backends

    vendor_driver = backends[_BACKEND[profile.vendor]].driver

    class EmulatedDriver(vendor_driver):
        def __init__(self) -> None:
            # GPUDriver's part: current device, stream and capability from torch.cuda. The
            # vendor's part would load its runtime library; its launcher class is kept.
            super(vendor_driver, self).__init__()
            self.utils = EmulatedDeviceUtils(torch, profile)
            self.launcher_cls = _refused_launcher

        @staticmethod
        def is_active() -> bool:
            return True

    EmulatedDriver.__name__ = EmulatedDriver.__qualname__ = vendor_driver.__name__
    return EmulatedDriver()


def install(torch: ModuleType, profile: profiles.Profile, driver_module: ModuleType) -> None:
    """Makes the emulated device's driver the one `triton.runtime.driver` creates, unless the
    program names another backend (TRITON_DEFAULT_BACKEND), which Triton's own choice serves."""
    triton_choice = driver_module._create_driver

    def create_driver() -> Any:
        if os.environ.get("TRITON_DEFAULT_BACKEND", _BACKEND[profile.vendor]) != _BACKEND[profile.vendor]:
            return triton_choice()
        return _emulated_driver(torch, profile)

    driver_module._create_driver = create_driver
