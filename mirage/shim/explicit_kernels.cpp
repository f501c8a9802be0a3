// Kernels of the emulated device's own, where the op path's CPU kernel is not what a CUDA build
// does: allocation (empty), copies between host and device, set_ with storages, dropout with the
// device's generator, autocast's half-to-float softmax, and the choices of backend (convolution,
// CTC loss) a CUDA build makes differently.
#include "as_one_kernel.h"
#include "faults.h"
#include "device_guard.h"
#include "device_memory.h"
#include "generators.h"
#include "graph_capture.h"
#include "host_views.h"
#include "op_path.h"
#include "busy_time.h"
#include "device_clock.h"
#include "op_cost.h"
#include "profiler_activities.h"
#include "race_checker.h"

#include <ATen/ATen.h>
#include <ATen/EmptyTensor.h>
#include <ATen/ops/as_strided_native.h>
#include <ATen/ops/resize_native.h>
#include <ATen/ops/view_native.h>
#include <ATen/ops/_reshape_alias_native.h>
#include <ATen/ops/copy.h>
#include <ATen/native/Resize.h>
#include <torch/library.h>

namespace mirage {

static DeviceIndex index_of(std::optional<c10::Device> device) {
  DeviceIndex d = (device && device->has_index()) ? device->index() : tl_device;
  check_index(d);
  return d;
}

static at::Tensor empty_memory_format(c10::IntArrayRef size, std::optional<at::ScalarType> dtype,
    std::optional<at::Layout>, std::optional<c10::Device> device, std::optional<bool>,
    std::optional<at::MemoryFormat> memory_format) {
  return at::detail::empty_generic(size, device_allocator(index_of(device)),
      c10::DispatchKeySet(c10::DispatchKey::CUDA), c10::dtype_or_default(dtype), memory_format);
}

static at::Tensor empty_strided(c10::IntArrayRef size, c10::IntArrayRef stride,
    std::optional<at::ScalarType> dtype, std::optional<at::Layout>, std::optional<c10::Device> device,
    std::optional<bool>) {
  return at::detail::empty_strided_generic(size, stride, device_allocator(index_of(device)),
      c10::DispatchKeySet(c10::DispatchKey::CUDA), c10::dtype_or_default(dtype));
}

// What CUDA runs for a copy within a device: a cudaMemcpyAsync where the two tensors have one
// dtype and one dense layout (Copy.cu's memcpy_eligible), else ATen's direct_copy_kernel_cuda, an
// elementwise kernel (a conversion, a strided or broadcast copy). The profiler shows the two
// apart, and a kernel hides communication beside it where a memcpy does not (device_clock.h).
static const char* device_copy_name(const at::Tensor& self, const at::Tensor& src) {
  const bool memcpy = self.scalar_type() == src.scalar_type() && self.is_conj() == src.is_conj() &&
                      self.is_neg() == src.is_neg() && self.is_non_overlapping_and_dense() &&
                      self.sizes().equals(src.sizes()) && self.strides().equals(src.strides());
  return memcpy ? "Memcpy DtoD" : "aten::copy_";
}

// Clocked mode: a copy is a kernel on the current stream of its device (the destination's, or
// the source's for a copy to the host), over the host link when it crosses it; the host waits
// for it unless it is non-blocking with pinned host memory, as cudaMemcpyAsync would.
static void clock_copy(const at::Tensor& self, const at::Tensor& src, bool non_blocking) {
  if (tl_kernel_depth > 0) return;
  const at::Tensor& on_device = self.is_cuda() ? self : src;
  const at::Tensor& host_side = self.is_cuda() ? src : self;
  const bool crosses_host = !self.is_cuda() || !src.is_cuda();
  const DeviceIndex dev = on_device.device().index();
  const int64_t bytes = static_cast<int64_t>(self.numel() * self.itemsize());
  // a device copy between dense tensors of one size and layout is a memcpy or a vectorized kernel; one
  // that transposes takes the general path (KernelTraffic's rule)
  KernelTraffic sides;
  sides.add(self);
  sides.add(src);
  const bool general = !crosses_host && sides.general;
  // a copy within the device reads and writes HBM, which a collective beside it shares
  const KernelCost within = device_copy_cost(bytes, general);
  const int64_t end = run_on_stream(dev, tl_stream[dev], crosses_host ? copy_cost_ns(bytes, true) : within.ns,
                                    crosses_host ? WorkKind::kCopy : WorkKind::kMemory, crosses_host ?
                                    (self.is_cuda() ? "Memcpy HtoD" : "Memcpy DtoH") : device_copy_name(self, src), bytes, 0,
                                    crosses_host ? nullptr : &within.beside);
  const bool async = non_blocking && host_side.is_pinned();
  if (crosses_host && !async) host_waits_for(end);
}

// Any direction between host and device, or between devices: the bytes are all host memory.
static at::Tensor& copy_(at::Tensor& self, const at::Tensor& src, bool non_blocking) {
  if (C10_UNLIKELY(g_fault_ops.load(std::memory_order_relaxed))) check_device_not_lost();  // --fault lose-gpu
  if (capturing()) {
    if (!self.is_cuda() || !src.is_cuda()) refuse_during_capture();  // a host copy syncs the stream
    record_step([into = graph_reference(self), from = graph_reference(src)]() mutable { into.copy_(from); });
    return self;
  }
  // --predict-only: a copy to the device moves no bytes unless they are integers (what steers the
  // program, README): device to device, and floating-point data from the host, whose values no
  // kernel would read (kernels run only on integer inputs) and the host reads back as 0. Its
  // pages of device memory stay untouched.
  // Inside a kernel mirage computes as ops (KernelScope) a copy of integers is made (what a fused
  // kernel's own steering reads, FlexAttention's block counts), one of floating-point data not.
  if (predict_only() && self.is_cuda() && (src.is_cuda() || is_phantom_dtype(self.scalar_type())) &&
      (tl_kernel_depth == 0 || is_phantom_dtype(self.scalar_type()))) {
    clock_copy(self, src, non_blocking);
    return self;
  }
  at::Tensor dst_cpu = self.is_cuda() ? cpu_alias(self) : self;
  if (predict_only() && !self.is_cuda() && src.is_cuda() && is_phantom_dtype(src.scalar_type()) &&
      tl_kernel_depth == 0) {  // device to host: phantom values read as the placeholder 0 (README)
    dst_cpu.zero_();
    clock_copy(self, src, non_blocking);
    return self;
  }
  at::Tensor src_cpu = src.is_cuda() ? cpu_alias(src) : src;
  const DeviceIndex dev = self.is_cuda() ? self.device().index() : src.is_cuda() ? src.device().index() : -1;
  const uint32_t launch = !timing() && dev >= 0 ? count_launch() : 0;  // (clocked mode: device_clock.cpp)
  const bool profiled = launch != 0 && profiling_device();  // torch.profiler's GPU side, host times
  const int64_t began = profiled ? profiler_wall_ns() : 0;
  {
    BusyTimer busy(dev);
    at::_ops::copy_::redispatch(c10::DispatchKeySet(c10::DispatchKey::CPU), dst_cpu, src_cpu, false);
  }
  if (profiled) {
    const char* direction = !self.is_cuda() ? "Memcpy DtoH" : src.is_cuda() ? device_copy_name(self, src) : "Memcpy HtoD";
    note_device_work(Interval{began, profiler_wall_ns(), direction, static_cast<int64_t>(self.numel() * self.itemsize()),
                              0, tl_stream[dev], WorkKind::kCopy, dev}, began, launch);
  }
  if (timing() && (self.is_cuda() || src.is_cuda())) clock_copy(self, src, non_blocking);
  if (C10_UNLIKELY(races::on()) && dev >= 0 && tl_kernel_depth == 0) {  // --check-races (race_checker.h)
    races::Kernel kernel(!self.is_cuda() ? "Memcpy DtoH (copy_)" : src.is_cuda() ? "Memcpy DtoD (copy_)"
                                                                                   : "Memcpy HtoD (copy_)",
                         dev, tl_stream[dev]);
    kernel.read(src);
    kernel.write(self);
    // a copy to the host returns once done, unless non-blocking into pinned memory
    if (!self.is_cuda() && non_blocking && self.is_pinned()) {
      kernel.write_host(self);
    } else if (!self.is_cuda()) {
      kernel.host_reads_result();
    }
    kernel.commit();
  }
  return self;
}

static at::Tensor& set_storage(at::Tensor& self, c10::Storage source, c10::SymInt offset,
    c10::SymIntArrayRef size, c10::SymIntArrayRef stride) {
  auto* impl = self.unsafeGetTensorImpl();
  if (!impl->storage().is_alias_of(source)) impl->set_storage_keep_dtype(std::move(source));
  impl->set_sizes_and_strides(C10_AS_INTARRAYREF_SLOW(size), C10_AS_INTARRAYREF_SLOW(stride),
      offset.expect_int());
  return self;
}

static at::Tensor& set_whole_storage(at::Tensor& self, c10::Storage source) {
  int64_t numel = static_cast<int64_t>(source.nbytes() / self.dtype().itemsize());
  auto* impl = self.unsafeGetTensorImpl();
  impl->set_storage_keep_dtype(std::move(source));
  impl->set_storage_offset(0);
  impl->set_sizes_contiguous({numel});
  return self;
}

static at::Tensor& set_source_tensor(at::Tensor& self, const at::Tensor& source) {
  auto* impl = self.unsafeGetTensorImpl();
  if (self.unsafeGetTensorImpl() != source.unsafeGetTensorImpl()) {
    impl->set_storage_keep_dtype(source.storage());
    impl->set_sizes_and_strides(source.sizes(), source.strides(), source.storage_offset());
  }
  return self;
}

static at::Tensor& set_empty(at::Tensor& self) {
  c10::Storage empty(c10::Storage::use_byte_size_t(), 0, device_allocator(self.device().index()), true);
  self.unsafeGetTensorImpl()->set_storage_keep_dtype(std::move(empty));
  self.unsafeGetTensorImpl()->set_sizes_contiguous({0});
  return self;
}

// Bernoulli dropout with the device's own generator (the CPU kernel would draw from the CPU's),
// registered as one kernel (as_one_kernel.h), as CUDA's fused_dropout_kernel reads the input and
// writes the output and the bool mask (aten/src/ATen/native/cuda/Dropout.cu).
static std::tuple<at::Tensor, at::Tensor> native_dropout(const at::Tensor& input, double p, std::optional<bool> train) {
  if (input.numel() == 0 || (train.has_value() && !*train) || p == 0) {
    return {input.clone(), at::ones_like(input, input.options().dtype(at::kBool))};
  }
  if (p == 1) return {at::zeros_like(input), at::zeros_like(input, input.options().dtype(at::kBool))};
  at::Tensor mask = at::empty_like(input, input.options().dtype(at::kBool))
                        .bernoulli_(1 - p, default_generator(input.device().index()));
  return {input.mul(mask).mul_(1.0 / (1 - p)), mask};
}
static constexpr char kNativeDropout[] = "aten::native_dropout";

static bool no_cudnn_ctc_loss(const at::Tensor&, const at::Tensor&, c10::IntArrayRef, c10::IntArrayRef, int64_t) {
  return false;
}
static bool no_cudnn_ctc_loss_tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t) {
  return false;
}

