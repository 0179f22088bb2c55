// examples/disagg/engine.cpp: see engine.hpp.
#include "engine.hpp"

#include <smartgen/smartgen.h>

#include <dlfcn.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <new>
#include <string>
#include <utility>

namespace sg::disagg {

namespace {

[[noreturn]] void fail(const std::string& message) { throw EngineError(message); }

// The library's attention-part calls, looked up in the process at first use rather than linked:
// programs that never pass arriving blocks (calibration, the prompt sampler) link no libsmartgen,
// and smartgen-disagg must still load against a library older than 0.2. A weak reference would not
// do for the latter: the calls are in the library's SMARTGEN_0.2 version node, and the dynamic
// loader refuses a program that needs a version its library lacks, weak reference or not (ld 2.40
// does not mark the version need weak). NULL members: not loaded.
struct AttentionCalls {
    decltype(&sg_attention_merge) merge;
    decltype(&sg_attention_finish) finish;
    decltype(&sg_last_error_message) last_error;
};
const AttentionCalls& attention_calls() {
    static const AttentionCalls calls{
        reinterpret_cast<decltype(&sg_attention_merge)>(dlsym(RTLD_DEFAULT, "sg_attention_merge")),
        reinterpret_cast<decltype(&sg_attention_finish)>(dlsym(RTLD_DEFAULT, "sg_attention_finish")),
        reinterpret_cast<decltype(&sg_last_error_message)>(dlsym(RTLD_DEFAULT, "sg_last_error_message"))};
    return calls;
}

// ---- numerics -------------------------------------------------------------------------------------

// Every sum is accumulated in run.c's order: a matmul output over j = 0..n-1, an attention score over
// i = 0..head_size-1, an attention output over the positions in order. The kernels vectorise across
// independent sums only (tokens of a tile, keys of a block, elements of a head), never within one, so
// prefill, decode and run.c itself produce the same bits whatever the vector width. The target is
// built with -ffp-contract=off so no multiply-add is fused on one path and not on another.
//
// Each kernel is a template over the vector type: 4 lanes (SSE, NEON: the baseline) or, on x86 CPUs
// that have it, 8 lanes in an AVX2 copy (no FMA) chosen once at run time.
typedef float v4f __attribute__((vector_size(16)));
typedef float v8f __attribute__((vector_size(32)));

template <class V>
constexpr int kLanes = int(sizeof(V) / sizeof(float));
constexpr int kMaxLanes = 8;
constexpr int kKeyPad = 4 * kMaxLanes;  // keys one score block may read past the last one

#define SG_INLINE [[gnu::always_inline]] inline
// Vector loads through memcpy: no alignment assumed, and no vector passed or returned by value.
#define SG_LOAD(V, var, ptr) \
    V var;                   \
    std::memcpy(&var, (ptr), sizeof(V))

// out[t][i] = sum over j of W[i][j] * in[t][j], for t < n_rows and i < d; W is [d][n], in is [n_rows][n].
// xt is scratch of n * kMaxLanes floats. Decode (one row) runs four output rows side by side; prefill
// transposes a tile of tokens so that each lane carries one token's sum, four output rows at a time.
template <class V>
SG_INLINE void matmul_impl(float* out, const float* in, const float* w, int n_rows, int n, int d, float* xt) {
    constexpr int L = kLanes<V>;
    if (n_rows == 1) {
        int i = 0;
        for (; i + 4 <= d; i += 4) {
            const float *w0 = w + size_t(i) * n, *w1 = w0 + n, *w2 = w1 + n, *w3 = w2 + n;
            float s0 = 0.0f, s1 = 0.0f, s2 = 0.0f, s3 = 0.0f;
            for (int j = 0; j < n; ++j) {
                s0 += w0[j] * in[j];
                s1 += w1[j] * in[j];
                s2 += w2[j] * in[j];
                s3 += w3[j] * in[j];
            }
            out[i] = s0, out[i + 1] = s1, out[i + 2] = s2, out[i + 3] = s3;
        }
        for (; i < d; ++i) {
            const float* wi = w + size_t(i) * n;
            float s0 = 0.0f;
            for (int j = 0; j < n; ++j) s0 += wi[j] * in[j];
            out[i] = s0;
        }
        return;
    }
    for (int t0 = 0; t0 < n_rows; t0 += L) {
        const int nt = std::min(L, n_rows - t0);
        for (int j = 0; j < n; ++j)
            for (int t = 0; t < L; ++t) xt[j * L + t] = t < nt ? in[size_t(t0 + t) * n + j] : 0.0f;
        float* o = out + size_t(t0) * d;
        int i = 0;
        for (; i + 4 <= d; i += 4) {
            const float *w0 = w + size_t(i) * n, *w1 = w0 + n, *w2 = w1 + n, *w3 = w2 + n;
            V a0 = {}, a1 = {}, a2 = {}, a3 = {};
            for (int j = 0; j < n; ++j) {
                SG_LOAD(V, x, xt + j * L);
                a0 += w0[j] * x;
                a1 += w1[j] * x;
                a2 += w2[j] * x;
                a3 += w3[j] * x;
            }
            for (int t = 0; t < nt; ++t) {
                float* ot = o + size_t(t) * d + i;
                ot[0] = a0[t], ot[1] = a1[t], ot[2] = a2[t], ot[3] = a3[t];
            }
        }
        for (; i < d; ++i) {
            const float* wi = w + size_t(i) * n;
            V a0 = {};
            for (int j = 0; j < n; ++j) {
                SG_LOAD(V, x, xt + j * L);
                a0 += wi[j] * x;
            }
            for (int t = 0; t < nt; ++t) o[size_t(t) * d + i] = a0[t];
        }
    }
}

// Scores of one query against keys 0..n_keys-1 whose head is stored transposed: kt[i * stride + u]
// is element i of key u; each score is run.c's sum over i of q[i] * k[i], divided by sqrt(head_size).
// Writes att[0 .. n_keys rounded up to 4 vectors); up to kKeyPad columns past n_keys are read and
// their scores discarded.
template <class V>
SG_INLINE void scores_impl(float* att, const float* q, const float* kt, size_t stride, int hs, int n_keys,
                           float scale) {
    constexpr int L = kLanes<V>;
    for (int u0 = 0; u0 < n_keys; u0 += 4 * L) {
        V a0 = {}, a1 = {}, a2 = {}, a3 = {};
        for (int i = 0; i < hs; ++i) {
            const float* row = kt + size_t(i) * stride + u0;
            const float qi = q[i];
            SG_LOAD(V, k0, row);
            SG_LOAD(V, k1, row + L);
            SG_LOAD(V, k2, row + 2 * L);
            SG_LOAD(V, k3, row + 3 * L);
            a0 += qi * k0;
            a1 += qi * k1;
            a2 += qi * k2;
            a3 += qi * k3;
        }
        a0 /= scale, a1 /= scale, a2 /= scale, a3 /= scale;
        std::memcpy(att + u0, &a0, sizeof a0);
        std::memcpy(att + u0 + L, &a1, sizeof a1);
        std::memcpy(att + u0 + 2 * L, &a2, sizeof a2);
        std::memcpy(att + u0 + 3 * L, &a3, sizeof a3);
    }
}

// out[i] = sum over u < n, in order, of att[u] * v[u * stride + i], for i < NC * lanes.
template <class V, int NC>
SG_INLINE void weighted_values_n(float* out, const float* att, const float* v, size_t stride, int n) {
    constexpr int L = kLanes<V>;
    V o[NC] = {};
    for (int u = 0; u < n; ++u) {
        const float a = att[u];
        const float* row = v + size_t(u) * stride;
        for (int c = 0; c < NC; ++c) {
            SG_LOAD(V, x, row + L * c);
            o[c] += a * x;
        }
    }
    std::memcpy(out, o, sizeof o);
}

// The same for any head size.
template <class V>
SG_INLINE void weighted_values_impl(float* out, const float* att, const float* v, size_t stride, int hs, int n) {
    constexpr int L = kLanes<V>;
    switch (hs) {
        case L:
            return weighted_values_n<V, 1>(out, att, v, stride, n);
        case 2 * L:
            return weighted_values_n<V, 2>(out, att, v, stride, n);
        case 4 * L:
            return weighted_values_n<V, 4>(out, att, v, stride, n);
        case 8 * L:
            return weighted_values_n<V, 8>(out, att, v, stride, n);
        default:
            std::fill(out, out + hs, 0.0f);
            for (int u = 0; u < n; ++u) {
                const float a = att[u];
                const float* row = v + size_t(u) * stride;
                for (int i = 0; i < hs; ++i) out[i] += a * row[i];
            }
    }
}

// Two rows at once for more independent sums in flight: out0 over keys 0..n-1 with att0, out1 over
// keys 0..n with att1 (the next prompt row). Each sum keeps its own order.
template <class V, int NC>
SG_INLINE void weighted_values2_n(float* out0, float* out1, const float* att0, const float* att1, const float* v,
                                  size_t stride, int n) {
    constexpr int L = kLanes<V>;
    V o0[NC] = {}, o1[NC] = {};
    for (int u = 0; u < n; ++u) {
        const float a0 = att0[u], a1 = att1[u];
        const float* row = v + size_t(u) * stride;
        for (int c = 0; c < NC; ++c) {
            SG_LOAD(V, x, row + L * c);
            o0[c] += a0 * x;
            o1[c] += a1 * x;
        }
    }
    const float a1 = att1[n];
    const float* row = v + size_t(n) * stride;
    for (int c = 0; c < NC; ++c) {
        SG_LOAD(V, x, row + L * c);
        o1[c] += a1 * x;
    }
    std::memcpy(out0, o0, sizeof o0);
    std::memcpy(out1, o1, sizeof o1);
}

template <class V>
SG_INLINE void weighted_values2_impl(float* out0, float* out1, const float* att0, const float* att1, const float* v,
                                     size_t stride, int hs, int n) {
    constexpr int L = kLanes<V>;
    switch (hs) {  // at most 8 accumulators, so they stay in registers
        case L:
            return weighted_values2_n<V, 1>(out0, out1, att0, att1, v, stride, n);
        case 2 * L:
            return weighted_values2_n<V, 2>(out0, out1, att0, att1, v, stride, n);
        case 4 * L:
            return weighted_values2_n<V, 4>(out0, out1, att0, att1, v, stride, n);
        default:
            weighted_values_impl<V>(out0, att0, v, stride, hs, n);
            weighted_values_impl<V>(out1, att1, v, stride, hs, n + 1);
    }
}

#if (defined(__x86_64__) || defined(__i386__)) && (defined(__GNUC__) || defined(__clang__)) && \
    !defined(SMARTGEN_ENGINE_NO_AVX2)
#define SG_HAVE_AVX2_COPY 1
__attribute__((target("avx2"), noinline)) void matmul_avx2(float* out, const float* in, const float* w, int n_rows,
                                                           int n, int d, float* xt) {
    matmul_impl<v8f>(out, in, w, n_rows, n, d, xt);
}
__attribute__((target("avx2"), noinline)) void scores_avx2(float* att, const float* q, const float* kt, size_t stride,
                                                           int hs, int n_keys, float scale) {
    scores_impl<v8f>(att, q, kt, stride, hs, n_keys, scale);
}
__attribute__((target("avx2"), noinline)) void weighted_values_avx2(float* out, const float* att, const float* v,
                                                                    size_t stride, int hs, int n) {
    weighted_values_impl<v8f>(out, att, v, stride, hs, n);
}
__attribute__((target("avx2"), noinline)) void weighted_values2_avx2(float* out0, float* out1, const float* att0,
                                                                     const float* att1, const float* v, size_t stride,
                                                                     int hs, int n) {
    weighted_values2_impl<v8f>(out0, out1, att0, att1, v, stride, hs, n);
}
bool use_avx2() {
    static const bool yes = [] {
        __builtin_cpu_init();
        return __builtin_cpu_supports("avx2") != 0;
    }();
    return yes;
}
#else
#define SG_HAVE_AVX2_COPY 0
constexpr bool use_avx2() { return false; }
#endif

__attribute__((noinline)) void matmul(float* out, const float* in, const float* w, int n_rows, int n, int d,
                                      float* xt) {
#if SG_HAVE_AVX2_COPY
    if (use_avx2()) return matmul_avx2(out, in, w, n_rows, n, d, xt);
#endif
    matmul_impl<v4f>(out, in, w, n_rows, n, d, xt);
}

__attribute__((noinline)) void scores_transposed(float* att, const float* q, const float* kt, size_t stride, int hs,
                                                 int n_keys, float scale) {
#if SG_HAVE_AVX2_COPY
    if (use_avx2()) return scores_avx2(att, q, kt, stride, hs, n_keys, scale);
#endif
    scores_impl<v4f>(att, q, kt, stride, hs, n_keys, scale);
}

__attribute__((noinline)) void weighted_values(float* out, const float* att, const float* v, size_t stride, int hs,
                                               int n) {
#if SG_HAVE_AVX2_COPY
    if (use_avx2()) return weighted_values_avx2(out, att, v, stride, hs, n);
#endif
    weighted_values_impl<v4f>(out, att, v, stride, hs, n);
}

__attribute__((noinline)) void weighted_values2(float* out0, float* out1, const float* att0, const float* att1,
                                                const float* v, size_t stride, int hs, int n) {
#if SG_HAVE_AVX2_COPY
    if (use_avx2()) return weighted_values2_avx2(out0, out1, att0, att1, v, stride, hs, n);
#endif
    weighted_values2_impl<v4f>(out0, out1, att0, att1, v, stride, hs, n);
}

// One attention score in run.c's order (decode).
inline float score(const float* q, const float* k, int hs, float scale) {
    float s = 0.0f;
    for (int i = 0; i < hs; ++i) s += q[i] * k[i];
    return s / scale;
}

// run.c's rmsnorm, in its order of operations.
void rmsnorm(float* o, const float* x, const float* weight, int size) {
    float ss = 0.0f;
    for (int j = 0; j < size; ++j) ss += x[j] * x[j];
    ss /= float(size);
    ss += 1e-5f;
    ss = 1.0f / std::sqrt(ss);
    for (int j = 0; j < size; ++j) o[j] = weight[j] * (ss * x[j]);
}

// run.c's softmax. The maximum does not depend on the order it is taken in, and each quotient is one
// rounding, so those two loops run four lanes wide; the sum of the exponentials stays sequential.
void softmax(float* x, int size) {
    int i = 0;
    float max_val = x[0];
    if (size >= 8) {
        SG_LOAD(v4f, m, x);
        for (i = 4; i + 4 <= size; i += 4) {
            SG_LOAD(v4f, y, x + i);
            m = y > m ? y : m;
        }
        max_val = std::max(std::max(m[0], m[1]), std::max(m[2], m[3]));
    }
    for (; i < size; ++i)
        if (x[i] > max_val) max_val = x[i];
    float sum = 0.0f;
    for (i = 0; i < size; ++i) {
        x[i] = std::exp(x[i] - max_val);
        sum += x[i];
    }
    for (i = 0; i + 4 <= size; i += 4) {
        SG_LOAD(v4f, y, x + i);
        y /= sum;
        std::memcpy(x + i, &y, sizeof y);
    }
    for (; i < size; ++i) x[i] /= sum;
}

// RoPE for one position on q [dim] and k [kv_dim], as run.c: pairs (i, i+1) with i stepping by 2
// through the whole vector, the frequency taken from i % head_size.
void rope(const Model& m, int pos, float* q, float* k) {
    const Config& c = m.config();
    const int hs = c.head_size(), kv_dim = c.kv_dim();
    for (int i = 0; i < c.dim; i += 2) {
        const int pair = (i % hs) / 2;
        const float fcr = m.rope_cos(pos, pair), fci = m.rope_sin(pos, pair);
        const float q0 = q[i], q1 = q[i + 1];
        q[i] = q0 * fcr - q1 * fci;
        q[i + 1] = q0 * fci + q1 * fcr;
        if (i < kv_dim) {
            const float k0 = k[i], k1 = k[i + 1];
            k[i] = k0 * fcr - k1 * fci;
            k[i + 1] = k0 * fci + k1 * fcr;
        }
    }
}

void store(void* dst, const float* src, int n, KvDtype dtype) {
    switch (dtype) {
        case KvDtype::kF32:
            std::memcpy(dst, src, size_t(n) * sizeof(float));
            return;
        case KvDtype::kF16: {
            auto* d = static_cast<uint16_t*>(dst);
            for (int i = 0; i < n; ++i) d[i] = f32_to_f16(src[i]);
            return;
        }
        case KvDtype::kBF16: {
            auto* d = static_cast<uint16_t*>(dst);
            for (int i = 0; i < n; ++i) d[i] = f32_to_bf16(src[i]);
            return;
        }
    }
}

void load(float* dst, const void* src, int n, KvDtype dtype) {
    switch (dtype) {
        case KvDtype::kF32:
            std::memcpy(dst, src, size_t(n) * sizeof(float));
            return;
        case KvDtype::kF16: {
            const auto* s = static_cast<const uint16_t*>(src);
            for (int i = 0; i < n; ++i) dst[i] = f16_to_f32(s[i]);
            return;
        }
        case KvDtype::kBF16: {
            const auto* s = static_cast<const uint16_t*>(src);
            for (int i = 0; i < n; ++i) dst[i] = bf16_to_f32(s[i]);
            return;
        }
    }
}

// What a value becomes after a trip through the pool.
void round_trip(float* x, size_t n, KvDtype dtype) {
    if (dtype == KvDtype::kF16)
        for (size_t i = 0; i < n; ++i) x[i] = f16_to_f32(f32_to_f16(x[i]));
    else if (dtype == KvDtype::kBF16)
        for (size_t i = 0; i < n; ++i) x[i] = bf16_to_f32(f32_to_bf16(x[i]));
}

void check_table(const KvPool& pool, BlockTable table, int n_tokens, const char* what) {
    const uint32_t need = blocks_for(n_tokens, pool.tokens_per_block);
    if (table.size() < need)
        fail(std::string(what) + ": block table has " + std::to_string(table.size()) + " entries, " +
             std::to_string(n_tokens) + " tokens in blocks of " + std::to_string(pool.tokens_per_block) + " need " +
             std::to_string(need));
    for (uint32_t j = 0; j < need; ++j)
        if (table[j] >= pool.num_blocks)
            fail(std::string(what) + ": block table entry " + std::to_string(j) + " is block " +
                 std::to_string(table[j]) + ", the pool has " + std::to_string(pool.num_blocks));
}

}  // namespace

// ---- conversions ----------------------------------------------------------------------------------

uint16_t f32_to_f16(float f) {
    const uint32_t x = std::bit_cast<uint32_t>(f);
    const uint32_t sign = (x >> 16) & 0x8000u;
    const uint32_t ax = x & 0x7fffffffu;
    if (ax >= 0x7f800000u) {                                                            // inf or NaN
        if (ax > 0x7f800000u) return uint16_t(sign | 0x7e00u | ((ax >> 13) & 0x3ffu));  // quiet NaN
        return uint16_t(sign | 0x7c00u);
    }
    if (ax >= 0x477ff000u) return uint16_t(sign | 0x7c00u);  // >= 65520 rounds to infinity
    if (ax < 0x38800000u) {                                  // below 2^-14: fp16 subnormal or zero
        if (ax <= 0x33000000u) return uint16_t(sign);        // <= 2^-25: ties to even gives 0
        const uint32_t e = ax >> 23;
        const uint32_t m = (ax & 0x7fffffu) | 0x800000u;
        const uint32_t shift = 126u - e;  // value / 2^-24 = m * 2^(e-126)
        uint32_t r = m >> shift;
        const uint32_t rem = m & ((1u << shift) - 1u), half = 1u << (shift - 1u);
        if (rem > half || (rem == half && (r & 1u))) ++r;
        return uint16_t(sign | r);  // r == 0x400 is the smallest normal, correctly encoded
    }
    const uint32_t r = ax - 0x38000000u;  // exponent rebiased 127 -> 15
    uint32_t h = r >> 13;
    const uint32_t rem = r & 0x1fffu;
    if (rem > 0x1000u || (rem == 0x1000u && (h & 1u))) ++h;
    return uint16_t(sign | h);
}

float f16_to_f32(uint16_t h) {
    const uint32_t sign = uint32_t(h & 0x8000u) << 16;
    const uint32_t e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
    if (e == 0) {
        const float f = float(m) * 0x1p-24f;  // exact: m < 2^10
        return sign ? -f : f;
    }
    if (e == 31) return std::bit_cast<float>(sign | 0x7f800000u | (m << 13));
    return std::bit_cast<float>(sign | ((e + 112u) << 23) | (m << 13));
}

uint16_t f32_to_bf16(float f) {
    uint32_t u = std::bit_cast<uint32_t>(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40u);  // quiet NaN
    u += 0x7fffu + ((u >> 16) & 1u);
    return uint16_t(u >> 16);
}

float bf16_to_f32(uint16_t b) { return std::bit_cast<float>(uint32_t(b) << 16); }

size_t dtype_bytes(KvDtype dtype) {
    switch (dtype) {
        case KvDtype::kF32:
            return 4;
        case KvDtype::kF16:
        case KvDtype::kBF16:
            return 2;
    }
    fail("unknown KV dtype " + std::to_string(uint32_t(dtype)));
}

const char* dtype_name(KvDtype dtype) {
    switch (dtype) {
        case KvDtype::kF32:
            return "fp32";
        case KvDtype::kF16:
            return "fp16";
        case KvDtype::kBF16:
            return "bf16";
    }
    return "unknown";
}

// ---- model ----------------------------------------------------------------------------------------

uint64_t Model::expected_file_bytes(const int32_t h[7]) {
    // 128-bit arithmetic: a hostile header must not overflow its way to a plausible size.
    __extension__ typedef unsigned __int128 u128;
    const int64_t dim = h[0], hidden = h[1], layers = h[2], heads = h[3], kv_heads = h[4], seq = h[6];
    const int64_t vocab = h[5] < 0 ? -int64_t(h[5]) : int64_t(h[5]);
    if (vocab > INT32_MAX) return 0;  // -INT32_MIN has no int32 value
    if (dim <= 0 || hidden <= 0 || layers <= 0 || heads <= 0 || kv_heads <= 0 || vocab <= 0 || seq <= 0) return 0;
    if (dim % heads != 0 || heads % kv_heads != 0 || (dim / heads) % 2 != 0) return 0;
    const u128 D = u128(dim), H = u128(hidden), L = u128(layers), V = u128(vocab), S = u128(seq);
    const u128 hs = u128(dim / heads), kv_dim = u128(kv_heads) * hs;
    u128 floats = V * D                 // token_embedding
                  + L * D               // rms_att
                  + L * D * D           // wq
                  + 2 * L * kv_dim * D  // wk, wv
                  + L * D * D           // wo
                  + L * D               // rms_ffn
                  + 3 * L * H * D       // w1, w2, w3
                  + D                   // rms_final
                  + S * hs;             // two RoPE tables of seq_len * head_size / 2
    if (h[5] < 0) floats += V * D;      // wcls
    const u128 bytes = 7 * sizeof(int32_t) + floats * sizeof(float);
    return bytes > u128(UINT64_MAX) ? 0 : uint64_t(bytes);
}

Model Model::load(const std::string& path) {
    const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) fail("cannot open checkpoint '" + path + "': " + std::strerror(errno));
    struct stat st {};
    if (::fstat(fd, &st) != 0) {
        const int e = errno;
        ::close(fd);
        fail("cannot stat checkpoint '" + path + "': " + std::strerror(e));
    }
    const size_t size = size_t(st.st_size);
    int32_t h[7] = {};
    if (size < sizeof h) {
        ::close(fd);
        fail("checkpoint '" + path + "' has " + std::to_string(size) + " bytes, less than its 28-byte header");
    }
    void* map = ::mmap(nullptr, size, PROT_READ, MAP_PRIVATE, fd, 0);
    const int map_errno = errno;
    ::close(fd);
    if (map == MAP_FAILED) fail("cannot map checkpoint '" + path + "': " + std::strerror(map_errno));

