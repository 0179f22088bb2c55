// runtime/quant: in-flight quantization of staged segments (sg_transfer_options_t.wire_quant), a
// pure codec: how a segment of the destination pool travels as one-byte codes and scales, and back.
// Uses kv/ (the layout) and kernels/ (the per-element code the CUDA kernels share); core/ calls it.
//
// A segment is a byte range of one destination region, in the destination layout's element order
// (the staging path's unit). Its scales are per (block, plane, KV head), as the CUDA plugin's
// quantize kernel has them: one float for every (block, plane, head) the segment's blocks could
// hold, in that order, the ones it does not touch 0, then one code per element in the segment's
// own order. Both sides derive the grouping from the destination layout alone, so nothing but the
// segment list travels beside the bytes. Elements go through kernels/kernels.hpp's quantize_value
// and dequantize_value, the per-element code the CUDA kernels share.
#pragma once

#include "kv/kv.hpp"
#include "kernels.hpp"

#include <smartgen/smartgen.h>

#include <cstdint>
#include <span>
#include <utility>

namespace sg::quant {

// The vector path the codec runs (the widest the CPU has by default: AVX2 with F16C, else SSE2 on
// x86-64; "sse2" means the portable loops elsewhere). use_simd is for tests and benchmarks, which
// hold every path against the CPU twin; it asks for a path the CPU lacks in vain.
enum class Simd { sse2, avx2 };
void use_simd(Simd s);
Simd simd_in_use();

// The code a public SG_WIRE_QUANT_* value names; false for SG_WIRE_QUANT_NONE and unknown values.
bool code_of(uint32_t wire_quant, kernels::QuantCode &code);
const char *name_of(uint32_t wire_quant);

struct Shape {
    uint64_t elements = 0;
    uint64_t groups = 0;  // scales sent, 4 bytes each
    uint64_t wire_bytes() const { return groups * 4 + elements; }
};

// The shape of region `region_in_layer`'s bytes [offset, offset + length) of layout `dst`; false
// when the range is not whole head rows inside block planes (padding, a cut row, a dtype with no
// quantized form), which then travels as it is.
bool shape_of(const kv::Layout &dst, uint32_t region_in_layer, uint64_t offset, uint64_t length, Shape &out);

// Writes the segment's scales and codes (shape.wire_bytes() bytes) to out from its raw bytes, the
// concatenation of `pieces`.
void encode(const kv::Layout &dst, uint32_t region_in_layer, uint64_t offset, uint64_t length, const Shape &shape,
            std::span<const std::pair<const uint8_t *, uint64_t>> pieces, kernels::QuantCode code, uint8_t *out);

// The reverse: dequantizes into `pool_bytes`, the segment's place in the destination pool.
void decode(const kv::Layout &dst, uint32_t region_in_layer, uint64_t offset, uint64_t length, const Shape &shape,
            const uint8_t *in, kernels::QuantCode code, uint8_t *pool_bytes);

}  // namespace sg::quant
