// torch.profiler's GPU side (profiler_activities.h). A CPU build's Kineto has no CUPTI, but it
// has the plugin interface CUPTI's own profiler hosts child profilers through: a registered
// IActivityProfiler is configured with every trace, gets the correlation ID of each CPU op
// (pushCorrelationId, on the op's thread) and, when the trace stops, logs its activities beside
// the CPU ops, where torch links them to their ops as it links CUPTI's (key_averages()'s CUDA
// columns, the exported trace's kernel rows and launch-to-kernel flows).
//
// Each piece of device work recorded becomes what CUPTI reports for it: the launch on the CPU
// thread (cuda_runtime: cudaLaunchKernel, cudaMemcpyAsync) and the kernel or memcpy on its
// device's stream row, both carrying a correlation ID of their own and the CPU op's as their
// linked activity, with an ac2g flow between them. Device work is named as the real libraries
// name theirs (kernel_name), so that tools that sort kernels by name (HTA: NCCL's as
// communication) read it as they read a GPU's.
#include "profiler_activities.h"

#include "unobserved_ops.h"

#include <c10/util/ApproximateClock.h>

// libkineto's activities format their metadata with fmt, which libtorch links in but does not
// export: this file compiles its own (header-only) copy.
#define FMT_HEADER_ONLY
#include <GenericTraceActivity.h>
#include <IActivityProfiler.h>
#include <ThreadUtil.h>
#include <libkineto.h>
#include <output_base.h>

#include <unistd.h>

#include <cstdlib>
#include <deque>
#include <mutex>
#include <set>
#include <string>
#include <string_view>
#include <unordered_set>
#include <vector>

