// runtime/common/layout_desc.hpp: the plain description of a paged KV pool's layout that travels
// between peers. wire/ encodes and decodes it (as wire::LayoutDesc, inside HandleExport); kv/ checks
// one a peer sent and turns it into a kv::Layout (kv::from_desc) and back (Layout::to_desc). It lives
// in common/ because both folders need it and neither may use the other (ARCHITECTURE.md §4).
// Depends on nothing.
#pragma once

#include <cstdint>

namespace sg {

struct LayoutDesc {
    uint32_t num_layers = 0, num_kv_heads = 0, head_dim = 0, tokens_per_block = 0;
    uint64_t num_blocks = 0;
    uint32_t dtype = 0, packing = 0, block_order = 0, mem_kind = 0;
    uint64_t block_stride_bytes = 0;  // resolved (never 0 on the wire)

    bool operator==(const LayoutDesc &) const = default;
};

}  // namespace sg