    Model m;
    m.map_ = map;
    m.map_bytes_ = size;
    std::memcpy(h, map, sizeof h);
    if (uint32_t(h[0]) == 0x616b3432u)
        fail("checkpoint '" + path + "' is a versioned llama2.c export (magic \"ak42\", version " +
             std::to_string(h[1]) + "); only the legacy v0 format is supported");
    const std::string header = "dim " + std::to_string(h[0]) + ", hidden_dim " + std::to_string(h[1]) + ", n_layers " +
                               std::to_string(h[2]) + ", n_heads " + std::to_string(h[3]) + ", n_kv_heads " +
                               std::to_string(h[4]) + ", vocab_size " + std::to_string(h[5]) + ", seq_len " +
                               std::to_string(h[6]);
    const uint64_t expected = expected_file_bytes(h);
    if (expected == 0)
        fail("checkpoint '" + path + "' has an invalid header (" + header +
             "): sizes must be positive (vocab_size may be negative), dim divisible by n_heads, n_heads by "
             "n_kv_heads, and the head size even");
    if (expected != size)
        fail("checkpoint '" + path + "' has " + std::to_string(size) + " bytes but its header (" + header +
             ") implies " + std::to_string(expected) + (size < expected ? ": truncated" : ": trailing data"));

    Config& c = m.config_;
    c.dim = h[0];
    c.hidden_dim = h[1];
    c.n_layers = h[2];
    c.n_heads = h[3];
    c.n_kv_heads = h[4];
    c.shared_classifier = h[5] > 0;
    c.vocab_size = h[5] < 0 ? -h[5] : h[5];
    c.seq_len = h[6];

