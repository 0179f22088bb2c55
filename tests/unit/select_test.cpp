// Unit tests for kernels/ and runtime/select. Each kernel is checked against a direct evaluation of
// its formula in double precision on random data, through every dtype and several key layouts
// (token-major, head-major with spare rows, odd strides); storage outside a view holds a large
// sentinel, so a kernel that reads past its view fails loudly. Then top-k ties, budgets (rounding,
// sinks and recent inside the budget, dense heads, the three forms, a total budget), the union across
// heads, profile JSON (round trip and invalid files named by path), and a planted needle that Quest
// must always find at budget 1/16.
#include "cpu/variants.hpp"
#include "kernels.hpp"
#include "select/select.hpp"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <numeric>
#include <random>
#include <set>
#include <string>
#include <tuple>
#include <vector>

namespace sg::select {
namespace {

using kernels::Combine;
using kernels::DType;
using kernels::View;

// ---- reference element decoding, written from the formats' definitions (not from kernels.hpp) ----

double ref_fp16(uint16_t h) {
    const double sign = h & 0x8000 ? -1.0 : 1.0;
    const int e = (h >> 10) & 31, m = h & 1023;
    if (e == 0) return sign * std::ldexp(m, -24);
    if (e == 31) return m ? std::numeric_limits<double>::quiet_NaN() : sign * std::numeric_limits<double>::infinity();
    return sign * std::ldexp(1024 + m, e - 25);
}

double ref_bf16(uint16_t b) {
    const double sign = b & 0x8000 ? -1.0 : 1.0;
    const int e = (b >> 7) & 255, m = b & 127;
    if (e == 0) return sign * std::ldexp(m, -133);
    if (e == 255) return m ? std::numeric_limits<double>::quiet_NaN() : sign * std::numeric_limits<double>::infinity();
    return sign * std::ldexp(128 + m, e - 134);
}

const char *dtype_name(DType d) { return d == DType::fp32 ? "fp32" : d == DType::fp16 ? "fp16" : "bf16"; }

enum class Shape { token_major, head_major, strided };
const char *shape_name(Shape s) {
    return s == Shape::token_major ? "token-major" : s == Shape::head_major ? "head-major" : "strided";
}

constexpr float kSentinel = 30000.f;  // representable in every dtype, and far above any real value

// A [token][head][dim] tensor stored in some dtype and shape; at() reads an element independently.
struct Tensor {
    DType dtype;
    std::vector<uint8_t> storage;
    View view;

