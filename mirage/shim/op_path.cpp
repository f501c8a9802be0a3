// The op path: the one place every operator on a device tensor passes (op_path.h).
#include "op_path.h"

#include "busy_time.h"
#include "config.h"
#include "device_guard.h"
#include "generators.h"
#include "graph_capture.h"
#include "host_views.h"

#include <ATen/ATen.h>
#include <torch/library.h>

#include <string>
#include <unordered_map>

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

// What the fallback reads of an operator's schema, read once per thread and operator: walking
// the schema (argument types, alias annotations) on every call cost more than the lookup.
struct OpTraits {
  const c10::Argument* arguments = nullptr;  // tells a schema re-registered at the same address
  uint32_t num_args = 0;
  uint32_t num_returns = 0;
  bool is_mutable = false;
  c10::SmallVector<uint32_t, 2> generator_args;  // Generator? arguments, which the CPU kernel must get
};

static const OpTraits& traits_of(const c10::FunctionSchema& schema) {
  static thread_local std::unordered_map<const c10::FunctionSchema*, OpTraits> known;
  OpTraits& traits = known[&schema];
  const auto& args = schema.arguments();
  if (traits.arguments != args.data() || traits.num_args != args.size()) {
    traits = OpTraits{args.data(), static_cast<uint32_t>(args.size()),
                      static_cast<uint32_t>(schema.returns().size()), schema.is_mutable(), {}};
    for (uint32_t i = 0; i < args.size(); ++i) {
      const auto& type = args[i].type();
      if (type->kind() == c10::TypeKind::OptionalType &&
          type->containedType(0)->kind() == c10::TypeKind::GeneratorType) {
        traits.generator_args.push_back(i);
      }
    }
  }
  return traits;
}

