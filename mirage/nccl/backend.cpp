// The emulated NCCL backend's life (process_group.h says what each file of it does): a
// communicator connected through the transport NCCL would choose, shrunk, aborted, announced
// under NCCL_DEBUG=INFO; and the Python module that puts the class where torch.distributed
// looks for ProcessGroupNCCL (mirage/runtime/distributed.py).

#include "clock.h"
#include "gloo_on_device.h"
#include "process_group.h"

#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/extension.h>
#include <pybind11/chrono.h>

#include <unistd.h>

#include <set>
#include <sstream>

namespace mirage::nccl {

ProcessGroupNCCL::ProcessGroupNCCL(c10::intrusive_ptr<c10d::Store> store, int rank, int size, c10::intrusive_ptr<Options> options)
    : c10d::Backend(rank, size), store_(std::move(store)), options_(std::move(options)), uid_(next_uid()++) {
  blocking_wait_ = env_flag("TORCH_NCCL_BLOCKING_WAIT", false);
  measure_durations_ = env_flag("TORCH_NCCL_ENABLE_TIMING", false);
  async_error_handling_ = env_int("TORCH_NCCL_ASYNC_ERROR_HANDLING", 3);
  // NCCL leaves a node's shared memory and P2P paths for the network only when both are
  // turned off; so does the emulation.
  // The connection's keys, per torchrun attempt where the workers share the agent's store
  // (TORCHELASTIC_USE_AGENT_STORE): torchrun restarts them against that same store, where the
  // failed attempt's keys (a communicator segment long unlinked) still sit. Without it each
  // attempt's workers get a new store, and the attempt count, which is each agent's own, may
  // differ between ranks (a node that rejoined counts from 0): no prefix then.
  const bool agent_store = std::getenv("TORCHELASTIC_USE_AGENT_STORE") &&
                           std::string(std::getenv("TORCHELASTIC_USE_AGENT_STORE")) == "True";
  const auto connect_store = c10::make_intrusive<c10d::PrefixStore>(
      agent_store ? "mirage/attempt-" + std::to_string(env_int("TORCHELASTIC_RESTART_COUNT", 0)) : "mirage", store_);
  const bool p2p = !env_flag("NCCL_P2P_DISABLE", false);
  // --stand-ins: the transport joins the running members only (stand_ins.cpp)
  stand_ins_map_ = stand_in_map(rank, size, group_ranks());
  const int joined_rank = stand_ins_map_ ? stand_ins_map_->running_rank : rank;
  const int joined = stand_ins_map_ ? stand_ins_map_->running_size : size;
  comm_ = env_flag("NCCL_SHM_DISABLE", false) && !p2p ? connect_sockets(connect_store, joined_rank, joined, options_->timeout)
          : std::getenv("MIRAGE_ISOLATED_NODES") ? connect_across_nodes(connect_store, joined_rank, joined, p2p, options_->timeout)
          : connect_shared_memory(connect_store, joined_rank, joined, p2p, options_->timeout);
  TORCH_CHECK_WITH(DistBackendError, comm_, library(), " error: the emulated ", library(),
                   " runs inside a mirage session only (mirage run -- ...): no MIRAGE_SESSION, or /dev/shm "
                   "has no room for the communicator (`df -h /dev/shm`; NCCL_SHM_DISABLE=1 NCCL_P2P_DISABLE=1 "
                   "use sockets instead)");
  if (stand_ins_map_) {
    TORCH_CHECK(shim_clock().predict_only, "mirage --stand-ins needs --timing --predict-only");
    stand_ins_ = with_stand_ins(*comm_, *stand_ins_map_);
  }
  if (shim_clock().predict_only) without_payload_ = without_payload(stand_ins_ ? *stand_ins_ : *comm_);
  if (std::getenv("NCCL_DEBUG") && (std::string(std::getenv("NCCL_DEBUG")) == "INFO" ||
                                    std::string(std::getenv("NCCL_DEBUG")) == "TRACE")) {
    log_init();
  }
}

// dist.shrink_group: a communicator over the ranks not excluded, formed by those ranks alone
// (through this group's store, under a key of this communicator and shrink), as ncclCommShrink
// forms it from the parent without the excluded ranks. SHRINK_ABORT (1) aborts the parent first.
c10::intrusive_ptr<c10d::Backend> ProcessGroupNCCL::shrink(const std::vector<int64_t>& ranks_to_exclude, int shrink_flags,
                                                           const c10::intrusive_ptr<c10d::Backend::Options>& opts_override) {
  TORCH_CHECK(supportsShrinking(), "Backend nccl does not support shrink");
  const std::set<int64_t> excluded(ranks_to_exclude.begin(), ranks_to_exclude.end());
  TORCH_CHECK_VALUE(!excluded.count(rank_), "rank ", rank_, " is excluded from the shrunk group and must not call "
                    "shrink_group");
  if (shrink_flags & 1) abort();
  auto options = c10::make_intrusive<Options>(*options_);
  if (auto asked = c10::dynamic_intrusive_pointer_cast<Options>(opts_override)) options = c10::make_intrusive<Options>(*asked);
  const auto parent_ranks = group_ranks();
  options->global_ranks_in_group.clear();
  int new_rank = 0;
  for (int r = 0; r < size_; ++r) {
    if (excluded.count(r)) continue;
    if (r < rank_) ++new_rank;
    options->global_ranks_in_group.push_back(parent_ranks[static_cast<size_t>(r)]);
  }
  const auto store = c10::make_intrusive<c10d::PrefixStore>(
      "mirage/shrink/" + comm_->instance() + "/" + std::to_string(++shrinks_), store_);
  return c10::make_intrusive<ProcessGroupNCCL>(store, new_rank, static_cast<int>(options->global_ranks_in_group.size()),
                                               options);
}

void ProcessGroupNCCL::startCoalescing() {
  std::lock_guard<std::mutex> g(mu_);
  coalescing_ = true;
  coalesced_.clear();
}

c10::intrusive_ptr<c10d::Work> ProcessGroupNCCL::endCoalescing() {
  std::vector<c10::intrusive_ptr<EmulatedWork>> works;
  {
    std::lock_guard<std::mutex> g(mu_);
    coalescing_ = false;
    works.swap(coalesced_);
  }
  return c10::make_intrusive<CoalescedWork>(rank_, std::move(works));
}

void ProcessGroupNCCL::abort() {
  failed_ = true;
  comm_->abort();
  stop_worker();
}

uint64_t& ProcessGroupNCCL::next_uid() {
  static uint64_t uid = 0;
  return uid;
}

std::vector<uint64_t> ProcessGroupNCCL::group_ranks() const {
  if (!options_->global_ranks_in_group.empty()) return options_->global_ranks_in_group;
  std::vector<uint64_t> ranks;
  for (int r = 0; r < size_; ++r) ranks.push_back(static_cast<uint64_t>(r));
  return ranks;
}

int ProcessGroupNCCL::transport_peer(int peer) const {
  if (!stand_ins_map_) return peer;
  TORCH_CHECK(stand_ins_map_->runs[peer], "mirage --stand-ins: a send or receive with rank ",
              group_ranks()[peer], ", which is stood in for (not running); point-to-point peers must be in the "
              "running replica (pipeline stages are; data-parallel peers, and with --stand-ins-in-node the other "
              "ranks of a tensor-parallel group, are not). Where the data-parallel index is not the outermost, "
              "--stand-ins-stride says every how many ranks it changes");
  return stand_ins_map_->stand_in[peer];
}

int ProcessGroupNCCL::my_global_rank() const {
  if (!options_->global_ranks_in_group.empty()) return static_cast<int>(options_->global_ranks_in_group[rank_]);
  return rank_;  // the default group (torch gives it no list): group ranks are global ranks
}

// NCCL_DEBUG=INFO's line for a new communicator, as NCCL prints it, with what mirage adds.
void ProcessGroupNCCL::log_init() const {
  char host[256] = "?";
  gethostname(host, sizeof(host) - 1);
  const int device = c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA)->getDevice().index();
  std::string profile = std::getenv("MIRAGE_PROFILE") ? std::getenv("MIRAGE_PROFILE") : "?";
  profile = profile.substr(profile.rfind('/') + 1);
  profile = profile.substr(0, profile.rfind('.'));
  const char* node = std::getenv("MIRAGE_NODE_RANK");
  const char* local = std::getenv("LOCAL_RANK");
  std::ostringstream line;
  line << host << ":" << getpid() << " [" << device << "] " << library() << " INFO comm 0x" << instance()
       << " rank " << rank_ << " nRanks " << size_ << " node " << (node ? node : "0") << " localRank "
       << (local ? local : "0") << " cudaDev " << device << " profile " << profile << " group " << group_name()
       << " - Init COMPLETE (mirage emulated, transport " << comm_->transport() << ")\n";
  // Then each peer's path, as NCCL's channel set-up lines give it, and the NIC it uses.
  const std::string prefix = std::string(host) + ":" + std::to_string(getpid()) + " [" + std::to_string(device) + "] " +
                             library() + " INFO ";
  bool network = false;
  for (int peer = 0; peer < size_; ++peer) {
    if (peer == rank_) continue;
    const std::string path = comm_->peer_path(peer);
    network |= path.rfind("NET/", 0) == 0;
    line << prefix << "Channel 00/0 : " << rank_ << "[" << device << "] -> " << peer << " via " << path << "\n";
  }
  if (network) line << prefix << "NET/Socket : Using [0]" << socket_interface() << "<0>\n";
  // One write: ranks sharing a stderr (torchrun's) must not interleave their lines.
  const std::string text = line.str();
  (void)!::write(STDERR_FILENO, text.data(), text.size());
}

}  // namespace mirage::nccl

