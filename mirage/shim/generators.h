// Each device's random generator: a CPU-kind generator, because the CPU kernels that do the work
// insist on a CPU generator, while each device must still have a stream of numbers of its own.
#pragma once

#include "config.h"

#include <ATen/core/Generator.h>

namespace mirage {

const at::Generator& default_generator(DeviceIndex dev);

}  // namespace mirage