    const size_t dim = size_t(c.dim), hid = size_t(c.hidden_dim), L = size_t(c.n_layers);
    const size_t kv_dim = size_t(c.kv_dim()), hs = size_t(c.head_size());
    const float* p = reinterpret_cast<const float*>(static_cast<const char*>(map) + sizeof h);
    Weights& w = m.weights_;
    w.token_embedding = p, p += size_t(c.vocab_size) * dim;
    w.rms_att = p, p += L * dim;
    w.wq = p, p += L * dim * dim;
    w.wk = p, p += L * kv_dim * dim;
    w.wv = p, p += L * kv_dim * dim;
    w.wo = p, p += L * dim * dim;
    w.rms_ffn = p, p += L * dim;
    w.w1 = p, p += L * hid * dim;
    w.w2 = p, p += L * dim * hid;
    w.w3 = p, p += L * hid * dim;
    w.rms_final = p, p += dim;
    p += size_t(c.seq_len) * hs / 2;  // freq_cis_real (unused)
    p += size_t(c.seq_len) * hs / 2;  // freq_cis_imag (unused)
    w.wcls = c.shared_classifier ? w.token_embedding : p;

    // run.c: freq = 1 / 10000^(head_dim / head_size) with head_dim = 2i; val = pos * freq.
    const size_t half = hs / 2;
    m.rope_cos_.resize(size_t(c.seq_len) * half);
    m.rope_sin_.resize(size_t(c.seq_len) * half);
    for (int pos = 0; pos < c.seq_len; ++pos)
        for (size_t i = 0; i < half; ++i) {
            const float freq = 1.0f / std::pow(10000.0f, float(2 * i) / float(hs));
            const float val = float(pos) * freq;
            m.rope_cos_[size_t(pos) * half + i] = std::cos(val);
            m.rope_sin_[size_t(pos) * half + i] = std::sin(val);
        }
    return m;
}

