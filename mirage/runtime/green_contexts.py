"""torch.cuda.green_contexts on an NVIDIA profile: what a cu128 build of torch 2.13 has.

A CUDA 12.8 build on an R570 driver has green contexts (`torch._C._CUDAGreenContext`, CUDA's
cuGreenCtxCreate: a context holding a share of the SMs, with its own default stream), and
PyTorch's own test gate for them (common_cuda.PLATFORM_SUPPORTS_GREEN_CONTEXT: CUDA >= 12.8 and
a driver >= 570, read from nvidia-smi) says so on such a box; a CPU build, so the device before
this, raised "PyTorch was not built with Green Context support!". A ROCm build has none, so AMD
profiles keep that error.

Each green context here keeps what torch's C++ class keeps (aten/src/ATen/cuda/
CUDAGreenContext.cpp) and checks what it checks, with its messages: the SM count against the
device's, a workqueue configuration refused as a CUDA 12.8 build refuses it (it needs CUDA
13.1), set_context making the context's default stream current and pop_context restoring the
parent's, Stream() handing out side streams. Work issued in a green context runs as any other
on the emulated device, and clocked mode times it on the whole GPU, not on the context's SMs.
"""

from __future__ import annotations

from types import ModuleType

_WORKQUEUE_NEEDS = "Workqueue configuration for green contexts requires CUDA 13.1+!"


def install(torch: ModuleType, compute_units: int) -> None:
    """Gives torch the C++ class a cu128 build has and points torch.cuda.green_contexts at it."""

    class CUDAGreenContext:
        """torch._C._CUDAGreenContext on an emulated NVIDIA GPU."""

        @staticmethod
        def create(*, device_id: int | None = None, num_sms: int | None = None, workqueue_scope=None,
                   workqueue_concurrency_limit: int | None = None) -> CUDAGreenContext:
            if num_sms is None and workqueue_scope is None:
                raise RuntimeError("At least one of num_sms or workqueue_scope must be specified")
            if workqueue_concurrency_limit is not None and workqueue_scope is None:
                raise RuntimeError("workqueue_concurrency_limit requires workqueue_scope to be set")
            device = torch.cuda.current_device() if device_id is None else device_id
            if num_sms is not None and not 0 < num_sms <= compute_units:
                raise RuntimeError(f"Invalid number of SMs requested for green context: {num_sms} "
                                   f"(device has {compute_units} SMs)")
            if workqueue_scope is not None:
                raise RuntimeError(_WORKQUEUE_NEEDS)
            return CUDAGreenContext(device)

        @staticmethod
        def max_workqueue_concurrency(device_id: int | None = None) -> int:
            raise RuntimeError("Workqueue configuration requires CUDA 13.1+!")

        def __init__(self, device: int) -> None:
            self._device = device
            self._default_stream = torch.cuda.Stream(device)  # a green context's own, non-blocking
            self._parents: list = []

        def set_context(self) -> None:
            self._parents.append(torch.cuda.current_stream(self._device))
            torch.cuda.set_stream(self._default_stream)

        def pop_context(self) -> None:
            if not self._parents:
                raise RuntimeError("expected popped context to be the current ctx")
            torch.cuda.set_stream(self._parents.pop())

        def Stream(self):  # noqa: N802 - torch's name
            return torch.cuda.Stream(self._device)

    torch._C._CUDAGreenContext = CUDAGreenContext
    torch.cuda.green_contexts._GreenContext = CUDAGreenContext
    torch.cuda.green_contexts.SUPPORTED = True
