// The CUDA plugin as the runtime sees it: libsmartgen-cuda.so.0 (kernels/cuda), loaded with dlopen
// the first time a CUDA pool is used, once per process, so libsmartgen itself links no CUDA library
// and runs host transfers on machines without a driver or toolkit.
#pragma once

#include <cstdint>

namespace sg::core {

// Answers a CUDA pool on `device`: throws SG_ERR_UNSUPPORTED whose message names what is missing
// (the plugin and why dlopen refused it, a usable driver, a device) or, with all of them present,
// that device-memory transfers are not in this build yet; SG_ERR_INVALID_LAYOUT for a device
// ordinal the driver does not have.
[[noreturn]] void refuse_cuda_pool(int32_t device);

}  // namespace sg::core
