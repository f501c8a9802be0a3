// The op path: the one place every operator on a device tensor passes (op_path.h).
#include "op_path.h"

#include "busy_time.h"
#include "config.h"
#include "cpu_allocator.h"
#include "cuda_dtypes.h"
#include "device_guard.h"
#include "faults.h"
#include "generators.h"
#include "graph_capture.h"
#include "device_clock.h"
#include "host_views.h"
#include "op_cost.h"
#include "profiler_activities.h"
#include "race_checker.h"
#include "sparse_and_nested.h"
#include "unobserved_ops.h"

#include <ATen/ATen.h>
#include <ATen/Operators.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <cstring>
#include <optional>
#include <string>
#include <string_view>
#include <tuple>
#include <type_traits>
#include <unordered_map>
#include <unordered_set>
#include <vector>

namespace mirage {

struct Aliased {
  at::Tensor orig;
  at::Tensor alias;
};

[[noreturn]] static void device_mismatch(const c10::Device& a, const c10::Device& b, const c10::OperatorHandle& op) {
  TORCH_CHECK(false, "Expected all tensors to be on the same device, but found at least two devices, ", a,
      " and ", b, "! (when checking argument for ", op.schema().name(), ")");
}

// An operator with a CUDA kernel in a CUDA build but no CPU kernel (and no shim kernel): the
// dispatcher's own message would name the CPU backend, which the caller never asked for.
[[noreturn]] static void not_emulated(const c10::OperatorHandle& op) {
  const auto& name = op.schema().operator_name();
  TORCH_CHECK_NOT_IMPLEMENTED(false, "mirage: ", name.name, name.overload_name.empty() ? "" : ".", name.overload_name,
      " has a CUDA kernel in a CUDA build of torch but no CPU kernel the emulated device could run, and mirage does "
      "not emulate it (README: 'CUDA-only operators'). Fix: use the operation it implements through its public "
      "API (e.g. torch.nn.functional), which takes an emulated path.");
}

// A quantized result (torch.quantize_per_tensor and its kin on a device tensor): a CUDA build
// keeps it as a QuantizedCUDA tensor with 39 kernels; mirage has none, and re-labelling the CPU
// kernel's quantized result as a plain device tensor would drop its quantizer unnoticed.
[[noreturn]] static void quantized_not_emulated() {
  TORCH_CHECK_NOT_IMPLEMENTED(false, "mirage: quantized tensors (QuantizedCUDA: torch.quantize_per_tensor, "
      "quantize_per_channel and their kin on a GPU tensor) are not emulated on the emulated device (README: "
      "'CUDA-only operators'). Fix: quantize on the CPU, or use torch.ao's fake quantization, whose tensors "
      "stay floating point.");
}

// What the op path reads of an operator's schema, read once per thread and operator: walking
// the schema (argument types, alias annotations) on every call cost more than the lookup.
struct OpTraits {
  const c10::Argument* arguments = nullptr;  // tells a schema re-registered at the same address
  uint32_t num_args = 0;
  uint32_t num_returns = 0;
  bool is_mutable = false;
  bool returns_view = false;   // its result aliases an argument (no kernel on a GPU)
  bool has_flops = false;      // torch.utils.flop_counter has its formula (clocked mode)
  bool has_implementation_traffic = false;  // its CUDA kernels move other bytes, or are several (clocked mode, op_cost.h)
  bool synchronizes = false;   // a GPU's host waits for it (.item(), nonzero's output size)
  c10::SmallVector<uint32_t, 2> generator_args;  // Generator? arguments, which the CPU kernel must get
  // Arguments it writes that no result returns (a foreach_*_ op, a fused optimizer step: they
  // return nothing): their bytes are written as well as read (clocked mode). A fused optimizer's
  // schema marks its `grads` written, which its kernel does only to unscale them (`grad_scale`
  // given): `grads_unscaled_by` is then grad_scale's index, and grads' is in unreturned_writes.
  c10::SmallVector<uint32_t, 4> unreturned_writes;
  int32_t grads_unscaled_by = -1;
  int32_t beta = -1;  // a BLAS op's `beta` argument (addmm, baddbmm, ...): with 0, cuBLAS does not read `self`
  uint64_t written = 0;  // bit i: argument i is written (Tensor(a!)), for --check-races
  const CudaDtypes* cuda_dtypes = nullptr;  // a CUDA kernel whose dtypes differ from the CPU kernel's (cuda_dtypes.h)
  bool bounds_checked_on_device = false;    // its CUDA kernel asserts its indices on the device
};

// The operators whose CUDA kernels check their indices (targets) with a device-side assert
// (CUDA_KERNEL_ASSERT in IndexKernel.cu, ScatterGatherKernel.cu, Indexing.cu, Loss.cu,
// NLLLoss2d.cu) where the CPU kernel raises an IndexError: on a GPU an index out of bounds in
// x[idx], gather/scatter, index_select (nn.Embedding) or a loss's target (F.cross_entropy with a
// label >= the class count) is "CUDA error: device-side assert triggered", after which the
// process's CUDA context is unusable. (x[5] with a Python int is a host check on both.)
static const std::unordered_set<std::string> kBoundsCheckedOnDevice{
    "aten::index", "aten::index_put_", "aten::_index_put_impl_", "aten::gather", "aten::scatter",
    "aten::scatter_", "aten::scatter_add", "aten::scatter_add_", "aten::scatter_reduce", "aten::scatter_reduce_",
    "aten::index_select", "aten::index_add", "aten::index_add_", "aten::nll_loss_forward", "aten::nll_loss2d_forward"};

// Whether a CPU kernel's error is the bound check a CUDA kernel makes on the device ("index 7 is
// out of bounds for dimension 0", "Target 10 is out of bounds.", "index out of range in self"),
// not a host check both make ("Dimension out of range").
static bool out_of_bounds(const c10::Error& error) {
  const std::string_view message = error.msg();
  return message.find("out of bounds") != std::string_view::npos ||
         message.find("index out of range") != std::string_view::npos;
}

static const OpTraits& traits_of(const c10::FunctionSchema& schema) {
  static thread_local std::unordered_map<const c10::FunctionSchema*, OpTraits> known;
  OpTraits& traits = known[&schema];
  const auto& args = schema.arguments();
  if (traits.arguments != args.data() || traits.num_args != args.size()) {
    traits = OpTraits{args.data(), static_cast<uint32_t>(args.size()),
                      static_cast<uint32_t>(schema.returns().size()), schema.is_mutable(), false, false, false, false, {}};
    for (uint32_t i = 0; i < args.size(); ++i) {
      const auto& type = args[i].type();
      if (type->kind() == c10::TypeKind::OptionalType &&
          type->containedType(0)->kind() == c10::TypeKind::GeneratorType) {
        traits.generator_args.push_back(i);
      }
      if (schema.returns().empty() && args[i].alias_info() && args[i].alias_info()->isWrite()) {
        traits.unreturned_writes.push_back(i);
      }
      if (args[i].name() == "grad_scale") traits.grads_unscaled_by = static_cast<int32_t>(i);
      if (args[i].name() == "beta" && i > 0 && args[0].name() == "self") traits.beta = static_cast<int32_t>(i);
      if (i < 64 && args[i].alias_info() && args[i].alias_info()->isWrite()) traits.written |= uint64_t{1} << i;
    }
    const auto& returns = schema.returns();
    traits.returns_view = !returns.empty() && returns[0].alias_info() && !returns[0].alias_info()->isWrite();
    static const std::unordered_set<std::string> synchronizing{
        "aten::_local_scalar_dense", "aten::nonzero", "aten::masked_select", "aten::unique_dim",
        "aten::_unique2", "aten::unique_consecutive", "aten::equal", "aten::is_nonzero"};
    traits.synchronizes = synchronizing.count(schema.name()) != 0;
    traits.cuda_dtypes = cuda_dtypes_of(schema);
    traits.bounds_checked_on_device = kBoundsCheckedOnDevice.count(schema.name()) != 0;
    if (timing()) {
      traits.has_flops = has_flop_formula(schema);
      traits.has_implementation_traffic = has_implementation_traffic(schema);
    }
  }
  return traits;
}

// The bytes of the arguments at `traits.unreturned_writes` (tensors or lists of them), from the
// op's arguments `args`.
static int64_t unreturned_write_bytes(const OpTraits& traits, const c10::IValue* args) {
  int64_t bytes = 0;
  for (uint32_t i : traits.unreturned_writes) {
    if (traits.grads_unscaled_by >= 0 && args[traits.grads_unscaled_by].isNone() &&
        traits.arguments[i].name() == "grads") {
      continue;  // read only: nothing to unscale
    }
    c10::IValue copy = args[i];
    auto count = [&](const at::Tensor& t) {
      if (t.defined()) bytes += static_cast<int64_t>(t.numel() * t.itemsize());
      return t;
    };
    if (copy.isTensor()) {
      count(copy.toTensor());
    } else if (copy.isTensorList() || copy.isList()) {
      map_tensor_lists(copy, count);
    }
  }
  return bytes;
}

// Clocked mode: a kernel of `op` on `device` reading what `traffic` counted of its arguments (its
// results are added) placed on the device's current stream; the host waits for it where a GPU's would.
static void clock_kernel(const c10::OperatorHandle& op, const OpTraits& traits, DeviceIndex device,
                         at::ScalarType dtype, KernelTraffic traffic, const std::vector<c10::IValue>& arguments,
                         const c10::IValue* results) {
  if (traits.returns_view || tl_kernel_depth > 0) return;  // a view launches nothing; a fused kernel is timed whole
  for (size_t i = 0; i < traits.num_returns; ++i) {
    if (results[i].isTensor() && results[i].toTensor().defined()) {
      const at::Tensor& out = results[i].toTensor();
      if (!out.is_cuda()) continue;
      if (has_members(out)) {  // its members are what the kernel wrote
        for (const at::Tensor& member : members_of(out)) traffic.add(member, true);
      } else {
        traffic.add(out);
      }
    }
  }
  // CUDA's addmm and baddbmm pass beta to cuBLAS, which reads C only when beta is not 0 (and
  // copy `self` into the result only then: aten/src/ATen/native/cuda/Blas.cpp): with beta=0,
  // `self` is not read. Megatron's attention scores are a baddbmm into an empty buffer so.
  if (traits.beta >= 0 && arguments.size() > static_cast<size_t>(traits.beta) && arguments[0].isTensor()) {
    const c10::IValue& beta = arguments[traits.beta];
    const at::Tensor& unread = arguments[0].toTensor();
    if (((beta.isDouble() && beta.toDouble() == 0) || (beta.isInt() && beta.toInt() == 0)) && unread.defined() &&
        unread.is_cuda() && !has_members(unread)) {
      traffic.bytes -= static_cast<int64_t>(unread.numel() * unread.itemsize());
    }
  }
  double flops = 0;
  GemmShape gemm;
  if (traits.has_flops) {
    flops = flop_count(op, arguments, results, traits.num_returns);
    gemm = gemm_shape(op.schema(), arguments, results, traits.num_returns);
  }
  const ImplementationTraffic cuda = traits.has_implementation_traffic
                                         ? implementation_traffic(op.schema(), arguments, results, traits.num_returns)
                                         : ImplementationTraffic{};
  traffic.bytes = std::max<int64_t>(traffic.bytes + cuda.bytes, 0);
  if (cuda.vectorized) traffic.general = false;
  const KernelCost cost =
      kernel_cost(flops, traffic.bytes, dtype, gemm, ComputeKind::kGemm, traffic.general, 1 + cuda.kernels);
  const int64_t end = run_on_stream(device, tl_stream[device], cost.ns, cost.kind, op.schema().name().c_str(),
                                    traffic.bytes, flops, &cost.beside, dtype);
  if (traits.synchronizes) host_waits_for(end);
}

// --predict-only: integer and bool data up to this size steers the program: its kernels run,
// and what no kernel computed reads as 0 (predict_without_running). A compiled graph's kernels
// follow the same rule (mirage/runtime/inductor.py reads it as predict_only_steering_bytes()).
constexpr int64_t kSteeringBytes = int64_t{16} << 20;

MIRAGE_LIBRARY(m) {
  m.def("predict_only_steering_bytes() -> int", []() -> int64_t { return kSteeringBytes; });
}

// --predict-only: the op's results from its Meta kernel (contents undefined) and its predicted
// time, without running the CPU kernel; false where the op needs its data (it then runs).
static bool predict_without_running(const c10::OperatorHandle& op, const OpTraits& traits, torch::jit::Stack* stack) {
  if (traits.synchronizes) {  // .item(), nonzero: their values steer the program, so they run...
    const c10::IValue& input = stack->back();
    if (op.schema().name() != "aten::_local_scalar_dense" || !input.isTensor() ||
        !is_phantom_dtype(input.toTensor().scalar_type())) {
      return false;
    }
    // ...but a floating-point value no kernel computed reads as the placeholder 0 (README)
    const at::Tensor scalar = input.toTensor();
    KernelTraffic read;
    read.add(scalar);
    clock_kernel(op, traits, scalar.device().index(), scalar.scalar_type(), read, {input},
                 stack->data() + (stack->size() - 1));
    stack->back() = c10::IValue(at::zeros({}, scalar.options().device(c10::kCPU)).item());
    return true;
  }
  const size_t base = stack->size() - traits.num_args;
  std::vector<c10::IValue> arguments(stack->begin() + static_cast<std::ptrdiff_t>(base), stack->end());
  DeviceIndex device = -1;
  at::ScalarType dtype = at::kFloat;
  KernelTraffic traffic;
  bool steering = true;  // every device tensor in holds integers or bools, in a small storage
  c10::SmallVector<const void*, 8> inputs;  // their storages
  bool in_list = false;  // counting a list argument's tensors
  bool with_members = false;  // a sparse or nested argument: such kernels run (their sizes steer what they make)
  auto count = [&](const at::Tensor& t) {
    if (!t.defined() || !t.is_cuda()) return t;
    if (has_members(t)) {
      with_members = true;
      return t;
    }
    inputs.push_back(t.storage().data());
    if (device < 0) {
      device = t.device().index();
      dtype = t.scalar_type();
    }
    steering = steering && !is_phantom_dtype(t.scalar_type()) &&
               static_cast<int64_t>(t.storage().nbytes()) <= kSteeringBytes;
    traffic.add(t, in_list);
    return t;
  };
  for (c10::IValue& iv : arguments) {
    if (iv.isTensor()) {
      count(iv.toTensor());
    } else if (iv.isTensorList() || iv.isList()) {
      c10::IValue copy = iv;
      in_list = true;
      map_tensor_lists(copy, count);
      in_list = false;
    }
  }
  if (device < 0 || with_members) return false;  // factories (no device tensor in): cheap, and their values may matter
  // Small kernels of integers and bools run: what they compute steers the program (the sizes
  // send_object_list concatenates and recv_object_list sums, token counts, indices), and the
  // host reads it as it is (is_phantom_dtype).
  if (steering) return false;
  traffic.bytes += unreturned_write_bytes(traits, arguments.data());
  if (!run_on_meta(op, stack, false, nullptr)) return false;
  // What such kernels read of a kernel that did not run (a mask compared from floating-point
  // data, indices of a maximum) is the placeholder 0, as the host reads floating-point data:
  // small new integer results are zeroed, in place (no kernel on the timeline).
  for (size_t i = stack->size() - traits.num_returns; i < stack->size(); ++i) {
    if (!(*stack)[i].isTensor()) continue;
    const at::Tensor& out = (*stack)[i].toTensor();
    if (out.defined() && out.is_cuda() && !is_phantom_dtype(out.scalar_type()) &&
        static_cast<int64_t>(out.storage().nbytes()) <= kSteeringBytes &&
        std::find(inputs.begin(), inputs.end(), out.storage().data()) == inputs.end()) {
      std::memset(out.storage().mutable_data(), 0, out.storage().nbytes());
    }
  }
  clock_kernel(op, traits, device, dtype, traffic, arguments, stack->data() + (stack->size() - traits.num_returns));
  return true;
}

// A device sparse or nested argument and its host view (sparse_and_nested.h).
struct MembersView {
  at::Tensor orig;
  at::Tensor host;
  Snapshot given;  // what `host` held before the kernel
};

// A CPU kernel's results as device tensors: an argument's alias -> the argument; a view of an
// alias -> a view of the argument's storage; anything else is fresh CPU memory, re-labelled as
// memory of the device (in place where the result alone holds it, else on a new device storage
// shared by its views), which is where the allocator model counts it. `Alias` has `orig` (a
// device tensor, or a pointer to one) and `alias` (its CPU alias).
template <class Alias>
struct DeviceResults {
  const c10::SmallVectorImpl<Alias>& aliased;
  DeviceIndex device;
  const c10::SmallVectorImpl<MembersView>* with_members = nullptr;  // the call's sparse and nested arguments
  c10::SmallVector<std::pair<c10::StorageImpl*, c10::Storage>, 2> adopted{};

