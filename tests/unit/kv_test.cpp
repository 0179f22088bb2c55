// Unit tests for runtime/kv: layout validation and derived sizes, block addressing, layout mapping
// rules, block-table checks, residency bitmaps, and refusal of nonsense layouts sent by a peer.
#include "kv/kv.hpp"

#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <string>
#include <vector>

namespace sg::kv {
namespace {

// Runs `stmt`, which must throw sg::Error with `status` and a message containing `needle`.
#define EXPECT_SG_ERROR(stmt, status_, needle)                                                             \
    do {                                                                                                   \
        try {                                                                                              \
            stmt;                                                                                          \
            ADD_FAILURE() << #stmt " did not throw";                                                       \
        } catch (const sg::Error &e_) {                                                                    \
            EXPECT_EQ(e_.status(), status_) << e_.what();                                                  \
            EXPECT_NE(std::string(e_.what()).find(needle), std::string::npos)                              \
                << "message \"" << e_.what() << "\" does not mention \"" << needle << "\"";                \
        }                                                                                                  \
    } while (0)

// A valid public layout with real (never dereferenced) base pointers, which tests then break.
struct Pub {
    char storage[8] = {};
    std::vector<void *> k, v;
    sg_kv_layout_t l{};

    Pub(uint32_t layers = 2, sg_kv_packing_t packing = SG_KV_SEPARATE) {
        for (uint32_t i = 0; i < layers; ++i) {
            k.push_back(&storage[i % 4]);
            v.push_back(&storage[4 + i % 4]);
        }
        l.struct_size = sizeof l;
        l.num_layers = layers;
        l.num_kv_heads = 8;
        l.head_dim = 128;
        l.tokens_per_block = 16;
        l.num_blocks = 100;
        l.dtype = SG_DTYPE_FP16;
        l.packing = packing;
        l.block_order = SG_BLOCK_TOKEN_MAJOR;
        l.mem_kind = SG_MEM_HOST;
        l.layer_k_base = k.data();
        l.layer_v_base = packing == SG_KV_SEPARATE ? v.data() : nullptr;
        l.layer_base_count = layers;
        l.block_stride_bytes = 0;
    }
};

LayoutDesc desc(uint32_t heads = 4, uint32_t head_dim = 64, uint32_t tpb = 16, sg_dtype_t dtype = SG_DTYPE_FP16) {
    LayoutDesc d;
    d.num_layers = 4;
    d.num_kv_heads = heads;
    d.head_dim = head_dim;
    d.tokens_per_block = tpb;
    d.num_blocks = 32;
    d.dtype = dtype;
    d.packing = SG_KV_SEPARATE;
    d.block_order = SG_BLOCK_TOKEN_MAJOR;
    d.mem_kind = SG_MEM_HOST;
    d.block_stride_bytes = 0;
    return d;
}

// ---- make_layout: derived sizes ----

TEST(KvLayout, DerivesSizesForEveryDtype) {
    struct Case {
        sg_dtype_t dtype;
        uint64_t elem;
    };
    for (Case c : {Case{SG_DTYPE_FP32, 4}, Case{SG_DTYPE_FP16, 2}, Case{SG_DTYPE_BF16, 2}, Case{SG_DTYPE_FP8_E4M3, 1}}) {
        SCOPED_TRACE(int(c.dtype));
        Pub p;
        p.l.dtype = c.dtype;
        const Layout l = make_layout(p.l);
        EXPECT_EQ(l.elem_bytes, c.elem);
        EXPECT_EQ(l.row_bytes(), 128 * c.elem);
        // 16 tokens x 8 heads x 128 dims.
        EXPECT_EQ(l.plane_bytes, 16ull * 8 * 128 * c.elem);
        EXPECT_EQ(l.block_stride, l.plane_bytes);  // separate: a block in a region is one plane
        EXPECT_EQ(l.region_bytes(), 100 * l.plane_bytes);
        EXPECT_EQ(l.regions_per_layer(), 2u);
    }
}

TEST(KvLayout, FusedStrideIsTwoPlanes) {
    Pub p(3, SG_KV_FUSED);
    p.l.dtype = SG_DTYPE_BF16;
    const Layout l = make_layout(p.l);
    EXPECT_EQ(l.plane_bytes, 16ull * 8 * 128 * 2);
    EXPECT_EQ(l.block_stride, 2 * l.plane_bytes);
    EXPECT_EQ(l.regions_per_layer(), 1u);
    EXPECT_EQ(l.region_bytes(), 100 * 2 * l.plane_bytes);
}

TEST(KvLayout, ExplicitStrideIsRespectedAndTooSmallRefused) {
    Pub p;
    const uint64_t plane = 16ull * 8 * 128 * 2;
    p.l.block_stride_bytes = plane + 256;  // padding between blocks, as some engines have
    Layout l = make_layout(p.l);
    EXPECT_EQ(l.plane_bytes, plane);
    EXPECT_EQ(l.block_stride, plane + 256);
    EXPECT_EQ(l.region_bytes(), 100 * (plane + 256));

    p.l.block_stride_bytes = plane;  // exactly one block is fine
    EXPECT_EQ(make_layout(p.l).block_stride, plane);

    p.l.block_stride_bytes = plane - 1;
    EXPECT_SG_ERROR(make_layout(p.l), SG_ERR_INVALID_LAYOUT, "block_stride_bytes");

    // Fused needs room for K and V: one plane is too small.
    Pub f(2, SG_KV_FUSED);
    f.l.block_stride_bytes = plane;
    EXPECT_SG_ERROR(make_layout(f.l), SG_ERR_INVALID_LAYOUT, "block_stride_bytes");
    f.l.block_stride_bytes = 2 * plane + 64;
    EXPECT_EQ(make_layout(f.l).block_stride, 2 * plane + 64);
}

TEST(KvLayout, CopiesEveryPublicField) {
    Pub p(5, SG_KV_FUSED);
    p.l.num_kv_heads = 3;
    p.l.head_dim = 7;
    p.l.tokens_per_block = 5;
    p.l.num_blocks = 11;
    p.l.dtype = SG_DTYPE_FP32;
    p.l.block_order = SG_BLOCK_HEAD_MAJOR;
    p.l.device = 3;
    const Layout l = make_layout(p.l);
    EXPECT_EQ(l.num_layers, 5u);
    EXPECT_EQ(l.num_kv_heads, 3u);
    EXPECT_EQ(l.head_dim, 7u);
    EXPECT_EQ(l.tokens_per_block, 5u);
    EXPECT_EQ(l.num_blocks, 11u);
    EXPECT_EQ(l.dtype, SG_DTYPE_FP32);
    EXPECT_EQ(l.packing, SG_KV_FUSED);
    EXPECT_EQ(l.order, SG_BLOCK_HEAD_MAJOR);
    EXPECT_EQ(l.device, 3);
    EXPECT_EQ(l.plane_bytes, 5ull * 3 * 7 * 4);
}

// ---- make_layout: every invalid field is refused and named ----

TEST(KvLayout, RefusesEachInvalidFieldByName) {
    struct Case {
        const char *field;
        void (*breakit)(Pub &);
    };
    const Case cases[] = {
        {"num_layers", [](Pub &p) { p.l.num_layers = 0; }},
        {"num_kv_heads", [](Pub &p) { p.l.num_kv_heads = 0; }},
        {"head_dim", [](Pub &p) { p.l.head_dim = 0; }},
        {"tokens_per_block", [](Pub &p) { p.l.tokens_per_block = 0; }},
        {"num_blocks", [](Pub &p) { p.l.num_blocks = 0; }},
        {"num_blocks", [](Pub &p) { p.l.num_blocks = (uint64_t(1) << 32) + 1; }},  // ids are 32-bit
        {"dtype", [](Pub &p) { p.l.dtype = sg_dtype_t(77); }},
        {"packing", [](Pub &p) { p.l.packing = sg_kv_packing_t(2); }},
        {"block_order", [](Pub &p) { p.l.block_order = sg_block_order_t(2); }},
        {"mem_kind", [](Pub &p) { p.l.mem_kind = sg_mem_kind_t(2); }},
        {"head_dim", [](Pub &p) { p.l.head_dim = (1u << 16) + 1; }},  // implausible sizes are named too
        {"layer_base_count", [](Pub &p) { p.l.layer_base_count = 1; }},
        {"layer_k_base", [](Pub &p) { p.l.layer_k_base = nullptr; }},
        {"layer_k_base[1]", [](Pub &p) { p.k[1] = nullptr; }},
        {"layer_v_base", [](Pub &p) { p.l.layer_v_base = nullptr; }},
        {"layer_v_base[1]", [](Pub &p) { p.v[1] = nullptr; }},
        {"block_stride_bytes", [](Pub &p) { p.l.block_stride_bytes = 1; }},
    };
    for (const Case &c : cases) {
        SCOPED_TRACE(c.field);
        Pub p;
        ASSERT_NO_THROW(make_layout(p.l));
        c.breakit(p);
        EXPECT_SG_ERROR(make_layout(p.l), SG_ERR_INVALID_LAYOUT, c.field);
    }
    // A fused pool has no V array: passing one is a caller mix-up.
    Pub f(2, SG_KV_FUSED);
    ASSERT_NO_THROW(make_layout(f.l));
    f.l.layer_v_base = f.v.data();
    EXPECT_SG_ERROR(make_layout(f.l), SG_ERR_INVALID_LAYOUT, "layer_v_base");
}

TEST(KvLayout, RefusesStrideTimesBlocksOverflow) {
    Pub p;
    p.l.block_stride_bytes = uint64_t(1) << 40;
    p.l.num_blocks = uint64_t(1) << 23;  // 2^63 bytes per region
    EXPECT_SG_ERROR(make_layout(p.l), SG_ERR_INVALID_LAYOUT, "overflows");
    p.l.block_stride_bytes = (uint64_t(1) << 40) + 1;
    p.l.num_blocks = 1;
    EXPECT_SG_ERROR(make_layout(p.l), SG_ERR_INVALID_LAYOUT, "block_stride_bytes");
}

// ---- addressing ----

TEST(KvLayout, PlaneAndRowOffsetsMatchHandComputedValues) {
    // 3 heads x 5 dims of fp16: a row (one token, one head) is 10 bytes; 4 tokens per block, so a
    // plane is 4 * 3 * 10 = 120 bytes.
    LayoutDesc d = desc(3, 5, 4, SG_DTYPE_FP16);

    d.packing = SG_KV_SEPARATE;
    d.block_order = SG_BLOCK_TOKEN_MAJOR;
    Layout l = from_desc(d);
    ASSERT_EQ(l.row_bytes(), 10u);
    ASSERT_EQ(l.plane_bytes, 120u);
    EXPECT_EQ(l.plane(0, 7).region, 0u);
    EXPECT_EQ(l.plane(0, 7).offset, 840u);
    EXPECT_EQ(l.plane(1, 7).region, 1u);  // V lives in its own region at the same block offset
    EXPECT_EQ(l.plane(1, 7).offset, 840u);
    EXPECT_EQ(l.row_offset(0, 0), 0u);
    EXPECT_EQ(l.row_offset(0, 2), 20u);  // token-major: heads of a token are adjacent
    EXPECT_EQ(l.row_offset(2, 1), 70u);  // (2 * 3 + 1) * 10
    EXPECT_EQ(l.row_offset(3, 2), 110u);  // last row ends exactly at the plane's end

    d.block_order = SG_BLOCK_HEAD_MAJOR;
    l = from_desc(d);
    EXPECT_EQ(l.row_offset(0, 2), 80u);  // head-major: (2 * 4 + 0) * 10
    EXPECT_EQ(l.row_offset(2, 1), 60u);  // (1 * 4 + 2) * 10
    EXPECT_EQ(l.row_offset(1, 0), 10u);  // tokens of a head are adjacent
    EXPECT_EQ(l.row_offset(3, 2), 110u);

    d.packing = SG_KV_FUSED;
    d.block_order = SG_BLOCK_TOKEN_MAJOR;
    l = from_desc(d);
    ASSERT_EQ(l.block_stride, 240u);
    EXPECT_EQ(l.plane(0, 7).region, 0u);
    EXPECT_EQ(l.plane(0, 7).offset, 1680u);
    EXPECT_EQ(l.plane(1, 7).region, 0u);  // V follows K in the same block
    EXPECT_EQ(l.plane(1, 7).offset, 1800u);

    d.block_stride_bytes = 256;  // padded fused blocks: V still right after K
    l = from_desc(d);
    EXPECT_EQ(l.plane(0, 7).offset, 7u * 256);
    EXPECT_EQ(l.plane(1, 7).offset, 7u * 256 + 120);

    d.packing = SG_KV_SEPARATE;
    d.block_stride_bytes = 200;
    l = from_desc(d);
    EXPECT_EQ(l.plane(1, 3).region, 1u);
    EXPECT_EQ(l.plane(1, 3).offset, 600u);
}

// ---- mapping ----

TEST(KvMapping, AcceptsDifferencesThePlannerMaps) {
    const Layout base = from_desc(desc());
    LayoutDesc d = desc(4, 64, 32);
    d.packing = SG_KV_FUSED;
    d.block_order = SG_BLOCK_HEAD_MAJOR;
    d.num_blocks = 999;
    d.block_stride_bytes = 2 * 32 * 4 * 64 * 2 + 4096;
    d.mem_kind = SG_MEM_CUDA;
    const Layout other = from_desc(d);
    EXPECT_NO_THROW(check_mappable(base, other));
    EXPECT_NO_THROW(check_mappable(other, base));
}

TEST(KvMapping, RefusesShapeOrDtypeDifferenceByName) {
    const Layout base = from_desc(desc());
    struct Case {
        const char *field;
        void (*change)(LayoutDesc &);
    };
    const Case cases[] = {
        {"num_layers", [](LayoutDesc &d) { d.num_layers = 5; }},
        {"num_kv_heads", [](LayoutDesc &d) { d.num_kv_heads = 8; }},
        {"head_dim", [](LayoutDesc &d) { d.head_dim = 128; }},
        // Same element size, different type: bytes would copy but mean something else.
        {"dtype", [](LayoutDesc &d) { d.dtype = SG_DTYPE_BF16; }},
    };
    for (const Case &c : cases) {
        SCOPED_TRACE(c.field);
        LayoutDesc d = desc();
        c.change(d);
        const Layout other = from_desc(d);
        EXPECT_SG_ERROR(check_mappable(base, other), SG_ERR_LAYOUT_MISMATCH, c.field);
        EXPECT_SG_ERROR(check_mappable(other, base), SG_ERR_LAYOUT_MISMATCH, c.field);
    }
}

// ---- block tables ----

TEST(KvBlockTable, AcceptsValidTables) {
    const Layout l = from_desc(desc(4, 64, 16));  // 32 blocks of 16 tokens
    const std::vector<uint32_t> ids = {31, 0, 7};
    EXPECT_NO_THROW(check_block_table(l, ids, 48));  // exactly full
    EXPECT_NO_THROW(check_block_table(l, ids, 33));  // last block partly used
}

TEST(KvBlockTable, RefusesOutOfPoolIdNamingTheIndex) {
    const Layout l = from_desc(desc(4, 64, 16));
    const std::vector<uint32_t> ids = {0, 31, 32};
    EXPECT_SG_ERROR(check_block_table(l, ids, 40), SG_ERR_OUT_OF_RANGE, "block_ids[2]");
    // Every entry is checked, also the last one of a partly used block.
    const std::vector<uint32_t> tail = {0, 1, 4000000000u};
    EXPECT_SG_ERROR(check_block_table(l, tail, 33), SG_ERR_OUT_OF_RANGE, "block_ids[2]");
    const std::vector<uint32_t> first = {77, 1};
    EXPECT_SG_ERROR(check_block_table(l, first, 17), SG_ERR_OUT_OF_RANGE, "block_ids[0]");
}

// A table longer than num_tokens needs was accepted: blocks nobody writes, and the request's
// residency counted blocks that never arrive.
TEST(KvBlockTable, RefusesMoreBlocksThanNeeded) {
    const Layout l = from_desc(desc(4, 64, 16));
    const std::vector<uint32_t> ids = {31, 0, 7};
    EXPECT_SG_ERROR(check_block_table(l, ids, 32), SG_ERR_INVALID_ARGUMENT, "need 2");
    EXPECT_SG_ERROR(check_block_table(l, ids, 1), SG_ERR_INVALID_ARGUMENT, "need 1");
    EXPECT_NO_THROW(check_block_table(l, ids, 33));
}

// Two entries naming one block meant two writes into one destination block.
TEST(KvBlockTable, RefusesRepeatedBlockIds) {
    const Layout l = from_desc(desc(4, 64, 16));
    const std::vector<uint32_t> twice = {5, 6, 5};
    EXPECT_SG_ERROR(check_block_table(l, twice, 48), SG_ERR_INVALID_ARGUMENT, "block_ids[0] and block_ids[2]");
    const std::vector<uint32_t> adjacent = {9, 9};
    EXPECT_SG_ERROR(check_block_table(l, adjacent, 32), SG_ERR_INVALID_ARGUMENT, "block 9");
    // Every block of the pool once, in a scrambled order, is fine.
    std::vector<uint32_t> all(32);
    for (uint32_t i = 0; i < 32; ++i) all[i] = (i * 7) % 32;
    EXPECT_NO_THROW(check_block_table(l, all, 512));
    all[31] = all[0];
    EXPECT_SG_ERROR(check_block_table(l, all, 512), SG_ERR_INVALID_ARGUMENT, "block_ids[0] and block_ids[31]");
}

TEST(KvBlockTable, RefusesTooFewBlocksAndZeroTokens) {
    const Layout l = from_desc(desc(4, 64, 16));
    const std::vector<uint32_t> ids = {3, 4};
    EXPECT_SG_ERROR(check_block_table(l, ids, 33), SG_ERR_OUT_OF_RANGE, "need 3");
    EXPECT_SG_ERROR(check_block_table(l, {}, 1), SG_ERR_OUT_OF_RANGE, "need 1");
    try {
        check_block_table(l, ids, 0);
        ADD_FAILURE() << "num_tokens 0 accepted";
    } catch (const sg::Error &e) {
        EXPECT_NE(e.status(), SG_OK);
        EXPECT_NE(std::string(e.what()).find("num_tokens"), std::string::npos) << e.what();
    }
}

// num_tokens near 2^64 once made the ceiling division wrap: "0 blocks needed", accepted, and the
// transfer then read far outside the table.
TEST(KvBlockTable, HugeTokenCountsAreRefusedWithoutWrapping) {
    const Layout l = from_desc(desc(4, 64, 16));  // 32 blocks of 16 tokens: 512 tokens at most
    const std::vector<uint32_t> ids = {3, 4};
    for (uint64_t n : {UINT64_MAX, UINT64_MAX - 1, UINT64_MAX - 14, UINT64_MAX - 15, uint64_t(1) << 63}) {
        SCOPED_TRACE(n);
        EXPECT_SG_ERROR(check_block_table(l, ids, n), SG_ERR_OUT_OF_RANGE, "num_blocks");
    }
    // One token more than the pool holds is refused for the pool, not for the table.
    std::vector<uint32_t> all(32);
    for (uint32_t i = 0; i < 32; ++i) all[i] = i;
    EXPECT_NO_THROW(check_block_table(l, all, 512));
    EXPECT_SG_ERROR(check_block_table(l, all, 513), SG_ERR_OUT_OF_RANGE, "512");
    // One token per block: nothing to round, the largest count still refused.
    const Layout one = from_desc(desc(4, 64, 1));
    EXPECT_SG_ERROR(check_block_table(one, ids, UINT64_MAX), SG_ERR_OUT_OF_RANGE, "num_blocks");
}

// ---- residency ----

TEST(KvResidency, SetTestCountAcrossWordBoundary) {
    Residency r;
    r.reset(3, 70);  // two words, the second partly used
    EXPECT_EQ(r.num_blocks(), 70u);
    for (uint32_t layer = 0; layer < 3; ++layer) EXPECT_EQ(r.count(layer), 0u);
    for (size_t i : {0, 8, 63, 64, 69}) r.set(1, i);
    r.set(1, 8);  // idempotent
    EXPECT_EQ(r.count(1), 5u);
    EXPECT_EQ(r.count(0), 0u);  // layers do not bleed into each other
    EXPECT_EQ(r.count(2), 0u);
    for (size_t i = 0; i < 70; ++i) {
        const bool want = i == 0 || i == 8 || i == 63 || i == 64 || i == 69;
        EXPECT_EQ(r.test(1, i), want) << i;
        EXPECT_FALSE(r.test(0, i));
        EXPECT_FALSE(r.test(2, i));
    }

    // LSB-first: block i is bit i % 8 of byte i / 8; exactly ceil(70 / 8) = 9 bytes are written.
    uint8_t out[12];
    std::memset(out, 0xAA, sizeof out);
    r.copy_layer(1, out);
    const uint8_t want[12] = {0x01, 0x01, 0, 0, 0, 0, 0, 0x80, 0x21, 0xAA, 0xAA, 0xAA};
    for (size_t b = 0; b < 12; ++b) EXPECT_EQ(out[b], want[b]) << "byte " << b;
}

TEST(KvResidency, SetLayerMarksExactlyNumBlocks) {
    struct Case {
        size_t blocks;
        std::vector<uint8_t> bytes;
    };
    const Case cases[] = {
        {1, {0x01}},
        {5, {0x1F}},
        {8, {0xFF}},
        {64, std::vector<uint8_t>(8, 0xFF)},
        {70, {0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0x3F}},
        {130, [] {
             std::vector<uint8_t> v(16, 0xFF);
             v.push_back(0x03);
             return v;
         }()},
    };
    for (const Case &c : cases) {
        SCOPED_TRACE(c.blocks);
        Residency r;
        r.reset(2, c.blocks);
        r.set_layer(1);
        // Bits past num_blocks stay clear, so count() equals num_blocks, not a word multiple.
        EXPECT_EQ(r.count(1), c.blocks);
        EXPECT_EQ(r.count(0), 0u);
        std::vector<uint8_t> out(c.bytes.size() + 2, 0xAA);
        r.copy_layer(1, out.data());
        for (size_t b = 0; b < c.bytes.size(); ++b) EXPECT_EQ(out[b], c.bytes[b]) << "byte " << b;
        EXPECT_EQ(out[c.bytes.size()], 0xAA);  // nothing written past ceil(num_blocks / 8)
        // Setting a bit that is already set by set_layer changes nothing.
        r.set(1, c.blocks - 1);
        EXPECT_EQ(r.count(1), c.blocks);
    }
}

TEST(KvResidency, MatchesABoolModelAndResetClears) {
    std::mt19937_64 rng(12345);
    Residency r;
    for (size_t blocks : {1, 7, 9, 63, 65, 127, 128, 200, 1000}) {
        SCOPED_TRACE(blocks);
        const uint32_t layers = 3;
        r.reset(layers, blocks);  // reusing one object: earlier bits must be gone
        std::vector<std::vector<bool>> model(layers, std::vector<bool>(blocks, false));
        for (uint32_t layer = 0; layer < layers; ++layer) ASSERT_EQ(r.count(layer), 0u);
        for (size_t k = 0; k < blocks; ++k) {
            const uint32_t layer = uint32_t(rng() % layers);
            const size_t i = size_t(rng() % blocks);
            r.set(layer, i);
            model[layer][i] = true;
        }
        for (uint32_t layer = 0; layer < layers; ++layer) {
            size_t n = 0;
            std::vector<uint8_t> out((blocks + 7) / 8, 0xEE);
            r.copy_layer(layer, out.data());
            for (size_t i = 0; i < blocks; ++i) {
                n += model[layer][i];
                ASSERT_EQ(r.test(layer, i), model[layer][i]) << "layer " << layer << " block " << i;
                ASSERT_EQ(bool(out[i / 8] >> (i % 8) & 1), model[layer][i]) << "layer " << layer << " block " << i;
            }
            // Padding bits of the last byte are zero.
            if (blocks % 8) EXPECT_EQ(out.back() >> (blocks % 8), 0);
            EXPECT_EQ(r.count(layer), n);
        }
    }
}

// ---- peer descriptors ----

TEST(KvDesc, RoundTripsThroughDescriptor) {
    Pub p(3, SG_KV_FUSED);
    p.l.block_order = SG_BLOCK_HEAD_MAJOR;
    p.l.dtype = SG_DTYPE_FP8_E4M3;
    p.l.block_stride_bytes = 2 * 16 * 8 * 128 + 512;
    const Layout a = make_layout(p.l);
    const LayoutDesc d = a.to_desc();
    EXPECT_EQ(d.block_stride_bytes, a.block_stride);  // always resolved on the wire
    const Layout b = from_desc(d);
    EXPECT_EQ(b.num_layers, a.num_layers);
    EXPECT_EQ(b.num_kv_heads, a.num_kv_heads);
    EXPECT_EQ(b.head_dim, a.head_dim);
    EXPECT_EQ(b.tokens_per_block, a.tokens_per_block);
    EXPECT_EQ(b.num_blocks, a.num_blocks);
    EXPECT_EQ(b.dtype, a.dtype);
    EXPECT_EQ(b.packing, a.packing);
    EXPECT_EQ(b.order, a.order);
    EXPECT_EQ(b.elem_bytes, 1u);
    EXPECT_EQ(b.plane_bytes, a.plane_bytes);
    EXPECT_EQ(b.block_stride, a.block_stride);
}

TEST(KvDesc, RefusesNonsenseAsProtocolError) {
    struct Case {
        const char *needle;
        void (*change)(LayoutDesc &);
    };
    const Case cases[] = {
        {"num_layers", [](LayoutDesc &d) { d.num_layers = 0; }},
        {"num_layers", [](LayoutDesc &d) { d.num_layers = 65537; }},
        {"num_kv_heads", [](LayoutDesc &d) { d.num_kv_heads = 0; }},
        {"head_dim", [](LayoutDesc &d) { d.head_dim = 0; }},
        {"tokens_per_block", [](LayoutDesc &d) { d.tokens_per_block = 0; }},
        {"tokens_per_block", [](LayoutDesc &d) { d.tokens_per_block = 0xFFFFFFFF; }},
        {"num_blocks", [](LayoutDesc &d) { d.num_blocks = 0; }},
        {"num_blocks", [](LayoutDesc &d) { d.num_blocks = ~uint64_t(0); }},
        {"dtype", [](LayoutDesc &d) { d.dtype = 4; }},
        {"packing", [](LayoutDesc &d) { d.packing = 0xFFFFFFFF; }},
        {"block_order", [](LayoutDesc &d) { d.block_order = 9; }},
        {"mem_kind", [](LayoutDesc &d) { d.mem_kind = 3; }},
        {"block_stride_bytes", [](LayoutDesc &d) { d.block_stride_bytes = 3; }},
        {"overflows", [](LayoutDesc &d) {
             d.block_stride_bytes = uint64_t(1) << 40;
             d.num_blocks = uint64_t(1) << 30;
         }},
    };
    for (const Case &c : cases) {
        SCOPED_TRACE(c.needle);
        LayoutDesc d = desc();
        ASSERT_NO_THROW(from_desc(d));
        c.change(d);
        EXPECT_SG_ERROR(from_desc(d), SG_ERR_PROTOCOL, c.needle);
    }
}

}  // namespace
}  // namespace sg::kv

