// Unit tests for runtime/plan. The main test is a reference check: for hundreds of random layout
// pairs and block tables it builds real pools, "executes" the compiled ops with memcpy, and compares
// every element of the destination with the source (and checks nothing else was touched). The rest
// pins down coalescing, the op size and iov limits, and that compilation does not allocate per block.
#include "plan/plan.hpp"
#include "plan/schedule.hpp"
#include "plan/transfer_state.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <numeric>
#include <random>
#include <span>
#include <sstream>
#include <string>
#include <tuple>
#include <vector>

namespace sg::plan {
namespace {

constexpr uint8_t kSentinel = 0xA5;

struct Shape {
    uint32_t layers = 1, heads = 2, head_dim = 8;
    sg_dtype_t dtype = SG_DTYPE_FP16;
};

struct SideSpec {
    uint32_t tpb = 16;
    sg_kv_packing_t packing = SG_KV_SEPARATE;
    sg_block_order_t order = SG_BLOCK_TOKEN_MAJOR;
    uint64_t stride_pad = 0;  // bytes added to the minimum block stride
    uint64_t num_blocks = 8;
};

kv::Layout make(const Shape &s, const SideSpec &p) {
    LayoutDesc d;
    d.num_layers = s.layers;
    d.num_kv_heads = s.heads;
    d.head_dim = s.head_dim;
    d.tokens_per_block = p.tpb;
    d.num_blocks = p.num_blocks;
    d.dtype = s.dtype;
    d.packing = p.packing;
    d.block_order = p.order;
    d.mem_kind = SG_MEM_HOST;
    d.block_stride_bytes = 0;
    if (p.stride_pad) {
        const uint64_t elem = s.dtype == SG_DTYPE_FP32 ? 4 : s.dtype == SG_DTYPE_FP8_E4M3 ? 1 : 2;
        const uint64_t plane = uint64_t(p.tpb) * s.heads * s.head_dim * elem;
        d.block_stride_bytes = plane * (p.packing == SG_KV_FUSED ? 2 : 1) + p.stride_pad;
    }
    return kv::from_desc(d);
}

// A pool in host memory: region r of layer l is regions[l * regions_per_layer + r]. All regions are
// slices of one allocation, back to back, as an engine that allocates its cache in one piece has them:
// so a plan that let one iov run from the end of one region into the next would go unnoticed by
// memcpy but not by execute(), which checks each iov stays inside the region it names.
struct Pool {
    kv::Layout layout;
    std::vector<uint8_t> storage;
    std::vector<std::span<uint8_t>> regions;

