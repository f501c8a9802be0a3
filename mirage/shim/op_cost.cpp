// The cost model (op_cost.h): its parameters, kernels, copies, collectives, FLOP counts.
#include "op_cost.h"

#include <sstream>

#include "device_guard.h"
#include "unobserved_ops.h"
#include "unprofiled.h"

#include <ATen/Context.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <map>
#include <mutex>
#include <shared_mutex>
#include <string>
#include <unordered_map>
#include <unordered_set>

namespace mirage {

namespace {

// MIRAGE_TIMING_MODEL: "key=value,key=value" (mirage/runtime/timing.py writes it from the
// profile's [timing] table and the tuning file). A missing key is mirage's bug, not the user's.
std::map<std::string, double> read_parameters() {
  std::map<std::string, double> values;
  const char* text = std::getenv("MIRAGE_TIMING_MODEL");
  std::string all = text ? text : "";
  size_t at = 0;
  while (at < all.size()) {
    size_t comma = all.find(',', at);
    if (comma == std::string::npos) comma = all.size();
    const std::string item = all.substr(at, comma - at);
    const size_t eq = item.find('=');
    if (eq != std::string::npos) values[item.substr(0, eq)] = std::strtod(item.c_str() + eq + 1, nullptr);
    at = comma + 1;
  }
  return values;
}

double need(const std::map<std::string, double>& values, const char* key) {
  auto it = values.find(key);
  TORCH_CHECK(it != values.end(), "mirage: clocked mode's model has no '", key, "' (MIRAGE_TIMING_MODEL)");
  return it->second;
}

// MIRAGE_SLOW_GPUS "rank:factor,..." and MIRAGE_SLOW_LINKS "a-b:factor,..." (the launcher's
// encoding of --fault slow-gpu / slow-link, checked there).
void read_slowdowns(CostModel& m) {
  const std::string rank = std::getenv("RANK") ? std::getenv("RANK") : "0";  // a lone process is rank 0
  std::stringstream gpus(std::getenv("MIRAGE_SLOW_GPUS") ? std::getenv("MIRAGE_SLOW_GPUS") : "");
  for (std::string entry; std::getline(gpus, entry, ',');) {
    const auto colon = entry.find(':');
    if (colon != std::string::npos && entry.substr(0, colon) == rank) m.gpu_slowdown = std::stod(entry.substr(colon + 1));
  }
  std::stringstream links(std::getenv("MIRAGE_SLOW_LINKS") ? std::getenv("MIRAGE_SLOW_LINKS") : "");
  for (std::string entry; std::getline(links, entry, ',');) {
    const auto dash = entry.find('-'), colon = entry.find(':');
    if (dash == std::string::npos || colon == std::string::npos) continue;
    m.slow_links.push_back({std::stoll(entry.substr(0, dash)), std::stoll(entry.substr(dash + 1, colon - dash - 1)),
                            std::stod(entry.substr(colon + 1))});
  }
}

// A GEMM's output tiles: ceil(rows / tile_m) x ceil(cols / tile_n) per batch.
static int64_t output_tiles(const CostModel& m, int64_t batch, int64_t rows, int64_t cols) {
  return batch * ((rows + m.tile_m - 1) / m.tile_m) * ((cols + m.tile_n - 1) / m.tile_n);
}

// One wave's epilogue: each unit storing its output tile while every unit stores, a share of it
// not hidden behind the main loop (gemm_epilogue_share, fitted to XLA's H100 matmul table).
static double epilogue_ns(const CostModel& m, at::ScalarType dtype) {
  const double tile_bytes = static_cast<double>(m.tile_m * m.tile_n) * std::max<int64_t>(2, c10::elementSize(dtype));
  return m.gemm_epilogue_share * static_cast<double>(m.compute_units) * tile_bytes / m.memory_bytes_per_ns;
}

// A GEMM of `flops` and `shape` on `units` compute units, each running its main loop at
// `unit_flops_per_ns`: its tiles (each split along K when the grid cannot fill the units) in whole
// waves, each wave its main loop and its epilogue.
static double gemm_waves_ns(const CostModel& m, double flops, GemmShape shape, int64_t units,
                            double unit_flops_per_ns, double epilogue) {
  int64_t splits = 1;
  if (shape.tiles < units && m.gemm_split_k_min > 0)
    splits = std::max<int64_t>(1, std::min(units / shape.tiles, shape.k / m.gemm_split_k_min));
  const int64_t pieces = shape.tiles * splits;
  const int64_t waves = (pieces + units - 1) / units;
  return static_cast<double>(waves) * (flops / static_cast<double>(pieces) / unit_flops_per_ns + epilogue);
}

CostModel load_model() {
  const auto p = read_parameters();
  constexpr double kGBs = 1.0;  // 1 GB/s = 1 byte/ns
  constexpr double kTflops = 1e3;  // 1 TFLOP/s = 1000 FLOP/ns
  CostModel m{};
  m.launch_ns = static_cast<int64_t>(need(p, "launch_us") * 1e3);
  m.kernel_fixed_ns = need(p, "kernel_overhead_us") * 1e3;
  m.memory_bytes_per_ns = need(p, "memory_bandwidth_gbs") * need(p, "memory_efficiency") * kGBs;
  m.general_bytes_per_ns = need(p, "memory_bandwidth_gbs") * need(p, "memory_efficiency_general") * kGBs;
  m.host_link_bytes_per_ns = need(p, "host_link_gbs") * kGBs;
  m.flops_per_ns_bf16 = need(p, "peak_tflops.bf16") * kTflops;
  m.flops_per_ns_fp16 = need(p, "peak_tflops.fp16") * kTflops;
  m.flops_per_ns_fp8 = need(p, "peak_tflops.fp8") * kTflops;
  m.flops_per_ns_fp32 = need(p, "peak_tflops.fp32") * kTflops;
  m.flops_per_ns_tf32 = need(p, "peak_tflops.tf32") * kTflops;
  m.gemm_efficiency = need(p, "gemm_efficiency");
  m.gemm_efficiency_fp8 = need(p, "gemm_efficiency_fp8");
  m.attention_efficiency = need(p, "attention_efficiency");
  m.attention_backward_efficiency = need(p, "attention_backward_efficiency");
  m.attention_causal_factor = need(p, "attention_causal_factor");
  m.attention_backward_causal_factor = need(p, "attention_backward_causal_factor");
  m.attention_block_rows = static_cast<int64_t>(need(p, "attention_block_rows"));
  m.attention_block_overhead = need(p, "attention_block_overhead");
  m.attention_backward_block_overhead = need(p, "attention_backward_block_overhead");
  m.attention_softmax_head_dims = need(p, "attention_softmax_head_dims");
  m.torch_flash_attention_rate = need(p, "torch_flash_attention_rate");
  m.torch_flash_attention_causal_rate = need(p, "torch_flash_attention_causal_rate");
  m.tile_m = static_cast<int64_t>(need(p, "gemm_tile_m"));
  m.tile_n = static_cast<int64_t>(need(p, "gemm_tile_n"));
  m.compute_units = static_cast<int64_t>(need(p, "compute_units"));
  m.nccl_compute_units = static_cast<int64_t>(need(p, "nccl_compute_units"));
  // A GPU's links are quoted both directions together; a ring uses one direction of each.
  const double link_one_way = need(p, "link_bandwidth_gbs") / 2 * kGBs;
  m.bus_bytes_per_ns = link_one_way * need(p, "nccl_bus_efficiency");
  m.nvls_bytes_per_ns = link_one_way * need(p, "nvls_bus_efficiency");
  m.bus_latency_ns = need(p, "nccl_latency_us") * 1e3;
  m.ll_latency_ns = need(p, "nccl_ll_latency_us") * 1e3;
  m.ll_efficiency = need(p, "nccl_ll_efficiency");
  m.nic_bytes_per_ns = need(p, "nic_bandwidth_gbs") * need(p, "nic_efficiency") * kGBs;
  m.nic_latency_ns = need(p, "nic_latency_us") * 1e3;
  m.p2p_bytes_per_ns = link_one_way * need(p, "nccl_bus_efficiency");
  m.gemm_epilogue_share = need(p, "gemm_epilogue_share");
  m.gemm_split_k_min = static_cast<int64_t>(need(p, "gemm_split_k_min"));
  m.shared_memory_per_block = static_cast<int64_t>(need(p, "shared_memory_per_block"));
  m.warp_size = static_cast<int64_t>(need(p, "warp_size"));
  read_slowdowns(m);
  return m;
}

double peak_flops_per_ns(const CostModel& m, at::ScalarType dtype) {
  switch (dtype) {
    case at::kBFloat16: return m.flops_per_ns_bf16;
    case at::kHalf: return m.flops_per_ns_fp16;
    case at::kFloat8_e4m3fn:
    case at::kFloat8_e5m2:
    case at::kFloat8_e4m3fnuz:
    case at::kFloat8_e5m2fnuz: return m.flops_per_ns_fp8;
    case at::kFloat:  // TF32 tensor cores only where torch allows them (allow_tf32 / matmul precision)
      return at::globalContext().allowTF32CuBLAS() ? m.flops_per_ns_tf32 : m.flops_per_ns_fp32;
    default: return m.flops_per_ns_fp32;  // other dtypes: the vector units at best
  }
}

// The aten operators torch.utils.flop_counter has a formula for (set once by the runtime).
struct FlopOps {
  std::shared_mutex mu;
  std::unordered_set<std::string> names;
  std::unordered_map<std::string, double> counted;  // by operator and argument shapes
};
FlopOps& flop_ops() {
  static FlopOps f;
  return f;
}

// What determines a FLOP count: the operator, its tensors' shapes and dtypes, its other arguments.
void append_key(std::string& key, const c10::IValue& v) {
  if (v.isTensor()) {
    const at::Tensor& t = v.toTensor();
    if (!t.defined()) {
      key += 'u';
      return;
    }
    key += 't';
    key += static_cast<char>(t.scalar_type());
    for (int64_t d : t.sizes()) key.append(reinterpret_cast<const char*>(&d), sizeof d);
  } else if (v.isInt()) {
    const int64_t i = v.toInt();
    key += 'i';
    key.append(reinterpret_cast<const char*>(&i), sizeof i);
  } else if (v.isBool()) {
    key += v.toBool() ? 'T' : 'F';
  } else if (v.isDouble()) {
    const double d = v.toDouble();
    key += 'd';
    key.append(reinterpret_cast<const char*>(&d), sizeof d);
  } else if (v.isList()) {
    key += '[';
    for (const c10::IValue& e : v.toListRef()) append_key(key, e);
    key += ']';
  } else {
    key += '?';
  }
}

}  // namespace

const CostModel& cost_model() {
  static const CostModel m = load_model();
  return m;
}

KernelCost kernel_cost(double flops, int64_t bytes, at::ScalarType dtype, GemmShape gemm, ComputeKind kind,
                       bool general, int kernels) {
  const CostModel& m = cost_model();
  const bool fp8 = dtype == at::kFloat8_e4m3fn || dtype == at::kFloat8_e5m2 || dtype == at::kFloat8_e4m3fnuz ||
                   dtype == at::kFloat8_e5m2fnuz;
  const double efficiency = kind == ComputeKind::kAttention           ? m.attention_efficiency
                            : kind == ComputeKind::kAttentionBackward ? m.attention_backward_efficiency
                            : fp8                                     ? m.gemm_efficiency_fp8
                                                                      : m.gemm_efficiency;
  const double rate = peak_flops_per_ns(m, dtype) * efficiency;  // the whole GPU's
  const double epilogue = gemm.tiles > 0 ? epilogue_ns(m, dtype) : 0.0;
  // The FLOPs' time on `units` compute units: a GEMM of known shape in waves over them, other
  // work spread over them evenly.
  auto compute_on = [&](int64_t units) {
    if (flops <= 0) return 0.0;
    const double unit_rate = rate / static_cast<double>(m.compute_units);
    if (gemm.tiles > 0) return gemm_waves_ns(m, flops, gemm, units, unit_rate, epilogue);
    return flops / (unit_rate * static_cast<double>(units));
  };
  const double compute = compute_on(m.compute_units);
  const double shared = compute_on(std::max<int64_t>(m.compute_units - m.nccl_compute_units, 1));
  const double memory =
      static_cast<double>(bytes) / (general && flops <= 0 ? m.general_bytes_per_ns : m.memory_bytes_per_ns);
  const double fixed = m.kernel_fixed_ns * kernels;
  const double ns = std::max(compute, memory) + fixed;
  return {static_cast<int64_t>(std::llround(ns)), flops > 0 && compute >= memory ? WorkKind::kCompute : WorkKind::kMemory,
          Beside{shared, memory, fixed}};
}

bool has_implementation_traffic(const c10::FunctionSchema& schema) {
  static const std::unordered_set<std::string> noted{
      "aten::native_layer_norm_backward", "aten::_fused_rms_norm_backward", "aten::_softmax", "aten::_log_softmax",
      "aten::_softmax_backward_data", "aten::_log_softmax_backward_data", "aten::nll_loss_forward",
      "aten::nll_loss_backward"};
  return noted.count(schema.name()) != 0;
}

static int64_t bytes_of(const at::Tensor& t) { return static_cast<int64_t>(t.numel() * t.itemsize()); }

// How many more times than once SoftMax.cu's kernel reads `rows` along `dim` (op_cost.h,
// softmax_traffic): 0, or the forward's 2 and the backward's 1 where a row fits no faster kernel.
static int softmax_rereads(const at::Tensor& rows, int64_t dim, bool backward, bool widening) {
  if (rows.dim() == 0 || rows.numel() == 0) return 0;
  dim = c10::maybe_wrap_dim(dim, rows.dim());
  const int passes = backward ? 1 : 2;
  int64_t inner = 1;
  for (int64_t d = dim + 1; d < rows.dim(); ++d) inner *= rows.size(d);
  if (inner != 1) return passes;  // the spatial kernel
  const CostModel& m = cost_model();
  const int64_t n = rows.size(dim), element = static_cast<int64_t>(rows.itemsize());
  const int64_t ilp = std::max<int64_t>(16 / element, 1);  // elements per 16-byte load
  int64_t block = 1;
  if (!backward) {
    if (widening ? n <= 1024 && n * element <= 4096 : n <= 2048 && n * element <= 8192) return 0;  // persistent
    block = (std::min<int64_t>(n, 1024) + m.warp_size - 1) / m.warp_size * m.warp_size;
    if (!widening && (n + block - 1) / block < 10) return 0;  // cunn_SoftMaxForwardReg
  } else {
    const int64_t grad_input_element = widening ? 2 : element;  // a widening backward returns half
    if (n <= 1024 && n * grad_input_element <= 4096) return 0;  // persistent
    const int64_t largest = std::min<int64_t>(n / ilp, 1024) / (ilp > 1 ? 2 : 1);  // SoftMax_getBlockSize
    while (block < largest) block *= 2;
    block = std::max(block, m.warp_size);
  }
  const int64_t accumulator = rows.scalar_type() == at::kDouble ? 8 : 4;  // a block reduction's per-warp slots
  const int64_t cached = (m.shared_memory_per_block - block / m.warp_size * accumulator) / element;
  if (n < cached && n % ilp == 0) return 0;  // cunn_SoftMaxForwardSmem / cunn_SoftMaxBackwardSmem
  return passes;
}

ImplementationTraffic softmax_traffic(const std::string& op, const c10::IValue* args) {
  const at::Tensor& first = args[0].toTensor();  // the input, or the output's gradient
  if (op == "aten::_softmax" || op == "aten::_log_softmax")  // (self, dim, half_to_float)
    return {softmax_rereads(first, args[1].toInt(), false, args[2].toBool()) * bytes_of(first), 0};
  // (grad_output, output, dim, input_dtype): a float gradient for a half input widens
  const int64_t dim = args[2].toInt();
  const bool widening = first.scalar_type() != static_cast<at::ScalarType>(args[3].toInt());
  if (op == "aten::_log_softmax_backward_data") return {softmax_rereads(first, dim, true, widening) * bytes_of(first), 0};
  const at::Tensor& output = args[1].toTensor();
  const auto product = static_cast<int64_t>(first.numel()) *
                       static_cast<int64_t>(c10::elementSize(c10::promoteTypes(first.scalar_type(), output.scalar_type())));
  // the product is written by the first kernel and read by the second, which reads the output again
  return {(2 + softmax_rereads(first, dim, true, widening)) * product + bytes_of(output), 1};
}

ImplementationTraffic implementation_traffic(const c10::FunctionSchema& schema, const std::vector<c10::IValue>& args,
                                             const c10::IValue* results, size_t num_results) {
  const std::string& name = schema.name();
  if (name.find("softmax") != std::string::npos) return softmax_traffic(name, args.data());
  if (args.size() < 2 || !args[0].isTensor() || !args[1].isTensor()) return {};
  const at::Tensor& grad_out = args[0].toTensor();
  if (name == "aten::nll_loss_forward") {  // (self, target, ...): one entry of self per target
    const at::Tensor& self = args[0].toTensor();
    return {args[1].toTensor().numel() * static_cast<int64_t>(self.itemsize()) - bytes_of(self), 0};
  }
  // (grad_output, self, ...): self unread; the gradient's zero fill, then a small kernel at the targets
  if (name == "aten::nll_loss_backward") return {-bytes_of(args[1].toTensor()), 1, true};
  bool weight_gradient = false;  // a norm's second kernel runs for the weight's or the bias's gradient
  for (size_t i = 1; i < num_results; ++i)
    weight_gradient = weight_gradient || (results[i].isTensor() && results[i].toTensor().defined());
  if (!weight_gradient) return {};
  const at::Tensor& input = args[1].toTensor();
  return {bytes_of(grad_out) + bytes_of(input), 1};
}

KernelCost device_copy_cost(int64_t bytes, bool general) {
  return kernel_cost(0, 2 * bytes, at::kByte, {}, ComputeKind::kGemm, general);  // read and write
}

int64_t copy_cost_ns(int64_t bytes, bool crosses_host, bool general) {
  const CostModel& m = cost_model();
  if (!crosses_host) return device_copy_cost(bytes, general).ns;
  return static_cast<int64_t>(std::llround(static_cast<double>(bytes) / m.host_link_bytes_per_ns + m.kernel_fixed_ns));
}

bool has_flop_formula(const c10::FunctionSchema& schema) {
  FlopOps& f = flop_ops();
  std::shared_lock<std::shared_mutex> g(f.mu);
  return f.names.count(schema.name()) != 0;
}

double flop_count(const c10::OperatorHandle& op, const std::vector<c10::IValue>& args, const c10::IValue* results,
                  size_t num_results) {
  const c10::FunctionSchema& schema = op.schema();
  std::string key = schema.name() + "." + schema.overload_name() + ":";
  for (const auto& a : args) append_key(key, a);
  FlopOps& f = flop_ops();
  {
    std::shared_lock<std::shared_mutex> g(f.mu);
    auto it = f.counted.find(key);
    if (it != f.counted.end()) return it->second;
  }
  static const c10::OperatorHandle counter = c10::Dispatcher::singleton().findSchemaOrThrow("mirage::flop_count", "");
  c10::impl::GenericList arg_list(c10::AnyType::get()), result_list(c10::AnyType::get());
  for (const auto& a : args) arg_list.push_back(a);
  for (size_t i = 0; i < num_results; ++i) result_list.push_back(results[i]);
  const std::string name = schema.name() + (schema.overload_name().empty() ? "" : "." + schema.overload_name());
  torch::jit::Stack stack{c10::IValue(name), c10::IValue(arg_list), c10::IValue(result_list)};
  double flops = 0;
  {
    KernelScope inside;  // the formula's own tensor work (if any) is not device work
    // The formula is Python, run inside the program's op: a Python profiler must not see it
    // (unprofiled.h); mirage::flop_count itself is unobserved (unobserved_ops.h).
    GilHeld gil;
    PythonProfilerSuspended suspended;
    counter.callBoxed(&stack);
    flops = stack.back().toDouble();
  }
  std::unique_lock<std::shared_mutex> g(f.mu);
  f.counted.emplace(std::move(key), flops);
  return flops;
}

GemmShape gemm_shape(const c10::FunctionSchema& schema, const std::vector<c10::IValue>& args,
                     const c10::IValue* results, size_t num_results) {
  // Each operator's first matrix operand (addmm and baddbmm take the bias first).
  static const std::unordered_map<std::string, size_t> first_matrix{
      {"aten::mm", 0}, {"aten::addmm", 1}, {"aten::bmm", 0}, {"aten::baddbmm", 1}, {"aten::_scaled_mm", 0}};
  const auto found = first_matrix.find(schema.name());
  if (found == first_matrix.end() || num_results == 0 || !results[0].isTensor() || args.size() <= found->second ||
      !args[found->second].isTensor())
    return {};
  const at::Tensor& out = results[0].toTensor();
  const at::Tensor& a = args[found->second].toTensor();
  if (out.dim() < 2 || a.dim() < 2) return {};
  int64_t batch = 1;
  for (int64_t d = 0; d < out.dim() - 2; ++d) batch *= out.size(d);
  return {output_tiles(cost_model(), batch, out.size(-2), out.size(-1)), a.size(-1)};
}

double causal_share(int64_t seq_q, int64_t seq_k, ComputeKind kind) {
  const CostModel& m = cost_model();
  const int64_t block = m.attention_block_rows;
  double work = 0.5;
  if (seq_q == seq_k && seq_q > 0 && block > 0) {
    const double rows = static_cast<double>((seq_q + block - 1) / block);
    work = (rows + 1) / (2 * rows);
  }
  return work / (kind == ComputeKind::kAttentionBackward ? m.attention_backward_causal_factor
                                                    : m.attention_causal_factor);
}

// Between attention_rate_begin and attention_rate_end, how fast a benchmark's stand-in for another
// implementation measured it against the one the profile's attention figures describe
// (flash-attn's FlashAttention-2); 0 outside, where each kernel runs at its own rate
// (fused_attention_rate).
static thread_local double tl_attention_rate = 0.0;

double fused_attention_rate(bool pytorch_flash, bool causal) {
  if (tl_attention_rate > 0) return tl_attention_rate;
  if (!pytorch_flash) return 1.0;
  const CostModel& m = cost_model();
  return causal ? m.torch_flash_attention_causal_rate : m.torch_flash_attention_rate;
}

// The head dim every profile's attention efficiencies were measured at (FlashAttention-2's
// figures at head dim 128; a profile's sources say so).
constexpr int64_t kMeasuredHeadDim = 128;

double attention_block_factor(double keys_swept, int64_t head_dim, ComputeKind kind) {
  const CostModel& m = cost_model();
  const double steps = std::max(1.0, keys_swept / static_cast<double>(std::max<int64_t>(m.attention_block_rows, 1)));
  const double overhead =
      kind == ComputeKind::kAttentionBackward ? m.attention_backward_block_overhead : m.attention_block_overhead;
  const double dims = static_cast<double>(std::clamp<int64_t>(head_dim, 1, kMeasuredHeadDim));
  const double besides_matmuls =
      (1 + m.attention_softmax_head_dims / dims) / (1 + m.attention_softmax_head_dims / kMeasuredHeadDim);
  return (steps + overhead) / steps * besides_matmuls;
}

double attention_time_factor(int64_t seq_q, int64_t seq_k, int64_t head_dim, bool causal, ComputeKind kind) {
  const double block = static_cast<double>(std::max<int64_t>(cost_model().attention_block_rows, 1));
  const double keys = std::ceil(static_cast<double>(seq_k) / block) * block;  // whole steps of keys
  // the keys a block of query rows sweeps on average: all of them, or a causal kernel's triangle
  // ((r + 1) / 2 steps for r blocks of rows; half where queries and keys differ in length)
  const double swept = !causal ? keys : seq_q == seq_k ? (keys + block) / 2 : keys / 2;
  return (causal ? causal_share(seq_q, seq_k, kind) : 1.0) * attention_block_factor(swept, head_dim, kind);
}

void clock_fused_kernel(const char* op, std::initializer_list<at::Tensor> inputs,
                        std::initializer_list<at::Tensor> outputs, bool causal, int64_t seq_q, int64_t seq_k,
                        ComputeKind kind) {
  const at::Tensor& first = *inputs.begin();
  const DeviceIndex dev = first.device().index();
  int64_t bytes = 0;
  std::vector<c10::IValue> args, results;
  for (const at::Tensor& t : inputs) {
    bytes += t.defined() ? static_cast<int64_t>(t.numel() * t.itemsize()) : 0;
    args.emplace_back(t);
  }
  for (const at::Tensor& t : outputs) {
    bytes += t.defined() ? static_cast<int64_t>(t.numel() * t.itemsize()) : 0;
    results.emplace_back(t);
  }
  const c10::OperatorHandle handle = c10::Dispatcher::singleton().findSchemaOrThrow(op, "");
  const double counted = has_flop_formula(handle.schema()) ? flop_count(handle, args, results.data(), results.size()) : 0;
  const double flops = causal ? counted / 2 : counted;  // the model's FLOPs (MFU); the time follows the work done
  const double work = counted * attention_time_factor(seq_q, seq_k, first.size(-1), causal, kind);
  const bool pytorch_flash = std::strstr(op, "_flash_attention") != nullptr;  // not the memory-efficient kernels
  const KernelCost cost =
      kernel_cost(work / fused_attention_rate(pytorch_flash, causal), bytes, first.scalar_type(), {}, kind);
  run_on_stream(dev, tl_stream[dev], cost.ns, cost.kind, handle.schema().name().c_str(), bytes, flops, &cost.beside,
                first.scalar_type());
}

void clock_memory_kernel(const char* name, DeviceIndex dev, int64_t bytes, at::ScalarType dtype, int kernels) {
  const KernelCost cost = kernel_cost(0, bytes, dtype, {}, ComputeKind::kGemm, false, kernels);
  run_on_stream(dev, tl_stream[dev], cost.ns, cost.kind, name, bytes, 0, &cost.beside, dtype);
}

}  // namespace mirage

