// The dtypes a CUDA build's kernels take, where they differ from a CPU build's (cuda_dtypes.h).
#include "cuda_dtypes.h"

#include <ATen/ATen.h>
#include <c10/util/SmallVector.h>

#include <algorithm>
#include <array>
#include <initializer_list>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace mirage {

using c10::ScalarType;
using DtypeSet = uint64_t;  // bit i: ScalarType i (46 of them in torch 2.13)

static constexpr DtypeSet dtypes(std::initializer_list<ScalarType> types) {
  DtypeSet set = 0;
  for (ScalarType t : types) set |= DtypeSet{1} << static_cast<int>(t);
  return set;
}
static constexpr bool contains(DtypeSet set, ScalarType t) { return (set >> static_cast<int>(t)) & 1; }

// The sets of ATen's AT_DISPATCH macros, by their names there.
constexpr DtypeSet kFloating = dtypes({ScalarType::Float, ScalarType::Double});
constexpr DtypeSet kComplex = dtypes({ScalarType::ComplexFloat, ScalarType::ComplexDouble});
constexpr DtypeSet kIntegral = dtypes({ScalarType::Byte, ScalarType::Char, ScalarType::Short, ScalarType::Int,
                                       ScalarType::Long});
constexpr DtypeSet kHalfAndBFloat16 = dtypes({ScalarType::Half, ScalarType::BFloat16});
constexpr DtypeSet kHalf = dtypes({ScalarType::Half});
constexpr DtypeSet kComplexHalf = dtypes({ScalarType::ComplexHalf});
constexpr DtypeSet kBool = dtypes({ScalarType::Bool});
constexpr DtypeSet kFloatingAndHalves = kFloating | kHalfAndBFloat16;                // ..._AND2(Half, BFloat16)
constexpr DtypeSet kBlas = kFloating | kComplex | kHalfAndBFloat16;                  // cuBLAS's GEMMs
constexpr DtypeSet kAllTypesAndHalves = kIntegral | kFloatingAndHalves;              // ALL_TYPES_AND2(Half, BFloat16)
constexpr DtypeSet kEverything = ~DtypeSet{0};

// How the CUDA kernel handles a dtype set beyond refusing: the CPU kernel one dtype wider, or,
// for complex nansum (which a CPU build refuses outright), a sum with NaNs as 0.
enum class Emulation { kWidened, kNanSumAsSum };

struct CudaDtypes {
  std::string_view op;  // the operator's name without "aten::": every overload and the in-place variant
  // The CUDA kernel's AT_DISPATCH name, in its NotImplementedError, and the dtypes it dispatches
  // over (of the call's first tensor); null: the CUDA kernel refuses nothing the CPU kernel takes.
  const char* kernel;
  DtypeSet takes;
  DtypeSet emulated;  // dtypes the CUDA kernel takes and the CPU kernel lacks
  Emulation how = Emulation::kWidened;
  bool half_fft_sizes = false;  // cuFFT's half precision: powers of two only (CuFFTPlanCache.h)
  // A check before the dispatch that refuses these dtypes in its own words (a RuntimeError).
  DtypeSet refused_early = 0;
  const char* early_message = nullptr;
  // The `reduce` argument's value for which the CUDA kernel takes every dtype (scatter_reduce's sum).
  std::string_view unless_reduce = {};
  // Its `min` and `max` are taken in an integer input's type (histc: min.to<scalar_t>()), so a
  // widened call gets them truncated.
  bool integer_bounds = false;
};