  static const at::Tensor& orig_of(const Alias& a) {
    if constexpr (std::is_pointer_v<decltype(a.orig)>) {
      return *a.orig;
    } else {
      return a.orig;
    }
  }

  at::Tensor map_back(const at::Tensor& out) {
    if (C10_UNLIKELY(out.defined() && out.is_quantized())) quantized_not_emulated();
    if (out.defined() && out.device().type() == DeviceType::CPU && has_members(out)) return back_with_members(out);
    if (!out.defined() || out.device().type() != DeviceType::CPU || out.layout() != c10::kStrided) return out;
    c10::StorageImpl* s = out.storage().unsafeGetStorageImpl();
    for (auto& a : aliased) {
      if (a.alias.unsafeGetTensorImpl() == out.unsafeGetTensorImpl()) return orig_of(a);
    }
    for (auto& a : aliased) {
      if (a.alias.storage().unsafeGetStorageImpl() == s) return on_storage(orig_of(a).storage(), out);
    }
    for (auto& p : adopted) {
      if (p.first == s) return on_storage(p.second, out);
    }
    adopted.emplace_back(s, adopt_storage(out.storage(), device));
    return on_storage(adopted.back().second, out);
  }

  // A sparse or nested result: the argument it is (an in-place op's), or a device tensor of its
  // kind over its members as device tensors (such a kernel's, or a dense op's: to_sparse,
  // _nested_tensor_from_mask).
  at::Tensor back_with_members(const at::Tensor& out) {
    if (with_members != nullptr) {
      for (const MembersView& view : *with_members) {
        if (view.host.unsafeGetTensorImpl() == out.unsafeGetTensorImpl()) return view.orig;
      }
    }
    return over_members(out, members_back(out));
  }

