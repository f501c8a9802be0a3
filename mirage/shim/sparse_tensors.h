// Sparse tensors on the emulated device (sparse_tensors.cpp): COO (SparseCUDA) and the compressed
// layouts CSR, CSC, BSR and BSC (SparseCsrCUDA). A CUDA build keeps a sparse tensor's members
// (COO: indices and values; compressed: compressed indices, plain indices and values) as dense
// device tensors inside it, and has SparseCUDA / SparseCsrCUDA kernels for the ops that have
// SparseCPU / SparseCsrCPU ones. The op path runs those ops as it runs dense ones: each device
// sparse argument becomes a host sparse tensor over CPU views of its members (no copy), the CPU
// twin's kernel runs, and a sparse result goes back as a device sparse tensor over device members,
// which the allocator model counts as any device memory.
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

// A sparse tensor's members as it holds them, without dispatching an op (`_indices()` on a
// device tensor would enter the op path): COO {indices, values}; compressed {compressed indices,
// plain indices, values}.
using SparseMembers = c10::SmallVector<at::Tensor, 3>;
SparseMembers sparse_members(const at::Tensor& sparse);

// A sparse tensor of `like`'s layout, sizes and (COO) dims and coalesced flag over `members`, on
// their device (a host or a device sparse tensor).
at::Tensor sparse_over(const at::Tensor& like, const SparseMembers& members);

// What a host view held when it was made, to tell whether a kernel wrote into it (an argument
// passed twice has two views, of which one may be written: `s.add_(s)`).
struct SparseSnapshot {
  SparseMembers members;
  std::vector<int64_t> sizes;
  bool coalesced;
};
SparseSnapshot snapshot(const at::Tensor& sparse);
bool written_since(const at::Tensor& sparse, const SparseSnapshot& before);

// After a kernel wrote into the host view `written` of the device tensor `orig` (in place or
// out=: a new nnz, new sizes, a coalesced flag), makes `orig` hold the same over the device
// `members` (the view's own, mapped back).
void sparse_sync_back(const at::Tensor& orig, const at::Tensor& written, const SparseMembers& members);

// The CPU build's key whose kernel runs for a call dispatched with `keys`: SparseCPU for a
// SparseCUDA kernel, SparseCsrCPU for a SparseCsrCUDA one, else CPU.
c10::DispatchKey host_key(c10::DispatchKeySet keys);

}  // namespace mirage
