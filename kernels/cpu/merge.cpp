// Attention over a part of the keys and the exact log-sum-exp merge of parts (kernels.hpp).
#include "cpu/cpu.hpp"

#include <cmath>

namespace sg::kernels {

using namespace cpu;

void attend_part(const float *query, const View &keys, const View &values, uint32_t kv_head, float scale,
                 AttentionPart part) {
    const uint32_t dim = keys.dim;
    float row[kMaxHeadDim];
    dispatch(keys.dtype, [&](auto kd) {
        dispatch(values.dtype, [&](auto vd) {
            constexpr DType K = decltype(kd)::value, V = decltype(vd)::value;
            for (uint64_t t = 0; t < keys.tokens; ++t) {
                convert<K>(cpu::row<K>(keys, t, kv_head), row, dim);
                const float s = scale * dot(query, row, dim);
                // Online softmax: when a larger score comes, what was summed is rescaled to it, so
                // every exponent stays <= 0 and nothing overflows.
                if (s > *part.max) {
                    const float shrink = std::exp(*part.max - s);  // exp(-inf) = 0 for the first key
                    *part.sum *= shrink;
                    for (uint32_t i = 0; i < dim; ++i) part.acc[i] *= shrink;
                    *part.max = s;
                }
                const float w = std::exp(s - *part.max);
                *part.sum += w;
                convert<V>(cpu::row<V>(values, t, kv_head), row, dim);
                for (uint32_t i = 0; i < dim; ++i) part.acc[i] += w * row[i];
            }
        });
    });
}

void merge_parts(AttentionPart into, float max_b, float sum_b, const float *acc_b, uint32_t dim) {
    if (sum_b == 0) return;  // b is empty
    if (*into.sum == 0) {    // into is empty
        *into.max = max_b;
        *into.sum = sum_b;
        for (uint32_t i = 0; i < dim; ++i) into.acc[i] = acc_b[i];
        return;
    }
    const float m = std::max(*into.max, max_b);
    const float wa = std::exp(*into.max - m), wb = std::exp(max_b - m);
    *into.sum = *into.sum * wa + sum_b * wb;
    for (uint32_t i = 0; i < dim; ++i) into.acc[i] = into.acc[i] * wa + acc_b[i] * wb;
    *into.max = m;
}

void finish_part(float sum, const float *acc, uint32_t dim, float *out) {
    const float inv = sum > 0 ? 1.0f / sum : 0.0f;
    for (uint32_t i = 0; i < dim; ++i) out[i] = acc[i] * inv;
}

}  // namespace sg::kernels
