// The engine's KV pool as SmartGen sees it: the same facts, field by field. Shared by the demo
// (main.cpp) and the quality measurement (quality.cpp), which both hand the engine's pool to the
// library; the engine itself stays free of SmartGen.
#pragma once

#include <smartgen/smartgen.h>

#include "engine.hpp"

namespace sg::disagg {

inline sg_kv_layout_t layout_of(const KvPool& p) {
    sg_kv_layout_t l;
    sg_kv_layout_init(&l);
    l.num_layers = uint32_t(p.num_layers);
    l.num_kv_heads = uint32_t(p.num_kv_heads);
    l.head_dim = uint32_t(p.head_dim);
    l.tokens_per_block = uint32_t(p.tokens_per_block);
    l.num_blocks = p.num_blocks;
    l.dtype = sg_dtype_t(uint32_t(p.dtype));  // KvDtype values are sg_dtype_t's
    l.packing = SG_KV_SEPARATE;
    l.block_order = SG_BLOCK_TOKEN_MAJOR;
    l.mem_kind = SG_MEM_HOST;
    l.layer_k_base = p.k_base.data();
    l.layer_v_base = p.v_base.data();
    l.layer_base_count = size_t(p.num_layers);
    l.block_stride_bytes = p.block_stride_bytes;
    return l;
}

}  // namespace sg::disagg
