// In-flight quantization (sg_transfer_options_t.wire_quant). The segment codec against the CPU
// twin (kernels::quantize_block, written on its own terms): a whole block plane's scales and codes
// bit for bit, in every packing, block order, dtype and code; ranges that are not whole rows
// refused; then quantized transfers on the fake fabric, full and selective, every element within
// half a code step of the source, the statistics' byte counts, and the refusals at the call and at
// the match.
#include "fake_pair.hpp"

#include "quant/quant.hpp"
#include "kernels.hpp"

#include <gtest/gtest.h>

#include <cmath>
#include <random>

namespace {

using namespace sg;
using namespace sg::testing;

struct Geometry {
    sg_dtype_t dtype;
    sg_kv_packing_t packing;
    sg_block_order_t order;
    uint32_t heads, dim, tpb;
    uint64_t pad;  // bytes of padding after each block
};

kv::Layout layout_of(const Geometry &g, uint64_t blocks) {
    sg_kv_layout_t pub{};
    pub.struct_size = sizeof pub;
    pub.num_layers = 1;
    pub.num_kv_heads = g.heads;
    pub.head_dim = g.dim;
    pub.tokens_per_block = g.tpb;
    pub.num_blocks = blocks;
    pub.dtype = g.dtype;
    pub.packing = g.packing;
    pub.block_order = g.order;
    const uint64_t plane = uint64_t(g.tpb) * g.heads * g.dim * kv::dtype_bytes(g.dtype);
    pub.block_stride_bytes = plane * (g.packing == SG_KV_FUSED ? 2 : 1) + g.pad;
    return kv::make_layout_shape(pub);
}

kernels::DType kernel_dtype_of(sg_dtype_t d) {
    return d == SG_DTYPE_FP32 ? kernels::DType::fp32 : d == SG_DTYPE_FP16 ? kernels::DType::fp16 : kernels::DType::bf16;
}

// Random values of a dtype, magnitudes spread over a few binades per head, and every 37th element
// one that takes the codec's other branches (zeros of both signs, subnormals, the largest half, a
// NaN and both infinities: the maximum skips them and their code is the twin's).
void fill(std::vector<uint8_t> &bytes, sg_dtype_t dtype, uint64_t seed) {
    std::mt19937_64 rng(seed);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    const float specials[] = {0.0f, -0.0f, 3e-6f, -6e-8f, 65504.0f, std::nanf(""), INFINITY, -INFINITY};
    const size_t eb = kv::dtype_bytes(dtype);
    for (size_t i = 0; i + eb <= bytes.size(); i += eb) {
        float f = normal(rng) * std::ldexp(1.0f, int(rng() % 6) - 3);
        if ((i / eb) % 37 == 5) f = specials[(i / eb / 37) % std::size(specials)];
        if (dtype == SG_DTYPE_FP32) {
            std::memcpy(&bytes[i], &f, 4);
        } else {
            const uint16_t h = dtype == SG_DTYPE_FP16 ? kernels::float_to_fp16(f) : kernels::float_to_bf16(f);
            std::memcpy(&bytes[i], &h, 2);
        }
    }
}

float scale_at(const uint8_t *wire, uint64_t group) {
    uint32_t v = 0;
    for (int i = 0; i < 4; ++i) v |= uint32_t(wire[4 * group + i]) << (8 * i);
    return std::bit_cast<float>(v);
}

class WireQuantCodec : public ::testing::TestWithParam<kernels::QuantCode> {};

TEST_P(WireQuantCodec, AWholePlaneIsTheCpuTwinsScalesAndCodesBitForBit) {
    const kernels::QuantCode code = GetParam();
    int cases = 0;
    // Every vector path the CPU has (AVX2 where it is there, SSE2 always on x86-64), then the default.
    const quant::Simd best = quant::simd_in_use();
    for (quant::Simd simd : {quant::Simd::sse2, quant::Simd::avx2}) {
    quant::use_simd(simd);
    SCOPED_TRACE(simd == quant::Simd::avx2 ? "avx2" : "sse2");
    for (sg_dtype_t dtype : {SG_DTYPE_FP32, SG_DTYPE_FP16, SG_DTYPE_BF16})
        for (sg_kv_packing_t packing : {SG_KV_SEPARATE, SG_KV_FUSED})
            for (sg_block_order_t order : {SG_BLOCK_TOKEN_MAJOR, SG_BLOCK_HEAD_MAJOR}) {
                const Geometry g{dtype, packing, order, 3, 40, 4, 0};  // 40: the 32-, 16-, 8- and 4-wide loops and tails
                const kv::Layout L = layout_of(g, 5);
                std::vector<uint8_t> region(L.region_bytes());
                fill(region, dtype, 7 + cases);
                for (uint64_t block = 0; block < L.num_blocks; ++block)
                    for (uint32_t plane = 0; plane < 2; ++plane) {
                        const kv::Layout::Loc at = L.plane(plane, block);
                        quant::Shape shape;
                        ASSERT_TRUE(quant::shape_of(L, at.region, at.offset, L.plane_bytes, shape));
                        const uint32_t planes_per_block = packing == SG_KV_FUSED ? 2 : 1;
                        ASSERT_EQ(shape.groups, uint64_t(planes_per_block) * g.heads);
                        ASSERT_EQ(shape.elements, L.plane_bytes / L.elem_bytes);
                        std::vector<uint8_t> wire(shape.wire_bytes());
                        const std::pair<const uint8_t *, uint64_t> piece{region.data() + at.offset, L.plane_bytes};
                        quant::encode(L, at.region, at.offset, L.plane_bytes, shape, std::span(&piece, 1), code,
                                                 wire.data());

                        const void *data = region.data() + at.offset;
                        const kernels::DType kd = kernel_dtype_of(dtype);
                        const kernels::View v = order == SG_BLOCK_TOKEN_MAJOR
                                                    ? kernels::token_major(data, kd, g.tpb, g.heads, g.dim)
                                                    : kernels::head_major(data, kd, g.tpb, g.heads, g.dim, g.tpb);
                        std::vector<uint8_t> codes(shape.elements);
                        std::vector<float> scales(g.heads);
                        kernels::quantize_block(v, code, codes.data(), scales.data());
                        const uint32_t p = packing == SG_KV_FUSED ? plane : 0;
                        for (uint32_t h = 0; h < g.heads; ++h)
                            EXPECT_EQ(std::bit_cast<uint32_t>(scale_at(wire.data(), p * g.heads + h)),
                                      std::bit_cast<uint32_t>(scales[h]))
                                << "dtype " << dtype << " packing " << packing << " order " << order << " head " << h;
                        // The other plane of a fused block is not in the segment: its scales are 0.
                        if (packing == SG_KV_FUSED)
                            for (uint32_t h = 0; h < g.heads; ++h) EXPECT_EQ(scale_at(wire.data(), (1 - p) * g.heads + h), 0.0f);
                        EXPECT_EQ(0, std::memcmp(wire.data() + 4 * shape.groups, codes.data(), codes.size()))
                            << "dtype " << dtype << " packing " << packing << " order " << order;

                        // And back: the twin's dequantization of the same codes, bit for bit.
                        std::vector<uint8_t> back(L.plane_bytes), twin(L.plane_bytes);
                        quant::decode(L, at.region, at.offset, L.plane_bytes, shape, wire.data(), code,
                                                 back.data());
                        const kernels::View out = order == SG_BLOCK_TOKEN_MAJOR
                                                      ? kernels::token_major(twin.data(), kd, g.tpb, g.heads, g.dim)
                                                      : kernels::head_major(twin.data(), kd, g.tpb, g.heads, g.dim, g.tpb);
                        kernels::dequantize_block(codes.data(), scales.data(), code, out);
                        EXPECT_EQ(back, twin);
                    }
                ++cases;
            }
    }
    quant::use_simd(best);
    EXPECT_EQ(cases, 24);
}

INSTANTIATE_TEST_SUITE_P(Codes, WireQuantCodec, ::testing::Values(kernels::QuantCode::int8, kernels::QuantCode::fp8_e4m3),
                         [](const auto &info) { return info.param == kernels::QuantCode::int8 ? "Int8" : "Fp8E4M3"; });

// One +Inf and one NaN in a head of 1,024 elements: 0.4's int8 sent the whole head back non-finite
// (an infinite scale), fp8 did so for +Inf. Now, for both codes, those two arrive as NaN and every
// other element of the head as it would without them (the scale of its finite values).
TEST_P(WireQuantCodec, ANonFiniteElementArrivesAsNaNAndSpreadsToNothing) {
    const kernels::QuantCode code = GetParam();
    const quant::Simd best = quant::simd_in_use();
    for (quant::Simd simd : {quant::Simd::sse2, quant::Simd::avx2}) {
        quant::use_simd(simd);
        SCOPED_TRACE(simd == quant::Simd::avx2 ? "avx2" : "sse2");
        for (sg_dtype_t dtype : {SG_DTYPE_FP32, SG_DTYPE_FP16, SG_DTYPE_BF16}) {
            const Geometry g{dtype, SG_KV_SEPARATE, SG_BLOCK_TOKEN_MAJOR, 1, 64, 16, 0};  // one head, 1,024 elements
            const kv::Layout L = layout_of(g, 1);
            const uint64_t n = L.plane_bytes / L.elem_bytes;
            std::vector<float> x(n);
            for (uint64_t i = 0; i < n; ++i) x[i] = std::sin(0.37f * float(i)) * 2.0f;
            const uint64_t inf_at = 100, nan_at = 700;
            x[inf_at] = INFINITY;
            x[nan_at] = std::nanf("");
            std::vector<uint8_t> region(L.region_bytes());
            for (uint64_t i = 0; i < n; ++i) {
                if (dtype == SG_DTYPE_FP32) {
                    std::memcpy(&region[4 * i], &x[i], 4);
                } else {
                    const uint16_t h = dtype == SG_DTYPE_FP16 ? kernels::float_to_fp16(x[i]) : kernels::float_to_bf16(x[i]);
                    std::memcpy(&region[2 * i], &h, 2);
                }
            }
            const kv::Layout::Loc at = L.plane(0, 0);
            quant::Shape shape;
            ASSERT_TRUE(quant::shape_of(L, at.region, at.offset, L.plane_bytes, shape));
            std::vector<uint8_t> wire(shape.wire_bytes()), back(L.plane_bytes);
            const std::pair<const uint8_t *, uint64_t> piece{region.data() + at.offset, L.plane_bytes};
            quant::encode(L, at.region, at.offset, L.plane_bytes, shape, std::span(&piece, 1), code, wire.data());
            const float scale = scale_at(wire.data(), 0);
            EXPECT_TRUE(std::isfinite(scale) && scale > 0) << scale;
            quant::decode(L, at.region, at.offset, L.plane_bytes, shape, wire.data(), code, back.data());
            int bad = 0;
            for (uint64_t i = 0; i < n; ++i) {
                float got;
                if (dtype == SG_DTYPE_FP32) {
                    std::memcpy(&got, &back[4 * i], 4);
                } else {
                    uint16_t h;
                    std::memcpy(&h, &back[2 * i], 2);
                    got = dtype == SG_DTYPE_FP16 ? kernels::fp16_to_float(h) : kernels::bf16_to_float(h);
                }
                if (i == inf_at || i == nan_at) {
                    EXPECT_TRUE(std::isnan(got)) << "element " << i << " arrived as " << got;
                    continue;
                }
                // Half an int8 step of the finite scale (E4M3 is relative: 1/16 of the value), and the
                // source's own rounding to its dtype.
                const float tol = (code == kernels::QuantCode::int8 ? 0.5f * scale : std::fabs(x[i]) / 16.0f) +
                                  std::fabs(x[i]) / 128.0f + 1e-3f;
                if (!(std::fabs(got - x[i]) <= tol)) ++bad;
            }
            EXPECT_EQ(bad, 0) << "dtype " << dtype << ": elements beside the non-finite ones changed";
        }
    }
    quant::use_simd(best);
}

TEST(WireQuant, ASegmentOverSeveralBlocksHasAScaleForEachBlockPlaneAndHead) {
    const Geometry g{SG_DTYPE_FP16, SG_KV_SEPARATE, SG_BLOCK_TOKEN_MAJOR, 2, 4, 4, 0};
    const kv::Layout L = layout_of(g, 8);
    quant::Shape shape;
    // Blocks 2..4 whole, then one token of block 5: four blocks, two heads.
    const uint64_t len = 3 * L.block_stride + L.row_bytes() * g.heads;
    ASSERT_TRUE(quant::shape_of(L, 1, 2 * L.block_stride, len, shape));
    EXPECT_EQ(shape.groups, 4u * 2);
    EXPECT_EQ(shape.elements, len / 2);
    EXPECT_EQ(shape.wire_bytes(), 4 * 8 + len / 2);
}

TEST(WireQuant, RangesThatAreNotWholeRowsOfAPlaneAreRefused) {
    const Geometry g{SG_DTYPE_FP16, SG_KV_FUSED, SG_BLOCK_TOKEN_MAJOR, 2, 4, 4, 16};
    const kv::Layout L = layout_of(g, 4);
    quant::Shape shape;
    EXPECT_TRUE(quant::shape_of(L, 0, 0, 2 * L.plane_bytes, shape));
    EXPECT_FALSE(quant::shape_of(L, 0, 0, L.block_stride + L.plane_bytes, shape)) << "covers the padding";
    EXPECT_FALSE(quant::shape_of(L, 0, 2, L.row_bytes(), shape)) << "a cut row";
    EXPECT_FALSE(quant::shape_of(L, 0, 0, L.row_bytes() / 2, shape)) << "half a row";
    EXPECT_FALSE(quant::shape_of(L, 1, 0, L.row_bytes(), shape)) << "a fused pool has one region a layer";
    const kv::Layout fp8 = layout_of({SG_DTYPE_FP8_E4M3, SG_KV_SEPARATE, SG_BLOCK_TOKEN_MAJOR, 2, 4, 4, 0}, 4);
    EXPECT_FALSE(quant::shape_of(fp8, 0, 0, fp8.row_bytes(), shape)) << "fp8 has no quantized form";
}

// ---- on the fake fabric ----

// Whether every element of the decode pool is within half a code step of the source: int8 steps
// are the (block, plane) scale, max |x| / 127; E4M3's a sixteenth of the value, or 2^-10 of the scale
// near zero; plus fp16's own rounding of the result.
::testing::AssertionResult within_a_step(const HostPool &src, const std::vector<uint32_t> &st, const HostPool &dst,
                                         const std::vector<uint32_t> &dt, uint64_t tokens, kernels::QuantCode code) {
    for (uint32_t l = 0; l < src.layers; ++l)
        for (int plane = 0; plane < 2; ++plane)
            for (size_t i = 0; i < st.size(); ++i) {
                const uint16_t *s = (plane ? src.v : src.k)[l].data() + size_t(st[i]) * src.block_elems();
                const uint16_t *d = (plane ? dst.v : dst.k)[l].data() + size_t(dt[i]) * dst.block_elems();
                const size_t n = size_t(std::min<uint64_t>(src.tpb, tokens - i * src.tpb)) * src.head_dim;
                float absmax = 0;
                for (size_t e = 0; e < n; ++e) absmax = std::fmax(absmax, std::fabs(kernels::fp16_to_float(s[e])));
                const float scale = absmax / kernels::quant_max(code);
                for (size_t e = 0; e < n; ++e) {
                    const float x = kernels::fp16_to_float(s[e]), y = kernels::fp16_to_float(d[e]);
                    const float step = code == kernels::QuantCode::int8 ? 0.5f * scale
                                                                       : std::fabs(x) / 16 + scale / 1024;
                    if (!(std::fabs(x - y) <= step * 1.0001f + std::fabs(x) / 1024))
                        return ::testing::AssertionFailure() << "layer " << l << " plane " << plane << " block " << i
                                                             << " element " << e << ": " << x << " arrived as " << y
                                                             << " (scale " << scale << ")";
                }
            }
    return ::testing::AssertionSuccess();
}

struct QuantCase {
    uint32_t wire_quant;
    uint32_t paths;
};

class WireQuantTransfer : public ::testing::TestWithParam<QuantCase> {};

TEST_P(WireQuantTransfer, EveryElementArrivesWithinHalfAStepAndTheWireCarriesCodes) {
    const QuantCase c = GetParam();
    FakePair p(11);
    Request r(p, 3, 64, 250);
    sg_transfer_options_t o = transfer_options(c.paths);
    o.wire_quant = c.wire_quant;
    r.do_expect(o);
    r.do_post(o);
    if (c.paths & SG_PATH_PROACTIVE) {
        // Proactive and on-demand first: ask for two blocks of layer 1, then let the rest come.
        ASSERT_TRUE(p.run_until([&] { return r.expect->paths() != 0; }));  // the Selective notice
        const uint32_t want[] = {5, 40};
        r.expect->fetch(1, want);
    }
    ASSERT_TRUE(r.run_to_quiesce()) << "prefill " << r.post->status << " " << r.post->error << ", decode "
                                    << r.expect->status << " " << r.expect->error << ", resident "
                                    << r.expect->residency.count(0) << "/" << r.expect->residency.count(1) << "/"
                                    << r.expect->residency.count(2) << " of " << r.dt.size();
    ASSERT_EQ(r.post->status, SG_OK) << r.post->error;
    ASSERT_EQ(r.expect->status, SG_OK) << r.expect->error;
    kernels::QuantCode code;
    ASSERT_TRUE(quant::code_of(c.wire_quant, code));
    EXPECT_TRUE(within_a_step(r.src, r.st, r.dst, r.dt, r.tokens, code));
    // fp16, one head: each block plane is 4 x 64 elements, 512 bytes, sent as 256 codes + one scale.
    const uint64_t payload = uint64_t(r.tokens) * 64 * 2 * 2 * 3;
    for (auto *t : {r.post.get(), r.expect.get()}) {
        EXPECT_EQ(t->stats.quantized_bytes, payload) << (t == r.post.get() ? "prefill" : "decode");
        EXPECT_GE(t->stats.quantized_wire_bytes, payload / 2);
        EXPECT_LE(t->stats.quantized_wire_bytes, payload / 2 + 4 * 2 * 3 * 2 * 63);
    }
    EXPECT_EQ(r.post->stats.quantized_wire_bytes, r.expect->stats.quantized_wire_bytes);
    r.finish();
}

INSTANTIATE_TEST_SUITE_P(
    Paths, WireQuantTransfer,
    ::testing::Values(QuantCase{SG_WIRE_QUANT_INT8, SG_PATH_FULL}, QuantCase{SG_WIRE_QUANT_FP8_E4M3, SG_PATH_FULL},
                      QuantCase{SG_WIRE_QUANT_INT8, SG_PATH_PROACTIVE | SG_PATH_ON_DEMAND | SG_PATH_SPECULATIVE},
                      QuantCase{SG_WIRE_QUANT_FP8_E4M3, SG_PATH_PROACTIVE | SG_PATH_ON_DEMAND | SG_PATH_SPECULATIVE}),
    [](const auto &info) {
        return std::string(info.param.wire_quant == SG_WIRE_QUANT_INT8 ? "Int8" : "Fp8") +
               (info.param.paths == SG_PATH_FULL ? "Full" : "Selective");
    });

TEST(WireQuant, SidesThatDisagreeFailAtTheMatchAndMoveNothing) {
    FakePair p(12);
    Request r(p, 2, 16, 60);
    sg_transfer_options_t o = transfer_options();
    r.do_expect(o);  // no consent
    p.run_until([&] { return false; }, 20);
    o.wire_quant = SG_WIRE_QUANT_INT8;
    try {
        r.do_post(o);
        FAIL() << "a quantized post matched an expect that did not consent";
    } catch (const Error &e) {
        EXPECT_EQ(e.status(), SG_ERR_LAYOUT_MISMATCH);
        EXPECT_NE(e.message().find("wire quantization differs"), std::string::npos) << e.message();
    }
    ASSERT_TRUE(p.run_until([&] { return r.expect->finished(); }));
    EXPECT_EQ(r.expect->status, SG_ERR_LAYOUT_MISMATCH);
    EXPECT_EQ(r.expect->stats.bytes, 0u);
    r.expect->release();
    r.expect.reset();
    p.close();
}

TEST(WireQuant, BadValuesAndPoolsWithoutAQuantizedFormAreRefusedAtTheCall) {
    FakePair p(13);
    Request r(p, 1, 8, 16);
    sg_transfer_options_t o = transfer_options();
    o.wire_quant = 3;
    try {
        p.decode->expect(p.at_decode, "q", r.dst_kv, r.dt, r.tokens, o);
        FAIL() << "wire_quant 3 accepted";
    } catch (const Error &e) {
        EXPECT_EQ(e.status(), SG_ERR_INVALID_ARGUMENT);
        EXPECT_NE(e.message().find("options.wire_quant"), std::string::npos);
    }
    HostPool fp8(1, 8);
    fp8.layout.dtype = SG_DTYPE_FP8_E4M3;  // fp16 storage is twice what an fp8 pool needs: fine here
    auto fp8_kv = std::make_shared<core::KvPool>(p.prefill.get(), fp8.layout);
    p.at_prefill->export_kv(*fp8_kv);
    o.wire_quant = SG_WIRE_QUANT_INT8;
    try {
        p.prefill->post(p.at_prefill, "q", fp8_kv, r.st, r.tokens, o, nullptr);
        FAIL() << "an fp8 pool accepted wire quantization";
    } catch (const Error &e) {
        EXPECT_EQ(e.status(), SG_ERR_INVALID_ARGUMENT);
        EXPECT_NE(e.message().find("fp32, fp16 or bf16"), std::string::npos) << e.message();
    }
    p.close();
}

}  // namespace