Model::Model(Model&& o) noexcept
    : config_(o.config_),
      weights_(o.weights_),
      map_(std::exchange(o.map_, nullptr)),
      map_bytes_(std::exchange(o.map_bytes_, 0)),
      rope_cos_(std::move(o.rope_cos_)),
      rope_sin_(std::move(o.rope_sin_)) {}

Model& Model::operator=(Model&& o) noexcept {
    if (this != &o) {
        if (map_) ::munmap(map_, map_bytes_);
        config_ = o.config_;
        weights_ = o.weights_;
        map_ = std::exchange(o.map_, nullptr);
        map_bytes_ = std::exchange(o.map_bytes_, 0);
        rope_cos_ = std::move(o.rope_cos_);
        rope_sin_ = std::move(o.rope_sin_);
    }
    return *this;
}

Model::~Model() {
    if (map_) ::munmap(map_, map_bytes_);
}

// ---- pool -----------------------------------------------------------------------------------------

void KvPool::check(const Config& c) const {
    auto mismatch = [&](const char* field, int64_t have, int64_t want) {
        fail(std::string("KV pool ") + field + " is " + std::to_string(have) + ", the model needs " +
             std::to_string(want));
    };
    if (num_layers != c.n_layers) mismatch("num_layers", num_layers, c.n_layers);
    if (num_kv_heads != c.n_kv_heads) mismatch("num_kv_heads", num_kv_heads, c.n_kv_heads);
    if (head_dim != c.head_size()) mismatch("head_dim", head_dim, c.head_size());
    if (tokens_per_block < 1) fail("KV pool tokens_per_block must be >= 1");
    if (num_blocks < 1) fail("KV pool has no blocks");
    if (dtype != KvDtype::kF32 && dtype != KvDtype::kF16 && dtype != KvDtype::kBF16)
        fail("KV pool dtype " + std::to_string(uint32_t(dtype)) + " is not supported (fp32, fp16, bf16)");
    if (k_base.size() != size_t(num_layers) || v_base.size() != size_t(num_layers))
        fail("KV pool needs one K and one V base pointer per layer");
    for (int l = 0; l < num_layers; ++l)
        if (!k_base[size_t(l)] || !v_base[size_t(l)])
            fail("KV pool base pointer of layer " + std::to_string(l) + " is null");
    if (block_stride_bytes && block_stride_bytes < plane_bytes())
        fail("KV pool block_stride_bytes " + std::to_string(block_stride_bytes) + " is below the plane size " +
             std::to_string(plane_bytes()));
}