  Members members_back(const at::Tensor& host) {
    Members members = members_of(host);
    for (at::Tensor& member : members) member = map_back(member);
    return members;
  }

  // The common case, one fresh tensor that nothing else holds, is re-labelled in place.
  at::Tensor operator()(at::Tensor&& out) {
    if (out.defined() && out.device().type() == DeviceType::CPU && out.layout() == c10::kStrided &&
        !out.is_nested() && !out.is_quantized() && relabel_in_place(out, device)) {
      return std::move(out);
    }
    return map_back(out);
  }
};

// One call of an operator on the op path: its device arguments aliased as CPU tensors, the CPU
// kernel run on them, its CPU results turned into device tensors.
struct OpCall {
  const c10::OperatorHandle& op;
  const OpTraits& traits;
  torch::jit::Stack* stack;
  c10::DispatchKey host_key;  // the CPU kernel's key: CPU, or SparseCPU / SparseCsrCPU / NestedTensorCPU
  bool widened;               // the CPU kernel runs one dtype wider, as the CUDA kernel computes (cuda_dtypes.h)
  c10::SmallVector<Aliased, 8> aliased;
  c10::SmallVector<bool, 8> aliased_written;  // --check-races: whether the kernel writes aliased[i]
  c10::SmallVector<MembersView, 1> with_members;  // sparse and nested arguments (their members are in `aliased`)
  DeviceIndex device = -1;
  KernelTraffic traffic;                // what the kernel reads and writes (clocked mode)
  std::vector<c10::IValue> arguments;   // kept for the FLOP formula and implementation traffic (clocked mode)