namespace {

// As torch's own bindings hold backends: the last reference dropped without the GIL.
template <typename T>
class NoGilHolder {
 public:
  NoGilHolder() = default;
  /* implicit */ NoGilHolder(c10::intrusive_ptr<T> impl) : impl_(std::move(impl)) {}
  explicit NoGilHolder(T* impl) : impl_(c10::intrusive_ptr<T>::unsafe_steal_from_new(impl)) {}
  ~NoGilHolder() {
    if (impl_ && PyGILState_Check()) {
      pybind11::gil_scoped_release release;
      impl_.reset();
    }
  }
  NoGilHolder(const NoGilHolder&) = default;
  NoGilHolder(NoGilHolder&&) noexcept = default;
  NoGilHolder& operator=(const NoGilHolder&) = default;
  NoGilHolder& operator=(NoGilHolder&&) noexcept = default;
  T* get() const noexcept { return impl_.get(); }
  T& operator*() const noexcept { return *impl_; }
  T* operator->() const noexcept { return impl_.get(); }

 private:
  c10::intrusive_ptr<T> impl_;
};

}  // namespace

PYBIND11_DECLARE_HOLDER_TYPE(T, NoGilHolder<T>, true)

// ProcessGroupNCCL.NCCL_CTA_POLICY_* (ncclConfig_t's CTA policies).
static const int kCtaDefault = 0, kCtaEfficiency = 1, kCtaZero = 2;

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  namespace py = pybind11;
  using mirage::nccl::NCCLConfig;
  using mirage::nccl::Options;
  using mirage::nccl::ProcessGroupNCCL;
  m.doc() = "mirage's emulated NCCL: a c10d backend over same-host shared memory";
  py::module::import("torch._C._distributed_c10d");  // registers the base classes

  auto pg = py::class_<ProcessGroupNCCL, c10d::Backend, NoGilHolder<ProcessGroupNCCL>>(m, "ProcessGroupNCCL");
  py::class_<NCCLConfig, c10::intrusive_ptr<NCCLConfig>>(pg, "NCCLConfig")
      .def(py::init<>())
      .def_readwrite("blocking", &NCCLConfig::blocking)
      .def_readwrite("cga_cluster_size", &NCCLConfig::cga_cluster_size)
      .def_readwrite("min_ctas", &NCCLConfig::min_ctas)
      .def_readwrite("max_ctas", &NCCLConfig::max_ctas)
      .def_readwrite("net_name", &NCCLConfig::net_name)
      .def_readwrite("split_share", &NCCLConfig::split_share)
      .def_readwrite("cta_policy", &NCCLConfig::cta_policy);
  py::class_<Options, c10d::Backend::Options, c10::intrusive_ptr<Options>>(pg, "Options")
      .def(py::init<bool>(), py::arg("is_high_priority_stream") = false)
      .def_readwrite("is_high_priority_stream", &Options::is_high_priority_stream)
      .def_readwrite("config", &Options::config)
      .def_readwrite("split_from", &Options::split_from)
      .def_readwrite("split_color", &Options::split_color)
      .def("__copy__", [](const Options& self) { return c10::make_intrusive<Options>(self); })
      .def("__deepcopy__", [](const Options& self, py::dict) { return c10::make_intrusive<Options>(self); });
  pg.def(py::init([](const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                     c10::intrusive_ptr<Options> options) {
           return c10::make_intrusive<ProcessGroupNCCL>(store, rank, size, std::move(options));
         }),
         py::arg("store"), py::arg("rank"), py::arg("size"), py::arg("options") = c10::make_intrusive<Options>(),
         py::call_guard<py::gil_scoped_release>())
      .def(py::init([](const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                       std::chrono::milliseconds timeout) {
             auto options = c10::make_intrusive<Options>();
             options->timeout = timeout;
             return c10::make_intrusive<ProcessGroupNCCL>(store, rank, size, std::move(options));
           }),
           py::arg("store"), py::arg("rank"), py::arg("size"), py::arg("timeout"),
           py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("options", &ProcessGroupNCCL::options)
      .def_property_readonly("uid", &ProcessGroupNCCL::uid)
      .def_property_readonly("_instance", &ProcessGroupNCCL::instance)
      .def("_add_ephemeral_timeout", &ProcessGroupNCCL::add_ephemeral_timeout)
      .def("_set_default_timeout", [](ProcessGroupNCCL& self, std::chrono::milliseconds t) { self.setTimeout(t); })
      .def("_group_start", [](ProcessGroupNCCL& self) { self.startCoalescing(); })
      .def("_group_end", [](ProcessGroupNCCL& self) { self.endCoalescing(); })
      .def("comm_split_count", [](ProcessGroupNCCL&) { return 0; })
      .def("_is_initialized", [](ProcessGroupNCCL&) { return true; })
      .def("perform_nocolor_split", [](ProcessGroupNCCL&, at::Device) {})
      .def("_verify_work_timeout", [](ProcessGroupNCCL&, const c10::intrusive_ptr<c10d::Work>&,
                                      std::chrono::milliseconds) { return false; })
      .def("_shutdown", [](ProcessGroupNCCL& self) { self.shutdown(); }, py::call_guard<py::gil_scoped_release>())
      .def_readonly_static("NCCL_CTA_POLICY_DEFAULT", &kCtaDefault)
      .def_readonly_static("NCCL_CTA_POLICY_EFFICIENCY", &kCtaEfficiency)
      .def_readonly_static("NCCL_CTA_POLICY_ZERO", &kCtaZero);
  py::class_<mirage::nccl::GlooOnDevice, c10d::Backend, NoGilHolder<mirage::nccl::GlooOnDevice>>(m, "GlooOnDevice")
      .def(py::init([](const c10::intrusive_ptr<c10d::Backend>& gloo) {
        return c10::make_intrusive<mirage::nccl::GlooOnDevice>(gloo);
      }));
  m.def("_set_session_fd", &mirage::nccl::set_session_fd);
  m.def("_set_nccl_version", [](const std::string& version) { mirage::nccl::nccl_version() = version; });
  m.def("_trace_pickle", [](bool include_collectives, bool only_active) {
    return py::bytes(mirage::nccl::trace_pickle(include_collectives, only_active));
  }, py::arg("include_collectives") = true, py::arg("only_active") = false);
}
