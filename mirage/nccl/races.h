// mirage run --check-races in the emulated NCCL: each collective and point-to-point transfer
// reads its inputs and writes its outputs on its communicator's stream, after that stream waited
// for the issuing one, and Work.wait() orders the waiter's stream after it, as ProcessGroupNCCL
// does. The checking itself is the shim's (mirage/shim/race_checker.h), found through dlsym as
// the clock is (clock.h); without --check-races `on` is false.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

namespace mirage::nccl {

struct ShimRaces {
  void* (*collective)(int, int64_t, const at::Tensor*, size_t, const at::Tensor*, size_t, const char*) = nullptr;
  void (*wait)(void*, int) = nullptr;
  void (*release)(void*) = nullptr;
  void (*name_stream)(int, int64_t, const char*) = nullptr;
  bool on = false;

  static const ShimRaces& get();
  // The operation `name` on `stream` of `device` (named `stream_name` in reports) reads `ins` and
  // writes `outs`; returns what Work.wait() orders its waiter after (release it with the Work).
  void* issue(int device, int64_t stream, const std::string& stream_name, const std::vector<at::Tensor>& ins,
              const std::vector<at::Tensor>& outs, const char* name) const;
};
inline const ShimRaces& shim_races() { return ShimRaces::get(); }

}  // namespace mirage::nccl