void fallback(const c10::OperatorHandle& op, c10::DispatchKeySet, torch::jit::Stack* stack) {
  if (capturing()) return capture_op(op, stack);
  const OpTraits& traits = traits_of(op.schema());
  const size_t num_args = traits.num_args;
  const size_t base = stack->size() - num_args;
  c10::SmallVector<Aliased, 8> aliased;
  DeviceIndex target = -1;
  bool has_cpu_tensor = false;
  c10::Device cpu_device(DeviceType::CPU);

  // Replaces a device tensor with its CPU alias; checks device agreement as PyTorch does.
  auto convert = [&](const at::Tensor& t, bool allow_cpu) -> at::Tensor {
    if (!t.defined()) return t;
    if (t.device().type() != DeviceType::CUDA) {
      if (!allow_cpu && t.dim() > 0) {
        if (target >= 0) device_mismatch(c10::Device(DeviceType::CUDA, target), t.device(), op);
        has_cpu_tensor = true;
      }
      return t;
    }
    DeviceIndex d = t.device().index();
    if (target < 0) {
      if (has_cpu_tensor) device_mismatch(t.device(), cpu_device, op);
      target = d;
    } else if (d != target) {
      device_mismatch(c10::Device(DeviceType::CUDA, target), t.device(), op);
    }
    at::Tensor a = cpu_alias(t);
    aliased.push_back({t, a});
    return a;
  };

  for (size_t i = 0; i < num_args; ++i) {
    c10::IValue& iv = (*stack)[base + i];
    if (iv.isTensor()) {
      iv = convert(iv.toTensor(), false);
    } else if (iv.isTensorList()) {
      map_tensor_lists(iv, [&](const at::Tensor& t) { return convert(t, false); });
    } else if (iv.isOptionalTensorList()) {
      // Index lists: real CUDA accepts CPU index tensors here.
      auto list = iv.toOptionalTensorList();
      for (size_t j = 0; j < list.size(); ++j) {
        std::optional<at::Tensor> e = list[j];
        if (e.has_value()) list[j] = convert(*e, true);
      }
      iv = std::move(list);
    } else if (iv.isList()) {  // Tensor[][] (c10d's allgather / reduce_scatter outputs)
      map_tensor_lists(iv, [&](const at::Tensor& t) { return convert(t, false); });
    } else if (iv.isDevice()) {
      c10::Device d = iv.toDevice();
      if (d.is_cuda()) {
        if (target < 0) target = d.has_index() ? d.index() : tl_device;
        iv = c10::IValue(cpu_device);
      }
    }
  }
  if (target < 0) target = tl_device;
  for (uint32_t i : traits.generator_args) {
    c10::IValue& iv = (*stack)[base + i];
    if (iv.isNone()) iv = c10::IValue(default_generator(target));
  }

  {
    BusyTimer busy(target);
    try {
      op.redispatchBoxed(c10::DispatchKeySet(c10::DispatchKey::CPU), stack);
    } catch (const c10::NotImplementedError&) {
      if (op.hasKernelForDispatchKey(c10::DispatchKey::CPU)) throw;
      not_emulated(op);
    }
  }

  // Writes (in-place / out=) may have resized an alias: carry that back to the device tensor.
  if (!aliased.empty() && traits.is_mutable) {
    for (auto& a : aliased) sync_back(a.orig, a.alias);
  }

  // Map results: an alias itself -> the original; a view of an alias -> a view of the original
  // storage; anything else is fresh CPU memory, re-labelled as memory of the target device (in
  // place where the result alone holds it, else on a new device storage shared by its views).
  c10::SmallVector<std::pair<c10::StorageImpl*, c10::Storage>, 2> adopted;
  auto map_back = [&](const at::Tensor& out) -> at::Tensor {
    if (!out.defined() || out.device().type() != DeviceType::CPU || out.layout() != c10::kStrided) return out;
    c10::StorageImpl* s = out.storage().unsafeGetStorageImpl();
    for (auto& a : aliased) {
      if (a.alias.unsafeGetTensorImpl() == out.unsafeGetTensorImpl()) return a.orig;
    }
    for (auto& a : aliased) {
      if (a.alias.storage().unsafeGetStorageImpl() == s) return on_storage(a.orig.storage(), out);
    }
    for (auto& p : adopted) {
      if (p.first == s) return on_storage(p.second, out);
    }
    adopted.emplace_back(s, adopt_storage(out.storage(), target));
    return on_storage(adopted.back().second, out);
  };
  const size_t num_returns = traits.num_returns;
  const size_t ret_base = stack->size() - num_returns;
  for (size_t i = 0; i < num_returns; ++i) {
    c10::IValue& iv = (*stack)[ret_base + i];
    if (iv.isTensor()) {
      // The common case, one fresh tensor that nothing else holds: take it out of the IValue so
      // that the IValue's reference does not count, re-label it, put it back.
      at::Tensor out = std::move(iv).toTensor();
      if (out.defined() && out.device().type() == DeviceType::CPU && out.layout() == c10::kStrided &&
          relabel_in_place(out, target)) {
        iv = std::move(out);
        continue;
      }
      iv = map_back(out);
    } else {
      map_tensor_lists(iv, map_back);
    }
  }
  for (auto& a : aliased) {
    a.orig.reset();
    recycle_alias(std::move(a.alias));
  }
}

// Aten ops with a CPU kernel but no CUDA kernel would otherwise reach CUDA through a
// CompositeExplicitAutogradNonFunctional "default backend kernel" (a functional wrapper around
// the out= variant), which behaves differently from the CPU path (extra out= resizes, warnings).
// Give every such aten op the fallback explicitly, so CUDA runs exactly the CPU kernel.
static const int g_register_cpu_twins = [] {
  static torch::Library aten(torch::Library::IMPL, "aten", c10::DispatchKey::CUDA, __FILE__, __LINE__);
  auto& dispatcher = c10::Dispatcher::singleton();
  // (c10d's ops keep torch's own CUDA kernels: they hand device tensors to the group's cuda
  // backend, the emulated NCCL of mirage/nccl.)
  for (const c10::OperatorName& name : dispatcher.getAllOpNames()) {
    if (name.name.rfind("aten::", 0) != 0) continue;
    auto op = dispatcher.findOp(name);
    if (!op || !op->hasKernelForDispatchKey(c10::DispatchKey::CPU)) continue;
    if (op->hasKernelForDispatchKey(c10::DispatchKey::CUDA)) continue;
    std::string qualified = name.name.substr(6) + (name.overload_name.empty() ? "" : "." + name.overload_name);
    aten.impl(qualified.c_str(), torch::CppFunction::makeFromBoxedFunction<&fallback>());
  }
  return 0;
}();
}  // namespace mirage

TORCH_LIBRARY_IMPL(_, CUDA, m) {
  m.fallback(torch::CppFunction::makeFromBoxedFunction<&mirage::fallback>());
}
