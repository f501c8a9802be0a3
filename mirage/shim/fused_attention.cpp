// Fused scaled-dot-product attention on the emulated device, as a CUDA (or ROCm) build runs it.
//
// F.scaled_dot_product_attention picks its backend through a DispatchStub that a CPU build has no
// CUDA entry for, so on the device every call took the math backend, whatever sdpa_kernel asked.
// This registers the CUDA entry: the choice a GPU build makes (flash attention, then memory-
// efficient attention, then math, in the context's priority order, each only if enabled and if
// the inputs meet its constraints; "No available kernel" when none does), and the CUDA-only flash
// and memory-efficient operators with their CUDA signatures (logsumexp, philox seed and offset),
// computed by PyTorch's CPU flash-attention kernel. So a forced fused backend gives that
// backend's results and autograd nodes. Not emulated: dropout inside a fused kernel (the CPU
// kernel has none; a call with dropout takes math), cuDNN attention (never chosen: flash, which
// takes the same inputs, stands in for it where a program prefers it).

#include <ATen/ATen.h>
#include <ATen/Context.h>
#include <ATen/native/DispatchStub.h>
#include <ATen/native/transformers/attention.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include "device_clock.h"
#include "op_cost.h"
#include "profiler_activities.h"

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <optional>
#include <tuple>

