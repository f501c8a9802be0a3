// The dtypes a CUDA build's kernels take, where they differ from a CPU build's (cuda_dtypes.cpp).
//
// The op path runs the CPU build's kernel of an op, whose dtype dispatch is the CPU's: a CPU
// kernel may take a dtype the CUDA kernel lacks (an integer or float8 matmul: a GPU raises
// `"addmm_cuda" not implemented for 'Char'`) or lack one the CUDA kernel takes (a float16 FFT,
// a bfloat16 3-D average pool, complex32 arithmetic: the CPU raises in its own words, naming a
// CPU kernel). For the ops op_db lists with such a difference, a device tensor of those dtypes
// now meets the CUDA kernel's behaviour: the CUDA kernel's error, or the CPU kernel run one dtype
// wider (float for float16 and bfloat16, complex64 for complex32) and its results rounded back,
// as the CUDA kernels compute those dtypes in float ("opmath") and store them rounded.
// tests/emulated/test_cuda_dtypes.py checks the table against op_db's CUDA dtypes.
#pragma once

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>

#include <cstdint>

namespace mirage {

struct CudaDtypes;

// The entry of the operator `schema` names, or null (most ops: the CPU kernel's dtypes are the
// CUDA kernel's).
const CudaDtypes* cuda_dtypes_of(const c10::FunctionSchema& schema);

// Raises as a CUDA build does where the CUDA kernel refuses the call's dtype (or, for a float16
// FFT, its signal sizes); true where the CPU kernel must run one dtype wider (run_widened).
// `args` are the op's arguments (device tensors or their CPU aliases: only dtypes and sizes are read).
bool check_cuda_dtypes(const CudaDtypes& entry, const c10::OperatorHandle& op, const c10::IValue* args,
                       uint32_t num_args);

// Whether a call whose first tensor has `dtype` takes the entry's boxed check (the unboxed hot
// ops ask this before taking their fast path).
bool needs_cuda_dtype_check(const CudaDtypes* entry, c10::ScalarType dtype);

// Runs the CPU kernel (`key`) of `op` on the stack's arguments (CPU aliases) with the widened
// dtypes, writes written arguments back in their own dtype and rounds results back.
void run_widened(const CudaDtypes& entry, const c10::OperatorHandle& op, c10::DispatchKey key,
                 torch::jit::Stack* stack);

}  // namespace mirage
