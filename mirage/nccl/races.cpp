// --check-races in the emulated NCCL (races.h).
#include "races.h"

#include <dlfcn.h>

namespace mirage::nccl {

const ShimRaces& ShimRaces::get() {
  static const ShimRaces races = [] {
    ShimRaces r;
    auto enabled = reinterpret_cast<int (*)()>(dlsym(RTLD_DEFAULT, "mirage_races_enabled"));
    r.collective = reinterpret_cast<void* (*)(int, int64_t, const at::Tensor*, size_t, const at::Tensor*, size_t,
                                              const char*)>(dlsym(RTLD_DEFAULT, "mirage_races_collective"));
    r.wait = reinterpret_cast<void (*)(void*, int)>(dlsym(RTLD_DEFAULT, "mirage_races_wait"));
    r.release = reinterpret_cast<void (*)(void*)>(dlsym(RTLD_DEFAULT, "mirage_races_release"));
    r.name_stream = reinterpret_cast<void (*)(int, int64_t, const char*)>(dlsym(RTLD_DEFAULT, "mirage_races_name_stream"));
    r.on = enabled && r.collective && r.wait && r.release && r.name_stream && enabled();
    return r;
  }();
  return races;
}

void* ShimRaces::issue(int device, int64_t stream, const std::string& stream_name, const std::vector<at::Tensor>& ins,
                       const std::vector<at::Tensor>& outs, const char* name) const {
  name_stream(device, stream, stream_name.c_str());
  return collective(device, stream, ins.data(), ins.size(), outs.data(), outs.size(), name);
}

}  // namespace mirage::nccl