namespace mirage {
namespace {

using at::Tensor;
using at::SDPBackend;

// --predict-only: attention's outputs with their shapes and no values (out, logsumexp).
std::tuple<Tensor, Tensor> predicted_attention(const Tensor& query, const Tensor& value) {
  std::vector<int64_t> shape = query.sizes().vec();
  shape.back() = value.size(-1);
  return {at::empty(shape, query.options()), at::empty({query.size(0), query.size(1), query.size(2)},
                                                       query.options().dtype(at::kFloat))};
}

// Whether the emulated device presents a ROCm build (its kernels' outputs differ in shape).
static bool rocm_profile() {
  static const bool rocm = [] {
    const char* vendor = std::getenv("MIRAGE_VENDOR");
    return !vendor || std::strcmp(vendor, "nvidia") != 0;
  }();
  return rocm;
}

bool half_precision(const Tensor& t) { return t.scalar_type() == at::kHalf || t.scalar_type() == at::kBFloat16; }

// What both fused kernels require of the inputs: 4-D (batch, heads, length, head dim), one head
// dim for all three, a multiple of 8 up to 256, no dropout (see above), and equal head counts,
// or, under enable_gqa for a kernel that takes grouped-query attention, query heads a multiple of
// key heads and as many key heads as value heads (sdp_utils' check_grouped_query_attention).
bool fused_shapes_fit(const Tensor& q, const Tensor& k, const Tensor& v, double dropout_p, bool enable_gqa,
                      bool supports_gqa) {
  // symbolic sizes (torch.compile's fake tensors) are read as such: reading them as ints would
  // specialise every dimension, batch and sequence length included
  if (q.dim() != 4 || k.dim() != 4 || v.dim() != 4 || q.is_nested()) return false;
  const c10::SymInt head_dim = q.sym_size(-1);
  if (k.sym_size(-1) != head_dim || v.sym_size(-1) != head_dim || head_dim % 8 != 0 || head_dim > 256) return false;
  if (dropout_p > 0.0) return false;
  if (enable_gqa && supports_gqa) return q.sym_size(1) % k.sym_size(1) == 0 && k.sym_size(1) == v.sym_size(1);
  return q.sym_size(1) == k.sym_size(1) && q.sym_size(1) == v.sym_size(1);
}

int64_t choose_backend(const Tensor& q, const Tensor& k, const Tensor& v, const std::optional<Tensor>& mask,
                       double dropout_p, bool /*is_causal*/, std::optional<double> /*scale*/, bool enable_gqa) {
  auto& ctx = at::globalContext();
  // Grouped-query attention: flash attention takes it on both vendors, memory-efficient
  // attention on CUDA only (sdp_utils.cpp's backend_supports_grouped_query_attention, supports_gqa).
  const bool flash_shapes = fused_shapes_fit(q, k, v, dropout_p, enable_gqa, true);
  const bool efficient_shapes = fused_shapes_fit(q, k, v, dropout_p, enable_gqa, !rocm_profile());
  for (SDPBackend backend : ctx.sDPPriorityOrder()) {
    switch (backend) {
      case SDPBackend::flash_attention:
        if (ctx.userEnabledFlashSDP() && flash_shapes && half_precision(q) && !(mask && mask->defined())) {
          return static_cast<int64_t>(backend);
        }
        break;
      case SDPBackend::efficient_attention:
        if (ctx.userEnabledMemEfficientSDP() && efficient_shapes && (half_precision(q) || q.scalar_type() == at::kFloat)) {
          return static_cast<int64_t>(backend);
        }
        break;
      case SDPBackend::math:
        if (ctx.userEnabledMathSDP()) return static_cast<int64_t>(backend);
        break;
      default:
        break;
    }
  }
  TORCH_CHECK(false, "No available kernel. Aborting execution.");
}

// An empty tensor with `like`'s options: what CUDA returns for outputs it does not compute.
Tensor no_values_like(const Tensor& like) { return at::empty({0}, like.options()); }

// The attention output in the layout torch's meta kernel gives it (the query's strides), which
// compiled graphs assert; the CPU kernel writes its own layout.
static Tensor in_query_layout(const Tensor& out, const Tensor& query) {
  Tensor shaped = at::empty_like(query);
  if (shaped.strides() == out.strides()) return out;
  return predict_only() ? shaped : shaped.copy_(out);
}

// (B, H, L, E) query; the CPU kernel's logsumexp is (B, H, L) in float, as CUDA's flash returns it.
std::tuple<Tensor, Tensor, Tensor, Tensor, c10::SymInt, c10::SymInt, Tensor, Tensor, Tensor> flash_attention(
    const Tensor& query, const Tensor& key, const Tensor& value, double dropout_p, bool is_causal,
    bool /*return_debug_mask*/, std::optional<double> scale) {
  TORCH_CHECK(dropout_p == 0.0, "mirage: flash attention with dropout is not emulated (the CPU kernel has none)");
  KernelScope kernel;
  const HostTimedFusedKernel profiled(kernel, "aten::_scaled_dot_product_flash_attention", query.device().index(),
                                      query.scalar_type());
  auto [out, logsumexp] = predict_only() ? predicted_attention(query, value)
                                         : at::_scaled_dot_product_flash_attention_for_cpu(query, key, value, 0.0,
                                                                                           is_causal, {}, scale);
  // The philox seed and offset as torch's meta kernel has them: CUDA's rng state (2 x uint64)
  // and offset (a uint64 scalar), ROCm's two int64 scalars. DTensor's context parallelism
  // wraps them as scalars.
  const bool rocm = rocm_profile();
  const Tensor seed = at::zeros(rocm ? c10::IntArrayRef{} : c10::IntArrayRef{2},
                                query.options().dtype(rocm ? at::kLong : at::kUInt64));
  const Tensor offset = at::zeros({}, seed.options());
  if (timing() && kernel.outermost) {
    clock_fused_kernel("aten::_scaled_dot_product_flash_attention", {query, key, value}, {out, logsumexp}, is_causal,
                       query.size(-2), key.size(-2), ComputeKind::kAttention);
  }
  // logsumexp (B, H, L) float and contiguous, as the meta kernel says (the CPU kernel's is a
  // transposed (B, L, H)).
  return {in_query_layout(out, query), logsumexp.to(at::kFloat).contiguous(), Tensor(), Tensor(), query.sym_size(2),
          key.sym_size(2), seed, offset, no_values_like(query)};
}

std::tuple<Tensor, Tensor, Tensor> flash_attention_backward(const Tensor& grad_out, const Tensor& query,
    const Tensor& key, const Tensor& value, const Tensor& out, const Tensor& logsumexp, const Tensor&, const Tensor&,
    c10::SymInt, c10::SymInt, double dropout_p, bool is_causal, const Tensor&, const Tensor&,
    std::optional<double> scale) {
  KernelScope kernel;
  const HostTimedFusedKernel profiled(kernel, "aten::_scaled_dot_product_flash_attention_backward",
                                      query.device().index(), query.scalar_type());
  auto grads = predict_only() ? std::make_tuple(at::empty_like(query), at::empty_like(key), at::empty_like(value))
                              : at::_scaled_dot_product_flash_attention_for_cpu_backward(
                                    grad_out, query, key, value, out, logsumexp, dropout_p, is_causal, {}, scale);
  if (timing() && kernel.outermost) {
    clock_fused_kernel("aten::_scaled_dot_product_flash_attention_backward", {grad_out, query, key, value, out},
                       {std::get<0>(grads), std::get<1>(grads), std::get<2>(grads)}, is_causal, query.size(-2),
                       key.size(-2), ComputeKind::kAttentionBackward);
  }
  return grads;
}

// Memory-efficient attention's logsumexp is (B, H, L rounded up to 32), float, on CUDA (the rows
// past L hold no value); ROCm's kernel gives (B, H, L) (as torch's meta kernel says for HIP builds).
constexpr int64_t kLogsumexpRows = 32;

static int64_t logsumexp_rows(int64_t length) {
  return rocm_profile() ? length : (length + kLogsumexpRows - 1) / kLogsumexpRows * kLogsumexpRows;
}

std::tuple<Tensor, Tensor, Tensor, Tensor> efficient_attention(const Tensor& query, const Tensor& key,
    const Tensor& value, const std::optional<Tensor>& attn_bias, bool compute_log_sumexp, double dropout_p,
    bool is_causal, std::optional<double> scale) {
  TORCH_CHECK(dropout_p == 0.0, "mirage: memory-efficient attention with dropout is not emulated");
  KernelScope kernel;
  const HostTimedFusedKernel profiled(kernel, "aten::_scaled_dot_product_efficient_attention", query.device().index(),
                                      query.scalar_type());
  const std::optional<Tensor> mask = attn_bias && attn_bias->defined() ? std::optional<Tensor>(attn_bias->to(query.scalar_type()))
                                                                       : std::nullopt;
  auto [out, logsumexp] = predict_only() ? predicted_attention(query, value)
                                         : at::_scaled_dot_product_flash_attention_for_cpu(query, key, value, 0.0,
                                                                                           is_causal, mask, scale);
  const int64_t length = query.size(2);
  const int64_t rows = compute_log_sumexp ? logsumexp_rows(length) : 0;
  Tensor lse = at::full({query.size(0), query.size(1), rows}, std::numeric_limits<float>::infinity(),
                        query.options().dtype(at::kFloat));
  if (rows > 0) lse.narrow(2, 0, length).copy_(logsumexp);
  const Tensor seed = at::zeros({}, query.options().dtype(at::kLong));
  if (timing() && kernel.outermost) {
    clock_fused_kernel("aten::_scaled_dot_product_efficient_attention", {query, key, value}, {out, lse}, is_causal,
                       query.size(-2), key.size(-2), ComputeKind::kAttention);
  }
  return {out, lse, seed, seed.clone()};
}

std::tuple<Tensor, Tensor, Tensor, Tensor> efficient_attention_backward_kernel(const Tensor& grad_out, const Tensor& query,
    const Tensor& key, const Tensor& value, const Tensor& attn_bias, const Tensor& out, const Tensor& logsumexp,
    const Tensor&, const Tensor&, double dropout_p, std::array<bool, 4> grad_input_mask, bool is_causal,
    std::optional<double> scale) {
  const Tensor lse = logsumexp.narrow(2, 0, query.size(2)).contiguous();
  if (!(attn_bias.defined() && grad_input_mask[3])) {
    const std::optional<Tensor> mask = attn_bias.defined() ? std::optional<Tensor>(attn_bias.to(query.scalar_type()))
                                                           : std::nullopt;
    auto [gq, gk, gv] = at::_scaled_dot_product_flash_attention_for_cpu_backward(grad_out, query, key, value, out, lse,
                                                                               dropout_p, is_causal, mask, scale);
    return {gq, gk, gv, Tensor()};
  }
  // The bias's gradient too (the CPU kernel gives none): from the probabilities the logsumexp
  // gives back, P = exp(S - lse), dS = P * (dP - rowsum(dO * O)), and dbias = dS summed to its shape.
  const auto acc = at::kFloat;
  // grouped-query attention: each key and value head serves `groups` query heads in turn
  const int64_t groups = query.size(1) / key.size(1);
  const Tensor q = query.to(acc), k = key.to(acc).repeat_interleave(groups, 1),
               v = value.to(acc).repeat_interleave(groups, 1), o = out.to(acc), go = grad_out.to(acc);
  const double s = scale ? *scale : 1.0 / std::sqrt(static_cast<double>(query.size(-1)));
  Tensor scores = at::matmul(q, k.transpose(-2, -1)) * s + attn_bias.to(acc);
  if (is_causal) {
    const Tensor above = at::ones({query.size(2), key.size(2)}, query.options().dtype(at::kBool)).triu(1);
    scores = scores.masked_fill(above, -std::numeric_limits<float>::infinity());
  }
  const Tensor probs = at::exp(scores - lse.unsqueeze(-1));
  const Tensor grad_scores = probs * (at::matmul(go, v.transpose(-2, -1)) - (go * o).sum(-1, true));
  const auto type = query.scalar_type();
  const auto per_key_head = [&](const Tensor& grad) { return grad.unflatten(1, {key.size(1), groups}).sum(2).to(type); };
  return {(at::matmul(grad_scores, k) * s).to(type), per_key_head(at::matmul(grad_scores.transpose(-2, -1), q) * s),
          per_key_head(at::matmul(probs.transpose(-2, -1), go)), at::sum_to(grad_scores, attn_bias.sizes()).to(attn_bias.scalar_type())};
}


// The backward as one fused kernel on the predicted timeline (its ATen work is not timed alone).
std::tuple<Tensor, Tensor, Tensor, Tensor> efficient_attention_backward(const Tensor& grad_out, const Tensor& query,
    const Tensor& key, const Tensor& value, const Tensor& attn_bias, const Tensor& out, const Tensor& logsumexp,
    const Tensor& seed, const Tensor& offset, double dropout_p, std::array<bool, 4> grad_input_mask, bool is_causal,
    std::optional<double> scale) {
  KernelScope kernel;
  const HostTimedFusedKernel profiled(kernel, "aten::_scaled_dot_product_efficient_attention_backward",
                                      query.device().index(), query.scalar_type());
  auto grads = predict_only() ? std::make_tuple(at::empty_like(query), at::empty_like(key), at::empty_like(value),
                                                attn_bias.defined() && grad_input_mask[3] ? at::empty_like(attn_bias) : Tensor())
                              : efficient_attention_backward_kernel(grad_out, query, key, value, attn_bias, out, logsumexp, seed, offset,
                                                   dropout_p, grad_input_mask, is_causal, scale);
  if (timing() && kernel.outermost) {
    clock_fused_kernel("aten::_scaled_dot_product_efficient_attention_backward", {grad_out, query, key, value, out},
                       {std::get<0>(grads), std::get<1>(grads), std::get<2>(grads)}, is_causal, query.size(-2),
                       key.size(-2), ComputeKind::kAttentionBackward);
  }
  return grads;
}

}  // namespace
}  // namespace mirage

namespace at::native {
REGISTER_CUDA_DISPATCH(_fused_sdp_choice_stub, &mirage::choose_backend)
}  // namespace at::native

TORCH_LIBRARY_IMPL(aten, CUDA, m) {
  m.impl("_scaled_dot_product_flash_attention", TORCH_FN(mirage::flash_attention));
  m.impl("_scaled_dot_product_flash_attention_backward", TORCH_FN(mirage::flash_attention_backward));
  m.impl("_scaled_dot_product_efficient_attention", TORCH_FN(mirage::efficient_attention));
  m.impl("_scaled_dot_product_efficient_attention_backward", TORCH_FN(mirage::efficient_attention_backward));
}