    void put(uint64_t index, float v) {
        uint8_t *p = storage.data() + index * kernels::dtype_bytes(dtype);
        if (dtype == DType::fp32) {
            std::memcpy(p, &v, 4);
        } else {
            const uint16_t h = dtype == DType::fp16 ? kernels::float_to_fp16(v) : kernels::float_to_bf16(v);
            std::memcpy(p, &h, 2);
        }
    }
    uint64_t index(uint64_t t, uint32_t h, uint32_t i) const {
        return t * view.token_stride + h * view.head_stride + i;
    }
    double at(uint64_t t, uint32_t h, uint32_t i) const {
        const uint8_t *p = storage.data() + index(t, h, i) * kernels::dtype_bytes(dtype);
        if (dtype == DType::fp32) {
            float f;
            std::memcpy(&f, p, 4);
            return f;
        }
        uint16_t x;
        std::memcpy(&x, p, 2);
        return dtype == DType::fp16 ? ref_fp16(x) : ref_bf16(x);
    }
};

template <class Gen>
Tensor make_tensor(DType dtype, Shape shape, uint64_t tokens, uint32_t heads, uint32_t dim, Gen &&gen) {
    Tensor x;
    x.dtype = dtype;
    uint64_t elements = 0;
    switch (shape) {
        case Shape::token_major:
            x.view = kernels::token_major(nullptr, dtype, tokens, heads, dim);
            elements = tokens * heads * dim;
            break;
        case Shape::head_major: {
            const uint64_t rows = tokens + 5;  // spare rows per head, as in a partly filled block
            x.view = kernels::head_major(nullptr, dtype, tokens, heads, dim, rows);
            elements = rows * heads * dim;
            break;
        }
        case Shape::strided:
            x.view = {nullptr, dtype, tokens, heads, dim, uint64_t(heads) * (dim + 3) + 7, dim + 3};
            elements = tokens * x.view.token_stride;
            break;
    }
    x.storage.resize(std::max<uint64_t>(elements, 1) * kernels::dtype_bytes(dtype));
    for (uint64_t e = 0; e < elements; ++e) x.put(e, kSentinel);
    for (uint64_t t = 0; t < tokens; ++t)
        for (uint32_t h = 0; h < heads; ++h)
            for (uint32_t i = 0; i < dim; ++i) x.put(x.index(t, h, i), gen(t, h, i));
    x.view.data = x.storage.data();
    return x;
}

template <class Rng>
Tensor random_tensor(Rng &rng, DType dtype, Shape shape, uint64_t tokens, uint32_t heads, uint32_t dim) {
    std::normal_distribution<float> normal;
    return make_tensor(dtype, shape, tokens, heads, dim, [&](uint64_t, uint32_t, uint32_t) { return normal(rng); });
}

double combine(Combine c, bool first, double acc, double v) {
    return first ? v : c == Combine::max ? std::max(acc, v) : acc + v;
}

// ---- reference kernels ----

// [block][head][2][dim] in double.
std::vector<double> ref_digest(const Tensor &k, uint32_t tpb) {
    const View &v = k.view;
    const uint64_t nb = kernels::num_blocks(v.tokens, tpb);
    std::vector<double> out(nb * v.heads * 2 * v.dim);
    for (uint64_t b = 0; b < nb; ++b)
        for (uint32_t h = 0; h < v.heads; ++h)
            for (uint32_t i = 0; i < v.dim; ++i) {
                double lo = INFINITY, hi = -INFINITY;
                for (uint64_t t = b * tpb; t < std::min<uint64_t>(v.tokens, (b + 1) * tpb); ++t) {
                    lo = std::min(lo, k.at(t, h, i));
                    hi = std::max(hi, k.at(t, h, i));
                }
                out[((b * v.heads + h) * 2 + 0) * v.dim + i] = lo;
                out[((b * v.heads + h) * 2 + 1) * v.dim + i] = hi;
            }
    return out;
}

// Scores and a matching tolerance (from the magnitude of the terms summed), [block][kv_head].
struct Expected {
    std::vector<double> value, tol;
};

Expected ref_quest(const std::vector<double> &digest, uint64_t nb, uint32_t kvh, const Tensor &q, Combine c) {
    const uint32_t dim = q.view.dim, group = q.view.heads / kvh;
    Expected e{std::vector<double>(nb * kvh), std::vector<double>(nb * kvh)};
    for (uint64_t b = 0; b < nb; ++b)
        for (uint32_t g = 0; g < kvh; ++g) {
            double acc = 0, mag = 0;
            for (uint32_t j = 0; j < group; ++j) {
                double s = 0;
                for (uint32_t i = 0; i < dim; ++i) {
                    const double qi = q.at(0, g * group + j, i);
                    const double lo = digest[((b * kvh + g) * 2) * dim + i],
                                 hi = digest[((b * kvh + g) * 2 + 1) * dim + i];
                    s += std::max(qi * lo, qi * hi);
                    mag += std::fabs(qi) * std::max(std::fabs(lo), std::fabs(hi));
                }
                acc = combine(c, j == 0, acc, s);
            }
            e.value[b * kvh + g] = acc;
            e.tol[b * kvh + g] = 1e-5 * mag + 1e-6;
        }
    return e;
}

// [kv_head][token]: Σ_w softmax over visible keys, per query head, combined over the group.
std::vector<double> ref_window(const Tensor &k, const Tensor &q, uint64_t first_pos, Combine c) {
    const uint64_t n = k.view.tokens, window = q.view.tokens;
    const uint32_t kvh = k.view.heads, dim = k.view.dim, group = q.view.heads / kvh;
    std::vector<double> out(kvh * n, 0.0), head(n), logits(n);
    for (uint32_t g = 0; g < kvh; ++g)
        for (uint32_t j = 0; j < group; ++j) {
            const uint32_t h = g * group + j;
            std::fill(head.begin(), head.end(), 0.0);
            for (uint64_t w = 0; w < window; ++w) {
                const uint64_t visible = std::min(n, first_pos + w + 1);
                double m = -INFINITY;
                for (uint64_t t = 0; t < visible; ++t) {
                    double s = 0;
                    for (uint32_t i = 0; i < dim; ++i) s += q.at(w, h, i) * k.at(t, g, i);
                    logits[t] = s / std::sqrt(double(dim));
                    m = std::max(m, logits[t]);
                }
                double z = 0;
                for (uint64_t t = 0; t < visible; ++t) z += std::exp(logits[t] - m);
                for (uint64_t t = 0; t < visible; ++t) head[t] += std::exp(logits[t] - m) / z;
            }
            for (uint64_t t = 0; t < n; ++t) out[g * n + t] = combine(c, j == 0, out[g * n + t], head[t]);
        }
    return out;
}

// [block][head] from [head][token] scores, max-pooled over `pool` tokens first.
std::vector<double> ref_blocks(const std::vector<double> &tok, uint32_t heads, uint64_t n, uint32_t tpb,
                               uint32_t pool) {
    const uint64_t nb = kernels::num_blocks(n, tpb);
    const int64_t r = pool / 2;
    std::vector<double> out(nb * heads, 0.0);
    for (uint32_t h = 0; h < heads; ++h)
        for (uint64_t t = 0; t < n; ++t) {
            double m = -INFINITY;
            for (int64_t u = int64_t(t) - r; u <= int64_t(t) + r; ++u)
                if (u >= 0 && u < int64_t(n)) m = std::max(m, tok[h * n + uint64_t(u)]);
            out[(t / tpb) * heads + h] += m;
        }
    return out;
}

// ---- element conversions ----

TEST(Convert, Fp16ToFloatMatchesDefinitionForAllValues) {
    for (uint32_t h = 0; h < 65536; ++h) {
        const double want = ref_fp16(uint16_t(h));
        const float got = kernels::fp16_to_float(uint16_t(h));
        if (std::isnan(want)) {
            ASSERT_TRUE(std::isnan(got)) << std::hex << h;
        } else {
            ASSERT_EQ(double(got), want) << std::hex << h;
        }
    }
}

TEST(Convert, Bf16ToFloatMatchesDefinitionForAllValues) {
    for (uint32_t b = 0; b < 65536; ++b) {
        const double want = ref_bf16(uint16_t(b));
        const float got = kernels::bf16_to_float(uint16_t(b));
        if (std::isnan(want)) {
            ASSERT_TRUE(std::isnan(got)) << std::hex << b;
        } else {
            ASSERT_EQ(double(got), want) << std::hex << b;
        }
    }
}

// float -> half/bf16 picks the nearest representable value, ties to even: checked against the
// neighbours of the result, for floats spread over every exponent the formats have.
template <class Encode, class Decode>
void check_rounding(Encode encode, Decode decode, double max_finite) {
    std::mt19937_64 rng(7);
    std::uniform_real_distribution<double> mant(1.0, 2.0);
    std::uniform_int_distribution<int> exp(-30, 17);
    for (int i = 0; i < 200000; ++i) {
        const float f = float((rng() & 1 ? -1 : 1) * std::ldexp(mant(rng), exp(rng)));
        const uint16_t h = encode(f);
        const double got = decode(h);
        if (std::fabs(double(f)) > max_finite) continue;  // overflow is checked separately
        ASSERT_TRUE(std::isfinite(got)) << f;
        for (int d : {-1, 1}) {
            const uint16_t nb = uint16_t(h + d);
            if ((nb & 0x8000) != (h & 0x8000)) continue;
            const double other = decode(nb);
            if (!std::isfinite(other)) continue;
            const double e0 = std::fabs(double(f) - got), e1 = std::fabs(double(f) - other);
            ASSERT_LE(e0, e1) << "f=" << f << " h=" << h;
            if (e0 == e1) {
                ASSERT_EQ(h & 1, 0) << "tie not to even: f=" << f;
            }
        }
    }
}

TEST(Convert, FloatToHalfAndBf16RoundToNearestEven) {
    check_rounding(kernels::float_to_fp16, ref_fp16, 65504.0);
    check_rounding(kernels::float_to_bf16, ref_bf16, 3.0e38);
    EXPECT_EQ(kernels::float_to_fp16(65520.f), 0x7c00);
    EXPECT_EQ(kernels::float_to_fp16(-1e10f), 0xfc00);
    EXPECT_EQ(kernels::float_to_fp16(65519.f), 0x7bff);
    EXPECT_TRUE(std::isnan(kernels::fp16_to_float(kernels::float_to_fp16(NAN))));
    EXPECT_TRUE(std::isnan(kernels::bf16_to_float(kernels::float_to_bf16(NAN))));
    for (uint32_t h = 0; h < 65536; ++h) {
        if (!std::isnan(ref_fp16(uint16_t(h)))) {
            ASSERT_EQ(kernels::float_to_fp16(kernels::fp16_to_float(uint16_t(h))), h) << std::hex << h;
        }
    }
}

// ---- digest and Quest ----

struct KernelCase {
    DType dtype;
    Shape shape;
};

void PrintTo(const KernelCase &c, std::ostream *os) { *os << dtype_name(c.dtype) << " " << shape_name(c.shape); }

std::string case_name(const testing::TestParamInfo<KernelCase> &info) {
    return std::string(dtype_name(info.param.dtype)) + "_" +
           (info.param.shape == Shape::token_major  ? "token_major"
            : info.param.shape == Shape::head_major ? "head_major"
                                                    : "strided");
}

class Kernels : public testing::TestWithParam<KernelCase> {};

TEST_P(Kernels, PageDigestIsElementwiseMinMax) {
    std::mt19937_64 rng(11 + int(GetParam().dtype) * 3 + int(GetParam().shape));
    for (const uint64_t tokens : {1ull, 15ull, 16ull, 17ull, 200ull})
        for (const uint32_t dim : {1u, 16u, 37u, 128u}) {
            SCOPED_TRACE("tokens " + std::to_string(tokens) + " dim " + std::to_string(dim));
            const uint32_t tpb = 16, heads = 3;
            const Tensor k = random_tensor(rng, GetParam().dtype, GetParam().shape, tokens, heads, dim);
            const uint64_t nb = kernels::num_blocks(tokens, tpb);
            std::vector<float> got(kernels::digest_floats(nb, heads, dim));
            kernels::page_digest(k.view, tpb, got.data());
            const std::vector<double> want = ref_digest(k, tpb);
            for (size_t i = 0; i < want.size(); ++i) ASSERT_EQ(double(got[i]), want[i]) << "element " << i;
        }
}

TEST_P(Kernels, QuestScoreIsUpperBoundFormula) {
    std::mt19937_64 rng(21 + int(GetParam().dtype) * 3 + int(GetParam().shape));
    for (const Combine c : {Combine::max, Combine::sum})
        for (const uint32_t group : {1u, 4u})
            for (const uint32_t dim : {8u, 37u, 128u}) {
                SCOPED_TRACE(std::string(c == Combine::max ? "max" : "sum") + " group " + std::to_string(group) +
                             " dim " + std::to_string(dim));
                const uint32_t tpb = 16, kvh = 2;
                const uint64_t tokens = 16 * 9 + 5;  // partial last block
                const Tensor k = random_tensor(rng, GetParam().dtype, GetParam().shape, tokens, kvh, dim);
                const Tensor q = random_tensor(rng, GetParam().dtype, GetParam().shape, 1, kvh * group, dim);
                const uint64_t nb = kernels::num_blocks(tokens, tpb);
                std::vector<float> digest(kernels::digest_floats(nb, kvh, dim)), got(nb * kvh);
                kernels::page_digest(k.view, tpb, digest.data());
                kernels::quest_scores(digest.data(), nb, kvh, q.view, c, got.data());
                const Expected want = ref_quest(ref_digest(k, tpb), nb, kvh, q, c);
                for (size_t i = 0; i < got.size(); ++i)
                    ASSERT_NEAR(got[i], want.value[i], want.tol[i]) << "score " << i;
            }
}

// ---- window attention (SnapKV) ----

TEST_P(Kernels, WindowAttentionIsSummedCausalSoftmax) {
    std::mt19937_64 rng(31 + int(GetParam().dtype) * 3 + int(GetParam().shape));
    struct Case {
        uint64_t tokens, window, first;
        uint32_t group, dim;
    };
    const Case cases[] = {
        {100, 8, 92, 1, 16},   // the usual: the last W prompt queries
        {77, 5, 72, 4, 37},    // GQA, odd sizes
        {130, 16, 40, 2, 64},  // queries mid-prompt: later keys are invisible to all of them
        {1, 1, 0, 2, 8},       // one token
        {70, 80, 0, 1, 8},     // a window longer than the prompt
    };
    for (const Combine c : {Combine::max, Combine::sum})
        for (const Case &cs : cases) {
            SCOPED_TRACE("tokens " + std::to_string(cs.tokens) + " window " + std::to_string(cs.window) + " group " +
                         std::to_string(cs.group) + (c == Combine::max ? " max" : " sum"));
            const uint32_t kvh = 2;
            const Tensor k = random_tensor(rng, GetParam().dtype, GetParam().shape, cs.tokens, kvh, cs.dim);
            const Tensor q = random_tensor(rng, GetParam().dtype, GetParam().shape, cs.window, kvh * cs.group, cs.dim);
            std::vector<float> scratch(kernels::window_scratch_floats(k.view, q.view)), got(kvh * cs.tokens);
            kernels::window_attention(k.view, q.view, cs.first, c, scratch, got.data());
            const std::vector<double> want = ref_window(k, q, cs.first, c);
            const double tol = 2e-6 * double(cs.window) * cs.group;
            for (size_t i = 0; i < got.size(); ++i) ASSERT_NEAR(got[i], want[i], tol) << "token score " << i;

            for (const uint32_t pool : {1u, 3u, 7u}) {
                const uint32_t tpb = 16;
                const uint64_t nb = kernels::num_blocks(cs.tokens, tpb);
                std::vector<float> blocks(nb * kvh), snap(nb * kvh);
                std::vector<float> snap_scratch(kernels::snapkv_scratch_floats(k.view, q.view));
                kernels::snapkv_scores(k.view, q.view, cs.first, c, tpb, pool, snap_scratch, snap.data());
                const std::vector<double> want_blocks = ref_blocks(want, kvh, cs.tokens, tpb, pool);
                for (size_t i = 0; i < snap.size(); ++i)
                    ASSERT_NEAR(snap[i], want_blocks[i], tol * tpb) << "pool " << pool << " block score " << i;
            }
        }
}

INSTANTIATE_TEST_SUITE_P(
    AllDtypesAndLayouts, Kernels,
    testing::Values(KernelCase{DType::fp32, Shape::token_major}, KernelCase{DType::fp32, Shape::head_major},
                    KernelCase{DType::fp32, Shape::strided}, KernelCase{DType::fp16, Shape::token_major},
                    KernelCase{DType::fp16, Shape::head_major}, KernelCase{DType::fp16, Shape::strided},
                    KernelCase{DType::bf16, Shape::token_major}, KernelCase{DType::bf16, Shape::head_major},
                    KernelCase{DType::bf16, Shape::strided}),
    case_name);

// The vector paths split a head's row into column chunks (AVX2: 64 and 16 elements; AVX-512: 128, 32
// and 16), and score all query heads per block when they fit on the stack (else a KV head at a time):
// every split, against the formula.
TEST(Kernels, DigestAndQuestOnEveryVectorPathSplit) {
    std::mt19937_64 rng(97);
    for (const DType dt : {DType::fp16, DType::bf16, DType::fp32})
        for (const Shape shape : {Shape::token_major, Shape::strided})
            for (const auto &[heads, dim] : {std::pair{3u, 48u}, std::pair{2u, 80u}, std::pair{9u, 1024u}}) {
                SCOPED_TRACE(std::string(dtype_name(dt)) + " " + shape_name(shape) + " heads " +
                             std::to_string(heads) + " dim " + std::to_string(dim));
                const uint32_t tpb = 16;
                const uint64_t tokens = 16 * 2 + 7;
                const Tensor k = random_tensor(rng, dt, shape, tokens, heads, dim);
                const uint64_t nb = kernels::num_blocks(tokens, tpb);
                std::vector<float> digest(kernels::digest_floats(nb, heads, dim));
                kernels::page_digest(k.view, tpb, digest.data());
                const std::vector<double> want = ref_digest(k, tpb);
                for (size_t i = 0; i < want.size(); ++i) ASSERT_EQ(double(digest[i]), want[i]) << "element " << i;
                const uint32_t group = 8;  // heads * 8 * 1024 floats do not fit in one pass
                const Tensor q = random_tensor(rng, dt, shape, 1, heads * group, dim);
                for (const Combine c : {Combine::max, Combine::sum}) {
                    std::vector<float> got(nb * heads);
                    kernels::quest_scores(digest.data(), nb, heads, q.view, c, got.data());
                    const Expected e = ref_quest(want, nb, heads, q, c);
                    for (size_t i = 0; i < got.size(); ++i) ASSERT_NEAR(got[i], e.value[i], e.tol[i]) << "score " << i;
                }
            }
}

// ---- the instruction-set variants against the portable path ----

// Values that stress ordering and conversion: ordinary ones over 2^-20 .. 2^10, +-0, subnormals of the
// dtype, its largest finite value (fp16 only when `huge`; bf16 and fp32 ones would overflow the sums)
// and, when `inf`, infinities. Never NaN (the digest of NaN keys is unspecified).
struct Extremes {
    DType dtype;
    bool inf, huge;
    float operator()(std::mt19937_64 &rng) const {
        std::normal_distribution<float> normal;
        const float sign = rng() % 2 ? -1.f : 1.f;
        switch (rng() % 16) {
            case 0:
                return 0.f;
            case 1:
                return -0.f;
            case 2:  // subnormal: fp16's are 2^-24 apart; bf16 shares fp32's range
                return sign * (dtype == DType::fp16 ? std::ldexp(float(1 + rng() % 1023), -24)
                                                    : std::ldexp(float(1 + rng() % 127), -133));
            case 3:
                if (inf) return sign * INFINITY;
                [[fallthrough]];
            case 4:
                if (huge && dtype == DType::fp16) return sign * 65504.f;
                [[fallthrough]];
            default:
                return normal(rng) * std::ldexp(1.f, int(rng() % 31) - 20);
        }
    }
};

std::vector<kernels::cpu::Isa> vector_isas() {
    std::vector<kernels::cpu::Isa> out;
    for (const auto isa : {kernels::cpu::Isa::avx2, kernels::cpu::Isa::avx512})
        if (kernels::cpu::isa_supported(isa)) out.push_back(isa);
    return out;
}

// Every variant this CPU runs computes the portable path's digest bit for bit (sign of zero
// included: min and max are exact, and 16-bit keys are ordered with -0 below +0 on every path), over
// random shapes: head_dim multiples of 16 and 32 and ones that must fall back, partial last blocks,
// all dtypes and layouts, values from Extremes with infinities. Its Quest scores match the portable
// ones within 2e-5 of the magnitude of the terms summed (sum_i |q_i| max(|lo_i|, |hi_i|)): the vector
// paths add in another order and fuse the multiply (q * (q < 0 ? lo : hi), one rounding, not two).
TEST(KernelVariants, MatchThePortablePathOnRandomShapes) {
    const auto isas = vector_isas();
    if (isas.empty()) GTEST_SKIP() << "this CPU has no vector variant (needs AVX2 + F16C + FMA)";
    std::mt19937_64 rng(1212);
    const uint32_t dims[] = {8, 16, 24, 32, 37, 48, 64, 80, 96, 128, 144, 256, 1024};
    for (int iter = 0; iter < 240; ++iter) {
        const DType dt = DType(rng() % 3);
        const Shape shape = Shape(rng() % 3);
        const uint32_t dim = dims[rng() % std::size(dims)];
        const uint32_t kvh = 1 + rng() % (dim >= 512 ? 3 : 9), group = 1 + rng() % 6;
        const uint32_t tpb = std::array<uint32_t, 4>{1, 7, 16, 32}[rng() % 4];
        const uint64_t tokens = 1 + rng() % 70;
        const Combine c = rng() % 2 ? Combine::max : Combine::sum;
        const std::string where = std::string(dtype_name(dt)) + " " + shape_name(shape) + " dim " +
                                  std::to_string(dim) + " kv_heads " + std::to_string(kvh) + " group " +
                                  std::to_string(group) + " tpb " + std::to_string(tpb) + " tokens " +
                                  std::to_string(tokens);
        SCOPED_TRACE(where);
        const Extremes with_inf{dt, true, true}, finite{dt, false, true};
        const Tensor k =
            make_tensor(dt, shape, tokens, kvh, dim, [&](uint64_t, uint32_t, uint32_t) { return with_inf(rng); });
        const Tensor kf =
            make_tensor(dt, shape, tokens, kvh, dim, [&](uint64_t, uint32_t, uint32_t) { return finite(rng); });
        const Tensor q =
            make_tensor(dt, shape, 1, kvh * group, dim, [&](uint64_t, uint32_t, uint32_t) { return finite(rng); });
        const uint64_t nb = kernels::num_blocks(tokens, tpb);
        const size_t n = kernels::digest_floats(nb, kvh, dim);
        std::vector<float> want(n), want_f(n), want_s(nb * kvh);
        kernels::cpu::page_digest_on(kernels::cpu::Isa::portable, k.view, tpb, want.data());
        kernels::cpu::page_digest_on(kernels::cpu::Isa::portable, kf.view, tpb, want_f.data());
        kernels::cpu::quest_scores_on(kernels::cpu::Isa::portable, want_f.data(), nb, kvh, q.view, c, want_s.data());
        for (const auto isa : isas) {
            SCOPED_TRACE(kernels::cpu::isa_name(isa));
            std::vector<float> got(n, NAN), got_s(nb * kvh, NAN);
            kernels::cpu::page_digest_on(isa, k.view, tpb, got.data());
            ASSERT_EQ(std::memcmp(got.data(), want.data(), n * sizeof(float)), 0) << "digest differs";
            kernels::cpu::quest_scores_on(isa, want_f.data(), nb, kvh, q.view, c, got_s.data());
            for (uint64_t b = 0; b < nb; ++b)
                for (uint32_t g = 0; g < kvh; ++g) {
                    double mag = 0, best = 0;
                    for (uint32_t j = 0; j < group; ++j) {
                        double m = 0;
                        for (uint32_t i = 0; i < dim; ++i) {
                            const float *lo = want_f.data() + (b * kvh + g) * 2 * dim;
                            m += std::fabs(q.at(0, g * group + j, i)) *
                                 std::max(std::fabs(double(lo[i])), std::fabs(double(lo[dim + i])));
                        }
                        best = std::max(best, m);
                        mag += m;
                    }
                    const double tol = 2e-5 * (c == Combine::sum ? mag : best) + 1e-30;
                    ASSERT_NEAR(got_s[b * kvh + g], want_s[b * kvh + g], tol)
                        << "score of block " << b << " head " << g;
                }
        }
    }
}

// Infinite keys in the digest: with no zero in the query, each term is +-inf or finite on every path
// (the blend picks the product that the max would), so the scores agree on +inf, -inf and NaN (both
// signs of infinity summed). A zero query element against an infinite bound is 0 * inf: the portable
// max(q lo, q hi) may drop that NaN and the vector paths keep it, so that case is left unspecified.
TEST(KernelVariants, InfiniteBoundsGiveTheSameNonFiniteScores) {
    const auto isas = vector_isas();
    if (isas.empty()) GTEST_SKIP() << "this CPU has no vector variant (needs AVX2 + F16C + FMA)";
    std::mt19937_64 rng(1213);
    for (int iter = 0; iter < 60; ++iter) {
        const DType dt = DType(rng() % 3);
        const uint32_t dim = std::array<uint32_t, 4>{16, 32, 64, 128}[rng() % 4], kvh = 2, group = 4, tpb = 4;
        const uint64_t tokens = 4 * 6;
        SCOPED_TRACE(std::string(dtype_name(dt)) + " dim " + std::to_string(dim));
        std::normal_distribution<float> normal;
        // Sparse infinities, so some blocks stay finite and some columns hold both signs.
        const Tensor k = make_tensor(dt, Shape::token_major, tokens, kvh, dim, [&](uint64_t, uint32_t, uint32_t) {
            return rng() % 200 == 0 ? (rng() % 2 ? INFINITY : -INFINITY) : normal(rng);
        });
        const Tensor q = make_tensor(dt, Shape::token_major, 1, kvh * group, dim, [&](uint64_t, uint32_t, uint32_t) {
            const float x = normal(rng);
            return x == 0.f ? 1.f : x;
        });
        const uint64_t nb = kernels::num_blocks(tokens, tpb);
        std::vector<float> digest(kernels::digest_floats(nb, kvh, dim)), want(nb * kvh);
        kernels::cpu::page_digest_on(kernels::cpu::Isa::portable, k.view, tpb, digest.data());
        for (const Combine c : {Combine::max, Combine::sum}) {
            kernels::cpu::quest_scores_on(kernels::cpu::Isa::portable, digest.data(), nb, kvh, q.view, c, want.data());
            for (const auto isa : isas) {
                std::vector<float> got(nb * kvh);
                kernels::cpu::quest_scores_on(isa, digest.data(), nb, kvh, q.view, c, got.data());
                for (size_t i = 0; i < got.size(); ++i) {
                    if (std::isfinite(want[i])) {
                        ASSERT_TRUE(std::isfinite(got[i])) << kernels::cpu::isa_name(isa) << " score " << i;
                        continue;
                    }
                    if (std::isnan(want[i]))
                        ASSERT_TRUE(std::isnan(got[i])) << kernels::cpu::isa_name(isa) << " score " << i;
                    else
                        ASSERT_EQ(got[i], want[i]) << kernels::cpu::isa_name(isa) << " score " << i;
                }
            }
        }
    }
}

// Digests of 4 MiB and more are written with streaming stores when the output is 64-byte aligned,
// and with ordinary ones when it is not: both bit-identical to the portable path, on both layouts.
TEST(KernelVariants, LargeDigestsStreamedOrNotAreExact) {
    const auto isas = vector_isas();
    if (isas.empty()) GTEST_SKIP() << "this CPU has no vector variant (needs AVX2 + F16C + FMA)";
    std::mt19937_64 rng(1214);
    const uint32_t heads = 8, dim = 128, tpb = 16;
    const uint64_t tokens = 16 * 520 + 3;  // digest of 521 blocks: 4.07 MiB
    for (const DType dt : {DType::fp16, DType::bf16})
        for (const Shape shape : {Shape::token_major, Shape::head_major}) {
            SCOPED_TRACE(std::string(dtype_name(dt)) + " " + shape_name(shape));
            const Extremes gen{dt, true, true};
            const Tensor k =
                make_tensor(dt, shape, tokens, heads, dim, [&](uint64_t, uint32_t, uint32_t) { return gen(rng); });
            const size_t n = kernels::digest_floats(kernels::num_blocks(tokens, tpb), heads, dim);
            ASSERT_GE(n * sizeof(float), 4u << 20);
            std::vector<float> want(n);
            kernels::cpu::page_digest_on(kernels::cpu::Isa::portable, k.view, tpb, want.data());
            std::vector<float> buf(n + 32);
            float *aligned = buf.data() + (64 - reinterpret_cast<uintptr_t>(buf.data()) % 64) % 64 / sizeof(float);
            for (const auto isa : isas)
                for (float *out : {aligned, aligned + 1}) {
                    std::fill(out, out + n, NAN);
                    kernels::cpu::page_digest_on(isa, k.view, tpb, out);
                    ASSERT_EQ(std::memcmp(out, want.data(), n * sizeof(float)), 0)
                        << kernels::cpu::isa_name(isa) << (out == aligned ? " aligned" : " misaligned");
                }
        }
}

// Queries and keys need not share a dtype.
TEST(Kernels, WindowAttentionMixedDtypes) {
    std::mt19937_64 rng(5);
    const Tensor k = random_tensor(rng, DType::bf16, Shape::head_major, 50, 2, 24);
    const Tensor q = random_tensor(rng, DType::fp32, Shape::token_major, 6, 4, 24);
    std::vector<float> scratch(kernels::window_scratch_floats(k.view, q.view)), got(2 * 50);
    kernels::window_attention(k.view, q.view, 44, Combine::sum, scratch, got.data());
    const std::vector<double> want = ref_window(k, q, 44, Combine::sum);
    for (size_t i = 0; i < got.size(); ++i) ASSERT_NEAR(got[i], want[i], 1e-5) << i;
}

TEST(Kernels, BlockScoresPoolingEdges) {
    std::mt19937_64 rng(9);
    std::uniform_real_distribution<float> u(0.f, 1.f);
    for (const uint64_t n : {1ull, 2ull, 5ull, 16ull, 33ull, 100ull, 257ull})
        for (const uint32_t pool : {1u, 3u, 5u, 9u, 31u})
            for (const uint32_t tpb : {1u, 4u, 16u}) {
                const uint32_t heads = 2;
                std::vector<float> tok(heads * n);
                for (auto &x : tok) x = u(rng);
                const std::vector<double> tok_d(tok.begin(), tok.end());
                std::vector<float> got(kernels::num_blocks(n, tpb) * heads);
                kernels::block_scores(tok.data(), heads, n, tpb, pool, got.data());
                const std::vector<double> want = ref_blocks(tok_d, heads, n, tpb, pool);
                for (size_t i = 0; i < got.size(); ++i)
                    ASSERT_NEAR(got[i], want[i], 1e-5 * tpb) << "n " << n << " pool " << pool << " tpb " << tpb;
            }
}

// ---- heavy hitters (H2O) ----

TEST(Kernels, HeavyHitterBlockSums) {
    std::mt19937_64 rng(13);
    std::uniform_real_distribution<float> u(0.f, 2.f);
    for (const Combine c : {Combine::max, Combine::sum})
        for (const uint32_t group : {1u, 3u})
            for (const uint64_t n : {1ull, 40ull, 161ull}) {
                const uint32_t kvh = 2, heads = kvh * group, tpb = 16;
                const uint64_t stride = n + 3;
                std::vector<float> acc(heads * stride, kSentinel);
                for (uint32_t h = 0; h < heads; ++h)
                    for (uint64_t t = 0; t < n; ++t) acc[h * stride + t] = u(rng);
                const uint64_t nb = kernels::num_blocks(n, tpb);
                std::vector<float> got(nb * kvh);
                kernels::h2o_scores(acc.data(), heads, n, stride, kvh, c, tpb, got.data());
                for (uint64_t b = 0; b < nb; ++b)
                    for (uint32_t g = 0; g < kvh; ++g) {
                        double want = 0;
                        for (uint64_t t = b * tpb; t < std::min(n, (b + 1) * tpb); ++t) {
                            double v = 0;
                            for (uint32_t j = 0; j < group; ++j)
                                v = combine(c, j == 0, v, acc[(g * group + j) * stride + t]);
                            want += v;
                        }
                        ASSERT_NEAR(got[b * kvh + g], want, 1e-5 * tpb * group) << "block " << b << " head " << g;
                    }
            }
}

// ---- paged pools: one call per block gives the digest of the whole sequence ----

TEST(Kernels, DigestOfPagedHeadMajorPoolMatchesContiguous) {
    std::mt19937_64 rng(17);
    const uint32_t tpb = 16, heads = 4, dim = 32, pool_blocks = 12;
    const uint64_t tokens = 16 * 7 + 9;
    const uint64_t nb = kernels::num_blocks(tokens, tpb);
    std::vector<uint32_t> table(pool_blocks);
    std::iota(table.begin(), table.end(), 0u);
    std::shuffle(table.begin(), table.end(), rng);
    table.resize(nb);
    // The pool: blocks of [head][tpb][dim] fp16; the same keys also token-major and contiguous.
    std::vector<uint16_t> pool(size_t(pool_blocks) * heads * tpb * dim, kernels::float_to_fp16(kSentinel));
    const Tensor flat = random_tensor(rng, DType::fp16, Shape::token_major, tokens, heads, dim);
    for (uint64_t t = 0; t < tokens; ++t)
        for (uint32_t h = 0; h < heads; ++h)
            for (uint32_t i = 0; i < dim; ++i)
                pool[((size_t(table[t / tpb]) * heads + h) * tpb + t % tpb) * dim + i] =
                    kernels::float_to_fp16(float(flat.at(t, h, i)));
    std::vector<float> want(kernels::digest_floats(nb, heads, dim)), got(want.size());
    kernels::page_digest(flat.view, tpb, want.data());
    for (uint64_t b = 0; b < nb; ++b) {
        const uint64_t valid = std::min<uint64_t>(tpb, tokens - b * tpb);
        const View block = kernels::head_major(pool.data() + size_t(table[b]) * heads * tpb * dim, DType::fp16, valid,
                                               heads, dim, tpb);
        kernels::page_digest(block, tpb, got.data() + kernels::digest_floats(b, heads, dim));
    }
    EXPECT_EQ(got, want);

    // slice() views a run of tokens of a larger view.
    std::vector<float> part(kernels::digest_floats(2, heads, dim));
    kernels::page_digest(kernels::slice(flat.view, 2 * tpb, 2 * tpb), tpb, part.data());
    EXPECT_TRUE(std::equal(part.begin(), part.end(), want.begin() + kernels::digest_floats(2, heads, dim)));
}

// ---- top-k ----

std::vector<uint32_t> ref_top_k(const std::vector<float> &s, size_t k) {
    std::vector<uint32_t> idx(s.size());
    std::iota(idx.begin(), idx.end(), 0u);
    const auto key = [&](uint32_t i) { return std::isnan(s[i]) ? -INFINITY : double(s[i]); };
    std::stable_sort(idx.begin(), idx.end(), [&](uint32_t a, uint32_t b) { return key(a) > key(b); });
    idx.resize(std::min(k, idx.size()));
    return idx;
}

TEST(TopK, TiesGoToTheLowerIndex) {
    const std::vector<float> s = {1, 3, 3, 2, 3, 2};
    EXPECT_EQ(kernels::top_k(s, 2), (std::vector<uint32_t>{1, 2}));
    EXPECT_EQ(kernels::top_k(s, 4), (std::vector<uint32_t>{1, 2, 4, 3}));
    EXPECT_EQ(kernels::top_k(s, 0), std::vector<uint32_t>{});
    EXPECT_EQ(kernels::top_k(s, 99), (std::vector<uint32_t>{1, 2, 4, 3, 5, 0}));
    const std::vector<float> flat(10, 0.5f);
    EXPECT_EQ(kernels::top_k(flat, 3), (std::vector<uint32_t>{0, 1, 2}));
    const std::vector<float> nan = {NAN, -INFINITY, 0.f, NAN};
    EXPECT_EQ(kernels::top_k(nan, 4), (std::vector<uint32_t>{2, 0, 1, 3}));
}

TEST(TopK, MatchesStableSortOnRandomTies) {
    std::mt19937_64 rng(3);
    for (int trial = 0; trial < 500; ++trial) {
        const size_t n = 1 + rng() % 300;
        std::vector<float> s(n);
        for (auto &x : s) x = rng() % 50 == 0 ? NAN : float(rng() % 6);  // many ties
        const size_t k = rng() % (n + 2);
        ASSERT_EQ(kernels::top_k(s, k), ref_top_k(s, k)) << "trial " << trial;
        // Over a shuffled subset of candidates: the same order among them, whatever their input order.
        std::vector<uint32_t> cand(n);
        std::iota(cand.begin(), cand.end(), 0u);
        std::shuffle(cand.begin(), cand.end(), rng);
        cand.resize(n / 2);
        std::vector<uint8_t> in(n, 0);
        for (uint32_t c : cand) in[c] = 1;
        kernels::top_k(s, cand, k);
        std::vector<uint32_t> want;
        for (uint32_t i : ref_top_k(s, n))
            if (in[i] && want.size() < k) want.push_back(i);
        ASSERT_EQ(std::vector<uint32_t>(cand.begin(), cand.begin() + std::min(k, cand.size())), want);
    }
}

// ---- budgets and selection ----

Profile uniform(uint32_t layers, uint32_t heads, uint32_t tpb, Policy policy, Budget budget, uint32_t sinks = 0,
                uint32_t recent = 0) {
    Profile p;
    p.model = "test";
    p.num_layers = layers;
    p.num_kv_heads = heads;
    p.block_tokens = tpb;
    p.defaults.policy = policy;
    p.defaults.budget = budget;
    p.defaults.sinks = sinks;
    p.defaults.recent = recent;
    return p;
}

std::vector<uint32_t> vec(const Vec<uint32_t> &v) { return std::vector<uint32_t>(v.begin(), v.end()); }

std::vector<uint32_t> range(uint32_t a, uint32_t b) {
    std::vector<uint32_t> r(b - a);
    std::iota(r.begin(), r.end(), a);
    return r;
}

TEST(Budget, RoundsUpToWholeBlocks) {
    EXPECT_EQ(budget_blocks(Budget::of_tokens(16), 1000, 16, 0), 1u);
    EXPECT_EQ(budget_blocks(Budget::of_tokens(17), 1000, 16, 0), 2u);
    EXPECT_EQ(budget_blocks(Budget::of_tokens(0), 1000, 16, 0), 0u);
    EXPECT_EQ(budget_blocks(Budget::of_fraction(1.0 / 16), 1000, 16, 0), 4u);  // 62.5 -> 63 tokens -> 4 blocks
    EXPECT_EQ(budget_blocks(Budget::of_fraction(0.1), 1000, 10, 0), 10u);      // exactly 100 tokens, not 101
    EXPECT_EQ(budget_blocks(Budget::of_fraction(1.0), 1000, 16, 0), 63u);      // includes the partial block
    EXPECT_EQ(budget_blocks(Budget::of_bytes(512), 1000, 16, 32), 1u);         // one block is 16 * 32 bytes
    EXPECT_EQ(budget_blocks(Budget::of_bytes(513), 1000, 16, 32), 2u);
    EXPECT_EQ(budget_blocks(Budget::of_tokens(1u << 30), 1000, 16, 0), 63u);  // capped at the request
    EXPECT_EQ(budget_blocks(Budget::of_bytes(UINT64_MAX), 1000, 16, 32), 63u);
    EXPECT_EQ(budget_blocks(Budget::of_tokens(5), 0, 16, 0), 0u);
    try {
        budget_blocks(Budget::of_bytes(100), 1000, 16, 0);
        FAIL() << "a bytes budget without head_token_bytes was accepted";
    } catch (const Error &e) {
        EXPECT_EQ(e.status(), SG_ERR_INVALID_ARGUMENT);
    }
}

// Blocks for a token count: (tokens + tpb - 1) / tpb wrapped to 0 near 2^64, and every size checked
// against that count passed.
TEST(Kernels, NumBlocksDoesNotWrapNear2To64) {
    EXPECT_EQ(kernels::num_blocks(0, 16), 0u);
    EXPECT_EQ(kernels::num_blocks(1, 16), 1u);
    EXPECT_EQ(kernels::num_blocks(32, 16), 2u);
    EXPECT_EQ(kernels::num_blocks(33, 16), 3u);
    EXPECT_EQ(kernels::num_blocks(UINT64_MAX, 16), UINT64_MAX / 16 + 1);
    EXPECT_EQ(kernels::num_blocks(UINT64_MAX - 1, 16), UINT64_MAX / 16 + 1);
    EXPECT_EQ(kernels::num_blocks(UINT64_MAX - 15, 16), UINT64_MAX / 16);  // 2^64 - 16: exact
    EXPECT_EQ(kernels::num_blocks(UINT64_MAX, 1), UINT64_MAX);
    EXPECT_EQ(kernels::num_blocks(UINT64_MAX, UINT32_MAX), UINT64_MAX / UINT32_MAX);  // 2^32 + 1, exact
}

// Scores that make block b's rank obvious: higher index, higher score, per head reversed on odd heads.
std::vector<float> ramp(uint64_t nb, uint32_t heads) {
    std::vector<float> s(nb * heads);
    for (uint64_t b = 0; b < nb; ++b)
        for (uint32_t h = 0; h < heads; ++h) s[b * heads + h] = h % 2 ? float(nb - b) : float(b);
    return s;
}

TEST(Select, SinksAndRecentCountInsideTheBudget) {
    // 1000 tokens, 16 per block: 63 blocks. Sinks 16 tokens = block 0; recent 40 tokens = tokens
    // 960..999 = blocks 60..62. A budget of 8 blocks leaves 4 for the best-scored middle blocks.
    const Profile p = uniform(1, 2, 16, Policy::quest, Budget::of_tokens(8 * 16), 16, 40);
    const Selector sel(p, {1000, 64});
    ASSERT_EQ(sel.num_blocks(), 63u);
    const LayerSelection s = sel.select_layer(0, ramp(63, 2));
    EXPECT_EQ(vec(s.heads[0]), (std::vector<uint32_t>{0, 56, 57, 58, 59, 60, 61, 62}));
    EXPECT_EQ(vec(s.heads[1]), (std::vector<uint32_t>{0, 1, 2, 3, 4, 60, 61, 62}));
    EXPECT_EQ(s.stats.head_blocks, 16u);
    EXPECT_EQ(s.stats.budget_blocks, 16u);
    EXPECT_EQ(s.stats.over_budget_heads, 0u);

    // Sinks and recent alone exceed a 2-block budget: they are still sent, and reported.
    const Profile tight = uniform(1, 2, 16, Policy::quest, Budget::of_tokens(20), 16, 40);
    const LayerSelection t = Selector(tight, {1000, 64}).select_layer(0, ramp(63, 2));
    EXPECT_EQ(vec(t.heads[0]), (std::vector<uint32_t>{0, 60, 61, 62}));
    EXPECT_EQ(t.stats.over_budget_heads, 2u);

    // Windows larger than the request cover it once.
    const Profile wide = uniform(1, 1, 16, Policy::quest, Budget::of_tokens(16), 5000, 5000);
    const Selector ws(wide, {100, 64});
    EXPECT_FALSE(ws.needs_scores(0));
    EXPECT_EQ(vec(ws.select_layer(0, {}).heads[0]), range(0, 7));
}

TEST(Select, SinksRecentPolicyWidensTheWindow) {
    const Profile p = uniform(1, 1, 16, Policy::sinks_recent, Budget::of_tokens(5 * 16), 16, 16);
    const Selector sel(p, {640, 64});
    EXPECT_FALSE(sel.needs_scores(0));
    EXPECT_EQ(vec(sel.select_layer(0, {}).heads[0]), (std::vector<uint32_t>{0, 36, 37, 38, 39}));
}

TEST(Select, DenseLayersAndHeadsSelectEverything) {
    Profile p = uniform(3, 4, 16, Policy::quest, Budget::of_fraction(0.125));
    p.layers.push_back({1, {.policy = Policy::dense}, {}});
    p.layers.push_back({2, {}, {{3, {.policy = Policy::dense}}}});
    const Selector sel(p, {512, 64});  // 32 blocks; 1/8 = 4 blocks
    const std::vector<float> scores = ramp(32, 4);
    const LayerSelection l0 = sel.select_layer(0, scores), l1 = sel.select_layer(1, scores),
                         l2 = sel.select_layer(2, scores);
    EXPECT_EQ(l0.stats.dense_heads, 0u);
    EXPECT_EQ(l0.stats.head_blocks, 16u);
    EXPECT_FALSE(sel.needs_scores(1));
    EXPECT_EQ(vec(sel.select_layer(1, {}).blocks), range(0, 32));
    EXPECT_EQ(l1.stats.dense_heads, 4u);
    EXPECT_EQ(l1.stats.head_blocks, 4u * 32);
    EXPECT_EQ(l1.stats.budget_blocks, 4u * 32);
    EXPECT_EQ(vec(l2.heads[3]), range(0, 32));
    EXPECT_EQ(l2.heads[0].size(), 4u);
    EXPECT_EQ(l2.stats.dense_heads, 1u);
    EXPECT_EQ(l2.stats.budget_blocks, 3u * 4 + 32);
    EXPECT_EQ(vec(l2.blocks), range(0, 32));
    EXPECT_EQ(sel.budget(2, 3), 32u);
    EXPECT_EQ(sel.rule(2, 3).policy, Policy::dense);
}

TEST(Select, TokensFractionAndBytesFormsAgree) {
    const uint64_t htb = 2 * 128 * 2;  // K+V, head_dim 128, fp16
    std::mt19937_64 rng(23);
    std::vector<float> scores(64 * 2);
    for (auto &x : scores) x = float(rng() % 1000);
    std::vector<std::vector<uint32_t>> results;
    for (const Budget b : {Budget::of_tokens(256), Budget::of_fraction(0.25), Budget::of_bytes(256 * htb),
                           Budget::of_tokens(250), Budget::of_bytes(250 * htb + 1)}) {
        const LayerSelection s =
            Selector(uniform(1, 2, 16, Policy::h2o, b, 16, 16), {1024, htb}).select_layer(0, scores);
        EXPECT_EQ(s.heads[0].size(), 16u);
        results.push_back(vec(s.heads[0]));
    }
    for (const auto &r : results) EXPECT_EQ(r, results[0]);
}

TEST(Select, BudgetLargerThanTheRequestTakesEverything) {
    for (const Budget b : {Budget::of_tokens(1u << 20), Budget::of_fraction(1.0), Budget::of_bytes(UINT64_MAX)}) {
        const Selector sel(uniform(2, 2, 16, Policy::quest, b, 4, 4), {100, 64});
        EXPECT_EQ(sel.budget(1, 1), 7u);
        const LayerSelection s = sel.select_layer(1, std::vector<float>(14, 1.f));
        EXPECT_EQ(vec(s.heads[0]), range(0, 7));
        EXPECT_EQ(vec(s.blocks), range(0, 7));
        EXPECT_EQ(s.stats.extra_bytes, 0u);
        EXPECT_EQ(s.stats.head_bytes, 2u * 100 * 64);
    }
}

TEST(Select, UnionReportsExtraBytesOfWholeBlocks) {
    // Head 0 prefers high blocks, head 1 low ones: their sets are disjoint apart from the sinks and
    // the recent block, so the union moves every head of blocks only one head wanted.
    const uint32_t tpb = 16;
    const uint64_t tokens = 16 * 20 + 7, htb = 256;  // 21 blocks, the last one with 7 tokens
    const Selector sel(uniform(1, 2, tpb, Policy::quest, Budget::of_tokens(5 * 16), 16, 7), {tokens, htb});
    const LayerSelection s = sel.select_layer(0, ramp(21, 2));
    EXPECT_EQ(vec(s.heads[0]), (std::vector<uint32_t>{0, 17, 18, 19, 20}));
    EXPECT_EQ(vec(s.heads[1]), (std::vector<uint32_t>{0, 1, 2, 3, 20}));
    EXPECT_EQ(vec(s.blocks), (std::vector<uint32_t>{0, 1, 2, 3, 17, 18, 19, 20}));
    const uint64_t head_tokens = 2 * (4 * 16 + 7), union_tokens = 7 * 16 + 7;
    EXPECT_EQ(s.stats.union_blocks, 8u);
    EXPECT_EQ(s.stats.head_bytes, head_tokens * htb);
    EXPECT_EQ(s.stats.union_bytes, union_tokens * htb * 2);
    EXPECT_EQ(s.stats.extra_bytes, s.stats.union_bytes - s.stats.head_bytes);
}

// Against a naive per-head selection: forced blocks, then the best-scored of the rest by a stable
// sort, over random profiles with per-layer and per-head overrides.
TEST(Select, MatchesNaiveSelectionOnRandomProfiles) {
    std::mt19937_64 rng(29);
    const Policy policies[] = {Policy::sinks_recent, Policy::quest, Policy::snapkv, Policy::h2o, Policy::dense};
    for (int trial = 0; trial < 200; ++trial) {
        const uint32_t layers = 1 + rng() % 3, heads = 1 + rng() % 4, tpb = 1 + rng() % 32;
        const uint64_t tokens = rng() % 600, htb = 1 + rng() % 512;
        auto random_budget = [&]() {
            switch (rng() % 3) {
                case 0:
                    return Budget::of_tokens(rng() % 700);
                case 1:
                    return Budget::of_fraction(double(1 + rng() % 100) / 100);
                default:
                    return Budget::of_bytes(rng() % (700 * htb));
            }
        };
        auto random_rule = [&](bool all) {
            RuleSpec r;
            if (all || rng() % 2) r.policy = policies[rng() % 5];
            if (all || rng() % 2) r.budget = random_budget();
            if (all || rng() % 2) r.sinks = uint32_t(rng() % 40);
            if (all || rng() % 2) r.recent = uint32_t(rng() % 80);
            return r;
        };
        Profile p = uniform(layers, heads, tpb, Policy::quest, Budget::of_tokens(0));
        p.defaults = random_rule(true);
        for (uint32_t l = 0; l < layers; ++l)
            if (rng() % 2) {
                LayerSpec ls{l, random_rule(false), {}};
                for (uint32_t h = 0; h < heads; ++h)
                    if (rng() % 2) ls.heads.push_back({h, random_rule(false)});
                p.layers.push_back(ls);
            }
        const Selector sel(p, {tokens, htb});
        const uint64_t nb = sel.num_blocks();
        ASSERT_EQ(nb, (tokens + tpb - 1) / tpb);
        for (uint32_t l = 0; l < layers; ++l) {
            std::vector<float> scores(nb * heads);
            for (auto &x : scores) x = float(rng() % 8);
            const LayerSelection s = sel.select_layer(l, scores);
            std::set<uint32_t> all;
            for (uint32_t h = 0; h < heads; ++h) {
                const Rule r = p.rule(l, h);
                const Rule resolved = r.policy == Policy::dense ? Rule{Policy::dense, {}, r.sinks, r.recent} : r;
                ASSERT_EQ(sel.rule(l, h), resolved);
                std::vector<uint32_t> want;
                if (r.policy == Policy::dense) {
                    want = range(0, uint32_t(nb));
                } else {
                    std::vector<uint8_t> forced(nb, 0);
                    for (uint64_t t = 0; t < std::min<uint64_t>(r.sinks, tokens); ++t) forced[t / tpb] = 1;
                    for (uint64_t t = tokens - std::min<uint64_t>(r.recent, tokens); t < tokens; ++t)
                        forced[t / tpb] = 1;
                    const uint64_t nforced = std::count(forced.begin(), forced.end(), 1);
                    const uint64_t budget = budget_blocks(r.budget, tokens, tpb, htb);
                    std::vector<float> col(nb, -INFINITY);
                    for (uint64_t b = 0; b < nb; ++b)
                        if (!forced[b]) col[b] = r.policy == Policy::sinks_recent ? float(b) : scores[b * heads + h];
                    std::vector<uint32_t> order = ref_top_k(col, nb);
                    uint64_t extra = budget > nforced ? budget - nforced : 0;
                    for (uint32_t b : order)
                        if (!forced[b] && extra > 0) {
                            forced[b] = 1;
                            --extra;
                        }
                    for (uint64_t b = 0; b < nb; ++b)
                        if (forced[b]) want.push_back(uint32_t(b));
                }
                ASSERT_EQ(vec(s.heads[h]), want)
                    << "trial " << trial << " layer " << l << " head " << h << " " << policy_name(r.policy);
                all.insert(want.begin(), want.end());
            }
            ASSERT_EQ(vec(s.blocks), std::vector<uint32_t>(all.begin(), all.end()));
        }
    }
}

TEST(Select, TotalBudgetCountsDenseLayersFirst) {
    // 4 layers x 2 heads x 64 blocks = 512 units; layer 0 dense (128 units). The others ask for 16
    // blocks each (96 units) beyond nothing forced.
    Profile p = uniform(4, 2, 16, Policy::quest, Budget::of_fraction(0.25));
    p.layers.push_back({0, {.policy = Policy::dense}, {}});
    const Request req{1024, 64};
    std::vector<float> scores(64 * 2);
    std::iota(scores.begin(), scores.end(), 0.f);
    const auto total_units = [&](const Selector &sel) {
        uint64_t sum = 0;
        for (uint32_t l = 0; l < 4; ++l) sum += sel.select_layer(l, scores).stats.head_blocks;
        return sum;
    };

    p.total_budget = Budget::of_fraction(0.5);  // 256 units: room for everything asked
    const Selector roomy(p, req);
    EXPECT_EQ(roomy.total_budget_blocks(), 256u);
    EXPECT_EQ(roomy.budget(1, 0), 16u);
    EXPECT_EQ(total_units(roomy), 128u + 96);

    p.total_budget = Budget::of_fraction(0.375);  // 192 units: 64 left after the dense layer, for 96 asked
    const Selector shared(p, req);
    EXPECT_FALSE(shared.over_total_budget());
    EXPECT_EQ(total_units(shared), 192u);
    uint64_t eleven = 0;
    for (uint32_t l = 1; l < 4; ++l)
        for (uint32_t h = 0; h < 2; ++h) {
            EXPECT_TRUE(shared.budget(l, h) == 10 || shared.budget(l, h) == 11);
            eleven += shared.budget(l, h) == 11;
        }
    EXPECT_EQ(eleven, 4u);                // 6 x 10 + 4 leftover units
    EXPECT_EQ(shared.budget(1, 0), 11u);  // leftovers go to the lowest (layer, head) on equal remainders

    p.total_budget = Budget::of_tokens(128);  // 8 blocks x 8 streams = 64 units: less than the dense layer
    const Selector over(p, req);
    EXPECT_TRUE(over.over_total_budget());
    EXPECT_EQ(total_units(over), 128u);  // dense is still sent; nothing else
    EXPECT_FALSE(over.needs_scores(1));

    p.total_budget = Budget::of_bytes(192 * 16 * 64);
    EXPECT_EQ(Selector(p, req).total_budget_blocks(), 192u);
}

// The block count of num_tokens near 2^64 wrapped to 0, and such a request was taken.
TEST(Select, TokenCountsBeyondUint32BlocksAreRefused) {
    const Profile p = uniform(1, 1, 16, Policy::quest, Budget::of_fraction(0.5));
    for (uint64_t n : {UINT64_MAX, UINT64_MAX - 1, UINT64_MAX - 15, uint64_t(UINT32_MAX) * 16 + 1}) {
        SCOPED_TRACE(n);
        try {
            Selector(p, {n, 64});
            ADD_FAILURE() << "accepted";
        } catch (const Error &e) {
            EXPECT_EQ(e.status(), SG_ERR_INVALID_ARGUMENT) << e.message();
        }
    }
    EXPECT_EQ(Selector(p, {uint64_t(UINT32_MAX) * 16, 64}).num_blocks(), uint64_t(UINT32_MAX));
}

TEST(Select, RejectsBadCalls) {
    const Selector sel(uniform(2, 2, 16, Policy::quest, Budget::of_fraction(0.5)), {100, 64});
    EXPECT_TRUE(sel.needs_scores(0));
    try {
        sel.select_layer(0, std::vector<float>(13));
        FAIL();
    } catch (const Error &e) {
        EXPECT_EQ(e.status(), SG_ERR_INVALID_ARGUMENT);
        EXPECT_NE(e.message().find("needs 14 scores"), std::string::npos) << e.message();
    }
    try {
        sel.select_layer(2, std::vector<float>(14));
        FAIL();
    } catch (const Error &e) {
        EXPECT_EQ(e.status(), SG_ERR_OUT_OF_RANGE);
    }
    try {
        Selector(uniform(1, 1, 16, Policy::quest, Budget::of_bytes(100)), {100, 0});
        FAIL();
    } catch (const Error &e) {
        EXPECT_EQ(e.status(), SG_ERR_INVALID_ARGUMENT);
    }
    // Reusing an output keeps nothing from the previous layer.
    LayerSelection out;
    sel.select_layer(0, ramp(7, 2), out);
    const Selector one_head(uniform(1, 1, 16, Policy::dense, Budget{}), {100, 64});
    one_head.select_layer(0, {}, out);
    EXPECT_EQ(out.heads.size(), 1u);
    EXPECT_EQ(vec(out.blocks), range(0, 7));
}

// ---- the needle ----

// A block whose keys point along the query is the one attention would pick; Quest must find it at a
// budget of 1/16 whatever the dtype, layout, GQA grouping and combine mode.
TEST(Select, QuestAlwaysFindsAPlantedNeedle) {
    std::mt19937_64 rng(37);
    std::normal_distribution<float> normal;
    const DType dtypes[] = {DType::fp32, DType::fp16, DType::bf16};
    const Shape shapes[] = {Shape::token_major, Shape::head_major, Shape::strided};
    int found = 0;
    const int trials = 120;
    for (int trial = 0; trial < trials; ++trial) {
        const DType dtype = dtypes[trial % 3];
        const Shape shape = shapes[(trial / 3) % 3];
        const Combine c = trial % 2 ? Combine::sum : Combine::max;
        const uint32_t kvh = 2, group = 1u << (rng() % 3), dim = trial % 4 ? 64 : 128, tpb = 16;
        const uint64_t tokens = 1024 + rng() % tpb;
        const uint64_t nb = kernels::num_blocks(tokens, tpb);
        const uint32_t needle_head = uint32_t(rng() % kvh);
        const uint64_t needle = 1 + rng() % (nb - 2);  // outside the sink and recent blocks
        // The query heads of the needle's group share a direction u; the needle's keys are 4u plus noise.
        std::vector<float> u(dim);
        for (auto &x : u) x = normal(rng);
        const Tensor q = make_tensor(dtype, shape, 1, kvh * group, dim, [&](uint64_t, uint32_t h, uint32_t i) {
            return h / group == needle_head ? u[i] + 0.3f * normal(rng) : normal(rng);
        });
        const Tensor k = make_tensor(dtype, shape, tokens, kvh, dim, [&](uint64_t t, uint32_t h, uint32_t i) {
            return h == needle_head && t / tpb == needle ? 4.f * u[i] + 0.1f * normal(rng) : normal(rng);
        });
        std::vector<float> digest(kernels::digest_floats(nb, kvh, dim)), scores(nb * kvh);
        kernels::page_digest(k.view, tpb, digest.data());
        kernels::quest_scores(digest.data(), nb, kvh, q.view, c, scores.data());
        Profile p = uniform(1, kvh, tpb, Policy::quest, Budget::of_fraction(1.0 / 16), 16, 16);
        p.combine = c;
        const LayerSelection s =
            Selector(p, {tokens, 2ull * dim * kernels::dtype_bytes(dtype)}).select_layer(0, scores);
        const auto &mine = s.heads[needle_head];
        const bool in_head = std::binary_search(mine.begin(), mine.end(), uint32_t(needle));
        const bool in_union = std::binary_search(s.blocks.begin(), s.blocks.end(), uint32_t(needle));
        EXPECT_TRUE(in_head && in_union) << "trial " << trial << " " << dtype_name(dtype) << " " << shape_name(shape)
                                         << " group " << group << " needle block " << needle;
        EXPECT_EQ(mine.size(), kernels::num_blocks(kernels::num_blocks(tokens, 16), 16));
        found += in_head;
    }
    EXPECT_EQ(found, trials);
}

// ---- profiles ----

const char *kProfile = R"({
  "version": 1,
  "model": "llama-3-8b",
  "num_layers": 32,
  "num_kv_heads": 8,
  "block_tokens": 16,
  "combine": "sum",
  "pool": 7,
  "total_budget": {"fraction": 0.125},
  "defaults": {"policy": "quest", "budget": {"fraction": 0.0625}, "sinks": 16, "recent": 64},
  "layers": [
    {"layer": 0, "policy": "dense"},
    {"layer": 1, "policy": "dense"},
    {"layer": 5, "budget": {"tokens": 2048}, "heads": [{"head": 3, "policy": "dense"}, {"head": 6, "policy": "h2o", "recent": 128}]},
    {"layer": 31, "policy": "snapkv", "budget": {"bytes": 1048576}, "sinks": 0}
  ]
})";

