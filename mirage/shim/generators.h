// Each emulated device's random generator, as CUDA has it: a Philox state of (seed, offset).
//
// torch.cuda.get_rng_state() gives its 16 bytes (seed, then offset, as uint64s) and
// set_rng_state() takes them back; manual_seed resets the offset to 0; offsets are multiples of
// 4; graphsafe_get_state/graphsafe_set_state share one state between generators. DTensor's
// offset-based RNG tracker reads and moves that offset for every random op on a sharded tensor.
//
// The values of the distributions DTensor and training use (uniform_, normal_, bernoulli_: rand,
// randn, initialisers, dropout) are a function of (seed, offset + element index) through
// counter-based Philox4x32-10, and such an op advances the offset by its element count rounded
// up to 4, which is what DTensor's tracker assumes: a shard initialised at the offset of its
// first element equals that slice of the unsharded tensor. (CUDA's kernels take the offset per
// thread and advance it by a launch-dependent multiple of 4; the bits differ from NVIDIA's.)
// Every other random op runs PyTorch's CPU kernel with a CPU generator seeded from (seed,
// offset), and advances the offset by 4: deterministic, and independent between generators.
#pragma once

#include "config.h"

#include <ATen/core/Generator.h>
#include <ATen/core/Tensor.h>
#include <c10/core/GeneratorImpl.h>

#include <cstdint>
#include <optional>
#include <utility>

namespace mirage {

// The state graphsafe_get_state shares between generators.
struct PhiloxState : c10::intrusive_ptr_target {
  uint64_t seed = c10::default_rng_seed_val;
  uint64_t offset = 0;
};

class PhiloxGenerator final : public c10::GeneratorImpl {
 public:
  explicit PhiloxGenerator(DeviceIndex device,
                           c10::intrusive_ptr<PhiloxState> state = c10::make_intrusive<PhiloxState>());

  void set_current_seed(uint64_t seed) override;
  void set_offset(uint64_t offset) override;
  uint64_t get_offset() const override;
  uint64_t current_seed() const override;
  uint64_t seed() override;
  void set_state(const c10::TensorImpl& new_state) override;
  c10::intrusive_ptr<c10::TensorImpl> get_state() const override;
  void graphsafe_set_state(const c10::intrusive_ptr<c10::GeneratorImpl>& other) override;
  c10::intrusive_ptr<c10::GeneratorImpl> graphsafe_get_state() const override;

  // (seed, offset) for an op that draws `increment` counters; the offset moves past them.
  // Holds the generator's mutex.
  std::pair<uint64_t, uint64_t> reserve(uint64_t increment);

 private:
  PhiloxGenerator* clone_impl() const override;
  c10::intrusive_ptr<PhiloxState> state_;
};

const at::Generator& default_generator(DeviceIndex dev);
at::Generator new_generator(DeviceIndex dev);

// The generator an op on device `dev` draws from: the one given (CUDA's error for another
// device type's), else the device's default.
PhiloxGenerator& generator_for(const std::optional<at::Generator>& given, DeviceIndex dev);

// A CPU generator for PyTorch's CPU kernel of a random op: seeded from the device generator's
// (seed, offset), whose offset advances by 4, unless a counter-based kernel of this thread has
// reserved the op's counters already (it then overwrites what the CPU kernel drew).
at::Generator host_generator_for(PhiloxGenerator& gen);

}  // namespace mirage
