// runtime/plan: compiles one layer of a request into coalesced RMA operations (this header), the
// transfer state machine (transfer_state.hpp) and the scheduler's policy (schedule.hpp), as
// ARCHITECTURE.md §4 places them. Depends on kv/ and common/. The core drives the state machine
// and applies the policy to the transfers and sessions it owns (core/transfer.cpp, scheduler.cpp).
//
// Compilation walks the request in token runs that stay inside one source and one destination
// block, so its cost is O(blocks) (O(blocks x heads) when a side is head-major) whatever the two
// block tables look like, and it allocates only when its output buffer must first grow: the bound
// is computed up front, so the number of allocations never depends on the number of blocks.
#pragma once

#include "common/common.hpp"
#include "kv/kv.hpp"

#include <cstdint>
#include <span>

namespace sg::plan {

inline constexpr uint32_t kMaxIov = 4;

struct Iov {
    const uint8_t *addr;
    uint64_t len;
    uint32_t src_region;  // index within the layer on the source side (for the local MR descriptor)
};

// One RMA write: up to kMaxIov local pieces into one contiguous destination range.
struct Op {
    uint32_t dst_region = 0;  // region index within the layer on the destination side
    uint32_t niov = 0;
    uint64_t dst_offset = 0;
    uint64_t len = 0;
    Iov iov[kMaxIov];
};

struct Limits {
    uint64_t max_op_bytes = 1ull << 30;  // also the provider's max_msg_size
    uint32_t max_iov = kMaxIov;          // the provider's rma_iov_limit, capped at kMaxIov
};

struct LayerPlanStats {
    uint64_t segments = 0;  // contiguous pieces before coalescing
    uint64_t bytes = 0;
};

// The side of a request being planned: its layout, its block table and, for the source, where each
// region of the layer starts in local memory (unused for the destination).
struct Side {
    const kv::Layout *layout;
    std::span<const uint32_t> blocks;
};

// Appends the layer's operations to `ops` (cleared first). src_bases[r] is the address of region r of
// this layer. Throws Error(SG_ERR_LAYOUT_MISMATCH) when the layouts cannot be mapped and
// SG_ERR_OUT_OF_RANGE when a table is too short for num_tokens (callers check ids beforehand).
LayerPlanStats compile_layer(const Side &src, const uint8_t *const src_bases[2], const Side &dst, uint64_t num_tokens,
                             const Limits &limits, Vec<Op> &ops);

// Upper bound on the operations compile_layer can produce for this request (used to reserve once).
uint64_t max_ops_per_layer(const Side &src, const Side &dst, uint64_t num_tokens);

}  // namespace sg::plan
