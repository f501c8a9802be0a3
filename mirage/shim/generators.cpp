// The devices' Philox generators and the counter-based kernels of the common distributions
// (generators.h says what is CUDA's and what is not).
#include "generators.h"

#include "op_path.h"
#include "graph_capture.h"
#include "host_views.h"
#include "device_clock.h"
#include "unobserved_ops.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Parallel.h>
#include <c10/util/irange.h>
#include <torch/library.h>

#include <array>
#include <cmath>
#include <cstring>
#include <mutex>

namespace mirage {

PhiloxGenerator::PhiloxGenerator(DeviceIndex device, c10::intrusive_ptr<PhiloxState> state)
    : c10::GeneratorImpl{c10::Device(DeviceType::CUDA, device), c10::DispatchKeySet(c10::DispatchKey::CUDA)},
      state_(std::move(state)) {}

void PhiloxGenerator::set_current_seed(uint64_t seed) {
  state_->seed = seed;
  state_->offset = 0;
}

void PhiloxGenerator::set_offset(uint64_t offset) {
  TORCH_CHECK(offset % 4 == 0, "offset must be a multiple of 4");
  state_->offset = offset;
}

uint64_t PhiloxGenerator::get_offset() const { return state_->offset; }
uint64_t PhiloxGenerator::current_seed() const { return state_->seed; }

uint64_t PhiloxGenerator::seed() {
  const uint64_t random = c10::detail::getNonDeterministicRandom(true);
  set_current_seed(random);
  return random;
}

// CUDA's layout: the seed, then the offset, 8 bytes each; a state of the seed alone is accepted.
c10::intrusive_ptr<c10::TensorImpl> PhiloxGenerator::get_state() const {
  at::Tensor state = at::empty({16}, at::TensorOptions().dtype(at::kByte));
  const uint64_t seed = state_->seed;
  const int64_t offset = static_cast<int64_t>(state_->offset);
  std::memcpy(state.data_ptr<uint8_t>(), &seed, 8);
  std::memcpy(state.data_ptr<uint8_t>() + 8, &offset, 8);
  return state.getIntrusivePtr();
}

void PhiloxGenerator::set_state(const c10::TensorImpl& new_state) {
  TORCH_CHECK_TYPE(new_state.layout() == at::kStrided && new_state.device().type() == DeviceType::CPU &&
                       new_state.dtype() == at::kByte,
                   "RNG state must be a torch.ByteTensor");
  TORCH_CHECK(new_state.is_contiguous(), "RNG state must be contiguous");
  const int64_t size = new_state.numel();
  TORCH_CHECK(size == 8 || size == 16, "RNG state is wrong size");
  const auto* bytes = new_state.data_dtype_initialized<uint8_t>();
  uint64_t seed = 0;
  int64_t offset = 0;
  std::memcpy(&seed, bytes, 8);
  if (size == 16) std::memcpy(&offset, bytes + 8, 8);
  set_current_seed(seed);
  set_offset(static_cast<uint64_t>(offset));
}

void PhiloxGenerator::graphsafe_set_state(const c10::intrusive_ptr<c10::GeneratorImpl>& other) {
  auto* philox = dynamic_cast<PhiloxGenerator*>(other.get());
  TORCH_CHECK(philox, "Expected a CUDA Generator");
  state_ = philox->state_;
}

c10::intrusive_ptr<c10::GeneratorImpl> PhiloxGenerator::graphsafe_get_state() const {
  return c10::make_intrusive<PhiloxGenerator>(device().index(), state_);
}

PhiloxGenerator* PhiloxGenerator::clone_impl() const {
  auto state = c10::make_intrusive<PhiloxState>();
  state->seed = state_->seed;
  state->offset = state_->offset;
  return new PhiloxGenerator(device().index(), std::move(state));
}

std::pair<uint64_t, uint64_t> PhiloxGenerator::reserve(uint64_t increment) {
  std::lock_guard<std::mutex> lock(mutex_);
  const uint64_t offset = state_->offset;
  state_->offset += (increment + 3) / 4 * 4;
  return {state_->seed, offset};
}

static std::mutex g_gen_mu;
static std::array<at::Generator, kMaxDevices> g_generators;

const at::Generator& default_generator(DeviceIndex dev) {
  check_index(dev);
  std::lock_guard<std::mutex> g(g_gen_mu);
  if (!g_generators[dev].defined()) g_generators[dev] = at::make_generator<PhiloxGenerator>(dev);
  return g_generators[dev];
}

at::Generator new_generator(DeviceIndex dev) {
  check_index(dev);
  return at::make_generator<PhiloxGenerator>(dev);
}

PhiloxGenerator& generator_for(const std::optional<at::Generator>& given, DeviceIndex dev) {
  if (given.has_value() && given->defined()) {
    TORCH_CHECK(given->device().type() == DeviceType::CUDA, "Expected a 'cuda' device type for generator but found '",
                given->device().type(), "'");
    return *given->get<PhiloxGenerator>();
  }
  return *default_generator(dev).get<PhiloxGenerator>();
}

static thread_local bool tl_counters_reserved = false;

// While a counter-based kernel runs the op path: its counters are reserved already.
struct CountersReserved {
  CountersReserved() { tl_counters_reserved = true; }
  ~CountersReserved() { tl_counters_reserved = false; }
};

at::Generator host_generator_for(PhiloxGenerator& gen) {
  uint64_t seed, offset;
  if (tl_counters_reserved) {
    std::lock_guard<std::mutex> lock(gen.mutex_);
    seed = gen.current_seed();
    offset = gen.get_offset();
  } else {
    std::tie(seed, offset) = gen.reserve(4);
  }
  // A 64-bit mix of the pair (splitmix64's finaliser), so nearby offsets seed unrelated streams.
  uint64_t mixed = seed ^ (offset * 0x9E3779B97F4A7C15ULL);
  mixed = (mixed ^ (mixed >> 30)) * 0xBF58476D1CE4E5B9ULL;
  mixed = (mixed ^ (mixed >> 27)) * 0x94D049BB133111EBULL;
  return at::make_generator<at::CPUGeneratorImpl>(mixed ^ (mixed >> 31));
}

// ---- Counter-based values: Philox4x32-10 (Salmon et al., "Parallel random numbers: as easy as
// 1, 2, 3", SC'11), key = the seed, counter = offset + element index.

static std::array<uint32_t, 4> philox(uint64_t seed, uint64_t counter) {
  uint32_t c0 = static_cast<uint32_t>(counter), c1 = static_cast<uint32_t>(counter >> 32), c2 = 0, c3 = 0;
  uint32_t k0 = static_cast<uint32_t>(seed), k1 = static_cast<uint32_t>(seed >> 32);
  for (int round = 0; round < 10; ++round) {
    const uint64_t p0 = uint64_t{0xD2511F53} * c0, p1 = uint64_t{0xCD9E8D57} * c2;
    const uint32_t n0 = static_cast<uint32_t>(p1 >> 32) ^ c1 ^ k0, n2 = static_cast<uint32_t>(p0 >> 32) ^ c3 ^ k1;
    c1 = static_cast<uint32_t>(p1);
    c3 = static_cast<uint32_t>(p0);
    c0 = n0;
    c2 = n2;
    k0 += 0x9E3779B9;
    k1 += 0xBB67AE85;
  }
  return {c0, c1, c2, c3};
}

// A uniform in [0, 1) from two words: 53 bits for double, 24 for the narrower types (whose
// rounding would otherwise reach 1).
static double unit(uint32_t hi, uint32_t lo, bool full_precision) {
  if (full_precision) return static_cast<double>(((uint64_t{hi} << 32 | lo) >> 11)) * 0x1.0p-53;
  return static_cast<double>(hi >> 8) * 0x1.0p-24;
}

enum class Distribution { kUniform, kNormal };

// n values of the distribution into a double buffer, element j from counter offset + j.
static at::Tensor draw(int64_t n, uint64_t seed, uint64_t offset, Distribution kind, bool full_precision) {
  at::Tensor out = at::empty({n}, at::TensorOptions().dtype(at::kDouble));
  double* data = out.data_ptr<double>();
  at::parallel_for(0, n, 1 << 14, [&](int64_t begin, int64_t end) {
    for (int64_t j = begin; j < end; ++j) {
      const auto w = philox(seed, offset + static_cast<uint64_t>(j));
      if (kind == Distribution::kUniform) {
        data[j] = unit(w[0], w[1], full_precision);
      } else {  // Box-Muller on (0, 1] x [0, 1)
        const double u1 = 1.0 - unit(w[0], w[1], true), u2 = unit(w[2], w[3], true);
        data[j] = std::sqrt(-2.0 * std::log(u1)) * std::cos(2.0 * M_PI * u2);
      }
    }
  });
  return out;
}

// uniform_, normal_, bernoulli_ (float p and tensor p) on a device tensor: the op path runs
// PyTorch's CPU kernel (its argument checks, the allocator model, busy time and the clock),
// with the op's counters reserved; then the values are replaced by the counter-based ones.
static void counter_based(const c10::OperatorHandle& op, c10::DispatchKeySet keys, torch::jit::Stack* stack) {
  if (capturing()) return fallback(op, keys, stack);  // a replay comes back here and draws anew
  const auto& args = op.schema().arguments();
  const size_t base = stack->size() - args.size();
  const at::Tensor self = (*stack)[base].toTensor();
  const std::string& overload = op.schema().overload_name();
  const std::string name = op.schema().name();
  c10::IValue& generator_arg = (*stack)[stack->size() - 1];
  const std::optional<at::Generator> given =
      generator_arg.isNone() ? std::nullopt : std::optional<at::Generator>(generator_arg.toGenerator());
  PhiloxGenerator& gen = generator_for(given, self.device().index());
  // a complex tensor draws its real and imaginary parts as a real tensor of twice its elements,
  // as CUDA's uniform_ and normal_ do (view_as_real; normal_ with std / sqrt(2))
  const int64_t draws = self.is_complex() ? 2 * self.numel() : self.numel();
  const auto [seed, offset] = gen.reserve(static_cast<uint64_t>(draws));
  const c10::IValue scalar = args.size() > 2 ? (*stack)[base + 1] : c10::IValue();
  const c10::IValue scalar2 = args.size() > 3 ? (*stack)[base + 2] : c10::IValue();
  {
    CountersReserved reserved;
    fallback(op, keys, stack);
  }
  if (predict_only() || self.numel() == 0) return;
  const at::Tensor host = self.is_complex() ? at::view_as_real(cpu_alias(self)) : cpu_alias(self);
  const bool full = host.scalar_type() == at::kDouble;
  at::Tensor values;
  if (name == "aten::uniform_") {
    const double from = scalar.toDouble(), to = scalar2.toDouble();
    values = draw(draws, seed, offset, Distribution::kUniform, full).mul_(to - from).add_(from);
    if (!full) {  // a value that rounds up to `to` in the narrower type becomes `from`, as CUDA's kernel does
      values = values.to(host.scalar_type());
      values.masked_fill_(values.ge(to), from);
    }
  } else if (name == "aten::normal_") {
    const double std = self.is_complex() ? scalar2.toDouble() / std::sqrt(2.0) : scalar2.toDouble();
    values = draw(draws, seed, offset, Distribution::kNormal, true).mul_(std).add_(scalar.toDouble());
  } else {  // bernoulli_: p a float, or a tensor broadcast to self
    at::Tensor u = draw(self.numel(), seed, offset, Distribution::kUniform, true).view(self.sizes());
    at::Tensor p = overload == "float" ? at::scalar_tensor(scalar.toDouble(), at::kDouble)
                                       : (scalar.toTensor().is_cuda() ? cpu_alias(scalar.toTensor()) : scalar.toTensor());
    values = at::lt(u, p.to(at::kDouble));
  }
  host.copy_(values.view(host.sizes()));
}

}  // namespace mirage

// The Python side asks for each device's default generator (torch.cuda.default_generators).
MIRAGE_LIBRARY(m) {
  m.def("default_generator(int device) -> Generator?", [](int64_t device) {
    return mirage::default_generator(static_cast<c10::DeviceIndex>(device));
  });
}

TORCH_LIBRARY_IMPL(aten, CUDA, m) {
  for (const char* name : {"uniform_", "normal_", "bernoulli_.float", "bernoulli_.Tensor"}) {
    m.impl(name, torch::CppFunction::makeFromBoxedFunction<&mirage::counter_based>());
  }
}