// From the CUDA kernels' AT_DISPATCH macros (torch 2.13: aten/src/ATen/native/cuda/) where op_db's
// dtypesIfCUDA differs from its CPU dtypes; tests/emulated/test_cuda_dtypes.py checks each
// against op_db on the emulated device.
static const std::array kCudaDtypes = {
    // cuBLAS's GEMMs and GEMVs take floating and complex types only: an integer or float8 matmul
    // is a GPU's NotImplementedError (Blas.cpp; mm and addbmm run addmm's kernel, bmm baddbmm's,
    // mv addmv's, a real vdot dot's).
    CudaDtypes{"mm", "addmm_cuda", kBlas, 0},
    CudaDtypes{"addmm", "addmm_cuda", kBlas, 0},
    CudaDtypes{"addbmm", "addmm_cuda", kBlas, 0},
    CudaDtypes{"bmm", "baddbmm_cuda", kBlas, 0},
    CudaDtypes{"baddbmm", "baddbmm_cuda", kBlas, 0},
    CudaDtypes{"mv", "addmv_impl_cuda", kBlas, 0},
    CudaDtypes{"addmv", "addmv_impl_cuda", kBlas, 0},
    CudaDtypes{"dot", "dot", kBlas, 0},
    CudaDtypes{"vdot", "dot", kBlas, 0},
    // Pooling and upsampling: floating types, float16 and bfloat16 (AT_DISPATCH_FLOATING_TYPES_AND2),
    // no integers; the CPU's 3-D average pool lacks the halves.
    CudaDtypes{"avg_pool2d", "avg_pool2d_out_cuda_frame", kFloatingAndHalves, 0},
    CudaDtypes{"avg_pool2d_backward", "avg_pool2d_backward_out_cuda_frame", kFloatingAndHalves, 0},
    CudaDtypes{"avg_pool3d", "avg_pool3d_out_cuda", kFloatingAndHalves, kHalfAndBFloat16},
    CudaDtypes{"avg_pool3d_backward", "avg_pool3d_backward_out_frame", kFloatingAndHalves, kHalfAndBFloat16},
    CudaDtypes{"max_pool2d_with_indices", "max_pool2d_with_indices_out_cuda_frame", kFloatingAndHalves, 0},
    CudaDtypes{"max_pool2d_with_indices_backward", "max_pool2d_with_indices_out_cuda_frame", kFloatingAndHalves, 0},
    CudaDtypes{"max_pool3d_with_indices", "max_pool3d_with_indices_out_frame", kFloatingAndHalves, 0},
    CudaDtypes{"max_pool3d_with_indices_backward", "max_pool3d_with_indices_backward_out_frame", kFloatingAndHalves, 0},
    CudaDtypes{"upsample_bilinear2d", "upsample_bilinear2d_out_frame", kFloatingAndHalves, 0},
    CudaDtypes{"upsample_bilinear2d_backward", "upsample_bilinear2d_backward_out_frame", kFloatingAndHalves, 0},
    CudaDtypes{"upsample_bicubic2d", "upsample_bicubic2d_out_frame", kFloatingAndHalves, 0},
    CudaDtypes{"upsample_bicubic2d_backward", "upsample_bicubic2d_backward_out_frame", kFloatingAndHalves, 0},
    CudaDtypes{"_upsample_bilinear2d_aa", "upsample_bilinear2d_out_frame", kFloatingAndHalves, kHalfAndBFloat16},
    CudaDtypes{"_upsample_bilinear2d_aa_backward", "upsample_gen2d_backward_out_frame", kFloatingAndHalves, kHalfAndBFloat16},
    CudaDtypes{"_upsample_bicubic2d_aa", "upsample_bilinear2d_out_frame", kFloatingAndHalves, 0},
    CudaDtypes{"_upsample_bicubic2d_aa_backward", "upsample_gen2d_backward_out_frame", kFloatingAndHalves, 0},
    // Losses and activations whose CPU kernels lack the halves.
    CudaDtypes{"multi_margin_loss", nullptr, 0, kHalfAndBFloat16},
    CudaDtypes{"multi_margin_loss_backward", nullptr, 0, kHalfAndBFloat16},
    CudaDtypes{"multilabel_margin_loss_forward", nullptr, 0, kHalfAndBFloat16},
    CudaDtypes{"multilabel_margin_loss_backward", nullptr, 0, kHalfAndBFloat16},
    CudaDtypes{"rrelu_with_noise", nullptr, 0, kHalf},
    // cuFFT (and hipFFT) compute float16 and complex32, in power-of-two sizes only.
    CudaDtypes{"_fft_r2c", nullptr, 0, kHalf | kComplexHalf, Emulation::kWidened, true},
    CudaDtypes{"_fft_c2r", nullptr, 0, kHalf | kComplexHalf, Emulation::kWidened, true},
    CudaDtypes{"_fft_c2c", nullptr, 0, kHalf | kComplexHalf, Emulation::kWidened, true},
    // complex32 (ComplexHalf): CUDA's unary and binary kernels dispatch it, computing in complex64.
    CudaDtypes{"acos", nullptr, 0, kComplexHalf},
    CudaDtypes{"acosh", nullptr, 0, kComplexHalf},
    // angle: floating types and complex ones (complex32 too) only; integers are promoted first.
    CudaDtypes{"angle", "angle_cuda", kEverything & ~kHalfAndBFloat16, kComplexHalf},
    CudaDtypes{"asin", nullptr, 0, kComplexHalf},
    CudaDtypes{"asinh", nullptr, 0, kComplexHalf},
    CudaDtypes{"atan", nullptr, 0, kComplexHalf},
    CudaDtypes{"atanh", nullptr, 0, kComplexHalf},
    CudaDtypes{"cos", nullptr, 0, kComplexHalf},
    CudaDtypes{"cosh", nullptr, 0, kComplexHalf},
    CudaDtypes{"div", nullptr, 0, kComplexHalf},
    CudaDtypes{"exp", nullptr, 0, kComplexHalf},
    CudaDtypes{"lerp", nullptr, 0, kComplexHalf},
    CudaDtypes{"log", nullptr, 0, kComplexHalf},
    CudaDtypes{"logaddexp", nullptr, 0, kComplexHalf},
    CudaDtypes{"pow", nullptr, 0, kComplexHalf},
    CudaDtypes{"prod", nullptr, 0, kComplexHalf},
    CudaDtypes{"rsqrt", nullptr, 0, kComplexHalf},
    CudaDtypes{"sigmoid", nullptr, 0, kComplexHalf},
    CudaDtypes{"sin", nullptr, 0, kComplexHalf},
    CudaDtypes{"sinh", nullptr, 0, kComplexHalf},
    CudaDtypes{"sqrt", nullptr, 0, kComplexHalf},
    CudaDtypes{"sum", nullptr, 0, kComplexHalf},
    CudaDtypes{"tan", nullptr, 0, kComplexHalf},
    CudaDtypes{"tanh", nullptr, 0, kComplexHalf},
    CudaDtypes{"tanh_backward", nullptr, 0, kComplexHalf},
    CudaDtypes{"sigmoid_backward", nullptr, 0, kComplexHalf},
    // bool: abs is the identity (abs_cuda takes Bool), trace sums the diagonal into int64.
    CudaDtypes{"abs", nullptr, 0, kBool},
    CudaDtypes{"trace", nullptr, 0, kBool | kComplexHalf},
    // Floating types only (IGammaKernel.cu).
    CudaDtypes{"igamma", "igamma_cuda", kFloating, 0},
    CudaDtypes{"igammac", "igammac_cuda", kFloating, 0},
    // histc counts every integer and floating type but the halves (SummaryOps.cu: float16 is
    // refused before the dispatch); the CPU's histogram floating types only.
    CudaDtypes{"histc", "histc", kIntegral | kFloating, kIntegral, Emulation::kWidened, false, kHalf,
               "HalfTensor is not supported", {}, true},
    // The dropout mask's scaling: floating types and the halves (Dropout.cu).
    CudaDtypes{"native_dropout_backward", "masked_scale", kFloatingAndHalves, 0},
    // scatter_reduce's other reductions take no bool (ScatterGatherKernel.cu); its sum does.
    CudaDtypes{"scatter_reduce", "cuda_scatter_gather_base_kernel_func", kAllTypesAndHalves, 0, Emulation::kWidened,
               false, 0, nullptr, "sum"},
    // a CPU build refuses complex nansum ("nansum on CPU does not support complex inputs")
    CudaDtypes{"nansum", nullptr, 0, kComplex | kComplexHalf, Emulation::kNanSumAsSum},
};