TEST(Profile, ParsesAndResolvesRules) {
    const Profile p = parse_profile(kProfile);
    EXPECT_EQ(p.model, "llama-3-8b");
    EXPECT_EQ(p.combine, Combine::sum);
    EXPECT_EQ(p.pool, 7u);
    EXPECT_EQ(p.total_budget, Budget::of_fraction(0.125));
    EXPECT_EQ(p.rule(0, 4).policy, Policy::dense);
    EXPECT_EQ(p.rule(2, 0), (Rule{Policy::quest, Budget::of_fraction(0.0625), 16, 64}));
    EXPECT_EQ(p.rule(5, 0), (Rule{Policy::quest, Budget::of_tokens(2048), 16, 64}));
    EXPECT_EQ(p.rule(5, 3).policy, Policy::dense);
    EXPECT_EQ(p.rule(5, 6), (Rule{Policy::h2o, Budget::of_tokens(2048), 16, 128}));
    EXPECT_EQ(p.rule(31, 7), (Rule{Policy::snapkv, Budget::of_bytes(1048576), 0, 64}));
    EXPECT_THROW(p.rule(32, 0), Error);
}

TEST(Profile, JsonRoundTrip) {
    const Profile p = parse_profile(kProfile);
    const std::string text = to_json(p);
    const Profile again = parse_profile(text);
    EXPECT_EQ(again, p);
    EXPECT_EQ(to_json(again), text);
    EXPECT_EQ(nlohmann::json::parse(text), nlohmann::json::parse(kProfile));  // nothing lost or added
    EXPECT_EQ(parse_profile(to_json(p, -1)), p);                              // compact form too

    // A profile built in code, with fractions that have no short decimal form.
    Profile q = uniform(3, 2, 32, Policy::snapkv, Budget::of_fraction(1.0 / 3), 4, 0);
    q.layers.push_back({2, {.budget = Budget::of_fraction(0.1 + 0.2)}, {{1, {.policy = Policy::sinks_recent}}}});
    EXPECT_EQ(parse_profile(to_json(q)), q);
}