  // Replaces every device tensor among the arguments with its CPU alias, checking that all are on
  // one device as PyTorch does; gives the CPU kernel the device's generator where it takes one.
  void alias_arguments() {
    const size_t base = stack->size() - traits.num_args;
    if (C10_UNLIKELY(traits.has_flops || traits.has_implementation_traffic)) arguments.assign(stack->begin() + base, stack->end());
    bool has_cpu_tensor = false;
    const bool count_bytes = timing();
    const bool check_races = races::on();
    bool writing = false;  // the argument being converted is written
    bool in_list = false;  // converting a list argument's tensors
    c10::Device cpu_device(DeviceType::CPU);
    // a sparse copy_ takes a source on another device, as CUDA's copy_sparse_ does
    const bool copies_across_devices = host_key != c10::DispatchKey::CPU && op.schema().name() == "aten::copy_";
    auto alias = [&](const at::Tensor& t) -> at::Tensor {  // a dense device tensor's CPU alias
      if (count_bytes) traffic.add(t, in_list);
      at::Tensor a = cpu_alias(t);
      aliased.push_back({t, a});
      if (C10_UNLIKELY(check_races)) aliased_written.push_back(writing);
      return a;
    };
    auto convert = [&](const at::Tensor& t, bool allow_cpu) -> at::Tensor {
      if (!t.defined()) return t;
      if (t.device().type() != DeviceType::CUDA) {
        if (!allow_cpu && !copies_across_devices && t.dim() > 0) {
          if (device >= 0) device_mismatch(c10::Device(DeviceType::CUDA, device), t.device(), op);
          has_cpu_tensor = true;
        }
        return t;
      }
      DeviceIndex d = t.device().index();
      if (device < 0) {
        if (has_cpu_tensor) device_mismatch(t.device(), cpu_device, op);
        device = d;
      } else if (d != device) {
        device_mismatch(c10::Device(DeviceType::CUDA, device), t.device(), op);
      }
      if (C10_UNLIKELY(has_members(t))) {  // a host view over CPU aliases of its members
        Members members = members_of(t);
        for (at::Tensor& member : members) member = alias(member);
        at::Tensor host = over_members(t, members);
        with_members.push_back({t, host, snapshot(host)});
        return host;
      }
      return alias(t);
    };
    for (size_t i = 0; i < traits.num_args; ++i) {
      c10::IValue& iv = (*stack)[base + i];
      if (C10_UNLIKELY(check_races)) writing = i < 64 && ((traits.written >> i) & 1);
      if (iv.isTensor()) {
        iv = convert(iv.toTensor(), false);
      } else if (iv.isTensorList()) {
        in_list = true;
        map_tensor_lists(iv, [&](const at::Tensor& t) { return convert(t, false); });
        in_list = false;
      } else if (iv.isOptionalTensorList()) {
        // Index lists: real CUDA accepts CPU index tensors here.
        auto list = iv.toOptionalTensorList();
        for (size_t j = 0; j < list.size(); ++j) {
          std::optional<at::Tensor> e = list[j];
          if (e.has_value()) list[j] = convert(*e, true);
        }
        iv = std::move(list);
      } else if (iv.isList()) {  // Tensor[][] (c10d's allgather / reduce_scatter outputs)
        in_list = true;
        map_tensor_lists(iv, [&](const at::Tensor& t) { return convert(t, false); });
        in_list = false;
      } else if (iv.isDevice()) {
        c10::Device d = iv.toDevice();
        if (d.is_cuda()) {
          if (device < 0) device = d.has_index() ? d.index() : tl_device;
          iv = c10::IValue(cpu_device);
        }
      }
    }
    if (device < 0) device = tl_device;
    if (count_bytes) traffic.bytes += unreturned_write_bytes(traits, stack->data() + base);
    for (uint32_t i : traits.generator_args) {  // the CPU kernel takes a CPU generator
      c10::IValue& iv = (*stack)[base + i];
      const std::optional<at::Generator> given =
          iv.isNone() ? std::nullopt : std::optional<at::Generator>(iv.toGenerator());
      iv = c10::IValue(host_generator_for(generator_for(given, device)));
    }
  }

