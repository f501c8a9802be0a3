#include "graph_capture.h"
#include "sparse_and_nested.h"

#include "config.h"
#include "device_guard.h"
#include "device_clock.h"
#include "device_memory.h"
#include "host_views.h"
#include "op_cost.h"
#include "op_path.h"
#include "unobserved_ops.h"

#include <ATen/ATen.h>
#include <torch/library.h>

#include <map>
#include <mutex>
#include <vector>

namespace mirage {

// As on a GPU, work issued while a graph is being captured is recorded, not run: each op's
// results are allocated with the shapes its Meta kernel computes (their contents undefined until
// a replay, as CUDA's), and the op, its arguments (the same device tensors) and its results are
// kept. A replay runs the recorded ops again in order, writing into the same result tensors, so
// new values in the captured inputs give new outputs. Capture is process-wide (autograd's device
// threads issue a captured backward pass). What a GPU refuses while capturing (copies to or
// from the host, synchronisation, data-dependent shapes) raises CUDA's error.

struct CapturedGraph {
  std::vector<std::function<void()>> steps;
};
static std::mutex g_graphs_mu;
static std::map<int64_t, CapturedGraph> g_graphs;
static int64_t g_next_graph = 1;
std::atomic<int64_t> g_capturing{0};
static std::atomic<bool> g_capture_failed{false};

[[noreturn]] void refuse_during_capture() {
  g_capture_failed = true;
  const char* api = config().amd ? "HIP" : "CUDA";
  TORCH_CHECK(false, api, " error: operation not permitted when stream is capturing\n", cuda_error_suffix());
}

// Whether `p` is memory of a private pool (what a graph captures into).
static bool in_private_pool(const void* p) {
  for (DeviceIndex d = 0; d < config().num_devices; ++d) {
    if (g_caches[d].in_private_segment(p)) return true;
  }
  return false;
}

// What a captured graph keeps of a tensor. Memory of a private pool is referred to, not owned (a
// CUDA graph holds addresses): the pool keeps the bytes while the graph holds the pool, and the
// tensor itself may die, as cudagraph trees expect of a graph's outputs. Other memory (parameters,
// inputs allocated before the capture) is kept alive with the graph, which on a GPU would be the
// caller's duty.
at::Tensor graph_reference(const at::Tensor& t) {
  if (!t.defined() || !t.has_storage()) return t;
  const c10::Storage& storage = t.storage();
  void* data = const_cast<void*>(storage.data());
  if (data == nullptr || !in_private_pool(data)) return t;
  c10::Storage alias(c10::Storage::use_byte_size_t(), storage.nbytes(), c10::DataPtr(data, storage.device()),
                     nullptr, false);
  auto impl = c10::make_intrusive<c10::TensorImpl>(
      std::move(alias), c10::DispatchKeySet(t.is_cuda() ? c10::DispatchKey::CUDA : c10::DispatchKey::CPU), t.dtype());
  impl->set_sizes_and_strides(t.sizes(), t.strides(), t.storage_offset());
  return at::Tensor(std::move(impl));
}

// A recorded op's argument as the graph keeps it (new lists: the caller's are left alone).
static c10::IValue graph_reference(const c10::IValue& iv) {
  if (iv.isTensor()) return graph_reference(iv.toTensor());
  if (iv.isTensorList()) {
    c10::List<at::Tensor> out;
    for (const at::Tensor& t : iv.toTensorList().vec()) out.push_back(graph_reference(t));
    return out;
  }
  if (iv.isOptionalTensorList()) {
    c10::List<std::optional<at::Tensor>> out;
    for (const std::optional<at::Tensor>& t : iv.toOptionalTensorList().vec()) {
      out.push_back(t.has_value() ? std::optional<at::Tensor>(graph_reference(*t)) : std::nullopt);
    }
    return out;
  }
  return iv;
}

void record_step(std::function<void()> step) {
  std::lock_guard<std::mutex> g(g_graphs_mu);
  g_graphs[g_capturing.load()].steps.push_back(std::move(step));
}

bool run_on_meta(const c10::OperatorHandle& op, torch::jit::Stack* stack, bool capture,
                 std::vector<std::pair<at::Tensor, size_t>>* fresh) {
  const size_t num_args = op.schema().arguments().size();
  const size_t base = stack->size() - num_args;
  std::vector<c10::IValue> originals;  // to run the kernel after all, outside a capture
  if (!capture) originals.assign(stack->begin() + static_cast<std::ptrdiff_t>(base), stack->end());
  bool host_tensor = false;
  std::vector<std::pair<at::Tensor, at::Tensor>> metas;  // (meta stand-in, device tensor)
  DeviceIndex target = tl_device;
  auto to_meta = [&](const at::Tensor& t) -> at::Tensor {
    if (!t.defined() || !t.is_cuda()) {
      if (t.defined() && t.dim() > 0) {
        if (capture) refuse_during_capture();  // a host tensor in device work
        host_tensor = true;
      }
      return t;
    }
    target = t.device().index();
    at::Tensor m = at::empty_strided(t.sizes(), t.strides(), t.options().device(c10::kMeta));
    metas.emplace_back(m, t);
    return m;
  };
  for (size_t i = base; i < stack->size(); ++i) {
    c10::IValue& iv = (*stack)[i];
    if (iv.isTensor()) {
      iv = to_meta(iv.toTensor());
    } else if (iv.isTensorList() || iv.isList()) {
      map_tensor_lists(iv, to_meta);
    } else if (iv.isOptionalTensorList()) {
      auto list = iv.toOptionalTensorList();
      for (size_t j = 0; j < list.size(); ++j) {
        std::optional<at::Tensor> e = list[j];
        if (e.has_value()) list[j] = to_meta(*e);
      }
      iv = std::move(list);
    } else if (iv.isDevice() && iv.toDevice().is_cuda()) {
      iv = c10::IValue(c10::Device(c10::kMeta));
    }
  }
  auto give_back = [&] {  // the arguments as they came, for the real kernel
    stack->resize(base);
    stack->insert(stack->end(), originals.begin(), originals.end());
    return false;
  };
  if (host_tensor) return give_back();
  try {
    op.redispatchBoxed(c10::DispatchKeySet(c10::DispatchKey::Meta), stack);
  } catch (...) {  // c10::Error, or a Python meta function's exception
    if (!capture) return give_back();
    refuse_during_capture();  // no shape without the data (nonzero, item, ...): the GPU syncs
  }
  const size_t num_returns = op.schema().returns().size();
  const size_t ret_base = stack->size() - num_returns;
  for (size_t i = 0; i < num_returns; ++i) {
    const c10::IValue& result = (*stack)[ret_base + i];
    // a host value from device data, or a nested or sparse tensor, whose makeup follows from it
    // (_nested_tensor_from_mask's components, to_sparse's nnz)
    if (!result.isTensor() || has_members(result.toTensor())) {
      if (!capture) return give_back();
      refuse_during_capture();
    }
  }
  for (size_t i = 0; i < num_returns; ++i) {
    c10::IValue& iv = (*stack)[ret_base + i];
    const at::Tensor m = iv.toTensor();
    if (!m.defined()) continue;  // a result the op was told not to compute (a norm's weight gradient)
    at::Tensor result;
    for (auto& [meta, device] : metas) {
      if (meta.unsafeGetTensorImpl() != m.unsafeGetTensorImpl()) continue;
      result = device;
      if (m.sizes() != device.sizes() || m.strides() != device.strides()) {  // an out= argument the kernel resized
        result.resize_(m.sizes());
        if (m.strides() != result.strides()) result.as_strided_(m.sizes(), m.strides(), m.storage_offset());
      }
    }
    if (!result.defined()) {
      for (auto& [meta, device] : metas) {
        if (meta.storage().is_alias_of(m.storage())) result = on_storage(device.storage(), m);
      }
    }
    if (!result.defined()) {
      result = at::empty_strided(m.sizes(), m.strides(), m.options().device(c10::Device(DeviceType::CUDA, target)));
      if (fresh) fresh->emplace_back(result, i);
    }
    iv = result;
  }
  return true;
}

// Records one op issued during capture and leaves its (not yet computed) results on the stack.
void capture_op(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  const size_t num_args = op.schema().arguments().size();
  const size_t base = stack->size() - num_args;
  // what the graph keeps of the arguments, taken before they are swapped for meta stand-ins
  std::vector<c10::IValue> inputs;
  for (size_t i = base; i < stack->size(); ++i) inputs.push_back(graph_reference((*stack)[i]));
  std::vector<std::pair<at::Tensor, size_t>> fresh;  // results the replay copies in, by position
  run_on_meta(op, stack, true, &fresh);
  for (auto& [captured, position] : fresh) captured = graph_reference(captured);
  record_step([op, inputs, fresh] {
    torch::jit::Stack replay(inputs.begin(), inputs.end());
    op.redispatchBoxed(c10::DispatchKeySet(c10::DispatchKey::CUDA), &replay);
    for (const auto& [captured, position] : fresh) {
      at::Tensor into = captured;
      into.copy_(replay[position].toTensor());
    }
  });
}

}  // namespace mirage

