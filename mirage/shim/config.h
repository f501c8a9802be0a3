// What the emulated node is, as the launcher describes it in the environment: the GPUs this
// process sees, their capacity, the vendor. Read once; every part of the shim includes this.
#pragma once

#include <c10/core/Device.h>
#include <c10/util/Exception.h>

#include <array>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>

namespace mirage {

using c10::DeviceIndex;
using c10::DeviceType;

constexpr int kMaxDevices = 64;

struct Config {
  DeviceIndex num_devices = 0;  // the GPUs this process sees
  std::array<DeviceIndex, kMaxDevices> node_gpu{};  // cuda:i is the node's GPU node_gpu[i]
  int64_t capacity = 0;      // bytes per device
  int64_t context_bytes = 0; // a process's GPU context on a device (its non-PyTorch memory)
  bool amd = true;           // message wording: "HIP out of memory" vs "CUDA out of memory"
  // --lazy-device-memory: device blocks are private memory that costs the host nothing until
  // written, and their pages go back when freed (shared_device_memory.cpp).
  bool lazy_memory = false;
  Config() {
    // MIRAGE_VISIBLE_GPUS: the node's GPUs after *_VISIBLE_DEVICES, in order, set by
    // mirage/runtime/boot.py before it loads the shim (torch.cuda reads the same list).
    const char* visible = std::getenv("MIRAGE_VISIBLE_GPUS");
    for (const char* p = visible ? visible : ""; *p && num_devices < kMaxDevices; ++p) {
      char* end = nullptr;
      long gpu = std::strtol(p, &end, 10);
      if (end == p || gpu < 0 || gpu >= kMaxDevices) break;
      node_gpu[num_devices++] = static_cast<DeviceIndex>(gpu);
      p = end;
      if (*p != ',') break;
    }
    if (const char* c = std::getenv("MIRAGE_GPU_MEMORY_BYTES")) capacity = std::strtoll(c, nullptr, 10);
    if (const char* c = std::getenv("MIRAGE_CONTEXT_BYTES")) context_bytes = std::strtoll(c, nullptr, 10);
    if (const char* v = std::getenv("MIRAGE_VENDOR")) amd = std::strcmp(v, "nvidia") != 0;
    if (const char* v = std::getenv("MIRAGE_LAZY_DEVICE_MEMORY")) lazy_memory = *v != '\0';
  }
};

inline const Config& config() {
  static Config cfg;
  return cfg;
}

inline void check_index(DeviceIndex index) {
  TORCH_CHECK(index >= 0 && index < config().num_devices, "Invalid device ordinal: cuda:",
      static_cast<int>(index), " (this emulated node has ", static_cast<int>(config().num_devices),
      " GPUs)");
}

// "1.50 MiB": sizes as the caching allocator's messages print them.
std::string format_size(int64_t bytes);

// What torch appends to a CUDA (HIP) error's message: where it may really have come from, and
// how to find out.
inline std::string cuda_error_suffix() {
  const char* api = config().amd ? "HIP" : "CUDA";
  return std::string(api) + " kernel errors might be asynchronously reported at some other API call, so the "
         "stacktrace below might be incorrect.\nFor debugging consider passing " + api + "_LAUNCH_BLOCKING=1\nCompile "
         "with `TORCH_USE_" + api + "_DSA` to enable device-side assertions.\n";
}

}  // namespace mirage