// _softmax / _log_softmax with half_to_float=True (F.softmax(x, dim, dtype=torch.float32) on a
// half input: half in, float out) have only a CUDA kernel; the CPU kernel refuses the
// conversion. As CUDA computes them (in float), the input is widened first; the backward, given
// float gradients for a half input (input_dtype), returns the half gradient as CUDA does. CUDA
// converts inside its one kernel (aten/src/ATen/native/cuda/SoftMax.cu), which reads the half
// input and writes the float result (the backward: the float gradient and output in, the half
// gradient out, after softmax's product kernel, op_cost.h): so the ops that compute it here are
// timed as those kernels, and under --predict-only only its result is made. Everything else: the
// CPU kernel.
static void softmax_half_to_float(const c10::OperatorHandle& op, c10::DispatchKeySet ks, torch::jit::Stack* stack) {
  const size_t num_args = op.schema().arguments().size();
  c10::IValue* arg = &(*stack)[stack->size() - num_args];
  const bool backward = op.schema().name().find("backward") != std::string::npos;
  const at::Tensor first = arg[0].toTensor();  // the input, or the backward's gradient
  at::ScalarType result_dtype = at::kFloat;
  if (!backward) {  // (self, dim, half_to_float)
    if (!arg[2].toBool()) return fallback(op, ks, stack);
    TORCH_CHECK(first.scalar_type() == at::kHalf || first.scalar_type() == at::kBFloat16,
                "conversion is supported for Half type only");
  } else {  // (grad_output, output, dim, input_dtype)
    result_dtype = static_cast<at::ScalarType>(arg[3].toInt());
    if (first.scalar_type() == result_dtype) return fallback(op, ks, stack);
    TORCH_CHECK(first.scalar_type() == at::kFloat && (result_dtype == at::kHalf || result_dtype == at::kBFloat16),
                "expected input and grad types to match, or input to be at::Half and grad to be at::Float");
  }
  int64_t bytes = 0;  // what the kernel reads
  for (size_t i = 0; i < num_args; ++i) {
    if (arg[i].isTensor()) bytes += moved(arg[i].toTensor());
  }
  // read now: the stack's arguments are consumed below (and the model exists only in clocked mode)
  const ImplementationTraffic cuda = timing() ? softmax_traffic(op.schema().name(), arg) : ImplementationTraffic{};
  auto compute = [&]() {
    if (predict_only()) {  // shapes and time only, as the op path predicts a kernel
      at::Tensor result = at::empty(first.sizes(), first.options().dtype(result_dtype));
      torch::jit::drop(*stack, num_args);
      stack->emplace_back(std::move(result));
    } else if (!backward) {
      arg[0] = first.to(at::kFloat);
      arg[2] = false;
      fallback(op, ks, stack);
    } else {
      arg[3] = static_cast<int64_t>(first.scalar_type());
      fallback(op, ks, stack);
      c10::IValue& result = stack->back();
      result = result.toTensor().to(result_dtype);
    }
  };
  if (capturing()) return compute();  // a CUDA graph records the ops for its replays, one by one
  const DeviceIndex dev = first.device().index();
  KernelScope kernel;
  const HostTimedFusedKernel profiled(kernel, op.schema().name().c_str(), dev, first.scalar_type());
  compute();
  if (timing() && kernel.outermost) {
    clock_memory_kernel(op.schema().name().c_str(), dev, bytes + moved(stack->back().toTensor()) + cuda.bytes,
                        first.scalar_type(), 1 + cuda.kernels);
  }
}

}  // namespace mirage