const CudaDtypes* cuda_dtypes_of(const c10::FunctionSchema& schema) {
  const std::string& name = schema.name();
  if (name.rfind("aten::", 0) != 0) return nullptr;
  std::string_view base = std::string_view(name).substr(6);
  if (base.size() > 1 && base.back() == '_') base.remove_suffix(1);  // the in-place variant (exp_)
  for (const CudaDtypes& entry : kCudaDtypes) {
    if (entry.op == base) return &entry;
  }
  return nullptr;
}

static std::optional<ScalarType> first_tensor_dtype(const c10::IValue* args, uint32_t num_args) {
  for (uint32_t i = 0; i < num_args; ++i) {
    if (args[i].isTensor() && args[i].toTensor().defined()) return args[i].toTensor().scalar_type();
  }
  return std::nullopt;
}

static bool refused(const CudaDtypes& entry, ScalarType dtype) {
  return (entry.kernel != nullptr && !contains(entry.takes, dtype)) || contains(entry.refused_early, dtype);
}

bool needs_cuda_dtype_check(const CudaDtypes* entry, ScalarType dtype) {
  return entry != nullptr && (refused(*entry, dtype) || contains(entry->emulated, dtype));
}

// A CUDA build's structured kernels check shapes (their meta function) before the dtype dispatch
// refuses: the op's Meta kernel on metadata copies of the arguments raises those first. Its
// results tell whether there is anything to compute: a CUDA kernel returns before its dispatch
// when its input or result is empty (an empty matmul is empty, or zeros, on a GPU too).
static bool anything_to_compute(const c10::OperatorHandle& op, const c10::IValue* args, uint32_t num_args) {
  for (uint32_t i = 0; i < num_args; ++i) {
    if (args[i].isTensor() && args[i].toTensor().defined() && args[i].toTensor().numel() == 0) return false;
  }
  if (!op.hasKernelForDispatchKey(c10::DispatchKey::Meta)) return true;
  auto on_meta = [](const at::Tensor& t) {
    return t.defined() ? at::empty_strided(t.sizes(), t.strides(), t.options().device(c10::kMeta)) : t;
  };
  torch::jit::Stack stack;
  for (uint32_t i = 0; i < num_args; ++i) {
    const c10::IValue& iv = args[i];
    if (iv.isTensor()) {
      stack.emplace_back(on_meta(iv.toTensor()));
    } else if (iv.isTensorList()) {
      std::vector<at::Tensor> list;
      for (const at::Tensor& t : iv.toTensorVector()) list.push_back(on_meta(t));
      stack.emplace_back(std::move(list));
    } else if (iv.isDevice()) {
      stack.emplace_back(c10::Device(c10::kMeta));
    } else {
      stack.push_back(iv);
    }
  }
  try {
    op.redispatchBoxed(c10::DispatchKeySet(c10::DispatchKey::Meta), &stack);
  } catch (const c10::NotImplementedError&) {
    return true;  // no Meta kernel for this overload after all: the dtype error is the first a GPU raises
  }
  for (const c10::IValue& result : stack) {
    if (result.isTensor() && result.toTensor().defined() && result.toTensor().numel() == 0) return false;
  }
  return true;
}

