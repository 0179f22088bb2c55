// runtime/plan: the scheduler's policy on the prefill side — the order in which a pass serves work
// and how much may be in flight. runtime/core/scheduler.cpp applies it to the transfers the
// context owns (posting needs the sessions and transports, which live in core/).
#pragma once

#include "common/common.hpp"

#include <cstdint>

namespace sg::plan {

// Every scheduler pass serves these in order: fetches the decode side is waiting for (on demand)
// before anything else, then proactive and full-path work, then the speculative rest, which also
// yields to a recent fetch (core/paths_prefill.cpp).
enum class PathClass : uint8_t { OnDemand = 0, Bulk = 1, Speculative = 2 };
inline constexpr int kPathClasses = 3;

// Operations one transfer posts per turn: transfers of equal priority on a session take turns,
// and a higher priority is served first on every pass.
inline constexpr uint32_t kTurnQuota = 16;

// Operations and bytes in flight against the context's bounds (SG_PARAM_MAX_OPS_IN_FLIGHT,
// max_bytes_in_flight, max_session_bytes_in_flight): bulk is kept to about one chunk so that a
// change of priority takes effect quickly and a fetch never queues behind much.
class InflightBudget {
  public:
    uint32_t max_ops = defaults::kMaxOpsInFlight;
    uint64_t max_bytes = defaults::kMaxBytesInFlight;
    uint64_t max_session_bytes = defaults::kMaxSessionBytesInFlight;

    bool has_op_slot() const { return ops_ < max_ops; }
    // Whether an operation of len bytes fits the context's and the session's byte bounds. One
    // larger than a bound still goes when nothing is in flight, or it could never go.
    bool may_post_bytes(uint64_t session_bytes, uint64_t len) const {
        if (bytes_ == 0) return true;
        return bytes_ + len <= max_bytes && session_bytes + len <= max_session_bytes;
    }
    void posted(uint64_t len) {
        ++ops_;
        bytes_ += len;
    }
    void completed(uint64_t len) {
        --ops_;
        bytes_ -= len;
    }
    uint32_t ops() const { return ops_; }
    uint64_t bytes() const { return bytes_; }

  private:
    uint32_t ops_ = 0;
    uint64_t bytes_ = 0;
};

}  // namespace sg::plan
