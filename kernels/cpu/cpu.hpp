// kernels/cpu: helpers shared by the reference CPU kernels (not part of kernels.hpp).
//
// Loops are written as a main part in fixed chunks of kLanes elements plus a scalar tail. A fixed
// inner trip count is what lets GCC vectorise at -O2 (its "very cheap" cost model refuses loops whose
// count is unknown), and independent per-lane accumulators let it vectorise float reductions without
// -ffast-math reassociation. The chunk loops are unrolled by pragma: -O2 would leave them rolled and
// keep the accumulators in memory, one store-to-load round trip per step (2x slower).
#pragma once

#include "kernels.hpp"

#include <algorithm>
#include <cassert>
#include <cstddef>
#include <cstdint>
#include <type_traits>

namespace sg::kernels::cpu {

inline constexpr size_t kLanes = 16;

template <DType D>
using Storage = std::conditional_t<D == DType::fp32, float, uint16_t>;

template <DType D>
inline float load(Storage<D> x) {
    if constexpr (D == DType::fp32)
        return x;
    else if constexpr (D == DType::fp16)
        return fp16_to_float(x);
    else
        return bf16_to_float(x);
}

// Calls f(std::integral_constant<DType, D>{}) for the view's dtype, so kernels are written once as
// templates and the conversion inlines into their loops.
template <class F>
inline void dispatch(DType d, F &&f) {
    switch (d) {
        case DType::fp32:
            f(std::integral_constant<DType, DType::fp32>{});
            return;
        case DType::fp16:
            f(std::integral_constant<DType, DType::fp16>{});
            return;
        case DType::bf16:
            f(std::integral_constant<DType, DType::bf16>{});
            return;
    }
}

template <DType D>
inline const Storage<D> *row(const View &v, uint64_t token, uint32_t head) {
    return static_cast<const Storage<D> *>(v.data) + token * v.token_stride + head * v.head_stride;
}

template <DType D>
inline void convert(const Storage<D> *__restrict src, float *__restrict dst, size_t n) {
    size_t i = 0;
    for (; i + kLanes <= n; i += kLanes)
#pragma GCC unroll 16
        for (size_t j = 0; j < kLanes; ++j) dst[i + j] = load<D>(src[i + j]);
    for (; i < n; ++i) dst[i] = load<D>(src[i]);
}

// Pairwise sum of per-lane accumulators: the halving steps vectorise, where summing lane by lane
// would be a chain of kLanes dependent scalar adds after every short reduction.
inline float reduce(float (&acc)[kLanes]) {
#pragma GCC unroll 16
    for (size_t w = kLanes / 2; w > 0; w /= 2)
#pragma GCC unroll 16
        for (size_t j = 0; j < w; ++j) acc[j] += acc[j + w];
    return acc[0];
}

inline float dot(const float *__restrict a, const float *__restrict b, size_t n) {
    float acc[kLanes] = {};
    size_t i = 0;
    for (; i + kLanes <= n; i += kLanes)
#pragma GCC unroll 16
        for (size_t j = 0; j < kLanes; ++j) acc[j] += a[i + j] * b[i + j];
    float s = 0.f;
    for (; i < n; ++i) s += a[i] * b[i];
    return s + reduce(acc);
}

inline float sum(const float *__restrict a, size_t n) {
    float acc[kLanes] = {};
    size_t i = 0;
    for (; i + kLanes <= n; i += kLanes)
#pragma GCC unroll 16
        for (size_t j = 0; j < kLanes; ++j) acc[j] += a[i + j];
    float s = 0.f;
    for (; i < n; ++i) s += a[i];
    return s + reduce(acc);
}

inline float combine(Combine c, float a, float b) { return c == Combine::max ? std::max(a, b) : a + b; }

// dst = src (first head of a group) or dst = combine(dst, src), element-wise.
inline void combine_into(Combine c, bool first, const float *__restrict src, float *__restrict dst, size_t n) {
    if (first) {
        std::copy(src, src + n, dst);
        return;
    }
    size_t i = 0;
    if (c == Combine::max) {
        for (; i + kLanes <= n; i += kLanes)
#pragma GCC unroll 16
            for (size_t j = 0; j < kLanes; ++j) dst[i + j] = std::max(dst[i + j], src[i + j]);
        for (; i < n; ++i) dst[i] = std::max(dst[i], src[i]);
    } else {
        for (; i + kLanes <= n; i += kLanes)
#pragma GCC unroll 16
            for (size_t j = 0; j < kLanes; ++j) dst[i + j] += src[i + j];
        for (; i < n; ++i) dst[i] += src[i];
    }
}

}  // namespace sg::kernels::cpu
