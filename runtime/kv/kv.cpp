#include "kv/kv.hpp"

#include <algorithm>
#include <bit>
#include <cstring>
#include <string>
#include <vector>

namespace sg::kv {

uint64_t dtype_bytes(sg_dtype_t d) {
    switch (d) {
        case SG_DTYPE_FP32: return 4;
        case SG_DTYPE_FP16:
        case SG_DTYPE_BF16: return 2;
        case SG_DTYPE_FP8_E4M3: return 1;
    }
    return 0;
}

namespace {

[[noreturn]] void bad_layout(const std::string &what) { fail(SG_ERR_INVALID_LAYOUT, "invalid KV layout: " + what); }

// Shared by local and peer layouts: fills the derived sizes or throws with `status`.
void derive(Layout &l, sg_status_t status, uint64_t stride_in) {
    auto bad = [&](const std::string &what) {
        if (status == SG_ERR_INVALID_LAYOUT) bad_layout(what);
        fail(status, "peer sent an invalid KV layout: " + what);
    };
    if (l.num_layers == 0) bad("num_layers must be >= 1");
    if (l.num_kv_heads == 0) bad("num_kv_heads must be >= 1");
    if (l.head_dim == 0) bad("head_dim must be >= 1");
    if (l.tokens_per_block == 0) bad("tokens_per_block must be >= 1");
    if (l.num_blocks == 0) bad("num_blocks must be >= 1");
    l.elem_bytes = dtype_bytes(l.dtype);
    if (l.elem_bytes == 0) bad("dtype " + std::to_string(int(l.dtype)) + " is not an sg_dtype_t");
    if (l.packing != SG_KV_SEPARATE && l.packing != SG_KV_FUSED)
        bad("packing " + std::to_string(int(l.packing)) + " is not an sg_kv_packing_t");
    if (l.order != SG_BLOCK_TOKEN_MAJOR && l.order != SG_BLOCK_HEAD_MAJOR)
        bad("block_order " + std::to_string(int(l.order)) + " is not an sg_block_order_t");
    if (l.mem_kind != SG_MEM_HOST && l.mem_kind != SG_MEM_CUDA)
        bad("mem_kind " + std::to_string(int(l.mem_kind)) + " is not an sg_mem_kind_t");
    // Products are bounded so no size below can overflow 64 bits.
    if (l.num_kv_heads > (1u << 16) || l.head_dim > (1u << 16) || l.tokens_per_block > (1u << 20))
        bad("num_kv_heads, head_dim or tokens_per_block is implausibly large");
    if (l.num_blocks > (uint64_t(1) << 32)) bad("num_blocks must be < 2^32 (block ids are 32-bit)");
    l.plane_bytes = uint64_t(l.tokens_per_block) * l.num_kv_heads * l.head_dim * l.elem_bytes;
    const uint64_t min_stride = l.plane_bytes * (l.packing == SG_KV_FUSED ? 2 : 1);
    l.block_stride = stride_in ? stride_in : min_stride;
    if (l.block_stride < min_stride)
        bad("block_stride_bytes " + std::to_string(stride_in) + " is smaller than a block (" +
            std::to_string(min_stride) + " bytes)");
    if (l.block_stride > (uint64_t(1) << 40) || l.num_blocks > (uint64_t(1) << 62) / l.block_stride)
        bad("num_blocks x block_stride_bytes overflows");
}

}  // namespace

Layout make_layout_shape(const sg_kv_layout_t &pub) {
    Layout l;
    l.num_layers = pub.num_layers;
    l.num_kv_heads = pub.num_kv_heads;
    l.head_dim = pub.head_dim;
    l.tokens_per_block = pub.tokens_per_block;
    l.num_blocks = pub.num_blocks ? pub.num_blocks : 1;
    l.dtype = pub.dtype;
    l.packing = pub.packing;
    l.order = pub.block_order;
    l.mem_kind = pub.mem_kind;
    l.device = pub.device;
    derive(l, SG_ERR_INVALID_LAYOUT, pub.block_stride_bytes);
    return l;
}

Layout make_layout(const sg_kv_layout_t &pub) {
    Layout l;
    l.num_layers = pub.num_layers;
    l.num_kv_heads = pub.num_kv_heads;
    l.head_dim = pub.head_dim;
    l.tokens_per_block = pub.tokens_per_block;
    l.num_blocks = pub.num_blocks;
    l.dtype = pub.dtype;
    l.packing = pub.packing;
    l.order = pub.block_order;
    l.mem_kind = pub.mem_kind;
    l.device = pub.device;
    derive(l, SG_ERR_INVALID_LAYOUT, pub.block_stride_bytes);
    if (!pub.layer_k_base) bad_layout("layer_k_base is NULL");
    if (pub.layer_base_count != pub.num_layers)
        bad_layout("layer_base_count (" + std::to_string(pub.layer_base_count) + ") must equal num_layers (" +
                   std::to_string(pub.num_layers) + ")");
    if (l.packing == SG_KV_SEPARATE && !pub.layer_v_base) bad_layout("layer_v_base is NULL with SG_KV_SEPARATE");
    if (l.packing == SG_KV_FUSED && pub.layer_v_base) bad_layout("layer_v_base must be NULL with SG_KV_FUSED");
    for (uint32_t i = 0; i < l.num_layers; ++i) {
        if (!pub.layer_k_base[i]) bad_layout("layer_k_base[" + std::to_string(i) + "] is NULL");
        if (pub.layer_v_base && !pub.layer_v_base[i]) bad_layout("layer_v_base[" + std::to_string(i) + "] is NULL");
    }
    return l;
}

Layout from_desc(const LayoutDesc &d) {
    // Enum fields are checked as integers before they become enums: a peer may send anything.
    if (d.dtype > SG_DTYPE_FP8_E4M3 || d.packing > SG_KV_FUSED || d.block_order > SG_BLOCK_HEAD_MAJOR ||
        d.mem_kind > SG_MEM_CUDA)
        fail(SG_ERR_PROTOCOL, "peer sent an invalid KV layout: dtype, packing, block_order or mem_kind out of range");
    Layout l;
    l.num_layers = d.num_layers;
    l.num_kv_heads = d.num_kv_heads;
    l.head_dim = d.head_dim;
    l.tokens_per_block = d.tokens_per_block;
    l.num_blocks = d.num_blocks;
    l.dtype = sg_dtype_t(d.dtype);
    l.packing = sg_kv_packing_t(d.packing);
    l.order = sg_block_order_t(d.block_order);
    l.mem_kind = sg_mem_kind_t(d.mem_kind);
    if (l.num_layers > 65536) fail(SG_ERR_PROTOCOL, "peer sent an invalid KV layout: num_layers > 65536");
    derive(l, SG_ERR_PROTOCOL, d.block_stride_bytes);
    return l;
}

LayoutDesc Layout::to_desc() const {
    LayoutDesc d;
    d.num_layers = num_layers;
    d.num_kv_heads = num_kv_heads;
    d.head_dim = head_dim;
    d.tokens_per_block = tokens_per_block;
    d.num_blocks = num_blocks;
    d.dtype = uint32_t(dtype);
    d.packing = uint32_t(packing);
    d.block_order = uint32_t(order);
    d.mem_kind = uint32_t(mem_kind);
    d.block_stride_bytes = block_stride;
    return d;
}

void check_mappable(const Layout &src, const Layout &dst) {
    auto mismatch = [](const char *field, uint64_t a, uint64_t b) {
        fail(SG_ERR_LAYOUT_MISMATCH, std::string("KV layouts cannot be mapped: ") + field + " differs (source " +
                                         std::to_string(a) + ", destination " + std::to_string(b) + ")");
    };
    if (src.num_layers != dst.num_layers) mismatch("num_layers", src.num_layers, dst.num_layers);
    if (src.num_kv_heads != dst.num_kv_heads) mismatch("num_kv_heads", src.num_kv_heads, dst.num_kv_heads);
    if (src.head_dim != dst.head_dim) mismatch("head_dim", src.head_dim, dst.head_dim);
    if (src.dtype != dst.dtype) mismatch("dtype", src.dtype, dst.dtype);
}

void check_block_table(const Layout &layout, std::span<const uint32_t> ids, uint64_t num_tokens) {
    if (num_tokens == 0) fail(SG_ERR_INVALID_ARGUMENT, "num_tokens must be >= 1");
    // Any num_tokens up to 2^64 - 1 may arrive here (from the caller or a peer): blocks_for cannot
    // wrap to a small count, and the pool's capacity bounds what may follow.
    const uint64_t tpb = layout.tokens_per_block;
    const uint64_t needed = blocks_for(num_tokens, layout.tokens_per_block);
    if (needed > layout.num_blocks)
        fail(SG_ERR_OUT_OF_RANGE, std::to_string(num_tokens) + " tokens need " + std::to_string(needed) +
                                      " blocks, more than the pool's num_blocks (" + std::to_string(layout.num_blocks) +
                                      " blocks of " + std::to_string(tpb) + " tokens hold " +
                                      std::to_string(saturating_mul(layout.num_blocks, tpb)) + " tokens)");
    if (ids.size() != needed)
        fail(ids.size() < needed ? SG_ERR_OUT_OF_RANGE : SG_ERR_INVALID_ARGUMENT,
             "block table has " + std::to_string(ids.size()) + " blocks but " + std::to_string(num_tokens) +
                 " tokens need " + std::to_string(needed) + " (tokens_per_block " + std::to_string(tpb) + ")");
    for (size_t i = 0; i < ids.size(); ++i)
        if (ids[i] >= layout.num_blocks)
            fail(SG_ERR_OUT_OF_RANGE, "block_ids[" + std::to_string(i) + "] = " + std::to_string(ids[i]) +
                                          " is outside the pool (num_blocks " + std::to_string(layout.num_blocks) + ")");
    // Each block at most once (on the decode side a repeat would be two writes into one block).
    // ids.size() == needed <= num_blocks <= 2^32 here, so an entry's index fits beside its id.
    std::vector<uint64_t> keyed(ids.size());
    for (size_t i = 0; i < ids.size(); ++i) keyed[i] = uint64_t(ids[i]) << 32 | i;
    std::sort(keyed.begin(), keyed.end());
    for (size_t i = 1; i < keyed.size(); ++i)
        if (keyed[i] >> 32 == keyed[i - 1] >> 32)
            fail(SG_ERR_INVALID_ARGUMENT, "block_ids[" + std::to_string(uint32_t(keyed[i - 1])) + "] and block_ids[" +
                                              std::to_string(uint32_t(keyed[i])) + "] both name block " +
                                              std::to_string(keyed[i] >> 32) + " (each block may appear once)");
}

uint32_t content_crc(const Layout &layout, const uint8_t *const layer_bases[2], std::span<const uint32_t> table,
                     uint64_t first_token, uint64_t end_token) {
    SG_ASSERT(end_token >= first_token && blocks_for(end_token, layout.tokens_per_block) <= table.size(),
              "content_crc: tokens outside the block table");
    const uint64_t row = layout.row_bytes(), tpb = layout.tokens_per_block;
    uint32_t crc = 0;
    for (uint32_t plane = 0; plane < 2; ++plane)
        for (uint64_t t = first_token; t < end_token;) {
            const uint32_t in_block = uint32_t(t % tpb);
            const uint64_t run = std::min<uint64_t>(end_token - t, tpb - in_block);
            const Layout::Loc loc = layout.plane(plane, table[t / tpb]);
            const uint8_t *base = layer_bases[loc.region] + loc.offset;
            if (layout.order == SG_BLOCK_TOKEN_MAJOR) {
                // A run of tokens is one stretch of rows: the canonical order already.
                crc = crc32c(crc, base + layout.row_offset(in_block, 0), run * layout.num_kv_heads * row);
            } else {
                for (uint64_t k = 0; k < run; ++k)
                    for (uint32_t h = 0; h < layout.num_kv_heads; ++h)
                        crc = crc32c(crc, base + layout.row_offset(uint32_t(in_block + k), h), row);
            }
            t += run;
        }
    return crc;
}

void Residency::reset(uint32_t num_layers, size_t num_blocks) {
    num_blocks_ = num_blocks;
    words_per_layer_ = (num_blocks + 63) / 64;
    bits_.assign(size_t(num_layers) * words_per_layer_, 0);
}

void Residency::set_layer(uint32_t layer) {
    uint64_t *w = bits_.data() + layer * words_per_layer_;
    for (size_t i = 0; i < words_per_layer_; ++i) w[i] = ~uint64_t(0);
    if (num_blocks_ % 64) w[words_per_layer_ - 1] = (uint64_t(1) << (num_blocks_ % 64)) - 1;
}

void Residency::set(uint32_t layer, size_t i) { bits_[layer * words_per_layer_ + i / 64] |= uint64_t(1) << (i % 64); }

bool Residency::test(uint32_t layer, size_t i) const {
    return bits_[layer * words_per_layer_ + i / 64] >> (i % 64) & 1;
}

size_t Residency::count(uint32_t layer) const {
    size_t n = 0;
    for (size_t i = 0; i < words_per_layer_; ++i) n += size_t(std::popcount(bits_[layer * words_per_layer_ + i]));
    return n;
}

void Residency::copy_layer(uint32_t layer, uint8_t *out) const {
    const uint64_t *w = bits_.data() + layer * words_per_layer_;
    for (size_t b = 0; b < (num_blocks_ + 7) / 8; ++b) out[b] = uint8_t(w[b / 8] >> (8 * (b % 8)));
}

}  // namespace sg::kv
