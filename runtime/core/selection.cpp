#include "core/selection.hpp"

#include "core/cuda_plugin.hpp"

#include <algorithm>
#include <cstring>

namespace sg::core {

kernels::DType kernel_dtype(sg_dtype_t dtype) {
    switch (dtype) {
        case SG_DTYPE_FP32: return kernels::DType::fp32;
        case SG_DTYPE_FP16: return kernels::DType::fp16;
        case SG_DTYPE_BF16: return kernels::DType::bf16;
        default: fail(SG_ERR_UNSUPPORTED, "selection reads fp32, fp16 or bf16 keys, not fp8");
    }
}

namespace {

// A view of one block's K plane holding `tokens` valid tokens.
kernels::View block_keys(const kv::Layout &L, const uint8_t *k_region, uint32_t block, uint64_t tokens) {
    const uint8_t *plane = k_region + L.plane(0, block).offset;
    const kernels::DType dt = kernel_dtype(L.dtype);
    if (L.order == SG_BLOCK_TOKEN_MAJOR) return kernels::token_major(plane, dt, tokens, L.num_kv_heads, L.head_dim);
    return kernels::head_major(plane, dt, tokens, L.num_kv_heads, L.head_dim, L.tokens_per_block);
}

uint64_t tokens_in_block(const kv::Layout &L, uint64_t num_tokens, size_t index) {
    const uint64_t first = uint64_t(index) * L.tokens_per_block;
    return std::min<uint64_t>(L.tokens_per_block, num_tokens - first);
}

}  // namespace

HostKeys host_keys(const kv::Layout &L, const uint8_t *k_region, std::span<const uint32_t> table) {
    HostKeys h;
    h.layout = L;
    h.k_region = k_region;
    h.table = table;
    if (L.mem_kind != SG_MEM_CUDA) return h;
    check_cuda_pool(L.device, {});  // the plugin, a driver and the device, each named when missing
    std::vector<std::pair<const uint8_t *, uint64_t>> pieces;
    pieces.reserve(table.size());
    for (uint32_t b : table) pieces.emplace_back(k_region + L.plane(0, b).offset, L.plane_bytes);
    h.copy.resize(table.size() * L.plane_bytes);
    cuda_stage_out(L.device, pieces, h.copy.data());
    h.layout.packing = SG_KV_SEPARATE;
    h.layout.block_stride = L.plane_bytes;
    h.layout.num_blocks = table.size();
    h.layout.mem_kind = SG_MEM_HOST;
    h.k_region = h.copy.data();
    h.iota.resize(table.size());
    for (uint32_t i = 0; i < h.iota.size(); ++i) h.iota[i] = i;
    h.table = h.iota;
    return h;
}

namespace {

bool digest_on_device(const kv::Layout &L, const uint8_t *k_region, std::span<const uint32_t> table,
                      uint64_t num_tokens, float *out) {
    sg_cuda_digest_t d{};
    d.keys = k_region;
    d.blocks = table.data();
    d.num_blocks = kernels::num_blocks(num_tokens, L.tokens_per_block);
    d.tokens = num_tokens;
    d.block_stride = L.block_stride;
    d.dtype = uint32_t(kernel_dtype(L.dtype));
    d.heads = L.num_kv_heads;
    d.dim = L.head_dim;
    d.tokens_per_block = L.tokens_per_block;
    d.head_major = L.order == SG_BLOCK_HEAD_MAJOR;
    d.out = out;
    return cuda_digest_to_host(L.device, d);
}

}  // namespace

void layer_digest(const kv::Layout &L, const uint8_t *k_region, std::span<const uint32_t> table, uint64_t num_tokens,
                  float *out) {
    if (L.mem_kind == SG_MEM_CUDA) {
        check_cuda_pool(L.device, {});
        if (digest_on_device(L, k_region, table, num_tokens, out)) return;
        const HostKeys keys = host_keys(L, k_region, table);  // a plugin without digest_to_host
        layer_digest(keys.layout, keys.k_region, keys.table, num_tokens, out);
        return;
    }
    const uint64_t per_block = kernels::digest_floats(1, L.num_kv_heads, L.head_dim);
    const uint64_t blocks = kernels::num_blocks(num_tokens, L.tokens_per_block);
    for (uint64_t b = 0; b < blocks; ++b) {
        const uint64_t n = tokens_in_block(L, num_tokens, b);
        kernels::page_digest(block_keys(L, k_region, table[b], n), uint32_t(n), out + b * per_block);
    }
}

LayerSelector::LayerSelector(const select::Profile &profile, uint32_t num_kv_heads, uint32_t head_dim,
                             uint64_t num_tokens, uint64_t head_token_bytes)
    : profile_(profile), sel_(profile_, select::Request{num_tokens, head_token_bytes}), kv_heads_(num_kv_heads),
      head_dim_(head_dim), num_tokens_(num_tokens) {
    if (profile.num_kv_heads != num_kv_heads)
        fail(SG_ERR_LAYOUT_MISMATCH, "the profile has " + std::to_string(profile.num_kv_heads) +
                                         " KV heads, the pool " + std::to_string(num_kv_heads));
}

void LayerSelector::select(uint32_t layer, const ScoreInput &in, select::LayerSelection &out) {
    if (layer >= sel_.num_layers()) fail(SG_ERR_OUT_OF_RANGE, "layer is beyond the profile");
    if (!sel_.needs_scores(layer)) {
        sel_.select_layer(layer, {}, out);
        return;
    }
    const uint64_t nb = sel_.num_blocks();
    scores_.assign(size_t(nb) * kv_heads_, 0.0f);
    bool need[5] = {};
    for (uint32_t h = 0; h < kv_heads_; ++h) need[size_t(sel_.rule(layer, h).policy)] = true;
    auto query_view = [&](uint64_t first, uint64_t count) {
        if (!in.queries || !in.num_queries || !in.num_q_heads)
            fail(SG_ERR_INVALID_ARGUMENT, "layer " + std::to_string(layer) + ": its policy needs queries");
        if (in.num_q_heads % kv_heads_)
            fail(SG_ERR_INVALID_ARGUMENT, "num_q_heads must be a multiple of num_kv_heads");
        const kernels::View all =
            kernels::token_major(in.queries, kernels::DType::fp32, in.num_queries, in.num_q_heads, head_dim_);
        return kernels::slice(all, first, count);
    };
    // Each policy scores every head; each head keeps the column of its own policy.
    auto take = [&](select::Policy p) {
        for (uint32_t h = 0; h < kv_heads_; ++h)
            if (sel_.rule(layer, h).policy == p)
                for (uint64_t b = 0; b < nb; ++b) scores_[b * kv_heads_ + h] = head_scores_[b * kv_heads_ + h];
    };
    head_scores_.resize(scores_.size());
    if (need[size_t(select::Policy::quest)]) {
        if (!in.digests) fail(SG_ERR_INVALID_ARGUMENT, "layer " + std::to_string(layer) + ": quest needs digests");
        kernels::quest_scores(in.digests, nb, kv_heads_, query_view(in.num_queries - 1, 1), profile_.combine,
                              head_scores_.data());
        take(select::Policy::quest);
    }
    if (need[size_t(select::Policy::snapkv)]) {
        if (!in.keys_layout || !in.k_region)
            fail(SG_ERR_INVALID_ARGUMENT, "layer " + std::to_string(layer) + ": snapkv needs the keys");
        // The kernel reads one strided view: gather the request's blocks into token order.
        const kv::Layout &L = *in.keys_layout;
        const uint64_t row = L.row_bytes();
        gathered_.resize(size_t(num_tokens_ * kv_heads_ * row));
        for (uint64_t b = 0; b < nb; ++b) {
            const uint8_t *plane = in.k_region + L.plane(0, in.table[b]).offset;
            const uint64_t n = tokens_in_block(L, num_tokens_, b);
            for (uint64_t t = 0; t < n; ++t)
                for (uint32_t h = 0; h < kv_heads_; ++h)
                    std::memcpy(&gathered_[((b * L.tokens_per_block + t) * kv_heads_ + h) * row],
                                plane + L.row_offset(uint32_t(t), h), row);
        }
        const kernels::View keys =
            kernels::token_major(gathered_.data(), kernel_dtype(L.dtype), num_tokens_, kv_heads_, head_dim_);
        const kernels::View q = query_view(0, in.num_queries);
        scratch_.resize(kernels::snapkv_scratch_floats(keys, q));
        kernels::snapkv_scores(keys, q, num_tokens_ - in.num_queries, profile_.combine, profile_.block_tokens,
                               profile_.pool, scratch_, head_scores_.data());
        take(select::Policy::snapkv);
    }
    if (need[size_t(select::Policy::h2o)]) {
        if (!in.accumulated) fail(SG_ERR_INVALID_ARGUMENT, "layer " + std::to_string(layer) + ": h2o needs accumulated attention");
        kernels::h2o_scores(in.accumulated, kv_heads_, num_tokens_, num_tokens_, kv_heads_, profile_.combine,
                            profile_.block_tokens, head_scores_.data());
        take(select::Policy::h2o);
    }
    sel_.select_layer(layer, scores_, out);
}

select::Profile default_profile(uint32_t num_layers, uint32_t num_kv_heads, uint32_t block_tokens) {
    select::Profile p;
    p.model = "default";
    p.num_layers = num_layers;
    p.num_kv_heads = num_kv_heads;
    p.block_tokens = block_tokens;
    p.defaults.policy = select::Policy::sinks_recent;
    p.defaults.budget = select::Budget::of_fraction(0.125);
    p.defaults.sinks = block_tokens;
    p.defaults.recent = block_tokens;
    select::validate(p);
    return p;
}

namespace {
// The largest request a selector holds: its logical block indices are uint32_t (sg_selector_select
// returns them), and one layer's digests are counted, as floats and as bytes, in size_t. Computed
// so that nothing wraps, for any num_tokens.
void check_selector_size(const kv::Layout &kl, uint64_t num_tokens) {
    const uint64_t blocks = kv::blocks_for(num_tokens, kl.tokens_per_block);
    if (blocks > UINT32_MAX)
        fail(SG_ERR_OUT_OF_RANGE, "num_tokens " + std::to_string(num_tokens) + " makes " + std::to_string(blocks) +
                                      " blocks of " + std::to_string(kl.tokens_per_block) +
                                      " tokens; a selector holds at most 2^32 - 1 blocks");
    const unsigned __int128 digest_bytes =
        (unsigned __int128)blocks * kl.num_kv_heads * 2 * kl.head_dim * sizeof(float);
    if (digest_bytes > SIZE_MAX)
        fail(SG_ERR_OUT_OF_RANGE, "num_tokens " + std::to_string(num_tokens) + ": one layer's digests (" +
                                      std::to_string(blocks) + " blocks x " + std::to_string(kl.num_kv_heads) +
                                      " KV heads x 2 x " + std::to_string(kl.head_dim) + " floats) exceed size_t");
}

const kv::Layout &checked_shape(const select::Profile &p, const kv::Layout &kl, uint64_t num_tokens) {
    if (num_tokens == 0) fail(SG_ERR_INVALID_ARGUMENT, "num_tokens is 0");
    check_selector_size(kl, num_tokens);
    if (p.block_tokens != kl.tokens_per_block || p.num_layers != kl.num_layers)
        fail(SG_ERR_LAYOUT_MISMATCH, "the profile is for " + std::to_string(p.num_layers) + " layers of " +
                                         std::to_string(p.block_tokens) + "-token blocks, the layout has " +
                                         std::to_string(kl.num_layers) + " of " + std::to_string(kl.tokens_per_block));
    return kl;
}
}  // namespace

RequestSelector::RequestSelector(const select::Profile &profile, const kv::Layout &shape, uint64_t num_tokens)
    : shape_(checked_shape(profile, shape, num_tokens)),
      num_tokens_(num_tokens),
      sel_(profile, shape.num_kv_heads, shape.head_dim, num_tokens, 2 * shape.row_bytes()) {}

uint64_t RequestSelector::digest_floats() const {
    return kernels::digest_floats(kernels::num_blocks(num_tokens_, shape_.tokens_per_block), shape_.num_kv_heads,
                                  shape_.head_dim);
}

void RequestSelector::check_pool(const kv::Layout &pool, std::span<const uint32_t> table) const {
    if (pool.num_kv_heads != shape_.num_kv_heads || pool.head_dim != shape_.head_dim ||
        pool.tokens_per_block != shape_.tokens_per_block || pool.dtype != shape_.dtype)
        fail(SG_ERR_LAYOUT_MISMATCH, "the layout's shape differs from the one the selector was made for");
    kv::check_block_table(pool, table, num_tokens_);
}

void RequestSelector::digest(const kv::Layout &pool, const uint8_t *k_region, std::span<const uint32_t> table,
                             float *out, uint64_t cap) const {
    check_pool(pool, table);
    const uint64_t need = digest_floats();
    if (cap < need) fail(SG_ERR_BUFFER_TOO_SMALL, "digests need " + std::to_string(need) + " floats");
    // A device pool's are computed on the device (layer_digest).
    layer_digest(pool, k_region, table, num_tokens_, out);
}

const Vec<uint32_t> &RequestSelector::select(uint32_t layer, ScoreInput in, const kv::Layout *keys_pool,
                                                     const uint8_t *k_region, std::span<const uint32_t> table) {
    HostKeys keys;
    if (keys_pool) {
        check_pool(*keys_pool, table);
        keys = host_keys(*keys_pool, k_region, table);
        in.keys_layout = &keys.layout;
        in.k_region = keys.k_region;
        in.table = keys.table;
    }
    sel_.select(layer, in, out_);
    return out_.blocks;
}

uint64_t RequestSelector::budget_blocks(uint32_t layer) const {
    if (layer >= shape_.num_layers) fail(SG_ERR_OUT_OF_RANGE, "layer is beyond the profile");
    uint64_t most = 0;
    for (uint32_t k = 0; k < shape_.num_kv_heads; ++k) most = std::max(most, sel_.selector().budget(layer, k));
    return most;
}

}  // namespace sg::core

