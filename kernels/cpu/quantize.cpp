// In-flight quantization of KV blocks, the CPU twin of the CUDA plugin's quantize/dequantize kernels
// (kernels/cuda). Written on its own terms (std::nearbyint, a loop per head) rather than on the
// kernels' per-element code, so the host harness compares two implementations; the E4M3 conversion
// is shared and tested against a brute-force nearest code instead.
#include <cmath>
#include <cstring>

#include "kernels.hpp"

namespace sg::kernels {

namespace {

uint64_t element_index(const View &v, uint64_t t, uint32_t h, uint32_t d) {
    return t * v.token_stride + uint64_t(h) * v.head_stride + d;
}

float load(const View &v, uint64_t index) {
    switch (v.dtype) {
        case DType::fp32: {
            float f;
            std::memcpy(&f, static_cast<const uint8_t *>(v.data) + index * 4, 4);
            return f;
        }
        case DType::fp16: {
            uint16_t h;
            std::memcpy(&h, static_cast<const uint8_t *>(v.data) + index * 2, 2);
            return fp16_to_float(h);
        }
        case DType::bf16: {
            uint16_t b;
            std::memcpy(&b, static_cast<const uint8_t *>(v.data) + index * 2, 2);
            return bf16_to_float(b);
        }
    }
    return 0.0f;
}

void store(const View &v, uint64_t index, float f) {
    auto *out = static_cast<uint8_t *>(const_cast<void *>(v.data));
    if (v.dtype == DType::fp32) {
        std::memcpy(out + index * 4, &f, 4);
        return;
    }
    const uint16_t h = v.dtype == DType::fp16 ? float_to_fp16(f) : float_to_bf16(f);
    std::memcpy(out + index * 2, &h, 2);
}

}  // namespace

void quantize_block(const View &block, QuantCode code, uint8_t *codes, float *scales) {
    for (uint32_t h = 0; h < block.heads; ++h) {
        float absmax = 0.0f;
        for (uint64_t t = 0; t < block.tokens; ++t)
            for (uint32_t d = 0; d < block.dim; ++d) {
                const float x = load(block, element_index(block, t, h, d));
                if (!non_finite(x)) absmax = std::fmax(absmax, std::fabs(x));
            }
        scales[h] = quant_scale(absmax, code);
        const float inv = quant_inv_scale(scales[h]);
        for (uint64_t t = 0; t < block.tokens; ++t)
            for (uint32_t d = 0; d < block.dim; ++d) {
                const uint64_t i = element_index(block, t, h, d);
                codes[i] = quantize_value(load(block, i), inv, code);
            }
    }
}

void dequantize_block(const uint8_t *codes, const float *scales, QuantCode code, const View &out) {
    for (uint32_t h = 0; h < out.heads; ++h)
        for (uint64_t t = 0; t < out.tokens; ++t)
            for (uint32_t d = 0; d < out.dim; ++d) {
                const uint64_t i = element_index(out, t, h, d);
                store(out, i, dequantize_value(codes[i], scales[h], code));
            }
}

}  // namespace sg::kernels
