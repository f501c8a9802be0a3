// The current device and stream of each thread (what torch.cuda.set_device / torch.cuda.stream
// set), kept by the CUDA device guard (device_guard.cpp).
#pragma once

#include "config.h"

#include <c10/core/Stream.h>

#include <array>

namespace mirage {

inline thread_local DeviceIndex tl_device = 0;
inline thread_local std::array<c10::StreamId, kMaxDevices> tl_stream{};

// A stream id no stream had (torch.cuda.Stream, a communicator's stream).
c10::StreamId new_stream_id();

}  // namespace mirage