void* KvPool::row(int layer, bool is_v, uint32_t block, int slot, int kv_head) const {
    char* base = static_cast<char*>(is_v ? v_base[size_t(layer)] : k_base[size_t(layer)]);
    const uint64_t elems = (uint64_t(slot) * uint64_t(num_kv_heads) + uint64_t(kv_head)) * uint64_t(head_dim);
    return base + uint64_t(block) * block_stride() + elems * dtype_bytes(dtype);
}

void KvPoolStorage::Free::operator()(void* p) const { ::operator delete(p, std::align_val_t(64)); }

KvPoolStorage::KvPoolStorage(const Config& c, int tokens_per_block, uint64_t num_blocks, KvDtype dtype) {
    view_.num_layers = c.n_layers;
    view_.num_kv_heads = c.n_kv_heads;
    view_.head_dim = c.head_size();
    view_.tokens_per_block = tokens_per_block;
    view_.num_blocks = num_blocks;
    view_.dtype = dtype;
    if (tokens_per_block < 1 || num_blocks < 1) fail("KvPoolStorage needs tokens_per_block >= 1 and num_blocks >= 1");
    (void)dtype_bytes(dtype);
    const size_t bytes = size_t(view_.region_bytes());
    for (int l = 0; l < c.n_layers; ++l)
        for (int kv = 0; kv < 2; ++kv) {
            void* p = ::operator new(bytes, std::align_val_t(64));
            std::memset(p, 0, bytes);
            regions_.emplace_back(p);
            (kv ? view_.v_base : view_.k_base).push_back(p);
        }
}

void KvPoolStorage::clear() {
    const size_t bytes = size_t(view_.region_bytes());
    for (auto& r : regions_) std::memset(r.get(), 0, bytes);
}

std::vector<uint32_t> identity_table(uint32_t n_blocks) {
    std::vector<uint32_t> t(n_blocks);
    for (uint32_t i = 0; i < n_blocks; ++i) t[i] = i;
    return t;
}

void read_kv(const KvPool& pool, BlockTable table, int layer, bool is_v, int pos, int kv_head, float* out) {
    const int B = pool.tokens_per_block;
    const uint32_t j = uint32_t(pos / B);
    if (pos < 0 || j >= table.size() || table[j] >= pool.num_blocks)
        fail("read_kv: position " + std::to_string(pos) + " is outside the block table");
    load(out, pool.row(layer, is_v, table[j], pos % B, kv_head), pool.head_dim, pool.dtype);
}

// ---- run state ------------------------------------------------------------------------------------

struct RunState::Buffers {
    Config c;
    // Activations of up to seq_len positions (prefill) or one (decode): [pos][width].
    std::vector<float> x, xb, xb2, q, k, v, hb, hb2;
    // Decode: K/V of attended positions gathered from the pool, indexed by position: [pos][kv_dim].
    std::vector<float> kc, vc;
    std::vector<float> kt;          // prefill: K transposed per KV head, [kv_dim][kt_stride]
    size_t kt_stride = 0;           // seq_len + a key block of padding
    std::vector<float> xt;          // matmul tile scratch
    std::vector<float> att, att2;   // scores of one query (two for row pairs)
    std::vector<int> positions;     // attended positions of one decode layer
    std::vector<uint8_t> block_on;  // decode: per logical block, attended?
    // Decode with arriving blocks: their positions, and per query head the two attention parts
    // (max and sum [n_heads], acc [n_heads][head_size]: sg_attention_merge's rows).
    std::vector<int> arriving_positions;
    std::vector<float> max_a, sum_a, acc_a, max_b, sum_b, acc_b;
    std::vector<float> logits;

    explicit Buffers(const Config& cfg) : c(cfg) {
        const size_t S = size_t(c.seq_len), dim = size_t(c.dim), kvd = size_t(c.kv_dim()), hid = size_t(c.hidden_dim);
        x.resize(S * dim);
        xb.resize(S * dim);
        xb2.resize(S * dim);
        q.resize(S * dim);
        k.resize(S * kvd);
        v.resize(S * kvd);
        hb.resize(S * hid);
        hb2.resize(S * hid);
        kc.resize(S * kvd);
        vc.resize(S * kvd);
        kt_stride = S + kKeyPad;
        kt.resize(kvd * kt_stride);
        xt.resize(size_t(std::max(c.dim, c.hidden_dim)) * kMaxLanes);
        att.resize(S + kKeyPad);
        att2.resize(S + kKeyPad);
        positions.resize(S);
        block_on.resize(S);
        arriving_positions.resize(S);
        for (auto* part : {&max_a, &max_b}) part->resize(size_t(c.n_heads));
        for (auto* part : {&sum_a, &sum_b}) part->resize(size_t(c.n_heads));
        for (auto* part : {&acc_a, &acc_b}) part->resize(dim);
        logits.resize(size_t(c.vocab_size));
    }
};

RunState::RunState(const Config& config) : b_(std::make_unique<Buffers>(config)) {}
RunState::RunState(RunState&&) noexcept = default;
RunState& RunState::operator=(RunState&&) noexcept = default;
RunState::~RunState() = default;
std::span<const float> RunState::logits() const { return b_->logits; }

