// The devices' default generators (generators.h), created on first use.
#include "generators.h"

#include <ATen/CPUGeneratorImpl.h>
#include <torch/library.h>

#include <array>
#include <mutex>

namespace mirage {

static std::mutex g_gen_mu;
static std::array<at::Generator, kMaxDevices> g_generators;

const at::Generator& default_generator(DeviceIndex dev) {
  check_index(dev);
  std::lock_guard<std::mutex> g(g_gen_mu);
  if (!g_generators[dev].defined()) {
    g_generators[dev] = at::make_generator<at::CPUGeneratorImpl>(c10::default_rng_seed_val);
  }
  return g_generators[dev];
}

}  // namespace mirage

// The Python side asks for each device's default generator (torch.cuda.default_generators).
TORCH_LIBRARY_FRAGMENT(mirage, m) {
  m.def("default_generator(int device) -> Generator?", [](int64_t device) {
    return mirage::default_generator(static_cast<c10::DeviceIndex>(device));
  });
}