namespace mirage {

namespace {

using libkineto::ActivityType;
using libkineto::GenericTraceActivity;

struct Launched {
  Interval work;
  uint32_t launch;           // the process's launch number: the activities' correlation ID
  uint64_t cpu_correlation;  // the CPU op that launched it (0: none, e.g. a receive completing)
  int64_t launched_at;       // on the work's clock (predicted or wall)
  int32_t thread;            // the launching thread's system id (the CPU op's tid in the trace)
};

// What the session recording has collected, and how to present it.
struct Recording {
  std::mutex mu;
  std::vector<Launched> launched;
  // Clocked mode: where predicted time 0 lies on the trace's (wall) time axis. Every rank's
  // predicted clock has the same origin (collectives start at the same predicted time on all
  // their ranks), so the job's one epoch (MIRAGE_CLOCK_EPOCH_NS, the launcher's start) lines
  // the ranks' GPU sides up as a real job's are. Without it: the session's start.
  int64_t epoch = -1;
  // From the runtime (profiler_describe_devices): the trace's deviceProperties entries and the
  // naming style of the profiled GPU's libraries.
  std::string device_properties;
  std::string arch;  // "sm_90", "gfx942"
  bool amd = false;
};

Recording& recording() {
  static Recording r;
  return r;
}

// The CPU ops running on this thread, innermost last (Kineto pushes and pops them), and, on a
// thread that runs none (the emulated NCCL's worker), the one whose work it reports now.
thread_local std::vector<uint64_t> tl_cpu_ops;
thread_local uint64_t tl_adopted_cpu_op = 0;

bool starts_with(std::string_view s, std::string_view prefix) { return s.substr(0, prefix.size()) == prefix; }
bool contains(std::string_view s, std::string_view part) { return s.find(part) != std::string_view::npos; }

// NCCL's name for a data type, as its reducing kernels carry it.
std::string nccl_type(c10::ScalarType dtype) {
  switch (dtype) {
    case c10::ScalarType::BFloat16: return "bf16";
    case c10::ScalarType::Half: return "f16";
    case c10::ScalarType::Double: return "f64";
    case c10::ScalarType::Int: return "i32";
    case c10::ScalarType::Long: return "i64";
    case c10::ScalarType::Byte:
    case c10::ScalarType::Bool: return "u8";
    case c10::ScalarType::Char: return "i8";
    default: return "f32";
  }
}

// NCCL's device kernel for a collective the emulated NCCL names "nccl:<op>": reductions carry
// their operation and type (the emulated NCCL's reductions are reported as sums).
std::string nccl_kernel(std::string_view op, c10::ScalarType dtype) {
  std::string kernel;
  if (contains(op, "all_reduce") || contains(op, "allreduce") || contains(op, "barrier")) {
    kernel = "AllReduce_Sum_" + nccl_type(dtype);
  } else if (contains(op, "all_gather") || contains(op, "allgather")) {
    kernel = "AllGather";
  } else if (contains(op, "reduce_scatter")) {
    kernel = "ReduceScatter_Sum_" + nccl_type(dtype);
  } else if (contains(op, "broadcast")) {
    kernel = "Broadcast";
  } else if (op == "nccl:reduce") {
    kernel = "Reduce_Sum_" + nccl_type(dtype);
  } else {
    return "ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)";
  }
  return "ncclDevKernel_" + kernel + "_RING_LL(ncclDevKernelArgsStorage<4096ul>)";
}

// The GEMM library's kernel: cuBLAS's on NVIDIA parts (its Ampere and its sm90+ naming),
// hipBLASLt's (Tensile's) on AMD ones.
std::string gemm_kernel(const Recording& r, c10::ScalarType dtype) {
  const bool bf16 = dtype == c10::ScalarType::BFloat16, f16 = dtype == c10::ScalarType::Half;
  if (r.amd) {  // Tensile's type code: inputs, outputs, compute
    return std::string("Cijk_Alik_Bljk_") + (bf16 ? "BBS_BH" : f16 ? "HHS_BH" : "S") +
           "_MT256x256x64_MI32x32x8x1_SN_LDSB1_GRVW8_WG32_8_1";
  }
  const std::string sm = "sm" + (starts_with(r.arch, "sm_") ? r.arch.substr(3) : std::string("90"));
  if (starts_with(sm, "sm8")) {
    return bf16 ? "ampere_bf16_s16816gemm_bf16_128x256_ldg8_f2f_stages_64x3_tn"
                : f16 ? "ampere_fp16_s16816gemm_fp16_128x256_ldg8_f2f_stages_64x3_tn" : "ampere_sgemm_128x64_tn";
  }
  const std::string types = bf16 ? "bf16bf16_bf16f32_f32" : f16 ? "f16f16_f16f32_f32" : "f32f32_f32f32_f32";
  return sm + "_xmma_gemm_" + types + "_tn_n_tilesize128x256x64_warpgroupsize2x1x1_execute_segment_k_off_kernel__5x_cublas";
}

// Fused attention's kernels: FlashAttention-2 (CUDA), AOTriton (ROCm), cuDNN's and
// memory-efficient attention's, and inductor's template for FlexAttention.
std::string attention_kernel(const Recording& r, std::string_view op, c10::ScalarType dtype) {
  const bool backward = contains(op, "backward");
  if (contains(op, "flex_attention")) return backward ? "triton_tem_fused_flex_attention_backward_0" : "triton_tem_fused_flex_attention_0";
  if (r.amd) return backward ? "bwd_kernel_dk_dv" : "attn_fwd";
  if (contains(op, "cudnn")) {
    return backward ? "cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_3_64x64x128_4x1x1_kernel0_0"
                    : "cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_3_64x64x128_4x1x1_kernel0_0";
  }
  if (contains(op, "efficient")) {  // its kernels are named by their data type
    const char* type = dtype == c10::ScalarType::BFloat16 ? "bf16" : dtype == c10::ScalarType::Half ? "f16" : "f32";
    return std::string(backward ? "fmha_cutlassB_" : "fmha_cutlassF_") + type +
           (backward ? "_aligned_64x64_k128_sm80" : "_aligned_64x64_rf_sm80");
  }
  return backward ? "void pytorch_flash::flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel<Flash_bwd_kernel_traits<128, 64, 128, 8, 2, 4, 2, false, false, cutlass::bfloat16_t, Flash_kernel_traits<128, 64, 128, 8, cutlass::bfloat16_t> >, false, true, false, false, false, true, false, false>(pytorch_flash::Flash_bwd_params)"
                  : "void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128, 64, 4, false, false, cutlass::bfloat16_t, Flash_kernel_traits<128, 128, 64, 4, cutlass::bfloat16_t> >, false, true, false, false, true, true, false, false>(pytorch_flash::Flash_fwd_params)";
}

// ATen's CUDA kernel for the rest, by the family its CUDA implementation uses.
std::string aten_kernel(std::string_view op) {
  static const std::unordered_set<std::string_view> reductions{
      "aten::sum", "aten::mean", "aten::norm", "aten::linalg_vector_norm", "aten::amax", "aten::amin", "aten::max",
      "aten::min", "aten::var", "aten::std", "aten::var_mean", "aten::prod", "aten::any", "aten::all",
      "aten::argmax", "aten::argmin", "aten::_foreach_norm", "aten::nansum", "aten::logsumexp"};
  const std::string name(op);
  if (starts_with(op, "aten::_fused_adam")) {
    return "void at::native::(anonymous namespace)::multi_tensor_apply_kernel<at::native::(anonymous namespace)::TensorListMetadata<4>, at::native::(anonymous namespace)::FusedAdamMathFunctor<float, 4, (at::native::ADAM_MODE)1, false> >(" + name + ")";
  }
  if (starts_with(op, "aten::_foreach_")) {
    return "void at::native::(anonymous namespace)::multi_tensor_apply_kernel<" + name + ">";
  }
  if (contains(op, "softmax")) return "void (anonymous namespace)::cunn_SoftMaxForward<" + name + ">";
  if (contains(op, "layer_norm")) return "void at::native::(anonymous namespace)::vectorized_layer_norm_kernel<" + name + ">";
  if (reductions.count(op)) return "void at::native::reduce_kernel<512, 1, at::native::ReduceOp<" + name + "> >";
  return "void at::native::vectorized_elementwise_kernel<4, " + name + ">";
}

bool is_gemm(std::string_view op) {
  static const std::unordered_set<std::string_view> gemms{"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm",
                                                         "aten::_scaled_mm", "aten::addbmm", "aten::_int_mm"};
  return gemms.count(op) != 0;
}

// What CUPTI calls a memcpy: its direction and the memory on each side.
std::string memcpy_name(std::string_view name) {
  if (contains(name, "HtoD")) return "Memcpy HtoD (Pageable -> Device)";
  if (contains(name, "DtoH") || name == "aten::_local_scalar_dense") return "Memcpy DtoH (Device -> Pageable)";
  return "Memcpy DtoD (Device -> Device)";
}

std::string kernel_name(const Recording& r, const Interval& w) {
  const std::string_view op(w.name ? w.name : "");
  if (w.kind == WorkKind::kCollective) return nccl_kernel(op, w.dtype);
  if (is_memcpy(w.name)) return memcpy_name(op);
  if (is_gemm(op)) return gemm_kernel(r, w.dtype);
  if (contains(op, "attention")) return attention_kernel(r, op, w.dtype);
  // a compiled graph's fused kernels, as one: inductor names its generated kernels so
  if (op == kCompiledGraph) return "triton_poi_fused_0";
  return aten_kernel(op);
}

// A stream's row: CUDA's legacy default stream is stream 7 in every Kineto trace.
int32_t stream_row(c10::StreamId stream) { return stream == 0 ? 7 : static_cast<int32_t>(stream); }

class Session final : public libkineto::IActivityProfilerSession {
 public:
  void start() override {
    Recording& r = recording();
    const int64_t predicted = timing() ? host_time() : 0;  // before r.mu: keep() takes the timeline's lock, then it
    const char* epoch = std::getenv("MIRAGE_CLOCK_EPOCH_NS");
    {
      std::lock_guard<std::mutex> g(r.mu);
      r.launched.clear();
      r.epoch = epoch && *epoch ? std::strtoll(epoch, nullptr, 10) : profiler_wall_ns() - predicted;
    }
    g_profiling_device.store(true);
    status_ = libkineto::TraceStatus::RECORDING;
  }