// cuFFT's plan for half precision (CuFFTConfig): every signal size a power of two.
static void check_half_fft_sizes(const c10::FunctionSchema& schema, const c10::IValue* args) {
  const at::Tensor& self = args[0].toTensor();
  const std::vector<int64_t> dims = args[1].toIntVector();
  std::vector<int64_t> signal;
  for (int64_t d : dims) signal.push_back(self.size(d));
  if (schema.name() == "aten::_fft_c2r" && !signal.empty()) signal.back() = args[3].toInt();  // last_dim_size
  for (int64_t size : signal) {
    TORCH_CHECK(size > 0 && (size & (size - 1)) == 0, "cuFFT only supports dimensions whose sizes are powers of two "
                "when computing in half precision, but got a signal size of", c10::IntArrayRef(signal));
  }
}

// scatter_reduce(..., reduce="sum") takes every dtype the CPU's does.
static bool takes_every_dtype_for(const CudaDtypes& entry, const c10::FunctionSchema& schema, const c10::IValue* args) {
  if (entry.unless_reduce.empty()) return false;
  const std::optional<int> reduce = schema.argumentIndexWithName("reduce");
  return reduce && args[*reduce].isString() && args[*reduce].toStringRef() == entry.unless_reduce;
}

bool check_cuda_dtypes(const CudaDtypes& entry, const c10::OperatorHandle& op, const c10::IValue* args,
                       uint32_t num_args) {
  const std::optional<ScalarType> dtype = first_tensor_dtype(args, num_args);
  if (!dtype) return false;
  if (refused(entry, *dtype) && !takes_every_dtype_for(entry, op.schema(), args) &&
      anything_to_compute(op, args, num_args)) {
    TORCH_CHECK(!contains(entry.refused_early, *dtype), entry.early_message);
    TORCH_CHECK_NOT_IMPLEMENTED(false, "\"", entry.kernel, "\" not implemented for '", c10::toString(*dtype), "'");
  }
  if (!contains(entry.emulated, *dtype)) return false;
  if (entry.half_fft_sizes) check_half_fft_sizes(op.schema(), args);
  return true;
}

// The dtype a narrow one is computed in, and what it goes back to.
static ScalarType wider(ScalarType t) {
  switch (t) {
    case ScalarType::Half:
    case ScalarType::BFloat16: return ScalarType::Float;
    case ScalarType::ComplexHalf: return ScalarType::ComplexFloat;
    case ScalarType::Bool: return ScalarType::Byte;
    default: return c10::isIntegralType(t, /*includeBool=*/false) ? ScalarType::Double : t;
  }
}

