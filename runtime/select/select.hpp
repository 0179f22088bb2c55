// runtime/select: which blocks of a request are essential, per layer — policies, budgets and the
// profiles that hold them (ARCHITECTURE §7). Depends on common/ and kernels/ (top-k; the engine or a
// later sg_selector_t computes block scores with the other kernels), and on nlohmann/json in the
// .cpp only.
//
// Selection is per layer and per KV head. Each non-dense head takes its sink blocks and its recent
// window first, then fills the rest of its budget with its best-scored blocks; a dense head takes
// every block. A block is essential for the layer when any head selects it: transfer and residency
// work on whole blocks over all KV heads, so the stats report what moving the union costs over the
// per-head sets.
//
// Budgets count everything proactive — sinks, the recent window and dense heads included — and
// round up to whole blocks (a block counts as block_tokens tokens, also when it is the partial last
// one). A head's budget is relative to that head's own stream: `tokens` of it, a `fraction` of the
// request's tokens, or `bytes` of its K and V. A profile may add a total budget for the whole
// request (all layers and heads): dense heads and every head's sinks and recent window are served
// first, and the rest is shared among the other heads in proportion to what their own budgets ask.
//
// Profile JSON (schema version 1; docs/profiles.md has the full description and an example):
//   {
//     "version": 1,                        required; other versions are refused
//     "model": "llama-3-8b",               required, non-empty
//     "num_layers": 32, "num_kv_heads": 8, required, >= 1
//     "block_tokens": 16,                  required, >= 1: the block size budgets round up to
//     "combine": "max",                    optional, "max" (default) or "sum": query heads -> KV head
//     "pool": 7,                           optional, odd >= 1 (default 1): SnapKV max-pool width
//     "total_budget": {"fraction": 0.125}, optional, whole-request budget
//     "defaults": {                        required: the rule of every (layer, head)
//       "policy": "quest",                 required: sinks_recent | quest | snapkv | h2o | dense
//       "budget": {"fraction": 0.0625},    one of {"tokens": n} {"fraction": f} {"bytes": n};
//                                          required wherever the resolved policy is not dense
//       "sinks": 16, "recent": 64          optional, tokens (default 0)
//     },
//     "layers": [                          optional overrides; any field of a rule may be overridden
//       {"layer": 0, "policy": "dense"},
//       {"layer": 5, "budget": {"tokens": 2048},
//        "heads": [{"head": 3, "policy": "dense"}]}
//     ]
//   }
// A (layer, head) takes each field from its head entry, else its layer entry, else defaults. Unknown
// fields are errors (a misspelt "budjet" must not silently fall back to the default). Errors throw
// sg::Error(SG_ERR_INVALID_ARGUMENT) with a message that starts with the JSON path of the bad field,
// e.g. "profile: layers[3].heads[1].budget.fraction: must be in (0, 1], got 1.5"; an unsupported
// version throws SG_ERR_VERSION_MISMATCH.
#pragma once