    Pool(const kv::Layout &l, std::mt19937_64 *fill_random) : layout(l) {
        const size_t n = size_t(l.num_layers) * l.regions_per_layer();
        storage.resize(n * l.region_bytes());
        if (fill_random)
            for (auto &b : storage) b = uint8_t((*fill_random)());
        else
            std::fill(storage.begin(), storage.end(), kSentinel);
        for (size_t i = 0; i < n; ++i) regions.emplace_back(storage.data() + i * l.region_bytes(), l.region_bytes());
    }
    std::span<uint8_t> region(uint32_t layer, uint32_t r) { return regions[size_t(layer) * layout.regions_per_layer() + r]; }
};

// Independent of kv::Layout::plane/row_offset: where element e of (plane, token, head) lives, as
// (region within the layer, byte offset), written straight from the layout definition.
std::pair<uint32_t, uint64_t> ref_locate(const kv::Layout &l, std::span<const uint32_t> table, uint32_t plane,
                                         uint64_t token, uint32_t head, uint32_t e) {
    const uint64_t block = table[token / l.tokens_per_block];
    const uint64_t t = token % l.tokens_per_block;
    const uint64_t row = uint64_t(l.head_dim) * l.elem_bytes;
    const uint64_t plane_bytes = uint64_t(l.tokens_per_block) * l.num_kv_heads * row;
    uint32_t region;
    uint64_t off = block * l.block_stride;
    if (l.packing == SG_KV_SEPARATE) {
        region = plane;
    } else {
        region = 0;
        off += plane * plane_bytes;
    }
    off += l.order == SG_BLOCK_TOKEN_MAJOR ? (t * l.num_kv_heads + head) * row : (uint64_t(head) * l.tokens_per_block + t) * row;
    return {region, off + uint64_t(e) * l.elem_bytes};
}

std::string describe(const kv::Layout &l) {
    std::ostringstream o;
    o << "tpb=" << l.tokens_per_block << (l.packing == SG_KV_FUSED ? " fused" : " separate")
      << (l.order == SG_BLOCK_TOKEN_MAJOR ? " token-major" : " head-major") << " stride=" << l.block_stride
      << " plane=" << l.plane_bytes << " blocks=" << l.num_blocks;
    return o.str();
}

// Checks each op's structural promises and copies it into dst (one layer). Returns the bytes moved.
uint64_t execute(const std::vector<Op> &ops_in, Pool &src, Pool &dst, uint32_t layer, const Limits &limits) {
    uint64_t moved = 0;
    std::vector<std::tuple<uint32_t, uint64_t, uint64_t>> ranges;
    for (size_t i = 0; i < ops_in.size(); ++i) {
        const Op &op = ops_in[i];
        SCOPED_TRACE("op " + std::to_string(i));
        EXPECT_GE(op.niov, 1u);
        EXPECT_LE(op.niov, limits.max_iov);
        EXPECT_GT(op.len, 0u);
        EXPECT_LE(op.len, limits.max_op_bytes);
        EXPECT_LT(op.dst_region, dst.layout.regions_per_layer());
        if (op.niov < 1 || op.niov > kMaxIov || op.dst_region >= dst.layout.regions_per_layer()) return moved;
        const std::span<uint8_t> d = dst.region(layer, op.dst_region);
        EXPECT_LE(op.dst_offset + op.len, d.size());
        if (op.dst_offset + op.len > d.size()) return moved;
        uint64_t at = op.dst_offset, sum = 0;
        for (uint32_t k = 0; k < op.niov; ++k) {
            const Iov &v = op.iov[k];
            // The iov must lie inside the source region it claims (that region's MR descriptor is used).
            EXPECT_LT(v.src_region, src.layout.regions_per_layer());
            if (v.src_region >= src.layout.regions_per_layer()) return moved;
            const std::span<uint8_t> s = src.region(layer, v.src_region);
            const bool inside = v.addr >= s.data() && v.addr + v.len <= s.data() + s.size();
            EXPECT_TRUE(inside) << "iov " << k << " is outside source region " << v.src_region;
            if (!inside) return moved;
            std::memcpy(d.data() + at, v.addr, v.len);
            at += v.len;
            sum += v.len;
        }
        EXPECT_EQ(sum, op.len) << "iov lengths do not add up to the op length";
        ranges.emplace_back(op.dst_region, op.dst_offset, op.len);
        moved += op.len;
    }
    // No two ops write the same destination byte (each byte moves once).
    std::sort(ranges.begin(), ranges.end());
    for (size_t i = 1; i < ranges.size(); ++i)
        if (std::get<0>(ranges[i]) == std::get<0>(ranges[i - 1]))
            EXPECT_LE(std::get<1>(ranges[i - 1]) + std::get<2>(ranges[i - 1]), std::get<1>(ranges[i]))
                << "ops overlap in destination region " << std::get<0>(ranges[i]);
    return moved;
}

// Element-by-element comparison of every requested (layer, plane, token, head, element), and a check
// that every byte outside the requested tokens still holds the sentinel. Returns false on a mismatch.
bool verify(Pool &src, std::span<const uint32_t> src_table, Pool &dst, std::span<const uint32_t> dst_table,
            uint64_t num_tokens) {
    const kv::Layout &sl = src.layout, &dl = dst.layout;
    const uint64_t eb = sl.elem_bytes;
    std::vector<std::vector<uint8_t>> covered(dst.regions.size());
    for (size_t i = 0; i < dst.regions.size(); ++i) covered[i].assign(dst.regions[i].size(), 0);
    for (uint32_t layer = 0; layer < sl.num_layers; ++layer)
        for (uint32_t plane = 0; plane < 2; ++plane)
            for (uint64_t t = 0; t < num_tokens; ++t)
                for (uint32_t h = 0; h < sl.num_kv_heads; ++h)
                    for (uint32_t e = 0; e < sl.head_dim; ++e) {
                        const auto [sr, so] = ref_locate(sl, src_table, plane, t, h, e);
                        const auto [dr, dof] = ref_locate(dl, dst_table, plane, t, h, e);
                        const uint8_t *s = src.region(layer, sr).data() + so;
                        const uint8_t *d = dst.region(layer, dr).data() + dof;
                        if (std::memcmp(s, d, eb) != 0) {
                            ADD_FAILURE() << "layer " << layer << (plane ? " V" : " K") << " token " << t << " head " << h
                                          << " element " << e << " differs (dst region " << dr << " offset " << dof
                                          << ")";
                            return false;
                        }
                        std::fill_n(covered[size_t(layer) * dl.regions_per_layer() + dr].begin() + dof, eb, 1);
                    }
    for (size_t r = 0; r < dst.regions.size(); ++r)
        for (size_t b = 0; b < dst.regions[r].size(); ++b)
            if (!covered[r][b] && dst.regions[r][b] != kSentinel) {
                ADD_FAILURE() << "byte " << b << " of destination region " << r
                              << " (layer " << r / dl.regions_per_layer() << ") was written but is not a requested element";
                return false;
            }
    return true;
}

std::vector<uint32_t> random_table(std::mt19937_64 &rng, uint64_t pool_blocks, size_t n, bool consecutive) {
    std::vector<uint32_t> ids(pool_blocks);
    std::iota(ids.begin(), ids.end(), 0u);
    if (consecutive) {
        const size_t start = size_t(rng() % (pool_blocks - n + 1));
        return std::vector<uint32_t>(ids.begin() + start, ids.begin() + start + n);
    }
    std::shuffle(ids.begin(), ids.end(), rng);
    ids.resize(n);
    return ids;
}

// Compiles and executes every layer of one transfer, then verifies. Returns false on any failure.
bool run_transfer(Pool &src, const std::vector<uint32_t> &st, Pool &dst, const std::vector<uint32_t> &dt,
                  uint64_t num_tokens, const Limits &limits, Vec<Op> &ops) {
    const kv::Layout &sl = src.layout;
    const uint64_t layer_bytes = 2 * num_tokens * sl.num_kv_heads * sl.row_bytes();
    const Side s{&src.layout, st}, d{&dst.layout, dt};
    for (uint32_t layer = 0; layer < sl.num_layers; ++layer) {
        const uint32_t rpl = sl.regions_per_layer();
        const uint8_t *bases[2] = {src.region(layer, 0).data(), src.region(layer, rpl - 1).data()};
        const LayerPlanStats stats = compile_layer(s, bases, d, num_tokens, limits, ops);
        EXPECT_EQ(stats.bytes, layer_bytes);
        EXPECT_GE(stats.segments, 1u);
        if (limits.max_op_bytes >= layer_bytes) EXPECT_LE(ops.size(), max_ops_per_layer(s, d, num_tokens));
        const std::vector<Op> copy(ops.begin(), ops.end());
        const uint64_t moved = execute(copy, src, dst, layer, limits);
        EXPECT_EQ(moved, layer_bytes) << "layer " << layer;
        if (::testing::Test::HasFailure()) return false;
    }
    return verify(src, st, dst, dt, num_tokens);
}

// ---- the reference check ----

TEST(PlanReference, RandomLayoutPairsMoveEveryElementAndNothingElse) {
    const uint32_t tpbs[] = {1, 4, 8, 16, 32};
    const uint32_t head_dims[] = {1, 2, 3, 8, 16};
    const sg_dtype_t dtypes[] = {SG_DTYPE_FP32, SG_DTYPE_FP16, SG_DTYPE_BF16, SG_DTYPE_FP8_E4M3};
    Vec<Op> ops;  // reused across cases, as the runtime reuses a transfer's op buffer
    for (uint64_t seed = 0; seed < 300; ++seed) {
        std::mt19937_64 rng(seed * 7919 + 1);
        auto pick = [&](uint64_t n) { return rng() % n; };
        Shape shape;
        shape.layers = 1 + uint32_t(pick(3));
        shape.heads = 1 + uint32_t(pick(4));
        shape.head_dim = head_dims[pick(5)];
        shape.dtype = dtypes[pick(4)];
        // Mostly short requests, sometimes long ones and exact block multiples.
        uint64_t num_tokens = 1 + pick(pick(4) == 0 ? 300 : 70);
        if (pick(4) == 0) num_tokens = 32 * (1 + pick(4));

        SideSpec sp[2];
        std::vector<uint32_t> tables[2];
        for (SideSpec &p : sp) {
            p.tpb = tpbs[pick(5)];
            p.packing = pick(2) ? SG_KV_FUSED : SG_KV_SEPARATE;
            p.order = pick(2) ? SG_BLOCK_HEAD_MAJOR : SG_BLOCK_TOKEN_MAJOR;
            p.stride_pad = pick(2) ? 0 : 1 + pick(64);
        }
        for (int side = 0; side < 2; ++side) {
            const size_t need = size_t((num_tokens + sp[side].tpb - 1) / sp[side].tpb);
            const size_t n = need + size_t(pick(3));                // tables may be longer than needed
            sp[side].num_blocks = n + pick(n + 4);                  // pools have unused blocks
            tables[side] = random_table(rng, sp[side].num_blocks, n, pick(4) == 0);  // sometimes consecutive
        }
        Limits limits;
        if (pick(2)) limits.max_op_bytes = 1 + pick(3 * uint64_t(shape.head_dim) * 4 * shape.heads);
        limits.max_iov = 1 + uint32_t(pick(kMaxIov));

        Pool src(make(shape, sp[0]), &rng);
        Pool dst(make(shape, sp[1]), nullptr);
        SCOPED_TRACE("seed " + std::to_string(seed) + ": src " + describe(src.layout) + " | dst " + describe(dst.layout) +
                     " | layers " + std::to_string(shape.layers) + " heads " + std::to_string(shape.heads) +
                     " head_dim " + std::to_string(shape.head_dim) + " elem " + std::to_string(src.layout.elem_bytes) +
                     " | tokens " + std::to_string(num_tokens) + " max_op_bytes " +
                     std::to_string(limits.max_op_bytes) + " max_iov " + std::to_string(limits.max_iov));
        ASSERT_TRUE(run_transfer(src, tables[0], dst, tables[1], num_tokens, limits, ops));
    }
}

// Every combination of order and packing on both sides, over a block-crossing request, so each
// planner path (token runs, head runs, single rows; planes inner or outer) is covered for sure.
TEST(PlanReference, EveryOrderAndPackingCombination) {
    Vec<Op> ops;
    int combos = 0;
    for (int so = 0; so < 2; ++so)
        for (int sp = 0; sp < 2; ++sp)
            for (int dord = 0; dord < 2; ++dord)
                for (int dp = 0; dp < 2; ++dp) {
                    std::mt19937_64 rng(uint64_t(100 + combos++));
                    Shape shape{2, 3, 4, SG_DTYPE_FP16};
                    SideSpec a{8, sp ? SG_KV_FUSED : SG_KV_SEPARATE, so ? SG_BLOCK_HEAD_MAJOR : SG_BLOCK_TOKEN_MAJOR, 0, 20};
                    SideSpec b{16, dp ? SG_KV_FUSED : SG_KV_SEPARATE, dord ? SG_BLOCK_HEAD_MAJOR : SG_BLOCK_TOKEN_MAJOR, 6, 12};
                    Pool src(make(shape, a), &rng);
                    Pool dst(make(shape, b), nullptr);
                    const std::vector<uint32_t> st = {19, 3, 4, 5, 0, 11, 12};  // 7 x 8 tokens
                    const std::vector<uint32_t> dt = {7, 2, 3, 10};             // 4 x 16 tokens
                    SCOPED_TRACE("src " + describe(src.layout) + " | dst " + describe(dst.layout));
                    ASSERT_TRUE(run_transfer(src, st, dst, dt, 53, Limits{}, ops));
                }
}

// ---- coalescing ----

struct CoalesceCase {
    sg_kv_packing_t packing;
    sg_block_order_t order;
};

TEST(PlanCoalesce, ConsecutiveBlocksOfIdenticalLayoutsBecomeOneOpPerRegion) {
    for (CoalesceCase c : {CoalesceCase{SG_KV_SEPARATE, SG_BLOCK_TOKEN_MAJOR}, CoalesceCase{SG_KV_SEPARATE, SG_BLOCK_HEAD_MAJOR},
                           CoalesceCase{SG_KV_FUSED, SG_BLOCK_TOKEN_MAJOR}, CoalesceCase{SG_KV_FUSED, SG_BLOCK_HEAD_MAJOR}}) {
        SCOPED_TRACE(std::string(c.packing == SG_KV_FUSED ? "fused" : "separate") +
                     (c.order == SG_BLOCK_HEAD_MAJOR ? " head-major" : " token-major"));
        std::mt19937_64 rng(7);
        Shape shape{3, 4, 16, SG_DTYPE_BF16};
        const SideSpec spec{16, c.packing, c.order, 0, 40};
        Pool src(make(shape, spec), &rng);
        Pool dst(make(shape, spec), nullptr);
        // Ten full blocks, consecutive on both sides but at different positions.
        std::vector<uint32_t> st(10), dt(10);
        std::iota(st.begin(), st.end(), 5u);
        std::iota(dt.begin(), dt.end(), 22u);
        const uint64_t num_tokens = 160;
        const kv::Layout &l = src.layout;
        Vec<Op> ops;
        const Side s{&src.layout, st}, d{&dst.layout, dt};
        for (uint32_t layer = 0; layer < shape.layers; ++layer) {
            const uint8_t *bases[2] = {src.region(layer, 0).data(), src.region(layer, l.regions_per_layer() - 1).data()};
            const LayerPlanStats stats = compile_layer(s, bases, d, num_tokens, Limits{}, ops);
            EXPECT_EQ(stats.bytes, 2 * 10 * l.plane_bytes);
            if (c.packing == SG_KV_SEPARATE) {
                // One op for all of K, one for all of V.
                ASSERT_EQ(ops.size(), 2u);
                for (uint32_t p = 0; p < 2; ++p) {
                    EXPECT_EQ(ops[p].dst_region, p);
                    EXPECT_EQ(ops[p].dst_offset, 22 * l.block_stride);
                    EXPECT_EQ(ops[p].len, 10 * l.plane_bytes);
                    ASSERT_EQ(ops[p].niov, 1u);
                    EXPECT_EQ(ops[p].iov[0].addr, src.region(layer, p).data() + 5 * l.block_stride);
                    EXPECT_EQ(ops[p].iov[0].src_region, p);
                }
            } else {
                // K and V of each block are neighbours, and blocks are neighbours: one op.
                ASSERT_EQ(ops.size(), 1u);
                EXPECT_EQ(ops[0].dst_region, 0u);
                EXPECT_EQ(ops[0].dst_offset, 22 * l.block_stride);
                EXPECT_EQ(ops[0].len, 10 * 2 * l.plane_bytes);
                ASSERT_EQ(ops[0].niov, 1u);
                EXPECT_EQ(ops[0].iov[0].addr, src.region(layer, 0).data() + 5 * l.block_stride);
            }
            const std::vector<Op> copy(ops.begin(), ops.end());
            execute(copy, src, dst, layer, Limits{});
        }
        EXPECT_TRUE(verify(src, st, dst, dt, num_tokens));
    }
}

TEST(PlanCoalesce, MaxOpBytesSplitsWithoutExceeding) {
    std::mt19937_64 rng(11);
    Shape shape{1, 4, 16, SG_DTYPE_FP16};
    const SideSpec spec{16, SG_KV_SEPARATE, SG_BLOCK_TOKEN_MAJOR, 0, 16};
    Pool src(make(shape, spec), &rng);
    const kv::Layout &l = src.layout;  // plane = 16 * 4 * 16 * 2 = 2048 bytes
    std::vector<uint32_t> st(8), dt(8);
    std::iota(st.begin(), st.end(), 0u);
    std::iota(dt.begin(), dt.end(), 8u);
    const uint64_t per_region = 8 * l.plane_bytes;
    for (uint64_t max_op : {uint64_t(1000), uint64_t(2048), uint64_t(3000), uint64_t(333), per_region - 1}) {
        SCOPED_TRACE(max_op);
        Pool dst(make(shape, spec), nullptr);
        Limits limits;
        limits.max_op_bytes = max_op;
        Vec<Op> ops;
        const uint8_t *bases[2] = {src.region(0, 0).data(), src.region(0, 1).data()};
        const LayerPlanStats stats = compile_layer(Side{&l, st}, bases, Side{&dst.layout, dt}, 128, limits, ops);
        uint64_t sum = 0;
        for (const Op &op : ops) {
            EXPECT_LE(op.len, max_op);
            sum += op.len;
        }
        EXPECT_EQ(sum, 2 * per_region);
        EXPECT_EQ(stats.bytes, sum);
        // Both regions are contiguous, so ops are filled to the limit: ceil(bytes / max) per region.
        EXPECT_EQ(ops.size(), 2 * ((per_region + max_op - 1) / max_op));
        const std::vector<Op> copy(ops.begin(), ops.end());
        EXPECT_EQ(execute(copy, src, dst, 0, limits), 2 * per_region);
        EXPECT_TRUE(verify(src, st, dst, dt, 128));
    }
}

TEST(PlanCoalesce, IovLimitGathersScatteredSourceBlocks) {
    std::mt19937_64 rng(13);
    Shape shape{1, 2, 8, SG_DTYPE_FP32};
    const SideSpec spec{8, SG_KV_SEPARATE, SG_BLOCK_TOKEN_MAJOR, 0, 32};
    Pool src(make(shape, spec), &rng);
    const kv::Layout &l = src.layout;
    // Source blocks are scattered (never adjacent), destination blocks are consecutive: each source
    // block is a separate iov into one contiguous destination range.
    const std::vector<uint32_t> st = {30, 2, 17, 9, 24, 5, 13, 0, 20, 27};
    std::vector<uint32_t> dt(10);
    std::iota(dt.begin(), dt.end(), 3u);
    const uint64_t num_tokens = 80;
    for (uint32_t max_iov = 1; max_iov <= kMaxIov; ++max_iov) {
        SCOPED_TRACE(max_iov);
        Pool dst(make(shape, spec), nullptr);
        Limits limits;
        limits.max_iov = max_iov;
        Vec<Op> ops;
        const uint8_t *bases[2] = {src.region(0, 0).data(), src.region(0, 1).data()};
        compile_layer(Side{&l, st}, bases, Side{&dst.layout, dt}, num_tokens, limits, ops);
        const uint64_t per_plane = (10 + max_iov - 1) / max_iov;
        ASSERT_EQ(ops.size(), 2 * per_plane);
        uint32_t max_seen = 0;
        for (size_t i = 0; i < ops.size(); ++i) {
            const Op &op = ops[i];
            max_seen = std::max(max_seen, op.niov);
            // Ops are full up to the last one of each plane.
            const uint32_t expect = (i % per_plane == per_plane - 1 && 10 % max_iov) ? 10 % max_iov : max_iov;
            EXPECT_EQ(op.niov, expect) << "op " << i;
            EXPECT_EQ(op.len, op.niov * l.plane_bytes) << "op " << i;
            for (uint32_t k = 0; k < op.niov; ++k) EXPECT_EQ(op.iov[k].len, l.plane_bytes);
        }
        EXPECT_EQ(max_seen, max_iov);
        const std::vector<Op> copy(ops.begin(), ops.end());
        execute(copy, src, dst, 0, limits);
        EXPECT_TRUE(verify(src, st, dst, dt, num_tokens));
    }
}

TEST(PlanCoalesce, MaxIovOneNeverGathers) {
    // Different orders on the two sides: the planner emits one row at a time, the worst case for
    // gathering. With max_iov 1 every op must still be a single piece.
    std::mt19937_64 rng(17);
    Shape shape{1, 3, 4, SG_DTYPE_FP16};
    Pool src(make(shape, SideSpec{4, SG_KV_FUSED, SG_BLOCK_HEAD_MAJOR, 0, 16}), &rng);
    Pool dst(make(shape, SideSpec{8, SG_KV_SEPARATE, SG_BLOCK_TOKEN_MAJOR, 0, 8}), nullptr);
    const std::vector<uint32_t> st = {3, 9, 1, 14, 7, 0, 12}, dt = {6, 2, 5, 0};
    Limits limits;
    limits.max_iov = 1;
    Vec<Op> ops;
    const uint8_t *bases[2] = {src.region(0, 0).data(), src.region(0, 0).data()};
    compile_layer(Side{&src.layout, st}, bases, Side{&dst.layout, dt}, 27, limits, ops);
    ASSERT_FALSE(ops.empty());
    for (const Op &op : ops) EXPECT_EQ(op.niov, 1u);
    const std::vector<Op> copy(ops.begin(), ops.end());
    execute(copy, src, dst, 0, limits);
    EXPECT_TRUE(verify(src, st, dst, dt, 27));
}

TEST(PlanCoalesce, IovNeverSpansTwoSourceRegions) {
    // A one-block separate pool whose K and V regions are adjacent in memory: K's bytes end exactly
    // where V's begin. The destination is fused, so K and V land next to each other too. The two
    // pieces may share an op, but not an iov: each region has its own registration descriptor.
    std::mt19937_64 rng(23);
    Shape shape{1, 2, 4, SG_DTYPE_FP16};
    Pool src(make(shape, SideSpec{8, SG_KV_SEPARATE, SG_BLOCK_TOKEN_MAJOR, 0, 1}), &rng);
    Pool dst(make(shape, SideSpec{8, SG_KV_FUSED, SG_BLOCK_TOKEN_MAJOR, 0, 4}), nullptr);
    ASSERT_EQ(src.region(0, 0).data() + src.region(0, 0).size(), src.region(0, 1).data());
    const std::vector<uint32_t> st = {0}, dt = {2};
    Vec<Op> ops;
    const uint8_t *bases[2] = {src.region(0, 0).data(), src.region(0, 1).data()};
    compile_layer(Side{&src.layout, st}, bases, Side{&dst.layout, dt}, 8, Limits{}, ops);
    ASSERT_EQ(ops.size(), 1u);
    ASSERT_EQ(ops[0].niov, 2u);
    EXPECT_EQ(ops[0].iov[0].src_region, 0u);
    EXPECT_EQ(ops[0].iov[1].src_region, 1u);
    EXPECT_EQ(ops[0].iov[0].len, src.layout.plane_bytes);
    const std::vector<Op> copy(ops.begin(), ops.end());
    execute(copy, src, dst, 0, Limits{});
    EXPECT_TRUE(verify(src, st, dst, dt, 8));
}

TEST(PlanCoalesce, MixedPackingStillGathersAlongEachPlane) {
    // Fused source, separate destination: consecutive destination blocks make one contiguous K range
    // (and one V range), while source K planes are a block stride apart. Walking one plane at a time
    // lets each op gather max_iov blocks; interleaving K and V would break every op after one piece.
    std::mt19937_64 rng(29);
    Shape shape{1, 2, 8, SG_DTYPE_FP16};
    Pool src(make(shape, SideSpec{16, SG_KV_FUSED, SG_BLOCK_TOKEN_MAJOR, 0, 16}), &rng);
    Pool dst(make(shape, SideSpec{16, SG_KV_SEPARATE, SG_BLOCK_TOKEN_MAJOR, 0, 16}), nullptr);
    std::vector<uint32_t> st(10), dt(10);
    std::iota(st.begin(), st.end(), 2u);
    std::iota(dt.begin(), dt.end(), 4u);
    Vec<Op> ops;
    const uint8_t *bases[2] = {src.region(0, 0).data(), src.region(0, 0).data()};
    compile_layer(Side{&src.layout, st}, bases, Side{&dst.layout, dt}, 160, Limits{}, ops);
    ASSERT_EQ(ops.size(), 2u * 3);  // per plane: ceil(10 blocks / 4 iovs)
    for (size_t i = 0; i < ops.size(); ++i) EXPECT_EQ(ops[i].dst_region, i < 3 ? 0u : 1u);
    const std::vector<Op> copy(ops.begin(), ops.end());
    execute(copy, src, dst, 0, Limits{});
    EXPECT_TRUE(verify(src, st, dst, dt, 160));
}

// ---- errors ----

TEST(PlanErrors, RefusesMismatchedShapeAndShortTables) {
    Shape a{1, 2, 8, SG_DTYPE_FP16}, b{1, 4, 8, SG_DTYPE_FP16};
    const kv::Layout la = make(a, SideSpec{}), lb = make(b, SideSpec{});
    const std::vector<uint32_t> t = {0, 1};
    std::vector<uint8_t> buf(la.region_bytes());
    const uint8_t *bases[2] = {buf.data(), buf.data()};
    Vec<Op> ops;
    try {
        compile_layer(Side{&la, t}, bases, Side{&lb, t}, 20, Limits{}, ops);
        ADD_FAILURE() << "heads mismatch accepted";
    } catch (const sg::Error &e) {
        EXPECT_EQ(e.status(), SG_ERR_LAYOUT_MISMATCH);
    }
    // 33 tokens of 16 per block need three blocks on each side.
    for (int side = 0; side < 2; ++side) {
        const std::vector<uint32_t> full = {0, 1, 2}, shortt = {0, 1};
        try {
            compile_layer(Side{&la, side ? full : shortt}, bases, Side{&la, side ? shortt : full}, 33, Limits{}, ops);
            ADD_FAILURE() << "short table accepted on side " << side;
        } catch (const sg::Error &e) {
            EXPECT_EQ(e.status(), SG_ERR_OUT_OF_RANGE);
        }
    }
}

// ---- allocation ----

TEST(PlanAllocation, CompileDoesNotAllocatePerBlock) {
    std::mt19937_64 rng(19);
    Shape shape{1, 2, 8, SG_DTYPE_FP16};
    // Token-major 16 per block on the source, head-major 8 per block on the destination: the
    // row-at-a-time path, which emits the most ops per block.
    const kv::Layout sl = make(shape, SideSpec{16, SG_KV_SEPARATE, SG_BLOCK_TOKEN_MAJOR, 0, 8192});
    const kv::Layout dl = make(shape, SideSpec{8, SG_KV_FUSED, SG_BLOCK_HEAD_MAJOR, 0, 16384});
    std::vector<uint8_t> k(sl.region_bytes()), v(sl.region_bytes());
    const uint8_t *bases[2] = {k.data(), v.data()};

    auto tables = [&](uint64_t src_blocks) {
        return std::make_pair(random_table(rng, sl.num_blocks, src_blocks, false),
                              random_table(rng, dl.num_blocks, 2 * src_blocks, false));
    };
    const auto [s16, d16] = tables(16);
    const auto [s4096, d4096] = tables(4096);

    auto allocations = [&](Vec<Op> &ops, const std::vector<uint32_t> &st, const std::vector<uint32_t> &dt) {
        const uint64_t before = sg::mem_allocation_count();
        compile_layer(Side{&sl, st}, bases, Side{&dl, dt}, st.size() * 16, Limits{}, ops);
        return sg::mem_allocation_count() - before;
    };

    // A fresh vector: one reservation, whatever the size of the request.
    Vec<Op> small, large;
    const uint64_t first_small = allocations(small, s16, d16);
    const uint64_t first_large = allocations(large, s4096, d4096);
    EXPECT_LE(first_small, 1u);
    EXPECT_EQ(first_small, first_large) << "allocations grow with the number of blocks";
    EXPECT_GT(large.size(), 4096u * 16);  // sanity: the large plan really has many ops

    // A warmed vector: no allocation at all, for the same request or a smaller one.
    for (int i = 0; i < 3; ++i) {
        EXPECT_EQ(allocations(small, s16, d16), 0u);
        EXPECT_EQ(allocations(large, s4096, d4096), 0u);
        EXPECT_EQ(allocations(large, s16, d16), 0u);
    }
}

}  // namespace
}  // namespace sg::plan