TEST(Profile, LoadsFromFile) {
    const std::string path = testing::TempDir() + "select_test_profile.json";
    {
        std::FILE *f = std::fopen(path.c_str(), "w");
        ASSERT_NE(f, nullptr);
        std::fputs(kProfile, f);
        std::fclose(f);
    }
    EXPECT_EQ(load_profile(path), parse_profile(kProfile));
    std::remove(path.c_str());
    try {
        load_profile(path);
        FAIL();
    } catch (const Error &e) {
        EXPECT_EQ(e.status(), SG_ERR_NOT_FOUND);
    }
}

struct BadProfile {
    const char *what;
    void (*edit)(nlohmann::json &);
    const char *path;  // the message must name this
    sg_status_t status = SG_ERR_INVALID_ARGUMENT;
};

const BadProfile kBadProfiles[] = {
    {"fraction above 1",
     [](nlohmann::json &j) {
         j["layers"][2]["heads"][1]["budget"] = {{"fraction", 1.5}};
     },
     "layers[2].heads[1].budget.fraction"},
    {"fraction of 0",
     [](nlohmann::json &j) {
         j["defaults"]["budget"] = {{"fraction", 0}};
     },
     "defaults.budget.fraction"},
    {"two budget kinds",
     [](nlohmann::json &j) {
         j["layers"][3]["budget"] = {{"tokens", 5}, {"bytes", 5}};
     },
     "layers[3].budget"},
    {"unknown budget kind",
     [](nlohmann::json &j) {
         j["defaults"]["budget"] = {{"blocks", 5}};
     },
     "defaults.budget.blocks"},
    {"negative token budget",
     [](nlohmann::json &j) {
         j["total_budget"] = {{"tokens", -5}};
     },
     "total_budget.tokens"},
    {"unknown policy", [](nlohmann::json &j) { j["layers"][1]["policy"] = "qwest"; }, "layers[1].policy"},
    {"missing budget for a non-dense head",
     [](nlohmann::json &j) {
         j["defaults"] = {{"policy", "dense"}};
         j["layers"][2].erase("budget");  // head 6 of layer 5 is h2o and now has no budget anywhere
     },
     "layers[2].heads[1].budget"},
    {"missing budget in defaults", [](nlohmann::json &j) { j["defaults"].erase("budget"); }, "defaults.budget"},
    {"head out of range", [](nlohmann::json &j) { j["layers"][2]["heads"][0]["head"] = 8; }, "layers[2].heads[0].head"},
    {"duplicate head", [](nlohmann::json &j) { j["layers"][2]["heads"][1]["head"] = 3; }, "layers[2].heads[1].head"},
    {"layer out of range", [](nlohmann::json &j) { j["layers"][0]["layer"] = 32; }, "layers[0].layer"},
    {"duplicate layer", [](nlohmann::json &j) { j["layers"][3]["layer"] = 1; }, "layers[3].layer"},
    {"layer entry without its index", [](nlohmann::json &j) { j["layers"][1].erase("layer"); }, "layers[1].layer"},
    {"misspelt field",
     [](nlohmann::json &j) {
         j["defaults"]["budjet"] = {{"tokens", 1}};
     },
     "defaults.budjet"},
    {"unknown field in a head", [](nlohmann::json &j) { j["layers"][2]["heads"][0]["dense"] = true; },
     "layers[2].heads[0].dense"},
    {"negative sinks", [](nlohmann::json &j) { j["layers"][3]["sinks"] = -1; }, "layers[3].sinks"},
    {"fractional recent", [](nlohmann::json &j) { j["defaults"]["recent"] = 1.5; }, "defaults.recent"},
    {"even pool", [](nlohmann::json &j) { j["pool"] = 4; }, "pool"},
    {"bad combine", [](nlohmann::json &j) { j["combine"] = "mean"; }, "combine"},
    {"no layers", [](nlohmann::json &j) { j["num_layers"] = 0; }, "num_layers"},
    {"no block size", [](nlohmann::json &j) { j.erase("block_tokens"); }, "block_tokens"},
    {"empty model", [](nlohmann::json &j) { j["model"] = ""; }, "model"},
    {"model not a string", [](nlohmann::json &j) { j["model"] = 7; }, "model"},
    {"heads not an array",
     [](nlohmann::json &j) {
         j["layers"][2]["heads"] = {{"head", 1}};
     },
     "layers[2].heads"},
    {"layer not an object", [](nlohmann::json &j) { j["layers"][0] = 3; }, "layers[0]"},
    {"defaults without policy", [](nlohmann::json &j) { j["defaults"].erase("policy"); }, "defaults.policy"},
    {"newer version",
     [](nlohmann::json &j) {
         j["version"] = 2;
         j["new_field"] = 1;
     },
     "version", SG_ERR_VERSION_MISMATCH},
};

