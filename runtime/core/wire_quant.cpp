// In-flight quantization of staged segments; the format is in wire_quant.hpp.
#include "core/wire_quant.hpp"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <vector>

namespace sg::core::wire_quant {

namespace {

// Where each head row of a segment belongs: the group (block, plane, head) of the row at `offset`.
struct Rows {
    uint64_t stride, plane, row, first_block;
    uint32_t heads, tokens_per_block, planes_per_block;
    bool token_major, fused;

    // false when the row is not wholly inside a plane (padding between blocks, a cut row).
    bool group(uint64_t offset, uint64_t &g) const {
        const uint64_t block = offset / stride;
        uint64_t q = offset % stride;
        uint64_t p = 0;
        if (fused) {
            p = q / plane;
            if (p >= 2) return false;
            q -= p * plane;
        }
        if (q % row != 0 || q + row > plane) return false;
        const uint64_t r = q / row;
        const uint64_t head = token_major ? r % heads : r / tokens_per_block;
        g = ((block - first_block) * planes_per_block + p) * heads + head;
        return true;
    }
};

Rows rows_of(const kv::Layout &d, uint64_t offset) {
    Rows r{};
    r.stride = d.block_stride;
    r.plane = d.plane_bytes;
    r.row = d.row_bytes();
    r.first_block = offset / d.block_stride;
    r.heads = d.num_kv_heads;
    r.tokens_per_block = d.tokens_per_block;
    r.fused = d.packing != SG_KV_SEPARATE;
    r.planes_per_block = r.fused ? 2 : 1;
    r.token_major = d.order == SG_BLOCK_TOKEN_MAJOR;
    return r;
}

float load(sg_dtype_t dtype, const uint8_t *p) {
    if (dtype == SG_DTYPE_FP32) {
        float f;
        std::memcpy(&f, p, 4);
        return f;
    }
    uint16_t h;
    std::memcpy(&h, p, 2);
    return dtype == SG_DTYPE_FP16 ? kernels::fp16_to_float(h) : kernels::bf16_to_float(h);
}

void store(sg_dtype_t dtype, uint8_t *p, float f) {
    if (dtype == SG_DTYPE_FP32) {
        std::memcpy(p, &f, 4);
        return;
    }
    const uint16_t h = dtype == SG_DTYPE_FP16 ? kernels::float_to_fp16(f) : kernels::float_to_bf16(f);
    std::memcpy(p, &h, 2);
}

// Scales travel little-endian, byte by byte, as every integer of the wire does.
void put_scale(uint8_t *out, float f) {
    const uint32_t v = std::bit_cast<uint32_t>(f);
    for (int i = 0; i < 4; ++i) out[i] = uint8_t(v >> (8 * i));
}

float get_scale(const uint8_t *in) {
    uint32_t v = 0;
    for (int i = 0; i < 4; ++i) v |= uint32_t(in[i]) << (8 * i);
    return std::bit_cast<float>(v);
}

}  // namespace

bool code_of(uint32_t wire_quant, kernels::QuantCode &code) {
    switch (wire_quant) {
    case SG_WIRE_QUANT_INT8: code = kernels::QuantCode::int8; return true;
    case SG_WIRE_QUANT_FP8_E4M3: code = kernels::QuantCode::fp8_e4m3; return true;
    default: return false;
    }
}

const char *name_of(uint32_t wire_quant) {
    switch (wire_quant) {
    case SG_WIRE_QUANT_NONE: return "none";
    case SG_WIRE_QUANT_INT8: return "int8";
    case SG_WIRE_QUANT_FP8_E4M3: return "fp8_e4m3";
    default: return "unknown";
    }
}

bool shape_of(const kv::Layout &dst, uint32_t region_in_layer, uint64_t offset, uint64_t length, Shape &out) {
    if (dst.dtype != SG_DTYPE_FP32 && dst.dtype != SG_DTYPE_FP16 && dst.dtype != SG_DTYPE_BF16) return false;
    if (region_in_layer >= dst.regions_per_layer() || length == 0 || dst.block_stride == 0) return false;
    const uint64_t row = dst.row_bytes();
    if (length % row != 0) return false;
    const Rows rows = rows_of(dst, offset);
    for (uint64_t at = offset; at < offset + length; at += row) {
        uint64_t g;
        if (!rows.group(at, g)) return false;
    }
    const uint64_t last_block = (offset + length - 1) / dst.block_stride;
    out.elements = length / dst.elem_bytes;
    out.groups = (last_block - rows.first_block + 1) * rows.planes_per_block * rows.heads;
    return true;
}

void encode(const kv::Layout &dst, uint32_t, uint64_t offset, uint64_t length, const Shape &shape,
            std::span<const std::pair<const uint8_t *, uint64_t>> pieces, kernels::QuantCode code, uint8_t *out) {
    // Rows are read twice (the maximum, then the codes); a segment of several pieces is gathered
    // first so both passes walk one contiguous range.
    thread_local std::vector<uint8_t> gathered;
    const uint8_t *raw = pieces.empty() ? nullptr : pieces[0].first;
    if (pieces.size() > 1) {
        gathered.resize(length);
        uint8_t *p = gathered.data();
        for (auto [src, len] : pieces) {
            std::memcpy(p, src, len);
            p += len;
        }
        raw = gathered.data();
    }
    thread_local std::vector<float> absmax;
    absmax.assign(shape.groups, 0.0f);
    const Rows rows = rows_of(dst, offset);
    const uint64_t row = dst.row_bytes(), eb = dst.elem_bytes;
    for (uint64_t at = 0; at < length; at += row) {
        uint64_t g = 0;
        rows.group(offset + at, g);  // shape_of checked every row
        float m = absmax[g];
        for (uint32_t d = 0; d < dst.head_dim; ++d) m = std::fmax(m, std::fabs(load(dst.dtype, raw + at + d * eb)));
        absmax[g] = m;
    }
    for (uint64_t g = 0; g < shape.groups; ++g) {
        absmax[g] = kernels::quant_scale(absmax[g], code);  // now the scale
        put_scale(out + 4 * g, absmax[g]);
    }
    uint8_t *codes = out + 4 * shape.groups;
    for (uint64_t at = 0; at < length; at += row) {
        uint64_t g = 0;
        rows.group(offset + at, g);
        const float inv = kernels::quant_inv_scale(absmax[g]);
        for (uint32_t d = 0; d < dst.head_dim; ++d)
            *codes++ = kernels::quantize_value(load(dst.dtype, raw + at + d * eb), inv, code);
    }
}

void decode(const kv::Layout &dst, uint32_t, uint64_t offset, uint64_t length, const Shape &shape, const uint8_t *in,
            kernels::QuantCode code, uint8_t *pool_bytes) {
    const Rows rows = rows_of(dst, offset);
    const uint64_t row = dst.row_bytes(), eb = dst.elem_bytes;
    const uint8_t *codes = in + 4 * shape.groups;
    for (uint64_t at = 0; at < length; at += row) {
        uint64_t g = 0;
        rows.group(offset + at, g);
        const float scale = get_scale(in + 4 * g);
        for (uint32_t d = 0; d < dst.head_dim; ++d)
            store(dst.dtype, pool_bytes + at + d * eb, kernels::dequantize_value(*codes++, scale, code));
    }
}

}  // namespace sg::core::wire_quant