namespace {

void check_state(const Model& model, RunState& state) {
    const Config &a = model.config(), &b = state.buffers().c;
    if (a.dim != b.dim || a.hidden_dim != b.hidden_dim || a.n_layers != b.n_layers || a.n_heads != b.n_heads ||
        a.n_kv_heads != b.n_kv_heads || a.vocab_size != b.vocab_size || a.seq_len != b.seq_len)
        fail("RunState was made for another model configuration");
}

// x (one position) -> logits, as run.c's tail.
std::span<const float> classify(const Model& model, const float* x, RunState::Buffers& s) {
    const Config& c = model.config();
    float* xn = s.xb2.data();  // free at this point
    rmsnorm(xn, x, model.weights().rms_final, c.dim);
    matmul(s.logits.data(), xn, model.weights().wcls, 1, c.dim, c.vocab_size, s.xt.data());
    return s.logits;
}

// The FFN block over n rows of s.x: x += w2 (silu(w1 n) * w3 n), n = rmsnorm(x).
void ffn(const Model& model, int l, int n, RunState::Buffers& s) {
    const Config& c = model.config();
    const Weights& w = model.weights();
    const size_t dim = size_t(c.dim), hid = size_t(c.hidden_dim);
    for (int t = 0; t < n; ++t) rmsnorm(s.xb.data() + t * dim, s.x.data() + t * dim, w.rms_ffn + l * dim, c.dim);
    matmul(s.hb.data(), s.xb.data(), w.w1 + l * hid * dim, n, c.dim, c.hidden_dim, s.xt.data());
    matmul(s.hb2.data(), s.xb.data(), w.w3 + l * hid * dim, n, c.dim, c.hidden_dim, s.xt.data());
    const size_t total = size_t(n) * hid;
    for (size_t i = 0; i < total; ++i) {
        float h = s.hb[i];
        h = h * (1.0f / (1.0f + std::exp(-h)));
        s.hb[i] = h * s.hb2[i];
    }
    matmul(s.xb.data(), s.hb.data(), w.w2 + l * dim * hid, n, c.hidden_dim, c.dim, s.xt.data());
    for (size_t i = 0; i < size_t(n) * dim; ++i) s.x[i] += s.xb[i];
}

// Causal attention of prompt row t over keys 0..t (s.kt transposed, s.v row-major); output into s.xb.
// With `mass`, adds each head's probabilities into mass[head * n_tokens + key].
void attend_prompt_row(const Model& model, int t, RunState::Buffers& s, float* mass, int n_tokens) {
    const Config& c = model.config();
    const int hs = c.head_size(), kvd = c.kv_dim(), dim = c.dim;
    const float scale = std::sqrt(float(hs));
    float* att = s.att.data();
    for (int h = 0; h < c.n_heads; ++h) {
        const int kvh = h / c.kv_mul();
        scores_transposed(att, s.q.data() + size_t(t) * dim + h * hs, s.kt.data() + size_t(kvh) * hs * s.kt_stride,
                          s.kt_stride, hs, t + 1, scale);
        softmax(att, t + 1);
        if (mass) {
            float* m = mass + size_t(h) * n_tokens;
            for (int u = 0; u <= t; ++u) m[u] += att[u];
        }
        weighted_values(s.xb.data() + size_t(t) * dim + h * hs, att, s.v.data() + size_t(kvh) * hs, size_t(kvd), hs,
                        t + 1);
    }
}

// Rows t and t+1 together (no capture): the same results as two attend_prompt_row calls.
void attend_prompt_rows2(const Model& model, int t, RunState::Buffers& s) {
    const Config& c = model.config();
    const int hs = c.head_size(), kvd = c.kv_dim(), dim = c.dim;
    const float scale = std::sqrt(float(hs));
    float *att0 = s.att.data(), *att1 = s.att2.data();
    for (int h = 0; h < c.n_heads; ++h) {
        const int kvh = h / c.kv_mul();
        const float* kt = s.kt.data() + size_t(kvh) * hs * s.kt_stride;
        const float* q0 = s.q.data() + size_t(t) * dim + h * hs;
        scores_transposed(att0, q0, kt, s.kt_stride, hs, t + 1, scale);
        scores_transposed(att1, q0 + dim, kt, s.kt_stride, hs, t + 2, scale);
        softmax(att0, t + 1);
        softmax(att1, t + 2);
        float* out0 = s.xb.data() + size_t(t) * dim + h * hs;
        weighted_values2(out0, out0 + dim, att0, att1, s.v.data() + size_t(kvh) * hs, size_t(kvd), hs, t + 1);
    }
}

// An attend set's blocks for one layer: strictly ascending, each inside the prompt.
void check_attend_blocks(const std::vector<uint32_t>& blocks, int l, uint32_t prompt_blocks) {
    for (size_t i = 0; i < blocks.size(); ++i) {
        if (blocks[i] >= prompt_blocks)
            fail("decode_step: AttendSet layer " + std::to_string(l) + " names block " + std::to_string(blocks[i]) +
                 ", the prompt has " + std::to_string(prompt_blocks));
        if (i && blocks[i] <= blocks[i - 1])
            fail("decode_step: AttendSet layer " + std::to_string(l) + " is not strictly ascending");
    }
}

// An arriving answer for one layer: strictly ascending and inside the layer's set (every prompt block
// when the set is nullptr).
void check_arriving_blocks(const std::vector<uint32_t>& arriving, const std::vector<uint32_t>* set, int l,
                           uint32_t prompt_blocks) {
    size_t k = 0;  // walks the set alongside: both ascending
    for (size_t i = 0; i < arriving.size(); ++i) {
        const uint32_t b = arriving[i];
        if (i && b <= arriving[i - 1])
            fail("decode_step: arriving blocks of layer " + std::to_string(l) + " are not strictly ascending");
        bool in_set = b < prompt_blocks;
        if (in_set && set) {
            while (k < set->size() && (*set)[k] < b) ++k;
            in_set = k < set->size() && (*set)[k] == b;
        }
        if (!in_set)
            fail("decode_step: arriving block " + std::to_string(b) + " of layer " + std::to_string(l) +
                 " is not in the layer's attend set");
    }
}

// The attention part of one query head over positions[0..n) (scores in att, values gathered in vc):
// max of the scores, sum of exp(score - max), acc = that weighted sum of the values, in position
// order. n = 0 gives the empty part {-inf, 0, zeros}.
void attention_part(const float* att, const int* positions, int n, const float* vc, size_t kvd, size_t koff, size_t hs,
                    float* max, float* sum, float* acc) {
    float m = -INFINITY;
    for (int j = 0; j < n; ++j) m = std::max(m, att[j]);
    float total = 0.0f;
    std::fill(acc, acc + hs, 0.0f);
    for (int j = 0; j < n; ++j) {
        const float e = std::exp(att[j] - m);
        total += e;
        const float* vv = vc + size_t(positions[j]) * kvd + koff;
        for (size_t i = 0; i < hs; ++i) acc[i] += e * vv[i];
    }
    *max = m;
    *sum = total;
}

// Parallel on-demand attention of one decode layer (AttendSet::arriving), into s.xb: per query head
// the part over the resident positions (the set's other blocks, the generated tokens, the current
// position), then wait_arriving(l), then the part over the arriving blocks' positions, and the
// runtime's exact log-sum-exp merge of the two. Nothing of an arriving block is read before
// wait_arriving returns: until then the pool may hold anything there.
template <class Gather>
void attend_in_two_parts(const Model& model, const AttendSet& attend, int l, int pos, int B,
                         const std::vector<uint32_t>* layer_blocks, const std::vector<uint32_t>& arriving,
                         RunState::Buffers& s, const Gather& gather, AttentionProbe* probe) {
    const AttentionCalls& sg = attention_calls();
    if (!sg.merge || !sg.finish)
        fail(
            "decode_step: arriving blocks need sg_attention_merge and sg_attention_finish (libsmartgen 0.2 or "
            "later), which this process has not loaded");
    const Config& c = model.config();
    const size_t kvd = size_t(c.kv_dim()), hs = size_t(c.head_size());
    const float scale = std::sqrt(float(hs));
    const int n_pos = pos + 1;

    // Per prompt block: 0 not attended, 1 resident, 2 arriving.
    const uint32_t prompt_blocks = blocks_for(attend.prompt_len, B);
    std::fill(s.block_on.begin(), s.block_on.begin() + prompt_blocks, uint8_t(layer_blocks ? 0 : 1));
    if (layer_blocks)
        for (uint32_t b : *layer_blocks) s.block_on[b] = 1;
    for (uint32_t b : arriving) s.block_on[b] = 2;
    int n_res = 0, n_arr = 0;
    for (int u = 0; u < n_pos; ++u) {
        const uint8_t on = u >= attend.prompt_len || u == pos ? uint8_t(1) : s.block_on[size_t(u / B)];
        if (on == 1) s.positions[size_t(n_res++)] = u;
        if (on == 2) s.arriving_positions[size_t(n_arr++)] = u;
    }

    // Scores and part of every query head over positions[0..n), whose K/V are gathered.
    auto parts = [&](const int* positions, int n, float* max, float* sum, float* acc) {
        for (int j = 0; j < n; ++j) {
            gather(false, positions[j]);
            gather(true, positions[j]);
        }
        for (int h = 0; h < c.n_heads; ++h) {
            const float* q = s.q.data() + size_t(h) * hs;
            const size_t koff = size_t(h / c.kv_mul()) * hs;
            float* att = s.att.data();
            for (int j = 0; j < n; ++j)
                att[j] = score(q, s.kc.data() + size_t(positions[j]) * kvd + koff, int(hs), scale);
            attention_part(att, positions, n, s.vc.data(), kvd, koff, hs, max + h, sum + h, acc + size_t(h) * hs);
        }
    };
    parts(s.positions.data(), n_res, s.max_a.data(), s.sum_a.data(), s.acc_a.data());
    attend.wait_arriving(l);
    parts(s.arriving_positions.data(), n_arr, s.max_b.data(), s.sum_b.data(), s.acc_b.data());

    if (probe) {  // every key is in place only now
        for (int u = 0; u < n_pos; ++u) gather(false, u);
        for (int h = 0; h < c.n_heads; ++h) {
            float* full = probe->probs.data() + (size_t(l) * c.n_heads + h) * n_pos;
            const size_t koff = size_t(h / c.kv_mul()) * hs;
            for (int u = 0; u < n_pos; ++u)
                full[u] = score(s.q.data() + size_t(h) * hs, s.kc.data() + size_t(u) * kvd + koff, int(hs), scale);
            softmax(full, n_pos);
        }
    }

    const uint32_t rows = uint32_t(c.n_heads), dim = uint32_t(hs);
    if (sg.merge(rows, dim, s.max_a.data(), s.sum_a.data(), s.acc_a.data(), s.max_b.data(), s.sum_b.data(),
                 s.acc_b.data()) != SG_OK ||
        sg.finish(rows, dim, s.sum_a.data(), s.acc_a.data(), s.xb.data()) != SG_OK)
        fail("decode_step: merging the attention parts of layer " + std::to_string(l) + ": " +
             (sg.last_error ? sg.last_error() : "(no message)"));
}

}  // namespace