MIRAGE_LIBRARY(m) {
  // A capture on `device` whose allocations come from private pool (id0, id1).
  m.def("graph_capture_begin(int device, int id0, int id1) -> int", [](int64_t device, int64_t id0, int64_t id1) -> int64_t {
    std::lock_guard<std::mutex> g(mirage::g_graphs_mu);
    TORCH_CHECK(!mirage::capturing(), "Cannot capture a new graph while another one is being captured");
    mirage::check_index(static_cast<c10::DeviceIndex>(device));
    const int64_t id = mirage::g_next_graph++;
    mirage::g_graphs[id];
    mirage::g_capture_failed = false;
    mirage::g_capture_pool = {static_cast<uint64_t>(id0), static_cast<uint64_t>(id1)};
    mirage::g_capture_device.store(static_cast<int>(device), std::memory_order_release);
    mirage::g_capturing = id;
    return id;
  });
  m.def("graph_capture_end(int graph) -> ()", [](int64_t graph) {
    TORCH_CHECK(mirage::g_capturing.load() == graph, "graph ", graph, " is not being captured");
    mirage::g_capture_device.store(-1, std::memory_order_release);
    mirage::g_capturing = 0;
    if (mirage::g_capture_failed.exchange(false)) {
      const char* api = mirage::config().amd ? "HIP" : "CUDA";
      TORCH_CHECK(false, api, " error: operation failed due to a previous error during capture");
    }
  });
  m.def("graph_reference(Tensor t) -> Tensor", [](const at::Tensor& t) { return mirage::graph_reference(t); });
  // cudagraph trees' view of a private pool (torch._C._cuda_getCheckpointState and friends). A
  // checkpoint travels as ints: per segment its address, small (0/1), block count, then per block
  // size, requested size, allocated (0/1).
  m.def("graph_capturing() -> bool", []() { return mirage::capturing(); });
  m.def("graph_capture_id() -> int", []() -> int64_t { return mirage::g_capturing.load(); });
  // Work that does not pass the op path (a torch.compile'd graph's host kernels) joins the graph
  // being captured as a call of operator `op` (schema `(int handle) -> ()`) on each replay.
  m.def("graph_record_call(str op, int handle) -> ()", [](const std::string& name, int64_t handle) {
    TORCH_CHECK(mirage::capturing(), "graph_record_call: no CUDA graph is being captured");
    const c10::OperatorHandle op = c10::Dispatcher::singleton().findSchemaOrThrow(name.c_str(), "");
    mirage::record_step([op, handle] {
      torch::jit::Stack stack{c10::IValue(handle)};
      op.callBoxed(&stack);
    });
  });
  m.def("graph_check_not_capturing() -> ()", []() {
    if (mirage::capturing()) mirage::refuse_during_capture();
  });
  m.def("graph_replay(int graph) -> ()", [](int64_t graph) {
    std::vector<std::function<void()>> steps;
    {
      std::lock_guard<std::mutex> g(mirage::g_graphs_mu);
      auto it = mirage::g_graphs.find(graph);
      TORCH_CHECK(it != mirage::g_graphs.end(), "Called CUDAGraph::replay without a preceding successful capture.");
      steps = it->second.steps;
    }
    // One launch for the whole graph: its kernels follow each other on the stream without the
    // host's per-kernel launch cost (clocked mode).
    if (mirage::timing()) mirage::host_waits_for(mirage::host_time() + mirage::cost_model().launch_ns);
    mirage::ReplayScope replaying;
    for (auto& step : steps) step();
  });
  m.def("graph_reset(int graph) -> ()", [](int64_t graph) {
    std::lock_guard<std::mutex> g(mirage::g_graphs_mu);
    mirage::g_graphs.erase(graph);
  });
}
