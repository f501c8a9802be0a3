// Sparse and nested tensors on the emulated device (sparse_and_nested.cpp): tensors that hold their
// data in member tensors rather than in one strided view of a storage. A CUDA build keeps those
// members in device memory: a sparse COO tensor its indices and values, a compressed one (CSR,
// CSC, BSR, BSC) its compressed and plain indices and values, a nested tensor (torch.nested's
// strided layout) one storage that its components' sizes, strides and offsets (host metadata)
// carve. It has SparseCUDA, SparseCsrCUDA and NestedTensorCUDA kernels for the ops that have
// SparseCPU, SparseCsrCPU and NestedTensorCPU ones. The op path runs those ops as it runs dense
// ones: each device argument of these kinds becomes a host tensor of its kind over CPU views of
// its members (no copy), the CPU twin's kernel runs, and such a result goes back as a device
// tensor over device members, which the allocator model counts as any device memory.
#pragma once

#include "config.h"

#include <ATen/core/Tensor.h>
#include <c10/core/DispatchKeySet.h>
#include <c10/util/SmallVector.h>

#include <vector>

namespace mirage {

inline bool is_sparse_layout(const at::Tensor& t) {
  if (!t.defined()) return false;
  const c10::Layout layout = t.layout();
  return layout == c10::kSparse || layout == c10::kSparseCsr || layout == c10::kSparseCsc ||
         layout == c10::kSparseBsr || layout == c10::kSparseBsc;
}

// A sparse or nested tensor: one whose data is in member tensors.
inline bool has_members(const at::Tensor& t) { return is_sparse_layout(t) || (t.defined() && t.is_nested()); }

// Its members as it holds them, without dispatching an op (`_indices()` on a device tensor would
// enter the op path): COO {indices, values}; compressed {compressed indices, plain indices,
// values}; nested {its whole storage as a 1-D tensor}.
using Members = c10::SmallVector<at::Tensor, 3>;
Members members_of(const at::Tensor& t);

// A tensor of `like`'s kind (layout, sizes, COO dims and coalesced flag, nested metadata) over
// `members`, on their device (a host or a device tensor).
at::Tensor over_members(const at::Tensor& like, const Members& members);

// What a host view held when it was made, to tell whether a kernel wrote into it (an argument
// passed twice has two views, of which one may be written: `s.add_(s)`). A nested tensor's
// kernels write into its storage, which its view shares, and never change its metadata.
struct Snapshot {
  Members members;
  std::vector<int64_t> sizes;
  bool coalesced;
};
Snapshot snapshot(const at::Tensor& t);
bool written_since(const at::Tensor& t, const Snapshot& before);

// After a kernel wrote into the host view `written` of the device sparse tensor `orig` (in place
// or out=: a new nnz, new sizes, a coalesced flag), makes `orig` hold the same over the device
// `members` (the view's own, mapped back).
void sync_members_back(const at::Tensor& orig, const at::Tensor& written, const Members& members);

// The CPU build's key whose kernel runs for a call dispatched with `keys`: SparseCPU for a
// SparseCUDA kernel, SparseCsrCPU for a SparseCsrCUDA one, NestedTensorCPU for a NestedTensorCUDA
// one, else CPU.
c10::DispatchKey host_key(c10::DispatchKeySet keys);

}  // namespace mirage