// Whether `t` belongs to the narrow family of the call's dtype (float16 and complex32 go together:
// an FFT takes one and makes the other).
static bool narrow_kin(ScalarType t, ScalarType first) {
  if (first == ScalarType::Half || first == ScalarType::ComplexHalf) {
    return t == ScalarType::Half || t == ScalarType::ComplexHalf;
  }
  return t == first;
}

// The result dtypes that go back narrow: float -> float16 (bfloat16), complex64 -> complex32, and
// a widened integer or bool back to itself.
static std::optional<ScalarType> narrowed(ScalarType result, ScalarType first) {
  switch (first) {
    case ScalarType::Half:
    case ScalarType::ComplexHalf:
      if (result == ScalarType::Float) return ScalarType::Half;
      if (result == ScalarType::ComplexFloat) return ScalarType::ComplexHalf;
      return std::nullopt;
    default: return result == wider(first) ? std::optional<ScalarType>(first) : std::nullopt;
  }
}

void run_widened(const CudaDtypes& entry, const c10::OperatorHandle& op, c10::DispatchKey key,
                 torch::jit::Stack* stack) {
  const c10::FunctionSchema& schema = op.schema();
  const size_t num_args = schema.arguments().size();
  const size_t base = stack->size() - num_args;
  const ScalarType first = *first_tensor_dtype(stack->data() + base, num_args);
  const c10::OperatorHandle* kernel = &op;
  if (entry.how == Emulation::kNanSumAsSum) {
    // nansum(self, dim, keepdim, dtype) is sum.dim_IntList of self with its NaNs zeroed (CUDA's
    // nansum adds 0 for a complex element with a NaN part); nansum.out is sum.IntList_out. The
    // sum of complex32 is widened in turn.
    const at::Tensor self = (*stack)[base].toTensor();
    (*stack)[base] = at::where(at::isnan(self), at::zeros({}, self.options()), self);
    static const c10::OperatorHandle sum = c10::Dispatcher::singleton().findSchemaOrThrow("aten::sum", "dim_IntList");
    static const c10::OperatorHandle sum_out = c10::Dispatcher::singleton().findSchemaOrThrow("aten::sum", "IntList_out");
    kernel = schema.overload_name().empty() ? &sum : &sum_out;
    if (first != ScalarType::ComplexHalf) return kernel->redispatchBoxed(c10::DispatchKeySet(key), stack);
  }
  struct Written {
    at::Tensor given;    // the argument as the caller passed it (a CPU alias)
    at::Tensor widened;  // the copy the kernel writes
  };
  c10::SmallVector<Written, 2> written;
  for (size_t i = 0; i < num_args; ++i) {
    c10::IValue& iv = (*stack)[base + i];
    if (!iv.isTensor()) continue;
    const at::Tensor t = iv.toTensor();
    if (!t.defined() || !narrow_kin(t.scalar_type(), first)) continue;
    at::Tensor widened = t.to(wider(t.scalar_type()));
    const auto* alias = schema.arguments()[i].alias_info();
    if (alias != nullptr && alias->isWrite()) written.push_back({t, widened});
    iv = std::move(widened);
  }
  if (entry.integer_bounds && c10::isIntegralType(first, false)) {
    for (const char* bound : {"min", "max"}) {
      c10::IValue& iv = (*stack)[base + *schema.argumentIndexWithName(bound)];
      iv = c10::Scalar(iv.toScalar().to<int64_t>());
    }
  }
  kernel->redispatchBoxed(c10::DispatchKeySet(key), stack);
  for (Written& w : written) {
    if (!w.given.sizes().equals(w.widened.sizes())) w.given.resize_(w.widened.sizes());
    w.given.copy_(w.widened);
  }
  const size_t num_returns = schema.returns().size();
  for (size_t i = stack->size() - num_returns; i < stack->size(); ++i) {
    c10::IValue& iv = (*stack)[i];
    if (!iv.isTensor()) continue;
    const at::Tensor result = iv.toTensor();
    auto is_written = [&](const Written& w) { return w.widened.unsafeGetTensorImpl() == result.unsafeGetTensorImpl(); };
    if (auto found = std::find_if(written.begin(), written.end(), is_written); found != written.end()) {
      iv = found->given;
    } else if (const auto narrow = narrowed(result.scalar_type(), first)) {
      iv = result.to(*narrow);
    }
  }
}

}  // namespace mirage