// ---- inference ------------------------------------------------------------------------------------

std::span<const float> prefill(const Model& model, const KvPool& pool, BlockTable table, std::span<const int> tokens,
                               RunState& state, const PrefillOptions& options) {
    const Config& c = model.config();
    const Weights& w = model.weights();
    check_state(model, state);
    pool.check(c);
    const int n = int(tokens.size());
    if (n < 1 || tokens.size() > size_t(c.seq_len))
        fail("prefill: " + std::to_string(tokens.size()) + " tokens, the model takes 1.." + std::to_string(c.seq_len));
    for (int t = 0; t < n; ++t)
        if (tokens[t] < 0 || tokens[t] >= c.vocab_size)
            fail("prefill: token " + std::to_string(tokens[t]) + " at position " + std::to_string(t) +
                 " is outside the vocabulary of " + std::to_string(c.vocab_size));
    check_table(pool, table, n, "prefill");
    if (options.window < 0) fail("prefill: window must be >= 0");
    if (options.window > 0 && !options.capture) fail("prefill: a window needs a PrefillCapture");

    RunState::Buffers& s = state.buffers();
    const size_t dim = size_t(c.dim), kvd = size_t(c.kv_dim());
    const int hs = c.head_size(), B = pool.tokens_per_block;
    PrefillCapture* cap = options.window > 0 ? options.capture : nullptr;
    const int W = cap ? std::min(options.window, n) : 0;
    if (cap) {
        cap->n_tokens = n;
        cap->window = W;
        cap->n_layers = c.n_layers;
        cap->n_heads = c.n_heads;
        cap->head_size = hs;
        cap->queries.assign(size_t(c.n_layers) * c.n_heads * W * hs, 0.0f);
        cap->window_attention.assign(size_t(c.n_layers) * c.n_heads * n, 0.0f);
    }

    for (int t = 0; t < n; ++t)
        std::memcpy(s.x.data() + t * dim, w.token_embedding + size_t(tokens[t]) * dim, dim * sizeof(float));

    for (int l = 0; l < c.n_layers; ++l) {
        for (int t = 0; t < n; ++t) rmsnorm(s.xb.data() + t * dim, s.x.data() + t * dim, w.rms_att + l * dim, c.dim);
        matmul(s.q.data(), s.xb.data(), w.wq + l * dim * dim, n, c.dim, c.dim, s.xt.data());
        matmul(s.k.data(), s.xb.data(), w.wk + l * kvd * dim, n, c.dim, int(kvd), s.xt.data());
        matmul(s.v.data(), s.xb.data(), w.wv + l * kvd * dim, n, c.dim, int(kvd), s.xt.data());
        for (int t = 0; t < n; ++t) rope(model, t, s.q.data() + t * dim, s.k.data() + t * kvd);

        // K/V into the pool, token-major inside each block; keep the values the pool now holds.
        for (int t = 0; t < n; ++t) {
            const uint32_t blk = table[size_t(t / B)];
            store(pool.row(l, false, blk, t % B, 0), s.k.data() + t * kvd, int(kvd), pool.dtype);
            store(pool.row(l, true, blk, t % B, 0), s.v.data() + t * kvd, int(kvd), pool.dtype);
        }
        round_trip(s.k.data(), size_t(n) * kvd, pool.dtype);
        round_trip(s.v.data(), size_t(n) * kvd, pool.dtype);
        for (int t = 0; t < n; ++t)
            for (size_t e = 0; e < kvd; ++e) s.kt[e * s.kt_stride + size_t(t)] = s.k[size_t(t) * kvd + e];

        // The window rows first, so their scores are ready when the hook runs.
        if (cap) {
            for (int r = 0; r < W; ++r) {
                const int t = n - W + r;
                for (int h = 0; h < c.n_heads; ++h) {
                    const float* q = s.q.data() + t * dim + h * hs;
                    std::copy(q, q + hs, cap->queries.data() + ((size_t(l) * c.n_heads + h) * W + r) * hs);
                }
                attend_prompt_row(model, t, s, cap->window_attention.data() + size_t(l) * c.n_heads * n, n);
            }
        }
        if (options.on_layer_written) options.on_layer_written(l);
        int t = 0;
        for (; t + 2 <= n - W; t += 2) attend_prompt_rows2(model, t, s);
        if (t < n - W) attend_prompt_row(model, t, s, nullptr, n);

        matmul(s.xb2.data(), s.xb.data(), w.wo + l * dim * dim, n, c.dim, c.dim, s.xt.data());
        for (size_t i = 0; i < size_t(n) * dim; ++i) s.x[i] += s.xb2[i];
        ffn(model, l, n, s);
    }
    return classify(model, s.x.data() + size_t(n - 1) * dim, s);
}