  void stop() override {
    g_profiling_device.store(false);
    status_ = libkineto::TraceStatus::PROCESSING;
  }

  std::vector<std::string> errors() override { return {}; }

  void pushCorrelationId(uint64_t id) override { tl_cpu_ops.push_back(id); }
  void popCorrelationId() override {
    if (!tl_cpu_ops.empty()) tl_cpu_ops.pop_back();
  }

  void processTrace(libkineto::ActivityLogger& logger) override {
    processTrace(logger, [](int32_t) -> const libkineto::ITraceActivity* { return nullptr; }, 0, 0);
  }

  void processTrace(libkineto::ActivityLogger& logger, libkineto::getLinkedActivityCallback cpu_op, int64_t,
                    int64_t) override {
    Recording& r = recording();
    std::vector<Launched> launched;
    {
      std::lock_guard<std::mutex> g(r.mu);
      launched.swap(r.launched);
    }
    const int32_t pid = static_cast<int32_t>(getpid());
    // Predicted times go on the trace's axis from the job's epoch; host times are on it.
    const int64_t shift = timing() ? r.epoch : 0;
    for (const Launched& l : launched) {
      const Interval& w = l.work;
      const std::string name = kernel_name(r, w);
      const bool copy = is_memcpy(w.name);
      const auto* op = l.cpu_correlation ? cpu_op(static_cast<int32_t>(l.cpu_correlation)) : nullptr;
      const auto correlation = static_cast<int32_t>(l.launch & 0x7fffffffu);
      GenericTraceActivity& launch = activities_.emplace_back(span_, ActivityType::CUDA_RUNTIME,
          copy ? (r.amd ? "hipMemcpyWithStream" : "cudaMemcpyAsync") : (r.amd ? "hipLaunchKernel" : "cudaLaunchKernel"));
      launch.startTime = l.launched_at + shift;
      launch.endTime = l.launched_at + shift;
      launch.device = pid;
      launch.resource = l.thread;
      launch.threadId = l.thread;
      launch.id = correlation;
      launch.linked = op;
      launch.flow.id = static_cast<uint32_t>(correlation);
      launch.flow.type = libkineto::kLinkAsyncCpuGpu;
      launch.flow.start = true;
      launch.addMetadata("correlation", correlation);

      GenericTraceActivity& kernel = activities_.emplace_back(
          span_, copy ? ActivityType::GPU_MEMCPY : ActivityType::CONCURRENT_KERNEL, name);
      kernel.startTime = w.start + shift;
      kernel.endTime = w.end + shift;
      kernel.device = w.device;
      kernel.resource = stream_row(w.stream);
      kernel.id = correlation;
      kernel.linked = op;
      kernel.flow.id = static_cast<uint32_t>(correlation);
      kernel.flow.type = libkineto::kLinkAsyncCpuGpu;
      kernel.flow.start = false;
      kernel.addMetadata("device", static_cast<int>(w.device));
      kernel.addMetadata("stream", stream_row(w.stream));
      kernel.addMetadata("correlation", correlation);
      if (copy) {
        kernel.addMetadata("bytes", w.bytes);
        const int64_t ns = std::max<int64_t>(w.end - w.start, 1);
        kernel.addMetadata("memory bandwidth (GB/s)", static_cast<double>(w.bytes) / static_cast<double>(ns));
      }
      rows_.insert({w.device, stream_row(w.stream)});
    }
    for (const auto& activity : activities_) logger.handleGenericActivity(activity);
  }