// nccl-tests' bus factor (mirage::nccl::Kind order): what each rank's links carry per byte of
// `bytes` among `n` ranks.
static double bus_factor(int kind, double n) {
  switch (kind) {
    case 0: return 2 * (n - 1) / n;  // all_reduce
    case 1:                          // all_gather (bytes: the gathered total)
    case 2:                          // reduce_scatter (bytes: the scattered total)
    case 5:                          // gather
    case 6:                          // scatter
    case 7: return (n - 1) / n;      // all_to_all
    case 8: return 0;                // barrier: latency only
    default: return 1;               // broadcast, reduce, send/recv
  }
}

double mirage::collective_hbm_share(int kind, int64_t bytes, int ranks, int64_t cost_ns) {
  if (ranks <= 1 || cost_ns <= 0) return 0;
  const double link_bytes = static_cast<double>(bytes) * bus_factor(kind, ranks);
  return 2 * link_bytes / static_cast<double>(cost_ns) / cost_model().memory_bytes_per_ns;
}

extern "C" double mirage_link_slowdown(const int64_t* nodes, int count) {
  double slowdown = 1.0;
  for (const auto& link : mirage::cost_model().slow_links) {
    const bool a = std::find(nodes, nodes + count, link.a) != nodes + count;
    const bool b = std::find(nodes, nodes + count, link.b) != nodes + count;
    if (a && b) slowdown = std::max(slowdown, link.factor);  // a ring across both crosses the link
  }
  return slowdown;
}