TEST(Profile, InvalidProfilesNameTheBadField) {
    for (const BadProfile &bad : kBadProfiles) {
        SCOPED_TRACE(bad.what);
        nlohmann::json j = nlohmann::json::parse(kProfile);
        bad.edit(j);
        try {
            parse_profile(j.dump());
            ADD_FAILURE() << "accepted: " << j.dump();
        } catch (const Error &e) {
            EXPECT_EQ(e.status(), bad.status) << e.message();
            EXPECT_NE(e.message().find(std::string("profile: ") + bad.path + ":"), std::string::npos)
                << "message \"" << e.message() << "\" does not name " << bad.path;
        }
    }
}

TEST(Profile, MalformedJsonAndCodeBuiltProfiles) {
    for (const char *text : {"", "{", "[1, 2]", "{\"version\": 1,}"}) {
        try {
            parse_profile(text);
            ADD_FAILURE() << "accepted: " << text;
        } catch (const Error &e) {
            EXPECT_EQ(e.status(), SG_ERR_INVALID_ARGUMENT) << e.message();
            EXPECT_EQ(e.message().rfind("profile: ", 0), 0u) << e.message();
        }
    }
    // Profiles built in code get the same checks, with the same paths, when a Selector takes them.
    Profile p = uniform(4, 2, 16, Policy::quest, Budget::of_fraction(0.5));
    p.layers.push_back({1, {}, {{0, {.budget = Budget::of_fraction(2.0)}}}});
    try {
        Selector(p, {100, 64});
        FAIL();
    } catch (const Error &e) {
        EXPECT_NE(e.message().find("layers[0].heads[0].budget.fraction"), std::string::npos) << e.message();
    }
}