  std::unique_ptr<libkineto::DeviceInfo> getDeviceInfo() override { return nullptr; }

  std::vector<libkineto::ResourceInfo> getResourceInfos() override {
    std::vector<libkineto::ResourceInfo> infos;
    for (const auto& [device, stream] : rows_) {
      infos.push_back({stream, stream, device, "stream " + std::to_string(stream)});
    }
    return infos;
  }

  std::unique_ptr<libkineto::CpuTraceBuffer> getTraceBuffer() override { return nullptr; }

  std::string getDeviceProperties() override { return recording().device_properties; }

  // Where the GPU side's times come from, in the trace's metadata (a real box's trace has no
  // such key; a reader of this one must be able to tell predicted from measured).
  std::unordered_map<std::string, std::string> getMetadata() override {
    return {{"mirage_device_time", timing() ? "\"predicted (mirage clocked mode)\""
                                            : "\"host (mirage: each kernel's time on this machine's CPU)\""}};
  }

 private:
  libkineto::TraceSpan span_{0, 0, "mirage"};
  std::deque<GenericTraceActivity> activities_;  // logged by address: a deque keeps them in place
  std::set<std::pair<int32_t, int32_t>> rows_;
};

class Profiler final : public libkineto::IActivityProfiler {
 public:
  const std::string& name() const override { return name_; }
  const std::set<ActivityType>& availableActivities() const override { return activities_; }