// ---- content_crc: the same tokens give the same CRC in any layout ----

namespace sg::kv {
namespace {

// A pool of one layer in host memory, filled so that element (plane, token, head, dim) of the
// request holds the same value whatever the layout.
struct CrcPool {
    Layout layout;
    std::vector<uint32_t> table;
    std::vector<std::vector<uint8_t>> regions;
    CrcPool(uint32_t tpb, uint32_t order, uint32_t packing, std::vector<uint32_t> table_, uint64_t tokens) {
        LayoutDesc d = desc(3, 8, tpb);
        d.num_layers = 1;
        d.num_blocks = 16;
        d.block_order = order;
        d.packing = packing;
        const uint64_t plane = uint64_t(tpb) * 3 * 8 * 2;
        d.block_stride_bytes = packing == SG_KV_SEPARATE ? plane : 2 * plane;
        layout = from_desc(d);
        table = std::move(table_);
        regions.assign(layout.regions_per_layer(), std::vector<uint8_t>(layout.region_bytes(), 0xee));
        for (uint32_t p = 0; p < 2; ++p)
            for (uint64_t t = 0; t < tokens; ++t)
                for (uint32_t h = 0; h < 3; ++h) {
                    const Layout::Loc loc = layout.plane(p, table[t / tpb]);
                    uint8_t *row = regions[loc.region].data() + loc.offset + layout.row_offset(uint32_t(t % tpb), h);
                    for (uint32_t i = 0; i < 16; ++i) row[i] = uint8_t(p * 131 + t * 7 + h * 29 + i);
                }
    }
    uint32_t crc(uint64_t first, uint64_t end) const {
        const uint8_t *bases[2] = {regions[0].data(), regions.size() > 1 ? regions[1].data() : nullptr};
        return content_crc(layout, bases, table, first, end);
    }
};

TEST(KvContentCrc, AgreesAcrossBlockSizeOrderAndPackingAndSeesOneByte) {
    const uint64_t tokens = 37;  // the last block of each pool is partial
    const CrcPool a(16, SG_BLOCK_TOKEN_MAJOR, SG_KV_SEPARATE, {5, 0, 9}, tokens);
    CrcPool b(4, SG_BLOCK_HEAD_MAJOR, SG_KV_FUSED, {15, 2, 7, 1, 0, 3, 4, 5, 6, 8}, tokens);
    for (uint64_t first = 0; first < tokens; first += 4) {
        const uint64_t end = std::min<uint64_t>(tokens, first + 4);
        EXPECT_EQ(a.crc(first, end), b.crc(first, end)) << "tokens " << first << ".." << end;
    }
    EXPECT_EQ(a.crc(0, tokens), b.crc(0, tokens));
    EXPECT_NE(a.crc(0, 4), a.crc(4, 8));
    // One byte of token 22, head 2, V plane (block 5 of b's request) changed: that block only.
    const Layout::Loc loc = b.layout.plane(1, b.table[22 / 4]);
    b.regions[loc.region][loc.offset + b.layout.row_offset(22 % 4, 2) + 5] ^= 1;
    for (uint64_t first = 0; first < tokens; first += 4) {
        const uint64_t end = std::min<uint64_t>(tokens, first + 4);
        if (first == 20)
            EXPECT_NE(a.crc(first, end), b.crc(first, end));
        else
            EXPECT_EQ(a.crc(first, end), b.crc(first, end)) << "tokens " << first << ".." << end;
    }
    // Bytes outside the request's tokens (the partial block's tail, other blocks) do not count.
    const Layout::Loc tail = b.layout.plane(0, b.table[9]);
    b.regions[tail.region][tail.offset + b.layout.row_offset(3, 0)] ^= 1;  // token 39 > 36
    EXPECT_EQ(a.crc(36, 37), b.crc(36, 37));
}

}  // namespace
}  // namespace sg::kv