// ---- hostile profile input ----

// What parse_profile threw: an sg::Error's status and message, or SG_ERR_INTERNAL and the what() of
// any other exception (which the ABI would turn into SG_ERR_INTERNAL); SG_OK when it parsed.
std::pair<sg_status_t, std::string> parse_outcome(std::string_view text) {
    try {
        parse_profile(text);
        return {SG_OK, ""};
    } catch (const Error &e) {
        return {e.status(), e.message()};
    } catch (const std::exception &e) {
        return {SG_ERR_INTERNAL, e.what()};
    }
}

std::string minimal(const std::string &defaults_budget = R"({"tokens": 64})", const std::string &extra = "") {
    return R"({"version": 1, "model": "m", "num_layers": 2, "num_kv_heads": 2, "block_tokens": 16,)" + extra +
           R"( "defaults": {"policy": "quest", "budget": )" + defaults_budget + "}}";
}

// A number too large for a double made nlohmann throw out_of_range, which reached the ABI as
// SG_ERR_INTERNAL; it is bad input, named by its field.
TEST(ProfileInput, NumberOverflowIsBadInputNamingTheField) {
    struct Case {
        std::string text, path;
    };
    const Case cases[] = {
        {minimal(R"({"tokens": 1e400})"), "profile: defaults.budget.tokens:"},
        {minimal(R"({"fraction": -1e999})"), "profile: defaults.budget.fraction:"},
        {minimal(R"({"tokens": 64})", R"( "pool": 1e400,)"), "profile: pool:"},
        {minimal(R"({"tokens": 64})", R"( "layers": [{"layer": 0}, {"layer": 1e400}],)"), "profile: layers[1].layer:"},
        {minimal(R"({"tokens": 64})", R"( "layers": [{"layer": 0, "heads": [1e400]}],)"), "profile: layers[0].heads[0]:"},
    };
    for (const Case &c : cases) {
        SCOPED_TRACE(c.text);
        const auto [status, message] = parse_outcome(c.text);
        EXPECT_EQ(status, SG_ERR_INVALID_ARGUMENT) << message;
        EXPECT_EQ(message.rfind(c.path, 0), 0u) << message;
    }
}