#include "common/common.hpp"
#include "kernels.hpp"

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace sg::select {

enum class Policy : uint8_t { sinks_recent, quest, snapkv, h2o, dense };

// "sinks_recent", "quest", "snapkv", "h2o", "dense".
const char *policy_name(Policy p);

struct Budget {
    enum class Kind : uint8_t { tokens, fraction, bytes };
    Kind kind = Kind::fraction;
    double fraction = 1.0;  // Kind::fraction: 0 < fraction <= 1
    uint64_t amount = 0;    // Kind::tokens or Kind::bytes

    static Budget of_tokens(uint64_t n) { return {Kind::tokens, 0.0, n}; }
    static Budget of_fraction(double f) { return {Kind::fraction, f, 0}; }
    static Budget of_bytes(uint64_t n) { return {Kind::bytes, 0.0, n}; }
    bool operator==(const Budget &) const = default;
};

// Blocks one (layer, KV head) may take under budget b in a request of num_tokens tokens, rounded up
// to whole blocks and capped at the request's blocks. head_token_bytes: bytes of K and V of one token
// of one KV head (2 * head_dim * dtype size); only bytes budgets read it, and need it > 0.
uint64_t budget_blocks(const Budget &b, uint64_t num_tokens, uint32_t block_tokens, uint64_t head_token_bytes);

// A rule as written at one level of a profile: unset fields are inherited.
struct RuleSpec {
    std::optional<Policy> policy;
    std::optional<Budget> budget;
    std::optional<uint32_t> sinks;   // tokens
    std::optional<uint32_t> recent;  // tokens
    bool operator==(const RuleSpec &) const = default;
};

struct HeadSpec {
    uint32_t head = 0;
    RuleSpec rule;
    bool operator==(const HeadSpec &) const = default;
};

struct LayerSpec {
    uint32_t layer = 0;
    RuleSpec rule;
    std::vector<HeadSpec> heads;
    bool operator==(const LayerSpec &) const = default;
};

// The rule one (layer, KV head) follows, every field resolved.
struct Rule {
    Policy policy = Policy::dense;
    Budget budget;  // meaningless when policy is dense
    uint32_t sinks = 0, recent = 0;
    bool operator==(const Rule &) const = default;
};

struct Profile {
    static constexpr uint32_t kVersion = 1;
    uint32_t version = kVersion;
    std::string model;
    uint32_t num_layers = 0, num_kv_heads = 0, block_tokens = 0;
    kernels::Combine combine = kernels::Combine::max;
    uint32_t pool = 1;
    std::optional<Budget> total_budget;
    RuleSpec defaults;
    std::vector<LayerSpec> layers;  // overrides, in file order (error paths index this vector)

    // The resolved rule; layer and head must be in range (checked: SG_ERR_OUT_OF_RANGE).
    Rule rule(uint32_t layer, uint32_t head) const;
    bool operator==(const Profile &) const = default;
};

// Bounds on the shape a profile declares. Checking, resolving and selecting visit every (layer,
// KV head), so without them a 150-byte profile asks for 10^18 steps.
// A KV layout a peer sends has at most 65536 layers (kv::from_desc).
inline constexpr uint32_t kMaxLayers = 65536;
// A KV layout has at most 2^16 KV heads (kv::make_layout).
inline constexpr uint32_t kMaxKvHeads = 65536;
// (layer, KV head) pairs: ~1000x Llama-3-405B (126 x 8), ~100x a 96-layer, 96-head MHA model.
inline constexpr uint64_t kMaxStreams = uint64_t(1) << 20;
// Bytes of profile text, the header's SG_PROFILE_MAX_BYTES.
inline constexpr size_t kMaxProfileBytes = SG_PROFILE_MAX_BYTES;

// Throws Error(SG_ERR_INVALID_ARGUMENT) naming the first bad field by its JSON path (or
// SG_ERR_VERSION_MISMATCH for version). Parsing validates; so does Selector, for profiles built in code.
void validate(const Profile &profile);

// Parses and validates a profile (schema above). Throws as validate, and also for malformed JSON
// (a NUL byte anywhere counts), wrong types, unknown or repeated fields, numbers no double holds,
// nesting deeper than the schema's and text longer than kMaxProfileBytes. Linear in the text.
Profile parse_profile(std::string_view json);
// Reads and parses a regular file of at most kMaxProfileBytes; SG_ERR_NOT_FOUND when it cannot be
// opened or read, SG_ERR_INVALID_ARGUMENT for anything else (a device, FIFO, directory, larger file).
Profile load_profile(const std::string &path);
// Canonical JSON (fields in schema order, only those set); parse_profile(to_json(p)) == p.
std::string to_json(const Profile &profile, int indent = 2);

// What the request looks like to selection.
struct Request {
    uint64_t num_tokens = 0;
    // K + V bytes of one token of one KV head in one layer (2 * head_dim * dtype size). 0 if unknown:
    // bytes budgets are then refused and the byte counts in LayerStats are 0.
    uint64_t head_token_bytes = 0;
};

struct LayerStats {
    uint64_t num_blocks = 0;     // blocks in the request
    uint64_t budget_blocks = 0;  // Σ over heads of each head's budget in blocks (dense: all)
    uint64_t head_blocks = 0;    // Σ over heads of the blocks each selected
    uint64_t union_blocks = 0;   // essential blocks (the union)
    uint64_t head_bytes = 0;     // bytes of the per-head sets (each block carrying only its heads)
    uint64_t union_bytes = 0;    // bytes of the union blocks with every KV head
    uint64_t extra_bytes = 0;    // union_bytes - head_bytes: the price of moving whole blocks
    uint32_t dense_heads = 0;
    uint32_t over_budget_heads = 0;  // heads whose sinks and recent window alone exceed their budget
};

struct LayerSelection {
    Vec<uint32_t> blocks;      // essential blocks of the layer, ascending logical indices 0..num_blocks-1
    Vec<Vec<uint32_t>> heads;  // per KV head, ascending
    LayerStats stats;
};

// Selection for one request under one profile. The budgets are fixed at construction (they depend on
// the request's size, not on scores), so each layer can be selected as soon as its scores exist.
// Immutable after construction: select_layer may run for several layers at once on different threads.
class Selector {
  public:
    // Validates profile and request (SG_ERR_INVALID_ARGUMENT).
    Selector(const Profile &profile, const Request &request);

    uint64_t num_blocks() const { return num_blocks_; }
    uint32_t num_layers() const { return num_layers_; }
    uint32_t num_kv_heads() const { return num_kv_heads_; }
    const Rule &rule(uint32_t layer, uint32_t head) const;
    // Blocks this head may take, after rounding, capping and any total budget (all for dense heads).
    // It selects max(this, its sink and recent blocks).
    uint64_t budget(uint32_t layer, uint32_t head) const;
    // Whether select_layer reads scores for this layer (some head is quest, snapkv or h2o and has
    // room beyond its sinks and recent window).
    bool needs_scores(uint32_t layer) const;
    // The total budget in blocks of one head of one layer (UINT64_MAX without one), and whether dense
    // heads plus sinks and recent windows alone exceed it (they are sent regardless).
    uint64_t total_budget_blocks() const { return total_blocks_; }
    bool over_total_budget() const { return over_total_; }

    // scores: [block][kv_head] (num_blocks() * num_kv_heads() floats) from the kernel of each head's
    // policy (quest_scores, snapkv_scores, h2o_scores); higher is more important. May be empty when
    // !needs_scores(layer). Throws SG_ERR_OUT_OF_RANGE for a bad layer, SG_ERR_INVALID_ARGUMENT for
    // scores of the wrong size. `out` is overwritten; its buffers are reused.
    void select_layer(uint32_t layer, std::span<const float> scores, LayerSelection &out) const;
    LayerSelection select_layer(uint32_t layer, std::span<const float> scores) const;

  private:
    struct Head {
        Rule rule;
        uint64_t own = 0;          // blocks its own budget allows (dense: all)
        uint64_t budget = 0;       // blocks, after the total budget
        uint64_t sink_end = 0;     // blocks [0, sink_end) are sinks
        uint64_t recent_from = 0;  // blocks [recent_from, num_blocks) are the recent window (>= sink_end)
        uint64_t forced = 0;       // sink and recent blocks (dense: all)
    };
    const Head &head(uint32_t layer, uint32_t h) const { return heads_[size_t(layer) * num_kv_heads_ + h]; }
    const Head &checked_head(uint32_t layer, uint32_t h) const;  // SG_ERR_OUT_OF_RANGE outside the profile

    uint32_t num_layers_ = 0, num_kv_heads_ = 0, block_tokens_ = 0;
    uint64_t num_tokens_ = 0, head_token_bytes_ = 0, num_blocks_ = 0;
    uint64_t total_blocks_ = UINT64_MAX;
    bool over_total_ = false;
    Vec<Head> heads_;  // [layer][kv_head]
};

}  // namespace sg::select
