// runtime/kv: paged KV pool layouts — validation, block addressing, mapping between two layouts —
// and residency bitmaps. Depends on common/ (also for the layout descriptor a peer sends).
//
// A pool has, per layer, one region (fused K+V, or K) or two (K and V). A block's K plane holds
// tokens_per_block x num_kv_heads x head_dim elements, ordered token-major or head-major; its V
// plane is the same shape, in the V region (separate) or right after the K plane (fused).
#pragma once

#include "common/common.hpp"
#include "common/layout_desc.hpp"

#include <smartgen/smartgen.h>

#include <cstdint>
#include <span>

namespace sg::kv {

struct Layout {
    uint32_t num_layers = 0, num_kv_heads = 0, head_dim = 0, tokens_per_block = 0;
    uint64_t num_blocks = 0;
    sg_dtype_t dtype = SG_DTYPE_FP16;
    sg_kv_packing_t packing = SG_KV_SEPARATE;
    sg_block_order_t order = SG_BLOCK_TOKEN_MAJOR;
    sg_mem_kind_t mem_kind = SG_MEM_HOST;
    int32_t device = 0;
    // Derived, always set by make_layout / from_desc.
    uint64_t elem_bytes = 0;
    uint64_t plane_bytes = 0;   // one K (or V) plane of one block
    uint64_t block_stride = 0;  // bytes between consecutive blocks in a region

    uint32_t regions_per_layer() const { return packing == SG_KV_SEPARATE ? 2 : 1; }
    uint64_t region_bytes() const { return num_blocks * block_stride; }
    uint64_t row_bytes() const { return uint64_t(head_dim) * elem_bytes; }  // one head, one token

    // Where plane p (0 = K, 1 = V) of `block` starts: region index within the layer, byte offset.
    struct Loc {
        uint32_t region;
        uint64_t offset;
    };
    Loc plane(uint32_t p, uint64_t block) const {
        if (packing == SG_KV_SEPARATE) return {p, block * block_stride};
        return {0, block * block_stride + p * plane_bytes};
    }
    // Offset inside a plane of (token-in-block, head).
    uint64_t row_offset(uint32_t token, uint32_t head) const {
        if (order == SG_BLOCK_TOKEN_MAJOR) return (uint64_t(token) * num_kv_heads + head) * row_bytes();
        return (uint64_t(head) * tokens_per_block + token) * row_bytes();
    }

    LayoutDesc to_desc() const;
};

// Bytes of one element; 0 for a value that is not an sg_dtype_t (also backs sg_dtype_size).
uint64_t dtype_bytes(sg_dtype_t dtype);

// Validates a public layout (already copied to full size) and derives the rest.
// Throws Error(SG_ERR_INVALID_LAYOUT) naming the bad field.
Layout make_layout(const sg_kv_layout_t &pub);
// The same checks of the shape only (no base pointers; num_blocks 0 taken as 1), for selectors.
Layout make_layout_shape(const sg_kv_layout_t &pub);
// Same checks for a descriptor received from a peer (SG_ERR_PROTOCOL on nonsense).
Layout from_desc(const LayoutDesc &desc);

// Throws Error(SG_ERR_LAYOUT_MISMATCH) naming the field when src cannot be mapped onto dst.
// Block ids, tokens per block, packing, block order and stride may differ; shape and dtype may not.
void check_mappable(const Layout &src, const Layout &dst);

// Blocks that hold num_tokens tokens (the ceiling), for any num_tokens: it cannot wrap.
constexpr uint64_t blocks_for(uint64_t num_tokens, uint32_t tokens_per_block) {
    return num_tokens / tokens_per_block + (num_tokens % tokens_per_block != 0);
}

// Checks a request's block table against a pool, for any num_tokens: num_tokens >= 1 and at most
// what the pool holds, exactly the blocks num_tokens needs, every id < num_blocks, no id twice.
// Throws Error naming what is wrong: SG_ERR_OUT_OF_RANGE (more tokens than the pool holds, too few
// blocks, an id outside the pool), SG_ERR_INVALID_ARGUMENT (0 tokens, more blocks than needed, a
// repeated id).
void check_block_table(const Layout &layout, std::span<const uint32_t> block_ids, uint64_t num_tokens);

// CRC32C (common/crc32c) of tokens [first_token, end_token) of one layer of a request, in an order
// no layout changes: every K row, token by token and head by head, then every V row the same way.
// Each side of a transfer computes it over its own blocks, so the two agree when the bytes do,
// whatever block size, order, packing or stride either pool has. layer_bases[r] is region r of the
// layer; table maps the request's block index to the pool's block. Host memory only.
uint32_t content_crc(const Layout &layout, const uint8_t *const layer_bases[2], std::span<const uint32_t> table,
                     uint64_t first_token, uint64_t end_token);

// Per layer, one bit per entry of a request's block table; a bit is set only once that block's
// bytes are in place.
class Residency {
  public:
    void reset(uint32_t num_layers, size_t num_blocks);
    void set_layer(uint32_t layer);
    void set(uint32_t layer, size_t index);
    bool test(uint32_t layer, size_t index) const;
    size_t count(uint32_t layer) const;
    size_t num_blocks() const { return num_blocks_; }
    // Copies a layer's bits LSB-first into out (ceil(num_blocks/8) bytes).
    void copy_layer(uint32_t layer, uint8_t *out) const;

  private:
    size_t words_per_layer_ = 0;
    size_t num_blocks_ = 0;
    Vec<uint64_t> bits_;
};

}  // namespace sg::kv