  // The CPU build's kernel, or the host kernel the caller gave for an op a CPU build has none for.
  void run_cpu_kernel(HostKernel host) {
    if (host != nullptr) return host(stack);
    if (widened) return run_widened(*traits.cuda_dtypes, op, host_key, stack);
    try {
      op.redispatchBoxed(c10::DispatchKeySet(host_key), stack);
    } catch (const c10::NotImplementedError&) {
      if (op.hasKernelForDispatchKey(host_key)) throw;
      not_emulated(op);
    } catch (const c10::Error& error) {
      if (!traits.bounds_checked_on_device || !out_of_bounds(error)) throw;
      device_side_assert(std::string("mirage: device-side assert in ") + op.schema().name() + " (a CUDA kernel checks "
                         "its indices on the device; the host kernel said: " + error.msg() + ")");
    }
  }

  // Writes (in-place / out=) may have resized an alias: that goes back to the device tensor.
  // Results become device tensors (DeviceResults).
  void adopt_results() {
    if (!aliased.empty() && traits.is_mutable) {
      for (auto& a : aliased) sync_back(a.orig, a.alias);
    }
    DeviceResults<Aliased> results{aliased, device, &with_members};
    if (traits.is_mutable) {  // a sparse argument written: its new members, as device tensors
      for (const MembersView& view : with_members) {
        if (written_since(view.host, view.given)) sync_members_back(view.orig, view.host, results.members_back(view.host));
      }
    }
    const size_t ret_base = stack->size() - traits.num_returns;
    for (size_t i = 0; i < traits.num_returns; ++i) {
      c10::IValue& iv = (*stack)[ret_base + i];
      if (iv.isTensor()) {
        // Taken out of the IValue so that the IValue's reference does not count (relabel_in_place).
        iv = results(std::move(iv).toTensor());
      } else {
        map_tensor_lists(iv, [&](const at::Tensor& out) { return results.map_back(out); });
      }
    }
  }

  // What the kernel computes in: its first device tensor's dtype.
  at::ScalarType dtype() const {
    if (!with_members.empty()) return with_members.front().orig.scalar_type();  // (aliased.front(): indices)
    return aliased.empty() ? at::kFloat : aliased.front().orig.scalar_type();
  }

  // Clocked mode: the kernel's place on the predicted timeline of its device's current stream.
  void clock() {
    const c10::IValue* results = stack->data() + (stack->size() - traits.num_returns);
    if (C10_LIKELY(with_members.empty())) return clock_kernel(op, traits, device, dtype(), traffic, arguments, results);
    // A sparse or nested kernel moves its members; the FLOP formulas are of dense tensors.
    OpTraits bytes_only = traits;
    bytes_only.has_flops = bytes_only.has_implementation_traffic = false;
    clock_kernel(op, bytes_only, device, dtype(), traffic, arguments, results);
  }

  // --check-races: the kernel reads and writes its arguments as its schema says and writes its fresh
  // results, on the current stream; the host waits for it where a GPU's would (.item()).
  void check_races() {
    races::Kernel kernel(op.schema().name().c_str(), device, tl_stream[device]);
    for (size_t i = 0; i < aliased.size(); ++i) {
      if (aliased_written[i]) {
        kernel.write(aliased[i].orig);
      } else {
        kernel.read(aliased[i].orig);
      }
    }
    // The results it wrote (a sparse or nested one: its members), kept here while the kernel
    // points at them: gathered first, as the vector may move its elements while it grows.
    c10::SmallVector<at::Tensor, 4> results;
    auto gather = [&](const at::Tensor& out) {
      if (!out.defined() || !out.is_cuda()) return out;
      if (has_members(out)) {
        for (at::Tensor& member : members_of(out)) results.push_back(std::move(member));
      } else {
        results.push_back(out);
      }
      return out;
    };
    const size_t ret_base = stack->size() - traits.num_returns;
    for (size_t i = 0; i < traits.num_returns; ++i) {
      c10::IValue& iv = (*stack)[ret_base + i];
      if (iv.isTensor()) {
        gather(iv.toTensor());
      } else {
        map_tensor_lists(iv, gather);
      }
    }
    for (const at::Tensor& out : results) {
      const bool argument = std::any_of(aliased.begin(), aliased.end(),
                                        [&](const Aliased& a) { return a.orig.is_alias_of(out); });
      if (!argument) kernel.write(out);  // (an argument it wrote is counted above)
    }
    if (traits.synchronizes) kernel.host_reads_result();
    kernel.commit();
  }

