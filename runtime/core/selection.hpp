// Selection over a paged pool: reads one layer's keys through a request's block table and turns
// them, with the profile's policies, into block scores (kernels/) and an essential set (select/).
// Shared by sg_selector_* (the decode side's own per-step choice) and the proactive path.
#pragma once

#include "kv/kv.hpp"
#include "select/select.hpp"

#include <cstdint>
#include <span>
#include <vector>

namespace sg::core {

kernels::DType kernel_dtype(sg_dtype_t dtype);  // SG_ERR_UNSUPPORTED for fp8

// The K planes a CPU selection reads for one layer and block table. For a host pool, its own region
// and the table as given; for a device pool, a host copy of the listed blocks' K planes (staged out
// through the CUDA plugin: block i at i x plane_bytes), a layout that says so and the table 0..n-1.
struct HostKeys {
    kv::Layout layout;
    const uint8_t *k_region = nullptr;
    std::span<const uint32_t> table;
    std::vector<uint8_t> copy;
    std::vector<uint32_t> iota;
};
HostKeys host_keys(const kv::Layout &pool_layout, const uint8_t *k_region, std::span<const uint32_t> table);

// Page digests of one layer: out[block][kv_head][2][head_dim] (min, max) for the request's blocks
// (the first num_tokens tokens through the table). A device pool's are computed on the device by
// the CUDA plugin, only the digests copied off it (from a host copy of the keys with a plugin that
// predates that call).
void layer_digest(const kv::Layout &L, const uint8_t *k_region, std::span<const uint32_t> table, uint64_t num_tokens,
                  float *out);

struct ScoreInput {
    const float *queries = nullptr;  // fp32 [num_queries][num_q_heads][head_dim]
    uint32_t num_queries = 0, num_q_heads = 0;
    const float *digests = nullptr;  // quest
    const kv::Layout *keys_layout = nullptr;  // snapkv: keys through layout + region + table
    const uint8_t *k_region = nullptr;
    std::span<const uint32_t> table;
    const float *accumulated = nullptr;  // h2o: [num_kv_heads][num_tokens]
};

// Scores and selects one layer. Scratch vectors are reused across calls.
class LayerSelector {
  public:
    LayerSelector(const select::Profile &profile, uint32_t num_kv_heads, uint32_t head_dim, uint64_t num_tokens,
                  uint64_t head_token_bytes);
    const select::Selector &selector() const { return sel_; }
    const select::Profile &profile() const { return profile_; }
    void select(uint32_t layer, const ScoreInput &in, select::LayerSelection &out);

  private:
    select::Profile profile_;
    select::Selector sel_;
    uint32_t kv_heads_, head_dim_;
    uint64_t num_tokens_;
    std::vector<float> scores_, head_scores_, scratch_;
    std::vector<uint8_t> gathered_;
};

// A host's own selector (sg_selector_t): a profile applied to one request, made for a pool shape,
// that checks each pool and block table it is handed against that shape.
class RequestSelector {
  public:
    // SG_ERR_INVALID_ARGUMENT (num_tokens 0), SG_ERR_OUT_OF_RANGE (more blocks than a uint32_t counts,
    // or one layer's digests beyond size_t), SG_ERR_LAYOUT_MISMATCH (the profile's blocks or layers).
    RequestSelector(const select::Profile &profile, const kv::Layout &shape, uint64_t num_tokens);
    uint64_t digest_floats() const;
    // A pool of the selector's shape and a block table for its request: SG_ERR_LAYOUT_MISMATCH, or
    // the table's own errors (kv::check_block_table).
    void check_pool(const kv::Layout &pool, std::span<const uint32_t> table) const;
    // One layer's page digests (layer_digest) into out, which holds cap floats (SG_ERR_BUFFER_TOO_SMALL).
    void digest(const kv::Layout &pool, const uint8_t *k_region, std::span<const uint32_t> table, float *out,
                uint64_t cap) const;
    // One layer's essential blocks; keys_pool (nullable) with k_region and table gives the keys a
    // policy reads (snapkv). Valid until the next call.
    const Vec<uint32_t> &select(uint32_t layer, ScoreInput in, const kv::Layout *keys_pool,
                                        const uint8_t *k_region, std::span<const uint32_t> table);
    // The largest budget of a layer's KV heads (SG_ERR_OUT_OF_RANGE beyond the profile's layers).
    uint64_t budget_blocks(uint32_t layer) const;

  private:
    kv::Layout shape_;
    uint64_t num_tokens_;
    LayerSelector sel_;
    select::LayerSelection out_;
};

// The profile used when a proactive transfer names none: sinks and recent window, 1/8 of blocks.
select::Profile default_profile(uint32_t num_layers, uint32_t num_kv_heads, uint32_t block_tokens);

}  // namespace sg::core
