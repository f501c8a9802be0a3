// Operators a CUDA build has a CUDA kernel for and a CPU build has no kernel for at all, which
// distributed code reaches: record_stream, and the SyncBatchNorm family (torch/nn/modules/_functions.py calls them
// on the device). Each follows its CUDA definition (aten/src/ATen/native/cuda/Normalization.cu):
// statistics in the accumulate type (float for half and bfloat16 inputs), biased variance
// inside invstd = 1 / sqrt(var + eps), the running variance updated with the unbiased one. They
// are written with ATen ops on the device tensors, so each step runs the CPU kernel in place
// through the shim's fallback.

#include <ATen/ATen.h>
#include <ATen/AccumulateType.h>
#include <torch/library.h>

#include <optional>
#include <tuple>

namespace mirage {
namespace {

using at::Tensor;

// Every dimension but the channels (dim 1): what batch norm reduces over.
std::vector<int64_t> reduced_dims(const Tensor& input) {
  std::vector<int64_t> dims{0};
  for (int64_t d = 2; d < input.dim(); ++d) dims.push_back(d);
  return dims;
}

// A per-channel vector shaped to broadcast against the input: [1, C, 1, ...].
Tensor per_channel(const Tensor& v, const Tensor& input) {
  std::vector<int64_t> shape(static_cast<size_t>(input.dim()), 1);
  shape[1] = v.numel();
  return v.view(shape);
}

at::ScalarType acc_type(const Tensor& input) { return at::toAccumulateType(input.scalar_type(), /*is_cuda=*/true); }

std::tuple<Tensor, Tensor> batch_norm_stats(const Tensor& input, double eps) {
  const Tensor x = input.to(acc_type(input));
  const auto dims = reduced_dims(input);
  Tensor mean = x.mean(dims);
  Tensor var = (x - per_channel(mean, x)).square().mean(dims);
  return {mean, (var + eps).rsqrt()};
}

// Combines per-rank statistics (rows of mean / invstd, with each rank's element count) into the
// group's, and updates the running statistics in place.
std::tuple<Tensor, Tensor> gather_stats(const Tensor& mean, const Tensor& invstd, const std::optional<Tensor>& running_mean,
                                        const std::optional<Tensor>& running_var, double momentum, double eps,
                                        const Tensor& counts) {
  const Tensor n = counts.to(mean.scalar_type()).view({-1, 1});
  const Tensor total = n.sum();
  Tensor global_mean = (mean * n).sum(0) / total;
  const Tensor var_each = (invstd.square().reciprocal() - eps);
  Tensor var = ((var_each + (mean - global_mean).square()) * n).sum(0) / total;
  if (running_mean && running_mean->defined()) {
    running_mean->copy_(running_mean->mul(1 - momentum).add(global_mean.to(running_mean->scalar_type()), momentum));
  }
  if (running_var && running_var->defined()) {
    const Tensor unbiased = var * total / (total - 1);
    running_var->copy_(running_var->mul(1 - momentum).add(unbiased.to(running_var->scalar_type()), momentum));
  }
  return {global_mean, (var + eps).rsqrt()};
}

std::tuple<Tensor, Tensor> batch_norm_gather_stats_with_counts(const Tensor&, const Tensor& mean, const Tensor& invstd,
                                                               const std::optional<Tensor>& running_mean,
                                                               const std::optional<Tensor>& running_var,
                                                               double momentum, double eps, const Tensor& counts) {
  return gather_stats(mean, invstd, running_mean, running_var, momentum, eps, counts);
}

std::tuple<Tensor, Tensor> batch_norm_gather_stats(const Tensor&, const Tensor& mean, const Tensor& invstd,
                                                   const std::optional<Tensor>& running_mean,
                                                   const std::optional<Tensor>& running_var, double momentum, double eps,
                                                   int64_t count) {
  return gather_stats(mean, invstd, running_mean, running_var, momentum, eps,
                      at::full({mean.size(0)}, static_cast<double>(count), mean.options()));
}

Tensor batch_norm_elemt(const Tensor& input, const std::optional<Tensor>& weight, const std::optional<Tensor>& bias,
                        const Tensor& mean, const Tensor& invstd, double) {
  const at::ScalarType acc = acc_type(input);
  Tensor out = (input.to(acc) - per_channel(mean.to(acc), input)) * per_channel(invstd.to(acc), input);
  if (weight && weight->defined()) out = out * per_channel(weight->to(acc), input);
  if (bias && bias->defined()) out = out + per_channel(bias->to(acc), input);
  return out.to(input.scalar_type()).contiguous(input.suggest_memory_format());
}

Tensor& batch_norm_elemt_out(const Tensor& input, const std::optional<Tensor>& weight, const std::optional<Tensor>& bias,
                             const Tensor& mean, const Tensor& invstd, double eps, Tensor& out) {
  out.copy_(mirage::batch_norm_elemt(input, weight, bias, mean, invstd, eps));
  return out;
}

std::tuple<Tensor, Tensor, Tensor, Tensor> batch_norm_backward_reduce(const Tensor& grad_out, const Tensor& input,
                                                                      const Tensor& mean, const Tensor& invstd,
                                                                      const std::optional<Tensor>& weight, bool input_g,
                                                                      bool weight_g, bool bias_g) {
  const at::ScalarType acc = acc_type(input);
  const auto dims = reduced_dims(input);
  const Tensor dy = grad_out.to(acc);
  const Tensor xmu = input.to(acc) - per_channel(mean.to(acc), input);
  Tensor sum_dy, sum_dy_xmu, grad_weight, grad_bias;
  if (input_g || weight_g || bias_g) {
    sum_dy = dy.sum(dims);
    sum_dy_xmu = (dy * xmu).sum(dims);
  }
  const at::ScalarType param = weight && weight->defined() ? weight->scalar_type() : input.scalar_type();
  if (weight_g) grad_weight = (sum_dy_xmu * invstd.to(acc)).to(param);
  if (bias_g) grad_bias = sum_dy.to(param);
  if (!input_g) sum_dy = sum_dy_xmu = Tensor();
  return {sum_dy, sum_dy_xmu, grad_weight, grad_bias};
}

Tensor batch_norm_backward_elemt(const Tensor& grad_out, const Tensor& input, const Tensor& mean, const Tensor& invstd,
                                 const std::optional<Tensor>& weight, const Tensor& sum_dy, const Tensor& sum_dy_xmu,
                                 const Tensor& count) {
  const at::ScalarType acc = acc_type(input);
  const Tensor total = count.to(acc).sum();
  const Tensor inv = per_channel(invstd.to(acc), input);
  const Tensor mean_dy = per_channel(sum_dy.to(acc) / total, input);
  const Tensor mean_dy_xmu = per_channel(sum_dy_xmu.to(acc) / total, input);
  const Tensor xmu = input.to(acc) - per_channel(mean.to(acc), input);
  Tensor grad = (grad_out.to(acc) - mean_dy - xmu * inv.square() * mean_dy_xmu) * inv;
  if (weight && weight->defined()) grad = grad * per_channel(weight->to(acc), input);
  return grad.to(input.scalar_type()).contiguous(input.suggest_memory_format());
}

// Tensor.record_stream (FSDP, ZeRO-3 prefetch, overlap schemes): on a GPU it tells the caching
// allocator not to reuse the block until the stream's queued work is done. Emulated work runs
// when it is issued and the allocator does not cache, so the block is already free to reuse.
void record_stream(Tensor& /*self*/, c10::Stream /*stream*/) {}

}  // namespace
}  // namespace mirage

TORCH_LIBRARY_IMPL(aten, CUDA, m) {
  m.impl("record_stream", TORCH_FN(mirage::record_stream));
  m.impl("batch_norm_stats", TORCH_FN(mirage::batch_norm_stats));
  m.impl("batch_norm_gather_stats", TORCH_FN(mirage::batch_norm_gather_stats));
  m.impl("batch_norm_gather_stats_with_counts", TORCH_FN(mirage::batch_norm_gather_stats_with_counts));
  m.impl("batch_norm_elemt", TORCH_FN(mirage::batch_norm_elemt));
  m.impl("batch_norm_elemt.out", TORCH_FN(mirage::batch_norm_elemt_out));
  m.impl("batch_norm_backward_reduce", TORCH_FN(mirage::batch_norm_backward_reduce));
  m.impl("batch_norm_backward_elemt", TORCH_FN(mirage::batch_norm_backward_elemt));
}
