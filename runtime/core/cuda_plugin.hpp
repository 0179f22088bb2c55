// The CUDA plugin as the runtime sees it: libsmartgen-cuda.so.0 (kernels/cuda), loaded with dlopen
// the first time a CUDA pool is used, once per process, so libsmartgen itself links no CUDA library
// and runs host transfers on machines without a driver or toolkit.
//
// Device pools move through the staging path (staging.cpp): the prefill side gathers a chunk's
// pieces from the device into its host staging slot, the decode side scatters a received slot into
// its device pool. The runtime never dereferences device memory itself; every access is one of the
// calls below.
#pragma once

#include "cuda/plugin_abi.h"

#include <cstdint>
#include <span>
#include <utility>

namespace sg::core {

// Accepts a CUDA pool on `device` whose regions start at `bases`: throws SG_ERR_UNSUPPORTED whose
// message names what is missing (the plugin and why dlopen refused it, a usable driver, a device),
// SG_ERR_INVALID_LAYOUT for a device ordinal the driver does not have or a base that is not memory
// of that device.
void check_cuda_pool(int32_t device, std::span<uint8_t *const> bases);

// The device side of a staged chunk, synchronous: the pieces (device addresses), back to back, into
// `host`, or `host` into them. Throw SG_ERR_INTERNAL with CUDA's message when the device fails.
void cuda_stage_out(int32_t device, std::span<const std::pair<const uint8_t *, uint64_t>> pieces, uint8_t *host);
void cuda_stage_in(int32_t device, std::span<const std::pair<uint8_t *, uint64_t>> pieces, const uint8_t *host);

// Page digests of a device region's listed blocks computed on the device (digest.blocks and
// digest.out in host memory; see plugin_abi.h). false when the plugin predates the call (the caller
// then digests a host copy of the keys); throws SG_ERR_INTERNAL with CUDA's message on failure.
bool cuda_digest_to_host(int32_t device, const sg_cuda_digest_t &digest);

// The engine's stream at sg_transfer_layer_written: an event recorded on it, which the runtime polls
// before it reads the layer (never waiting on the engine's stream itself).
class StreamEvent {
  public:
    StreamEvent(int32_t device, void *stream);  // throws SG_ERR_UNSUPPORTED / SG_ERR_INVALID_ARGUMENT
    ~StreamEvent();
    StreamEvent(const StreamEvent &) = delete;
    StreamEvent &operator=(const StreamEvent &) = delete;
    // Whether the work queued on the stream before the event has finished; throws SG_ERR_INTERNAL
    // when the device reports an error.
    bool done();

  private:
    void *event_ = nullptr;
};

}  // namespace sg::core
