// CPU views of device memory, and device tensors over CPU results: how the op path hands device
// memory to PyTorch's CPU kernels without copying, and how their results become device memory.
#pragma once

#include "config.h"

#include <ATen/core/Tensor.h>

namespace mirage {

// A CPU tensor over the same bytes as `t` (same geometry, same offset), for CPU kernels. Its
// storage is resizable with the CPU allocator so that out= kernels may grow it; the op path
// notices (sync_back) and moves the grown bytes back into device memory.
at::Tensor cpu_alias(const at::Tensor& t);
// Keeps `alias` for the next cpu_alias if nothing but the caller holds it.
void recycle_alias(at::Tensor&& alias);
// A device tensor with `geometry`'s sizes/strides/offset/dtype on `storage`.
at::Tensor on_storage(c10::Storage storage, const at::Tensor& geometry);
// A device storage over a fresh CPU result's bytes, the CPU storage kept alive inside it.
c10::Storage adopt_storage(const c10::Storage& cpu, DeviceIndex dev);
// The allocator model's block of a kernel's result adopted as device memory (null: not one).
struct CachedBlock;
const CachedBlock* adopted_block(const c10::DataPtr& data);
// Re-labels a kernel's fresh CPU result as a device tensor in place; false: not possible.
bool relabel_in_place(at::Tensor& out, DeviceIndex dev);
// After a CPU kernel wrote into `alias` (in-place or out=), make `orig` reflect any resize.
void sync_back(const at::Tensor& orig, const at::Tensor& alias);

}  // namespace mirage
