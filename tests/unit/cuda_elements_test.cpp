// The CUDA kernels' per-element work (kernels/cuda/elements.hpp), run on the host over every element
// of the grid a kernel would launch, against the CPU twins: the packed staging layout against a
// plain memcpy of each block's planes, and the digest elements against kernels::page_digest, bit for
// bit. Runs everywhere (no GPU, no CUDA toolkit needed); the device runs the same functions.
#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <vector>

#include "cuda/elements.hpp"
#include "kernels.hpp"

namespace {

using sg::kernels::DType;
namespace elem = sg::kernels::cuda;

struct Regions {
    std::vector<uint8_t> k, v;
};

// The CPU twin of the staged path's pack: each listed block's K plane then its V plane, memcpy'd.
std::vector<uint8_t> pack_with_memcpy(const elem::PackGeometry &g, const Regions &r, const std::vector<uint32_t> &blocks) {
    std::vector<uint8_t> out;
    for (uint32_t b : blocks) {
        const uint8_t *k = r.k.data() + uint64_t(b) * g.block_stride;
        const uint8_t *v = g.fused ? k + g.plane_bytes : r.v.data() + uint64_t(b) * g.block_stride;
        out.insert(out.end(), k, k + g.plane_bytes);
        out.insert(out.end(), v, v + g.plane_bytes);
    }
    return out;
}

TEST(CudaElements, PackedSourceIsTheMemcpyPackOfEveryByte) {
    std::mt19937_64 rng(7);
    for (int round = 0; round < 40; ++round) {
        elem::PackGeometry g;
        g.fused = round % 2;
        g.plane_bytes = 16u * (1 + rng() % 64) + (round % 3 == 0 ? 2 : 0);  // some planes not a multiple of 16
        const uint64_t block_bytes = g.plane_bytes * (g.fused ? 2 : 1);
        g.block_stride = block_bytes + (rng() % 3) * 32;  // packed, or padded between blocks
        const uint32_t pool_blocks = 8 + uint32_t(rng() % 40);
        Regions r;
        r.k.resize(uint64_t(pool_blocks) * g.block_stride);
        if (!g.fused) r.v.resize(r.k.size());
        for (auto &b : r.k) b = uint8_t(rng());
        for (auto &b : r.v) b = uint8_t(rng());
        std::vector<uint32_t> blocks(1 + rng() % pool_blocks);
        for (auto &b : blocks) b = uint32_t(rng() % pool_blocks);  // scattered, repeats allowed for a gather

        const std::vector<uint8_t> want = pack_with_memcpy(g, r, blocks);
        std::vector<uint8_t> gathered(want.size());
        std::vector<uint8_t> k_back(r.k.size()), v_back(r.v.size());
        // What the gather and scatter kernels do, one unit per "thread", over the whole grid.
        const uint32_t unit = elem::pack_unit(g, 16);
        ASSERT_EQ(want.size() % unit, 0u);
        for (uint64_t at = 0; at < want.size(); at += unit) {
            const elem::PackSource s = elem::packed_source(g, blocks.data(), at);
            const uint8_t *region = s.plane == 0 || g.fused ? r.k.data() : r.v.data();
            std::memcpy(&gathered[at], region + s.region_offset, unit);
            uint8_t *back = s.plane == 0 || g.fused ? k_back.data() : v_back.data();
            std::memcpy(back + s.region_offset, &want[at], unit);
        }
        ASSERT_EQ(gathered, want) << "round " << round << ", plane " << g.plane_bytes << ", fused " << g.fused;
        // Scatter puts every packed byte back where it came from (the last of repeated blocks wins,
        // and holds the same bytes).
        for (uint32_t b : blocks) {
            const uint64_t at = uint64_t(b) * g.block_stride;
            ASSERT_EQ(0, std::memcmp(&k_back[at], &r.k[at], g.fused ? 2 * g.plane_bytes : g.plane_bytes));
            if (!g.fused) {
                ASSERT_EQ(0, std::memcmp(&v_back[at], &r.v[at], g.plane_bytes));
            }
        }
    }
}

TEST(CudaElements, PackUnitIsTheWidestAlignedDivisor) {
    EXPECT_EQ(elem::pack_unit({4096, 8192, 2, 0}, 256), 16u);
    EXPECT_EQ(elem::pack_unit({4104, 8208, 2, 0}, 256), 8u);
    EXPECT_EQ(elem::pack_unit({4096, 8192, 2, 0}, 4), 4u);
    EXPECT_EQ(elem::pack_unit({18, 36, 2, 0}, 256), 2u);
    EXPECT_EQ(elem::pack_unit({4095, 8190, 2, 0}, 256), 1u);
}

// Keys in every dtype and both block orders, a partial last block: each digest element equals
// page_digest's row element, bit for bit.
TEST(CudaElements, DigestElementsAreThePageDigest) {
    std::mt19937 rng(11);
    std::normal_distribution<float> key(0.0f, 3.0f);
    for (DType dtype : {DType::fp32, DType::fp16, DType::bf16}) {
        for (bool head_major : {false, true}) {
            const uint32_t heads = 3, dim = 40, tpb = 16;
            const uint64_t tokens = 16 * 5 + 7;  // five full blocks and a partial one
            const uint64_t blocks = sg::kernels::num_blocks(tokens, tpb);
            const size_t eb = sg::kernels::dtype_bytes(dtype);
            const uint64_t block_elems = uint64_t(tpb) * heads * dim;
            std::vector<uint8_t> pool(blocks * block_elems * eb);
            for (uint64_t i = 0; i < blocks * block_elems; ++i) {
                const float f = key(rng);
                if (dtype == DType::fp32) std::memcpy(&pool[i * 4], &f, 4);
                const uint16_t h = dtype == DType::fp16 ? sg::kernels::float_to_fp16(f) : sg::kernels::float_to_bf16(f);
                if (dtype != DType::fp32) std::memcpy(&pool[i * 2], &h, 2);
            }
            std::vector<float> want(sg::kernels::digest_floats(blocks, heads, dim));
            std::vector<float> got(want.size(), -1.0f);
            for (uint64_t b = 0; b < blocks; ++b) {
                const void *block = &pool[b * block_elems * eb];
                const uint64_t valid = std::min<uint64_t>(tpb, tokens - b * tpb);
                const sg::kernels::View v = head_major ? sg::kernels::head_major(block, dtype, tpb, heads, dim, tpb)
                                                       : sg::kernels::token_major(block, dtype, tpb, heads, dim);
                // The CPU twin, one block at a time as the runtime calls it.
                sg::kernels::page_digest(sg::kernels::slice(v, 0, valid), tpb, &want[b * heads * 2 * dim]);
                for (uint32_t h = 0; h < heads; ++h)
                    for (uint32_t d = 0; d < dim; ++d) {
                        float *row = &got[(b * heads + h) * 2 * dim];
                        elem::digest_element(v, valid, h, d, &row[d], &row[dim + d]);
                    }
            }
            for (size_t i = 0; i < want.size(); ++i)
                ASSERT_EQ(std::memcmp(&want[i], &got[i], 4), 0)
                    << "dtype " << int(dtype) << (head_major ? " head-major" : " token-major") << " float " << i
                    << ": " << want[i] << " vs " << got[i];
        }
    }
}

}  // namespace