// json_parse stopped at a NUL byte, so "{...}\0garbage" inside len was accepted.
TEST(ProfileInput, OnlyWhitespaceMayFollowTheValue) {
    const std::string good = minimal();
    EXPECT_EQ(parse_outcome(good + " \n\t\r ").first, SG_OK);
    for (const std::string &tail : {std::string("\0", 1), std::string("\0garbage", 8), std::string(" \0 ", 3)}) {
        const auto [status, message] = parse_outcome(good + tail);
        EXPECT_EQ(status, SG_ERR_INVALID_ARGUMENT) << message;
        EXPECT_NE(message.find("NUL"), std::string::npos) << message;
    }
    EXPECT_EQ(parse_outcome(good + " x").first, SG_ERR_INVALID_ARGUMENT);
}

// A 150-byte profile that declared 10^6 layers x 10^3 heads took 11 s, 10^9 x 10^9 never returned:
// the declared shape is bounded, so parsing stays linear in the input.
TEST(ProfileInput, DeclaredShapeIsBounded) {
    const auto shaped = [](const std::string &layers, const std::string &heads) {
        return R"({"version": 1, "model": "m", "num_layers": )" + layers + R"(, "num_kv_heads": )" + heads +
               R"(, "block_tokens": 16, "defaults": {"policy": "dense"}})";
    };
    struct Case {
        std::string layers, heads, field;
    };
    const Case cases[] = {
        {"1000000", "1000", "profile: num_layers:"},
        {"1000000000", "1000000000", "profile: num_layers:"},
        {"4294967295", "4294967295", "profile: num_layers:"},
        {"8", "1000000", "profile: num_kv_heads:"},
        {"65536", "65536", "profile: num_kv_heads:"},  // each within its bound, the product not
    };
    const auto t0 = std::chrono::steady_clock::now();
    for (const Case &c : cases) {
        SCOPED_TRACE(c.layers + " x " + c.heads);
        const auto [status, message] = parse_outcome(shaped(c.layers, c.heads));
        EXPECT_EQ(status, SG_ERR_INVALID_ARGUMENT) << message;
        EXPECT_EQ(message.rfind(c.field, 0), 0u) << message;
    }
    // The largest shape allowed still parses, quickly.
    EXPECT_EQ(parse_outcome(shaped("4096", "256")).first, SG_OK);
    EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), 2.0);
    // A profile built in code is held to the same bounds when a Selector takes it.
    try {
        Selector(uniform(70000, 1, 16, Policy::dense, Budget{}), {100, 64});
        FAIL() << "70000 layers accepted";
    } catch (const Error &e) {
        EXPECT_EQ(e.status(), SG_ERR_INVALID_ARGUMENT);
        EXPECT_NE(e.message().find("num_layers"), std::string::npos) << e.message();
    }
}