  // Aliases nobody kept go back to the thread's spares.
  void release_aliases() {
    for (auto& a : aliased) {
      a.orig.reset();
      recycle_alias(std::move(a.alias));
    }
  }
};

void fallback_on_host(const c10::OperatorHandle& op, c10::DispatchKeySet keys, torch::jit::Stack* stack, HostKernel host) {
  if (C10_UNLIKELY(g_fault_ops.load(std::memory_order_relaxed))) fault_at_op();  // --fault ...:at=op:N
  const OpTraits& traits = traits_of(op.schema());
  // a dtype the CUDA kernel refuses raises as there; one it takes and the CPU kernel lacks is widened
  const bool widened = C10_UNLIKELY(traits.cuda_dtypes != nullptr) && host == nullptr &&
      check_cuda_dtypes(*traits.cuda_dtypes, op, stack->data() + (stack->size() - traits.num_args), traits.num_args);
  if (capturing()) return capture_op(op, stack);  // recorded for replay, not run
  const c10::DispatchKey cpu_key = host_key(keys);
  // shapes and time only (a sparse or nested kernel runs: what it makes depends on its data)
  if (C10_UNLIKELY(predict_only()) && cpu_key == c10::DispatchKey::CPU && predict_without_running(op, traits, stack)) return;
  OpCall call{op, traits, stack, cpu_key, widened};
  call.alias_arguments();
  // torch.profiler's GPU side without clocked mode: the kernel as long as it ran here
  // (clocked mode counts launches where it places them, device_clock.cpp)
  const uint32_t launch = !timing() && !traits.returns_view ? count_launch() : 0;
  // (inside a fused kernel its ops are not reported alone: profiler_activities.h)
  const bool profiled = launch != 0 && profiling_device() && tl_kernel_depth == 0;
  const int64_t began = profiled ? profiler_wall_ns() : 0;
  {
    BusyTimer busy(call.device);  // utilization (host time)
    DeviceKernelRunning running;  // its CPU allocations are not the process's CPU memory (cpu_allocator.h)
    call.run_cpu_kernel(host);
  }
  if (profiled) {
    note_device_work(Interval{began, profiler_wall_ns(), op.schema().name().c_str(), 0, 0, tl_stream[call.device],
                              WorkKind::kCompute, call.device, call.dtype()}, began, launch);
  }
  call.adopt_results();           // memory accounting (the allocator model)
  if (C10_UNLIKELY(races::on()) && !traits.returns_view) call.check_races();  // --check-races (race_checker.h)
  if (timing()) call.clock();     // the predicted timeline
  call.release_aliases();
}

void fallback(const c10::OperatorHandle& op, c10::DispatchKeySet keys, torch::jit::Stack* stack) {
  fallback_on_host(op, keys, stack, nullptr);
}

// The unboxed op path: the same call as `fallback` for the hottest small ops, without boxing.
// A boxed call packs every argument into a stack of IValues and the CPU kernel unpacks it again,
// which on a kernel of a few microseconds (an optimizer's per-parameter step, a small layer) is
// a tenth of the op. These ops take their C++ arguments directly: tensors aliased as CPU tensors,
// the CPU kernel called through its typed redispatch, results adopted as `fallback` adopts them.
// Whatever observes work beyond memory and busy time (clocked mode, --check-races, a fault, a
// graph capture, torch.profiler's GPU side) goes through `fallback`, so each of those still sees
// every op in one place.
namespace unboxed {

// Plain emulation: nothing that needs the boxed call's view of the op is on.
static bool plain() {
  return !timing() && !races::on() && !capturing() && !g_fault_ops.load(std::memory_order_relaxed) &&
         !profiling_device();
}

struct Alias {
  const at::Tensor* orig;  // the caller's argument
  at::Tensor alias;
};

struct Call {
  c10::SmallVector<Alias, 6> aliased;
  DeviceIndex device = -1;
  bool one_device = true;  // false: a tensor on another device (the boxed path raises PyTorch's error)

  at::Tensor cpu(const at::Tensor& t) {
    if (!t.defined()) return t;
    if (t.device().type() != DeviceType::CUDA) {
      if (t.dim() > 0) one_device = false;  // a CPU scalar is fine, as on CUDA
      return t;
    }
    if (device < 0) device = t.device().index();
    if (t.device().index() != device) one_device = false;
    aliased.push_back({&t, cpu_alias(t)});
    return aliased.back().alias;
  }

  // An argument as the CPU kernel takes it: tensors as their CPU aliases, the rest as given.
  // (Taken as lvalues: the arguments are forwarded again, untouched, when the boxed path runs.)
  template <class T>
  decltype(auto) convert(T& value) {
    using Plain = std::remove_const_t<T>;
    if constexpr (std::is_same_v<Plain, at::Tensor>) {
      return cpu(value);
    } else if constexpr (std::is_same_v<Plain, std::optional<at::Tensor>>) {
      return value.has_value() ? std::optional<at::Tensor>(cpu(*value)) : std::optional<at::Tensor>();
    } else {
      return (value);
    }
  }

