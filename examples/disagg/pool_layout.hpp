// The engine's KV pool as SmartGen sees it: the same facts, field by field. Shared by the demo
// (main.cpp) and the quality measurement (quality.cpp), which both hand the engine's pool to the
// library; the engine itself stays free of SmartGen.
#pragma once

#include <smartgen/smartgen.h>

#include <string>

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

// --wire-quant's names (none, int8, fp8) for sg_transfer_options_t.wire_quant, both ways.
inline bool wire_quant_of(const std::string& name, uint32_t& out) {
    if (name == "none") out = SG_WIRE_QUANT_NONE;
    else if (name == "int8") out = SG_WIRE_QUANT_INT8;
    else if (name == "fp8") out = SG_WIRE_QUANT_FP8_E4M3;
    else return false;
    return true;
}
inline const char* wire_quant_name(uint32_t w) {
    return w == SG_WIRE_QUANT_INT8 ? "int8" : w == SG_WIRE_QUANT_FP8_E4M3 ? "fp8" : "none";
}

}  // namespace sg::disagg