// ---- The transfer state machine and the scheduler's policy -------------------------------------

namespace state_tests {
using sg::plan::TransferState;

TEST(TransferStateMachine, OnlyTheDiagramsTransitionsAreLegal) {
    const TransferState all[] = {TransferState::Unmatched, TransferState::Running, TransferState::Finished,
                                 TransferState::Quiesced, TransferState::Released};
    auto edge = [](TransferState a, TransferState b) {
        using S = TransferState;
        return (a == S::Unmatched && (b == S::Running || b == S::Finished)) || (a == S::Running && b == S::Finished) ||
               (a == S::Finished && (b == S::Quiesced || b == S::Released)) || (a == S::Quiesced && b == S::Released);
    };
    int legal = 0;
    for (TransferState a : all)
        for (TransferState b : all) {
            EXPECT_EQ(sg::plan::legal_transition(a, b), edge(a, b))
                << sg::plan::state_name(a) << " -> " << sg::plan::state_name(b);
            legal += sg::plan::legal_transition(a, b);
        }
    EXPECT_EQ(legal, 6);  // no state moves to itself, nothing leaves Released, nothing goes back
}

TEST(InflightBudget, BoundsOperationsAndBytesButLetsAnOversizedOperationGoAlone) {
    sg::plan::InflightBudget b;
    b.max_ops = 2;
    b.max_bytes = 100;
    b.max_session_bytes = 60;
    EXPECT_TRUE(b.has_op_slot());
    EXPECT_TRUE(b.may_post_bytes(0, 1000));  // nothing in flight: even one larger than every bound
    b.posted(50);
    EXPECT_FALSE(b.may_post_bytes(50, 20));  // the session's bound (50 + 20 > 60)
    EXPECT_TRUE(b.may_post_bytes(0, 20));    // another session may
    EXPECT_FALSE(b.may_post_bytes(0, 51));   // the context's bound (50 + 51 > 100)
    b.posted(40);
    EXPECT_FALSE(b.has_op_slot());
    b.completed(50);
    EXPECT_TRUE(b.has_op_slot());
    EXPECT_EQ(b.ops(), 1u);
    EXPECT_EQ(b.bytes(), 40u);
    b.completed(40);
    EXPECT_TRUE(b.may_post_bytes(0, 1u << 30));
}

}  // namespace state_tests