  ~Call() {
    for (auto& a : aliased) recycle_alias(std::move(a.alias));
  }
};

template <class T>
using Converted = std::conditional_t<std::is_same_v<std::decay_t<T>, at::Tensor>, at::Tensor,
                  std::conditional_t<std::is_same_v<std::decay_t<T>, std::optional<at::Tensor>>,
                                     std::optional<at::Tensor>, T>>;

template <class Op, class Schema = typename Op::schema>
struct Kernel;

template <class Op, class Ret, class... Args>
struct Kernel<Op, Ret(Args...)> {
  static constexpr bool kMutates = (std::is_same_v<Args, at::Tensor&> || ...);

  static const c10::OperatorHandle& handle() {
    static const c10::OperatorHandle op = c10::Dispatcher::singleton().findSchemaOrThrow(Op::name, Op::overload_name);
    return op;
  }

  static Ret boxed(c10::DispatchKeySet keys, Args... args) {
    return c10::impl::BoxedKernelWrapper<Ret(Args...)>::call(c10::BoxedKernel::makeFromFunction<&fallback>(), handle(),
                                                              keys, std::forward<Args>(args)...);
  }

  // The dtype of its first tensor argument, which its CUDA kernel dispatches on.
  static std::optional<c10::ScalarType> first_dtype(const std::remove_reference_t<Args>&... args) {
    std::optional<c10::ScalarType> found;
    auto look = [&](const auto& arg) {
      if constexpr (std::is_same_v<std::decay_t<decltype(arg)>, at::Tensor>) {
        if (!found && arg.defined()) found = arg.scalar_type();
      }
    };
    (look(args), ...);
    return found;
  }