// Objects with many fields (ordered_json inserts each in linear time: quadratic in the input),
// repeated fields (the last one silently won) and deep nesting (the error message dumped the value
// recursively) are refused while reading, before any of that cost.
TEST(ProfileInput, FieldsAndNestingAreBounded) {
    std::string many = R"({"version": 1)";
    for (int i = 0; i < 200000; ++i) many += ", \"f" + std::to_string(i) + "\": 0";
    many += "}";
    const auto t0 = std::chrono::steady_clock::now();
    auto [status, message] = parse_outcome(many);
    EXPECT_EQ(status, SG_ERR_INVALID_ARGUMENT) << message;
    EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), 2.0);

    std::tie(status, message) = parse_outcome(minimal(R"({"tokens": 64})", R"( "pool": 3, "pool": 5,)"));
    EXPECT_EQ(status, SG_ERR_INVALID_ARGUMENT) << message;
    EXPECT_EQ(message.rfind("profile: pool:", 0), 0u) << message;

    const std::string deep = R"({"version": )" + std::string(200000, '[') + std::string(200000, ']') + "}";
    std::tie(status, message) = parse_outcome(deep);
    EXPECT_EQ(status, SG_ERR_INVALID_ARGUMENT) << message.substr(0, 200);
    EXPECT_EQ(message.rfind("profile: version", 0), 0u) << message.substr(0, 200);
    EXPECT_LT(message.size(), 1000u);
}

TEST(ProfileInput, SizeIsCapped) {
    std::string big = minimal();
    big.resize(size_t(SG_PROFILE_MAX_BYTES) + 1, ' ');
    const auto [status, message] = parse_outcome(big);
    EXPECT_EQ(status, SG_ERR_INVALID_ARGUMENT) << message;
    EXPECT_NE(message.find("64 MiB"), std::string::npos) << message;
}

// load_profile("/dev/zero") read without end; a FIFO blocked in open.
TEST(ProfileInput, LoadRefusesNonRegularAndOversizedFiles) {
    const auto load_outcome = [](const std::string &path) -> std::pair<sg_status_t, std::string> {
        try {
            load_profile(path);
            return {SG_OK, ""};
        } catch (const Error &e) {
            return {e.status(), e.message()};
        }
    };
    for (const char *path : {"/dev/zero", "/dev/null", "/"}) {
        SCOPED_TRACE(path);
        const auto [status, message] = load_outcome(path);
        EXPECT_EQ(status, SG_ERR_INVALID_ARGUMENT) << message;
        EXPECT_NE(message.find("not a regular file"), std::string::npos) << message;
    }
    const std::string fifo = testing::TempDir() + "select_test_profile.fifo";
    std::remove(fifo.c_str());
    ASSERT_EQ(mkfifo(fifo.c_str(), 0600), 0);
    EXPECT_EQ(load_outcome(fifo).first, SG_ERR_INVALID_ARGUMENT);  // and returns: nothing writes to it
    std::remove(fifo.c_str());

    const std::string big = testing::TempDir() + "select_test_profile_big.json";
    {
        std::FILE *f = std::fopen(big.c_str(), "w");
        ASSERT_NE(f, nullptr);
        std::fputs(minimal().c_str(), f);
        std::fclose(f);
    }
    EXPECT_EQ(load_outcome(big).first, SG_OK);
    ASSERT_EQ(truncate(big.c_str(), off_t(SG_PROFILE_MAX_BYTES) + 1), 0);  // sparse: costs no disk
    const auto [status, message] = load_outcome(big);
    EXPECT_EQ(status, SG_ERR_INVALID_ARGUMENT) << message;
    EXPECT_NE(message.find("64 MiB"), std::string::npos) << message;
    std::remove(big.c_str());
}

}  // namespace
}  // namespace sg::select

// ---- Parallel on-demand attention: attention over parts, merged exactly ------------------------

namespace merge_tests {

using sg::kernels::AttentionPart;
using sg::kernels::DType;

// Keys and values of `heads` KV heads stored in `dtype`, with the floats they round to.
struct Rows {
    DType dtype;
    std::vector<float> f32;      // what the kernel reads, as floats
    std::vector<uint16_t> f16;   // storage for fp16 / bf16
    const void *data() const { return dtype == DType::fp32 ? static_cast<const void *>(f32.data()) : f16.data(); }
};

Rows make_rows(DType dtype, size_t n, std::mt19937 &rng, float spread) {
    std::normal_distribution<float> nd(0.0f, spread);
    Rows r{dtype, std::vector<float>(n), std::vector<uint16_t>(n)};
    for (size_t i = 0; i < n; ++i) {
        const float x = nd(rng);
        if (dtype == DType::fp16) {
            r.f16[i] = sg::kernels::float_to_fp16(x);
            r.f32[i] = sg::kernels::fp16_to_float(r.f16[i]);
        } else if (dtype == DType::bf16) {
            r.f16[i] = sg::kernels::float_to_bf16(x);
            r.f32[i] = sg::kernels::bf16_to_float(r.f16[i]);
        } else {
            r.f32[i] = x;
        }
    }
    return r;
}

// The merged result of any split equals attention over all keys, computed directly in double,
// within 2e-5 relative to the largest |value| (fp32 accumulation over up to 300 keys); large score
// spreads check that the running max keeps every exponent finite.
TEST(AttentionMerge, AnySplitMergesToTheUnsplitAttention) {
    std::mt19937 rng(20261201);
    int empty_parts = 0;
    for (DType dtype : {DType::fp32, DType::fp16, DType::bf16}) {
        for (int trial = 0; trial < 150; ++trial) {
            const uint32_t heads = 2, dim = std::array<uint32_t, 3>{8, 64, 128}[rng() % 3];
            const uint64_t tokens = 1 + rng() % 300;
            const uint32_t kv_head = rng() % heads;
            const float spread = trial % 3 == 0 ? 8.0f : 1.0f;  // scores up to ~+-500 at 8
            const Rows k = make_rows(dtype, tokens * heads * dim, rng, spread);
            const Rows v = make_rows(dtype, tokens * heads * dim, rng, 1.0f);
            std::vector<float> q(dim);
            std::normal_distribution<float> nd(0.0f, spread);
            for (float &x : q) x = nd(rng);
            const float scale = 1.0f / std::sqrt(float(dim));
            const auto keys = sg::kernels::token_major(k.data(), dtype, tokens, heads, dim);
            const auto values = sg::kernels::token_major(v.data(), dtype, tokens, heads, dim);

            // Reference: softmax attention over every key, in double.
            std::vector<double> s(tokens), ref(dim, 0.0);
            double m = -INFINITY, z = 0, vmax = 0;
            for (uint64_t t = 0; t < tokens; ++t) {
                double d = 0;
                for (uint32_t i = 0; i < dim; ++i) d += double(q[i]) * k.f32[(t * heads + kv_head) * dim + i];
                s[t] = d * scale;
                m = std::max(m, s[t]);
            }
            for (uint64_t t = 0; t < tokens; ++t) {
                const double w = std::exp(s[t] - m);
                z += w;
                for (uint32_t i = 0; i < dim; ++i) {
                    const double x = v.f32[(t * heads + kv_head) * dim + i];
                    ref[i] += w * x;
                    vmax = std::max(vmax, std::abs(x));
                }
            }
            for (double &x : ref) x /= z;

            // Cut the tokens into runs (blocks) and hand each run to one of 1-6 parts, some of
            // which may get none; attend each part run by run, then merge the parts in a random
            // order.
            const int nparts = 1 + int(rng() % 6);
            std::vector<float> maxes(nparts, -INFINITY), sums(nparts, 0.0f);
            std::vector<std::vector<float>> accs(nparts, std::vector<float>(dim, 0.0f));
            for (uint64_t first = 0; first < tokens;) {
                const uint64_t run = std::min<uint64_t>(tokens - first, 1 + rng() % 32);
                const int p = int(rng() % nparts);
                sg::kernels::attend_part(q.data(), sg::kernels::slice(keys, first, run), sg::kernels::slice(values, first, run),
                                         kv_head, scale, AttentionPart{&maxes[p], &sums[p], accs[p].data()});
                first += run;
            }
            std::vector<int> order(nparts);
            std::iota(order.begin(), order.end(), 0);
            std::shuffle(order.begin(), order.end(), rng);
            float mx = -INFINITY, sm = 0;
            std::vector<float> acc(dim, 0.0f), out(dim);
            for (int p : order) {
                empty_parts += sums[p] == 0;
                sg::kernels::merge_parts(AttentionPart{&mx, &sm, acc.data()}, maxes[p], sums[p], accs[p].data(), dim);
            }
            sg::kernels::finish_part(sm, acc.data(), dim, out.data());
            for (uint32_t i = 0; i < dim; ++i)
                ASSERT_NEAR(out[i], ref[i], 2e-5 * (1 + vmax))
                    << "dtype " << int(dtype) << " trial " << trial << " tokens " << tokens << " parts " << nparts;
        }
    }
    EXPECT_GT(empty_parts, 0) << "the splits never had an empty part";
}

TEST(AttentionMerge, EmptyPartsLeaveAPartAsItIs) {
    float m = -INFINITY, s = 0;
    std::vector<float> acc(4, 0.0f), out(4);
    const float v[4] = {1, 2, 3, 4};
    sg::kernels::merge_parts(AttentionPart{&m, &s, acc.data()}, -INFINITY, 0, v, 4);  // empty into empty
    EXPECT_EQ(s, 0.0f);
    sg::kernels::finish_part(s, acc.data(), 4, out.data());
    for (float x : out) EXPECT_EQ(x, 0.0f);
    sg::kernels::merge_parts(AttentionPart{&m, &s, acc.data()}, 3.0f, 2.0f, v, 4);  // a part into empty
    sg::kernels::merge_parts(AttentionPart{&m, &s, acc.data()}, -INFINITY, 0, v, 4);  // empty into it
    EXPECT_EQ(m, 3.0f);
    EXPECT_EQ(s, 2.0f);
    sg::kernels::finish_part(s, acc.data(), 4, out.data());
    for (int i = 0; i < 4; ++i) EXPECT_FLOAT_EQ(out[i], v[i] / 2.0f);
}

}  // namespace merge_tests