  std::unique_ptr<libkineto::IActivityProfilerSession> configure(const std::set<ActivityType>& asked,
                                                                 const libkineto::Config&) override {
    if (!asked.count(ActivityType::CONCURRENT_KERNEL) && !asked.count(ActivityType::GPU_MEMCPY)) return nullptr;
    return std::make_unique<Session>();
  }
  std::unique_ptr<libkineto::IActivityProfilerSession> configure(int64_t, int64_t, const std::set<ActivityType>& asked,
                                                                 const libkineto::Config& config) override {
    return configure(asked, config);
  }

 private:
  const std::string name_ = "mirage";
  const std::set<ActivityType> activities_{ActivityType::CONCURRENT_KERNEL, ActivityType::GPU_MEMCPY,
                                           ActivityType::CUDA_RUNTIME};
};

const bool registered = [] {
  libkineto::api().registerProfilerFactory([] { return std::make_unique<Profiler>(); });
  return true;
}();

}  // namespace

int64_t profiler_wall_ns() { return c10::getTime(); }

void note_device_work(const Interval& work, int64_t launched_at, uint32_t launch) {
  Recording& r = recording();
  const uint64_t op = tl_cpu_ops.empty() ? tl_adopted_cpu_op : tl_cpu_ops.back();
  const auto thread = static_cast<int32_t>(libkineto::systemThreadId());
  std::lock_guard<std::mutex> g(r.mu);
  r.launched.push_back({work, launch, op, launched_at, thread});
}

}  // namespace mirage

extern "C" {
int mirage_profiler_recording() { return mirage::profiling_device() ? 1 : 0; }

int64_t mirage_profiler_wall_ns() { return mirage::profiler_wall_ns(); }

uint64_t mirage_profiler_cpu_op() {
  return mirage::profiling_device() && !mirage::tl_cpu_ops.empty() ? mirage::tl_cpu_ops.back() : 0;
}

void mirage_profiler_adopt_cpu_op(uint64_t op) { mirage::tl_adopted_cpu_op = op; }

void mirage_profiler_collective(int device, int64_t stream, int64_t start, int64_t end, const char* name,
                                int64_t bytes, int dtype) {
  if (!mirage::profiling_device()) return;
  mirage::note_device_work(mirage::Interval{start, end, name, bytes, 0, stream, mirage::WorkKind::kCollective,
                                            static_cast<mirage::DeviceIndex>(device),
                                            dtype < 0 ? c10::ScalarType::Undefined : static_cast<c10::ScalarType>(dtype)},
                           start, mirage::count_launch());
}
}

// The runtime describes the profiled GPUs once (mirage/runtime/torch_cuda.py): the trace's
// deviceProperties (a JSON object per device, as a CUDA build writes them) and the kernel names'
// style.
MIRAGE_LIBRARY(m) {
  m.def("profiler_describe_devices(str properties, str arch, bool amd) -> ()",
        [](const std::string& properties, const std::string& arch, bool amd) {
          auto& r = mirage::recording();
          std::lock_guard<std::mutex> g(r.mu);
          r.device_properties = properties;
          r.arch = arch;
          r.amd = amd;
        });
}