extern "C" int64_t mirage_collective_cost_ns(int kind, int64_t bytes, int ranks, int nodes, double nic_slowdown) {
  const mirage::CostModel& m = mirage::cost_model();
  if (ranks <= 1) return 0;
  const double n = ranks, size = static_cast<double>(bytes);
  const double per_node = std::max(1.0, n / std::max(nodes, 1));
  double bus = kind == 9 ? m.p2p_bytes_per_ns : m.bus_bytes_per_ns;
  // NVLink SHARP reduces in the switch: NCCL takes it for all_reduce on more than 4 GPUs a node.
  if (kind == 0 && m.nvls_bytes_per_ns > 0 && per_node > 4) bus = m.nvls_bytes_per_ns;
  double across = 0, extra = 0;  // between nodes: what each GPU's NIC carries, and the hops' latency
  if (nodes > 1) {
    across = kind == 9 ? size
             : kind == 7 ? size * (n - per_node) / n  // the share that leaves the node
                         : size / per_node * bus_factor(kind, nodes);
    extra = m.nic_latency_ns * std::ceil(std::log2(static_cast<double>(nodes)));
  }
  // One protocol: its latency, then the bytes at its share of the links' (and NICs') bandwidth.
  auto protocol = [&](double latency, double efficiency) {
    double transfer = size * bus_factor(kind, n) / (bus * efficiency);
    if (nodes > 1) transfer = std::max(transfer, across * nic_slowdown / (m.nic_bytes_per_ns * efficiency));
    return latency + extra + transfer;
  };
  const double simple = protocol(m.bus_latency_ns, 1.0), ll = protocol(m.ll_latency_ns, m.ll_efficiency);
  return static_cast<int64_t>(std::llround(std::min(simple, ll)));
}