  static Ret call(c10::DispatchKeySet keys, Args... args) {
    if (!plain()) return boxed(keys, std::forward<Args>(args)...);
    static const CudaDtypes* const cuda_dtypes = cuda_dtypes_of(handle().schema());
    if (C10_UNLIKELY(cuda_dtypes != nullptr)) {  // (cuda_dtypes.h: mm of integers, complex32 sums)
      const std::optional<c10::ScalarType> dtype = first_dtype(args...);
      if (dtype && needs_cuda_dtype_check(cuda_dtypes, *dtype)) return boxed(keys, std::forward<Args>(args)...);
    }
    Call call;
    std::tuple<Converted<Args>...> cpu_args{call.convert(args)...};
    if (!call.one_device) {
      call.aliased.clear();
      return boxed(keys, std::forward<Args>(args)...);
    }
    if (call.device < 0) call.device = tl_device;
    count_launch();  // torch.profiler's launch count, as fallback keeps it
    auto run = [&]() -> Ret {
      BusyTimer busy(call.device);  // utilization (host time)
      DeviceKernelRunning running;  // its CPU allocations are not the process's CPU memory (cpu_allocator.h)
      return std::apply([](auto&... cpu) -> Ret {
        return Op::redispatch(c10::DispatchKeySet(c10::DispatchKey::CPU), cpu...);
      }, cpu_args);
    };
    if constexpr (std::is_same_v<Ret, at::Tensor&>) {  // in-place and out=: the argument written
      const at::Tensor& written = run();
      for (auto& a : call.aliased) sync_back(*a.orig, a.alias);
      for (auto& a : call.aliased) {
        if (a.alias.unsafeGetTensorImpl() == written.unsafeGetTensorImpl()) return const_cast<at::Tensor&>(*a.orig);
      }
      TORCH_INTERNAL_ASSERT(false, "mirage: ", Op::name, " returned a tensor that is not its argument");
    } else {
      Ret out = run();
      if constexpr (kMutates) {
        for (auto& a : call.aliased) sync_back(*a.orig, a.alias);
      }
      DeviceResults<Alias> results{call.aliased, call.device};
      if constexpr (std::is_same_v<Ret, at::Tensor>) {
        return results(std::move(out));
      } else {  // a tuple of tensors
        return std::apply([&](auto&... each) { return Ret{results(std::move(each))...}; }, out);
      }
    }
  }
};

// An op's registration: its name as `aten.impl` takes it ("add.Tensor"), read off at::_ops.
struct HotOp {
  std::string name;
  torch::CppFunction (*kernel)();
};

template <class Op>
HotOp hot() {
  const std::string overload = Op::overload_name;
  return {std::string(Op::name).substr(6) + (overload.empty() ? "" : "." + overload),
          [] { return torch::CppFunction::makeFromUnboxedFunction(TORCH_FN(Kernel<Op>::call)); }};
}

// The ops of small training steps (a linear layer, a norm, an activation, a loss, AdamW's
// per-parameter update), by their profile (docs/benchmarks.md, issue 33).
static std::vector<HotOp> hot_ops() {
  namespace ops = at::_ops;
  return {
      hot<ops::add_Tensor>(), hot<ops::add__Tensor>(), hot<ops::sub_Tensor>(), hot<ops::mul_Tensor>(),
      hot<ops::mul__Tensor>(), hot<ops::div_Tensor>(), hot<ops::div__Tensor>(), hot<ops::lerp__Scalar>(),
      hot<ops::addcmul_>(), hot<ops::addcdiv_>(), hot<ops::sqrt>(), hot<ops::rsqrt>(), hot<ops::neg>(),
      hot<ops::mm>(), hot<ops::addmm>(), hot<ops::bmm>(), hot<ops::native_layer_norm>(),
      hot<ops::native_layer_norm_backward>(), hot<ops::gelu>(), hot<ops::gelu_backward>(), hot<ops::silu>(),
      hot<ops::silu_backward>(), hot<ops::threshold_backward>(), hot<ops::clamp_min>(),
      hot<ops::sum_dim_IntList>(), hot<ops::mean_dim>(), hot<ops::pow_Tensor_Scalar>(), hot<ops::mse_loss>(),
      hot<ops::mse_loss_backward>(), hot<ops::_softmax>(), hot<ops::_log_softmax>(),
      hot<ops::_softmax_backward_data>(), hot<ops::_log_softmax_backward_data>(),
  };
}

}  // namespace unboxed

// The operators a CUDA build has a CPU kernel for and neither a CUDA nor a composite one
// (native_functions.yaml, which torchgen ships in the wheel), so that a device tensor makes the
// dispatcher raise: torch.histogram (torch.histc is the GPU's), to_mkldnn, from_file,
// sparse.spdiags, the CPU's int4 and mkldnn kernels. tests/emulated/test_op_path.py checks the
// list against the installed torch's yaml. Left out: torch.compile's `_functional_assert_async.msg`
// and `_make_dep_token`, which a CUDA build's compiled graphs never reach with device tensors, and
// `_scaled_dot_product_flash_attention_for_cpu` and its backward, which are the emulated device's
// own flash attention (fused_attention.cpp).
static constexpr std::array<std::string_view, 34> kCpuOnlyInACudaBuild{
    "_add_relu.Tensor", "_add_relu_.Tensor", "_add_relu.out", "_add_relu.Scalar", "_add_relu_.Scalar",
    "_test_functorch_fallback", "_empty_affine_quantized", "_empty_per_channel_affine_quantized", "from_file",
    "mkldnn_rnn_layer", "mkldnn_rnn_layer_backward", "_convert_weight_to_int4pack_for_cpu",
    "_weight_int4pack_mm_for_cpu", "_dyn_quant_pack_4bit_weight", "_dyn_quant_matmul_4bit", "narrow_copy.out",
    "_spdiags", "to_mkldnn", "quantize_per_tensor.tensors", "histogram.bins_tensor_out", "histogram.bins_tensor",
    "histogram.bin_ct_out", "histogram.bin_ct", "_histogramdd_bin_edges", "_histogramdd_from_bin_cts",
    "_histogramdd_from_bin_tensors", "_upsample_lanczos2d_aa.out", "_upsample_lanczos2d_aa_backward.grad_input",
    "slow_conv3d_forward.output", "slow_conv3d_forward", "_test_optional_intlist", "_test_optional_filled_intlist",
    "_test_optional_floatlist", "_foobar"};

MIRAGE_LIBRARY(m) {  // (what tests/emulated/test_op_path.py checks against the yaml)
  m.def("cpu_only_in_a_cuda_build() -> str[]", []() {
    return std::vector<std::string>(kCpuOnlyInACudaBuild.begin(), kCpuOnlyInACudaBuild.end());
  });
}

// Such an operator called with device tensors: the dispatcher's own words on a CUDA build.
static void no_cuda_kernel_in_a_cuda_build(const c10::OperatorHandle& op, c10::DispatchKeySet, torch::jit::Stack*) {
  const std::string name = c10::toString(op.operator_name());
  TORCH_CHECK_NOT_IMPLEMENTED(false, "Could not run '", name, "' with arguments from the 'CUDA' backend. This "
      "could be because the operator doesn't exist for this backend, or was omitted during the selective/custom "
      "build process (if using custom build). If you are a Facebook employee using PyTorch on mobile, please visit "
      "https://fburl.com/ptmfixes for possible resolutions. '", name, "' is only available for the CPU backend in "
      "a CUDA build of torch (native_functions.yaml).");
}

// Aten ops with a CPU kernel but no CUDA kernel would otherwise reach CUDA through a
// CompositeExplicitAutogradNonFunctional "default backend kernel" (a functional wrapper around
// the out= variant), which behaves differently from the CPU path (extra out= resizes, warnings).
// Give every such aten op the fallback explicitly, so CUDA runs exactly the CPU kernel; those a
// CUDA build has no CUDA kernel for raise as there.
static const int g_register_cpu_twins = [] {
  static torch::Library aten(torch::Library::IMPL, "aten", c10::DispatchKey::CUDA, __FILE__, __LINE__);
  auto& dispatcher = c10::Dispatcher::singleton();
  const auto hot = unboxed::hot_ops();
  // (c10d's ops keep torch's own CUDA kernels: they hand device tensors to the group's cuda
  // backend, the emulated NCCL of mirage/nccl.)
  for (const c10::OperatorName& name : dispatcher.getAllOpNames()) {
    if (name.name.rfind("aten::", 0) != 0) continue;
    auto op = dispatcher.findOp(name);
    if (!op || !op->hasKernelForDispatchKey(c10::DispatchKey::CPU)) continue;
    if (op->hasKernelForDispatchKey(c10::DispatchKey::CUDA)) continue;
    std::string qualified = name.name.substr(6) + (name.overload_name.empty() ? "" : "." + name.overload_name);
    if (std::find(kCpuOnlyInACudaBuild.begin(), kCpuOnlyInACudaBuild.end(), qualified) != kCpuOnlyInACudaBuild.end()) {
      aten.impl(qualified.c_str(), torch::CppFunction::makeFromBoxedFunction<&no_cuda_kernel_in_a_cuda_build>());
      continue;
    }
    auto fast = std::find_if(hot.begin(), hot.end(), [&](const unboxed::HotOp& entry) { return entry.name == qualified; });
    aten.impl(qualified.c_str(), fast != hot.end() ? fast->kernel() : torch::CppFunction::makeFromBoxedFunction<&fallback>());
  }
  return 0;
}();
}  // namespace mirage

TORCH_LIBRARY_IMPL(_, CUDA, m) {
  m.fallback(torch::CppFunction::makeFromBoxedFunction<&mirage::fallback>());
}