TORCH_LIBRARY_IMPL(aten, CUDA, m) {
  m.impl("empty.memory_format", TORCH_FN(mirage::empty_memory_format));
  m.impl("empty_strided", TORCH_FN(mirage::empty_strided));
  m.impl("as_strided", TORCH_FN(at::native::as_strided_tensorimpl));
  m.impl("view", TORCH_FN(at::native::view));
  m.impl("_reshape_alias", TORCH_FN(at::native::_reshape_alias));
  m.impl("resize_", TORCH_FN(at::native::resize_));
  m.impl("copy_", TORCH_FN(mirage::copy_));
  m.impl("set_.source_Storage_storage_offset", TORCH_FN(mirage::set_storage));
  m.impl("set_.source_Storage", TORCH_FN(mirage::set_whole_storage));
  m.impl("set_.source_Tensor", TORCH_FN(mirage::set_source_tensor));
  m.impl("set_", TORCH_FN(mirage::set_empty));
  m.impl("native_dropout", TORCH_FN((mirage::AsOneKernel<mirage::kNativeDropout, &mirage::native_dropout>::call)));
  for (const char* name : {"_softmax", "_log_softmax", "_softmax_backward_data", "_log_softmax_backward_data"}) {
    m.impl(name, torch::CppFunction::makeFromBoxedFunction<&mirage::softmax_half_to_float>());
  }
  // Composites that pick a CUDA-only backend for device tensors (depthwise, slow 3d and
  // transposed convolutions, whose CUDA kernels a CPU build lacks): run the CPU composite on
  // CPU views instead, so the CPU's own algorithm choice (and numbers) apply.
  for (const char* name : {"convolution", "_convolution", "convolution_backward"}) {
    m.impl(name, torch::CppFunction::makeFromBoxedFunction<&mirage::fallback>());
  }
  // There is no cuDNN/MIOpen behind the emulated device: ctc_loss takes its native path.
  m.impl("_use_cudnn_ctc_loss", TORCH_FN(mirage::no_cudnn_ctc_loss));
  m.impl("_use_cudnn_ctc_loss.Tensor", TORCH_FN(mirage::no_cudnn_ctc_loss_tensor));
  m.impl("_use_miopen_ctc_loss", TORCH_FN(mirage::no_cudnn_ctc_loss));
  m.impl("_use_miopen_ctc_loss.Tensor", TORCH_FN(mirage::no_cudnn_ctc_loss_tensor));
}