MIRAGE_LIBRARY(m) {
  // Implemented in Python (mirage/runtime/timing.py) over torch.utils.flop_counter's registry.
  m.def("flop_count(str op, Any[] args, Any[] results) -> float");
  // The model's predictions without running anything (bench/validate.py compares them with
  // published measurements): an M x N x K GEMM, a streaming kernel moving `bytes`, a collective.
  m.def("clock_predict_gemm_ns(int m, int n, int k, ScalarType dtype) -> int",
        [](int64_t rows, int64_t cols, int64_t inner, c10::ScalarType dtype) -> int64_t {
          const double flops = 2.0 * rows * cols * inner;
          const int64_t bytes = (rows * inner + inner * cols + rows * cols) * static_cast<int64_t>(c10::elementSize(dtype));
          const mirage::GemmShape shape{mirage::output_tiles(mirage::cost_model(), 1, rows, cols), inner};
          return mirage::kernel_cost(flops, bytes, dtype, shape).ns;
        });
  // The same GEMM while a collective's kernel runs beside it for its whole length.
  m.def("clock_predict_gemm_beside_collective_ns(int m, int n, int k, ScalarType dtype) -> int",
        [](int64_t rows, int64_t cols, int64_t inner, c10::ScalarType dtype) -> int64_t {
          const double flops = 2.0 * rows * cols * inner;
          const int64_t bytes = (rows * inner + inner * cols + rows * cols) * static_cast<int64_t>(c10::elementSize(dtype));
          const mirage::GemmShape shape{mirage::output_tiles(mirage::cost_model(), 1, rows, cols), inner};
          return mirage::kernel_cost(flops, bytes, dtype, shape).beside.cost(0);
        });
  // Fused attention over batch x heads x seq x head_dim: its forward (4 x b x h x s^2 x d FLOPs,
  // reading q, k, v and writing the output), or its backward (2.5 x those FLOPs, with the scores'
  // recomputation; reading q, k, v, the output and its gradient, writing three gradients), timed
  // by attention_time_factor, as `implementation` runs it: "pytorch" (SDPA's flash kernels, PyTorch's
  // own build) or "flash-attn" (that package's FlashAttention-2, which the efficiencies describe).
  m.def("clock_predict_attention_ns(int batch, int heads, int seq, int head_dim, bool causal, ScalarType dtype, "
        "bool backward=False, str implementation=\"pytorch\") -> int",
        [](int64_t batch, int64_t heads, int64_t seq, int64_t head_dim, bool causal, c10::ScalarType dtype,
           bool backward, c10::string_view implementation) -> int64_t {
          TORCH_CHECK(implementation == "pytorch" || implementation == "flash-attn",
                      "clock_predict_attention_ns: implementation must be \"pytorch\" or \"flash-attn\", got \"",
                      std::string(implementation), "\"");
          const auto kind = backward ? mirage::ComputeKind::kAttentionBackward : mirage::ComputeKind::kAttention;
          const double forward = 4.0 * batch * heads * seq * seq * head_dim;
          const double rate = mirage::fused_attention_rate(implementation == "pytorch", causal);
          const double work = (backward ? 2.5 : 1.0) * forward *
                              mirage::attention_time_factor(seq, seq, head_dim, causal, kind) / rate;
          const int64_t tensor = batch * heads * seq * head_dim * static_cast<int64_t>(c10::elementSize(dtype));
          return mirage::kernel_cost(work, (backward ? 8 : 4) * tensor, dtype, {}, kind).ns;
        });
  m.def("clock_predict_stream_ns(int bytes) -> int",
        [](int64_t bytes) -> int64_t { return mirage::kernel_cost(0, bytes, c10::kByte, {}).ns; });
  m.def("clock_predict_collective_ns(int kind, int bytes, int ranks, int nodes) -> int",
        [](int64_t kind, int64_t bytes, int64_t ranks, int64_t nodes) -> int64_t {
          return mirage_collective_cost_ns(static_cast<int>(kind), bytes, static_cast<int>(ranks), static_cast<int>(nodes),
                                           1.0);
        });
  // One kernel of a torch.compile'd graph (its host kernels do not pass the op path), on the
  // device's current stream: a matmul or a fused group, as mirage/runtime/inductor.py's
  // _graph_kernels estimates them at compile time from the graph inductor is handed.
  // `gemm`: a matmul's [batch, rows, cols, K] (waves, epilogues and split-K as the op path costs
  // the same GEMM), or [] for a fused group or a shape inductor left symbolic.
  m.def("clock_compiled_graph(int device, float flops, int bytes, ScalarType dtype, int[] gemm) -> ()",
        [](int64_t device, double flops, int64_t bytes, c10::ScalarType dtype, std::vector<int64_t> gemm) {
          if (!mirage::timing()) return;
          const auto dev = static_cast<mirage::DeviceIndex>(device);
          const mirage::GemmShape shape =
              gemm.size() == 4 ? mirage::GemmShape{mirage::output_tiles(mirage::cost_model(), gemm[0], gemm[1], gemm[2]), gemm[3]}
                               : mirage::GemmShape{};
          const mirage::KernelCost cost = mirage::kernel_cost(flops, bytes, dtype, shape);
          mirage::run_on_stream(dev, mirage::tl_stream[dev], cost.ns, cost.kind, mirage::kCompiledGraph, bytes, flops,
                                &cost.beside);
        });
  // A benchmark's stand-in for an attention implementation other than SDPA's own (bench/e2e_gpt.py's
  // --attn-impl triton): the SDPA attention kernels (flash, memory-efficient) this thread places
  // until attention_rate_end do their work at `rate` times the speed of flash-attn's
  // FlashAttention-2, which the profile's attention efficiencies describe (in place of their own
  // rate, fused_attention_rate), `rate` being what a publication measured the two at, side by side.
  m.def("attention_rate_begin(float rate) -> ()", [](double rate) {
    TORCH_CHECK(rate > 0 && std::isfinite(rate), "attention_rate_begin: the rate must be a positive number, got ",
                rate);
    TORCH_CHECK(mirage::tl_attention_rate == 0.0, "attention_rate_begin: a rate is already set on this thread; "
                "end it with attention_rate_end first");
    mirage::tl_attention_rate = rate;
  });
  m.def("attention_rate_end() -> ()", []() { mirage::tl_attention_rate = 0.0; });
  // A GPU kernel that mirage runs as many ops (FlexAttention's block-sparse implementation,
  // mirage/runtime/flex_attention.py): between begin and end its ops are not timed alone, and end
  // places one attention kernel of `flops` (the blocks it visits) and `bytes` on the current stream,
  // its blocks of query rows sweeping `keys_per_query_block` keys on average at `head_dim`
  // (attention_block_factor).
  m.def("fused_kernel_begin() -> ()", []() { ++mirage::tl_kernel_depth; });
  m.def("fused_kernel_end(int kernel, int device, int bytes, float flops, ScalarType dtype, int head_dim, "
        "float keys_per_query_block) -> ()",
        [](int64_t kernel, int64_t device, int64_t bytes, double flops, c10::ScalarType dtype, int64_t head_dim,
           double keys_per_query_block) {
          static const char* const names[] = {"flex_attention", "flex_attention_backward"};
          if (--mirage::tl_kernel_depth > 0 || !mirage::timing() || kernel < 0 || kernel > 1) return;
          const auto dev = static_cast<mirage::DeviceIndex>(device);
          const auto kind = kernel == 0 ? mirage::ComputeKind::kAttention : mirage::ComputeKind::kAttentionBackward;
          const double work = flops * mirage::attention_block_factor(keys_per_query_block, head_dim, kind);
          const mirage::KernelCost cost = mirage::kernel_cost(work, bytes, dtype, {}, kind);
          mirage::run_on_stream(dev, mirage::tl_stream[dev], cost.ns, cost.kind, names[kernel], bytes, flops,
                                &cost.beside, dtype);
        });
  // The same for a memory-bound kernel of an extension a workload provides as ops (a stand-in
  // for a compiled CUDA extension, such as Megatron's fused softmax), named in traces as `name`.
  m.def("fused_kernel_end_named(str name, int device, int bytes, ScalarType dtype) -> ()",
        [](const std::string& name, int64_t device, int64_t bytes, c10::ScalarType dtype) {
          if (--mirage::tl_kernel_depth > 0 || !mirage::timing()) return;
          static std::mutex mu;
          static std::unordered_set<std::string> interned;  // the trace keeps the name's pointer
          const char* kept;
          {
            std::lock_guard<std::mutex> g(mu);
            kept = interned.insert(name).first->c_str();
          }
          mirage::clock_memory_kernel(kept, static_cast<mirage::DeviceIndex>(device), bytes, dtype);
        });
  m.def("clock_set_flop_ops(str[] names) -> ()", [](std::vector<std::string> names) {
    mirage::FlopOps& f = mirage::flop_ops();
    std::unique_lock<std::shared_mutex> g(f.mu);
    f.names = std::unordered_set<std::string>(names.begin(), names.end());
  });
}