std::span<const float> decode_step(const Model& model, const KvPool& pool, BlockTable table, int pos, int token,
                                   RunState& state, const AttendSet* attend, AttentionProbe* probe) {
    const Config& c = model.config();
    const Weights& w = model.weights();
    check_state(model, state);
    pool.check(c);
    if (pos < 0 || pos >= c.seq_len)
        fail("decode_step: position " + std::to_string(pos) + " is outside 0.." + std::to_string(c.seq_len - 1));
    if (token < 0 || token >= c.vocab_size)
        fail("decode_step: token " + std::to_string(token) + " is outside the vocabulary of " +
             std::to_string(c.vocab_size));
    check_table(pool, table, pos + 1, "decode_step");
    const int B = pool.tokens_per_block;
    if (attend) {
        if (attend->prompt_len < 0 || attend->prompt_len > c.seq_len)
            fail("decode_step: AttendSet prompt_len " + std::to_string(attend->prompt_len) + " is outside 0.." +
                 std::to_string(c.seq_len));
        if (!attend->select) {
            if (attend->layer_blocks.size() != size_t(c.n_layers))
                fail("decode_step: AttendSet has " + std::to_string(attend->layer_blocks.size()) +
                     " layers, the model " + std::to_string(c.n_layers));
            for (int l = 0; l < c.n_layers; ++l)
                check_attend_blocks(attend->layer_blocks[size_t(l)], l, blocks_for(attend->prompt_len, B));
        }
    }

    RunState::Buffers& s = state.buffers();
    const size_t dim = size_t(c.dim), kvd = size_t(c.kv_dim()), hs = size_t(c.head_size());
    const float scale = std::sqrt(float(hs));
    const int n_pos = pos + 1;
    if (probe) {
        probe->n_layers = c.n_layers;
        probe->n_heads = c.n_heads;
        probe->n_pos = n_pos;
        probe->probs.resize(size_t(c.n_layers) * c.n_heads * n_pos);
    }
    std::memcpy(s.x.data(), w.token_embedding + size_t(token) * dim, dim * sizeof(float));

    for (int l = 0; l < c.n_layers; ++l) {
        rmsnorm(s.xb.data(), s.x.data(), w.rms_att + l * dim, c.dim);
        matmul(s.q.data(), s.xb.data(), w.wq + l * dim * dim, 1, c.dim, c.dim, s.xt.data());
        matmul(s.k.data(), s.xb.data(), w.wk + l * kvd * dim, 1, c.dim, int(kvd), s.xt.data());
        matmul(s.v.data(), s.xb.data(), w.wv + l * kvd * dim, 1, c.dim, int(kvd), s.xt.data());
        rope(model, pos, s.q.data(), s.k.data());
        const uint32_t blk = table[size_t(pos / B)];
        store(pool.row(l, false, blk, pos % B, 0), s.k.data(), int(kvd), pool.dtype);
        store(pool.row(l, true, blk, pos % B, 0), s.v.data(), int(kvd), pool.dtype);

        // The prompt blocks this layer attends to: nullptr = all of them.
        const std::vector<uint32_t>* layer_blocks = nullptr;
        if (attend && attend->select) {
            layer_blocks = attend->select(l, s.q.data());
            if (layer_blocks) check_attend_blocks(*layer_blocks, l, blocks_for(attend->prompt_len, B));
        } else if (attend) {
            layer_blocks = &attend->layer_blocks[size_t(l)];
        }
        // The blocks of that set still in flight: nullptr = none.
        const std::vector<uint32_t>* arriving = attend && attend->arriving ? attend->arriving(l) : nullptr;
        if (arriving && arriving->empty()) arriving = nullptr;
        if (arriving) {
            check_arriving_blocks(*arriving, layer_blocks, l, blocks_for(attend->prompt_len, B));
            if (!attend->wait_arriving)
                fail("decode_step: layer " + std::to_string(l) +
                     " has arriving blocks and the AttendSet no wait_arriving");
        }
        // Gather K (all positions when probing) and V (attended positions) into position-indexed rows.
        auto gather = [&](bool is_v, int u) {
            float* dst = (is_v ? s.vc : s.kc).data() + size_t(u) * kvd;
            load(dst, pool.row(l, is_v, table[size_t(u / B)], u % B, 0), int(kvd), pool.dtype);
        };
        if (arriving) {
            attend_in_two_parts(model, *attend, l, pos, B, layer_blocks, *arriving, s, gather, probe);
        } else {
            // The positions this step attends to, ascending.
            int n_att = 0;
            if (!layer_blocks) {
                for (int u = 0; u < n_pos; ++u) s.positions[size_t(u)] = u;
                n_att = n_pos;
            } else {
                const uint32_t prompt_blocks = blocks_for(attend->prompt_len, B);
                std::fill(s.block_on.begin(), s.block_on.begin() + prompt_blocks, uint8_t{0});
                for (uint32_t b : *layer_blocks) s.block_on[b] = 1;
                for (int u = 0; u < n_pos; ++u)
                    if (u >= attend->prompt_len || u == pos || s.block_on[size_t(u / B)])
                        s.positions[size_t(n_att++)] = u;
            }
            if (probe)
                for (int u = 0; u < n_pos; ++u) gather(false, u);
            for (int j = 0; j < n_att; ++j) {
                if (!probe) gather(false, s.positions[size_t(j)]);
                gather(true, s.positions[size_t(j)]);
            }

            for (int h = 0; h < c.n_heads; ++h) {
                const float* q = s.q.data() + h * hs;
                const size_t koff = size_t(h / c.kv_mul()) * hs;
                float* att = s.att.data();
                if (probe) {
                    float* full = probe->probs.data() + (size_t(l) * c.n_heads + h) * n_pos;
                    for (int u = 0; u < n_pos; ++u)
                        full[u] = score(q, s.kc.data() + size_t(u) * kvd + koff, int(hs), scale);
                    for (int j = 0; j < n_att; ++j) att[j] = full[s.positions[size_t(j)]];
                    softmax(full, n_pos);
                } else {
                    for (int j = 0; j < n_att; ++j)
                        att[j] = score(q, s.kc.data() + size_t(s.positions[size_t(j)]) * kvd + koff, int(hs), scale);
                }
                softmax(att, n_att);
                float* out = s.xb.data() + h * hs;
                std::fill(out, out + hs, 0.0f);
                for (int j = 0; j < n_att; ++j) {
                    const float a = att[j];
                    const float* vv = s.vc.data() + size_t(s.positions[size_t(j)]) * kvd + koff;
                    for (size_t i = 0; i < hs; ++i) out[i] += a * vv[i];
                }
            }
        }
        matmul(s.xb2.data(), s.xb.data(), w.wo + l * dim * dim, 1, c.dim, c.dim, s.xt.data());
        for (size_t i = 0; i < dim; ++i) s.x[i] += s.xb2[i];
        ffn(model, l, 1, s);
    }
    return classify(model, s.x.data(), s);
}

int argmax(std::span<const float> logits) {
    if (logits.empty()) fail("argmax of no logits");
    int best = 0;
    for (size_t i = 1; i < logits.size(); ++i)
        if (logits[i] > logits[size_t(best)]) best = int(i);
    return best;
}

std::vector<int> colocated(const Model& model, const KvPool& pool, BlockTable table, std::span<const int> prompt,
                           int n_new, RunState& state) {
    const Config& c = model.config();
    if (n_new < 1) fail("colocated: n_new must be >= 1");
    if (prompt.size() + size_t(n_new) - 1 > size_t(c.seq_len))
        fail("colocated: " + std::to_string(prompt.size()) + " prompt tokens + " + std::to_string(n_new) +
             " new ones exceed seq_len " + std::to_string(c.seq_len));
    std::vector<int> out;
    out.reserve(size_t(n_new));
    out.push_back(argmax(prefill(model, pool, table, prompt, state)));
    for (int i = 1; i < n_new; ++i)
        out.push_back(argmax(decode_step(model, pool, table, int(prompt.size()) + i - 1, out.back(), state)));
    return out;
}

std::vector<int> colocated(const Model& model, std::span<const int> prompt, int n_new,
                           const ColocatedOptions& options) {
    const int total = int(prompt.size()) + std::max(n_new, 1) - 1;
    const uint32_t blocks = std::max<uint32_t>(1, blocks_for(total, options.tokens_per_block));
    KvPoolStorage storage(model.config(), options.tokens_per_block, blocks, options.dtype);
    const std::vector<uint32_t> table = identity_table(blocks);
    RunState state(model.config());
    return colocated(model, storage.view(), table, prompt, n_new, state);
}

}  // namespace sg::disagg
