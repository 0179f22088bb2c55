#include "plan/plan.hpp"

#include <algorithm>

namespace sg::plan {

namespace {

enum class Unit {
    TokenRows,  // both token-major: a run of tokens is contiguous across all heads
    HeadRuns,   // both head-major: per head, a run of tokens is contiguous
    Rows,       // orders differ: one (token, head) row at a time
};

Unit unit_for(const kv::Layout &a, const kv::Layout &b) {
    if (a.order == SG_BLOCK_TOKEN_MAJOR && b.order == SG_BLOCK_TOKEN_MAJOR) return Unit::TokenRows;
    if (a.order == SG_BLOCK_HEAD_MAJOR && b.order == SG_BLOCK_HEAD_MAJOR) return Unit::HeadRuns;
    return Unit::Rows;
}

class Coalescer {
  public:
    Coalescer(Vec<Op> &ops, const Limits &limits) : ops_(ops), limits_(limits) {}

    void add(const uint8_t *src, uint32_t src_region, uint32_t dst_region, uint64_t dst_offset, uint64_t len) {
        stats.segments++;
        stats.bytes += len;
        while (len) {
            if (!ops_.empty()) {
                Op &last = ops_.back();
                const bool dst_adjacent = last.dst_region == dst_region && last.dst_offset + last.len == dst_offset;
                const uint64_t room = limits_.max_op_bytes - last.len;
                if (dst_adjacent && room) {
                    const uint64_t take = std::min(room, len);
                    Iov &tail = last.iov[last.niov - 1];
                    if (tail.addr + tail.len == src && tail.src_region == src_region) {
                        tail.len += take;
                    } else if (last.niov < limits_.max_iov) {
                        last.iov[last.niov++] = Iov{src, take, src_region};
                    } else {
                        goto new_op;
                    }
                    last.len += take;
                    src += take;
                    dst_offset += take;
                    len -= take;
                    continue;
                }
            }
        new_op:
            const uint64_t take = std::min(limits_.max_op_bytes, len);
            Op op;
            op.dst_region = dst_region;
            op.dst_offset = dst_offset;
            op.len = take;
            op.niov = 1;
            op.iov[0] = Iov{src, take, src_region};
            ops_.push_back(op);
            src += take;
            dst_offset += take;
            len -= take;
        }
    }

    LayerPlanStats stats;

  private:
    Vec<Op> &ops_;
    const Limits &limits_;
};

}  // namespace

uint64_t max_ops_per_layer(const Side &src, const Side &dst, uint64_t num_tokens) {
    const kv::Layout &s = *src.layout, &d = *dst.layout;
    const uint64_t runs = (num_tokens + s.tokens_per_block - 1) / s.tokens_per_block +
                          (num_tokens + d.tokens_per_block - 1) / d.tokens_per_block;
    uint64_t per_run = 1;
    switch (unit_for(s, d)) {
        case Unit::TokenRows: per_run = 1; break;
        case Unit::HeadRuns: per_run = s.num_kv_heads; break;
        case Unit::Rows: per_run = uint64_t(std::min(s.tokens_per_block, d.tokens_per_block)) * s.num_kv_heads; break;
    }
    // Two planes; an op split by max_op_bytes only happens for runs larger than that, which adds at
    // most bytes / max_op_bytes more — callers reserve for the common case and the vector grows
    // (once, geometrically) otherwise.
    return 2 * runs * per_run;
}

LayerPlanStats compile_layer(const Side &src, const uint8_t *const src_bases[2], const Side &dst, uint64_t num_tokens,
                             const Limits &limits, Vec<Op> &ops) {
    const kv::Layout &s = *src.layout, &d = *dst.layout;
    kv::check_mappable(s, d);
    const uint64_t s_need = (num_tokens + s.tokens_per_block - 1) / s.tokens_per_block;
    const uint64_t d_need = (num_tokens + d.tokens_per_block - 1) / d.tokens_per_block;
    if (src.blocks.size() < s_need || dst.blocks.size() < d_need)
        fail(SG_ERR_OUT_OF_RANGE, "block table too short for num_tokens");
    ops.clear();
    const uint64_t bound = max_ops_per_layer(src, dst, num_tokens);
    if (ops.capacity() < bound) ops.reserve(bound);

    Coalescer out(ops, limits);
    const Unit unit = unit_for(s, d);
    const uint64_t row = s.row_bytes();
    // Fused on both sides: K and V of a block are neighbours, so walk planes innermost to let them
    // coalesce; otherwise walk planes outermost so consecutive blocks of one region coalesce.
    const bool planes_inner = s.packing == SG_KV_FUSED && d.packing == SG_KV_FUSED;

    auto emit_run = [&](uint32_t plane, uint64_t t, uint64_t n) {
        const uint64_t sb = src.blocks[t / s.tokens_per_block], db = dst.blocks[t / d.tokens_per_block];
        const uint32_t st = uint32_t(t % s.tokens_per_block), dt = uint32_t(t % d.tokens_per_block);
        const kv::Layout::Loc sl = s.plane(plane, sb), dl = d.plane(plane, db);
        switch (unit) {
            case Unit::TokenRows:
                out.add(src_bases[sl.region] + sl.offset + s.row_offset(st, 0), sl.region, dl.region,
                        dl.offset + d.row_offset(dt, 0), n * s.num_kv_heads * row);
                break;
            case Unit::HeadRuns:
                for (uint32_t h = 0; h < s.num_kv_heads; ++h)
                    out.add(src_bases[sl.region] + sl.offset + s.row_offset(st, h), sl.region, dl.region,
                            dl.offset + d.row_offset(dt, h), n * row);
                break;
            case Unit::Rows:
                for (uint64_t k = 0; k < n; ++k)
                    for (uint32_t h = 0; h < s.num_kv_heads; ++h)
                        out.add(src_bases[sl.region] + sl.offset + s.row_offset(uint32_t(st + k), h), sl.region,
                                dl.region, dl.offset + d.row_offset(uint32_t(dt + k), h), row);
                break;
        }
    };
    // A run ends where either side's block ends.
    auto for_each_run = [&](auto &&fn) {
        for (uint64_t t = 0; t < num_tokens;) {
            const uint64_t n = std::min({uint64_t(s.tokens_per_block - t % s.tokens_per_block),
                                         uint64_t(d.tokens_per_block - t % d.tokens_per_block), num_tokens - t});
            fn(t, n);
            t += n;
        }
    };
    if (planes_inner) {
        for_each_run([&](uint64_t t, uint64_t n) {
            emit_run(0, t, n);
            emit_run(1, t, n);
        });
    } else {
        for (uint32_t plane = 0; plane < 2; ++plane) for_each_run([&](uint64_t t, uint64_t n) { emit_run(plane, t, n); });
    }
    return out.stats;
}

}  // namespace sg::plan
