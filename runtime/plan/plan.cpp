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

// What a new operation is copied from before its fields are filled in: a value-initialised Op is
// zeroed with rep stos, and one built elsewhere and pushed is copied with wide loads of the narrower
// stores that just wrote it (a store-forwarding stall); each cost more than the rest of planning.
constexpr Op kBlankOp{};

// Merges segments into operations: a segment that continues the open operation's destination
// range extends its last local piece (when it also continues that piece) or adds a piece (up to
// max_iov); anything else starts a new operation. Operations are split at max_op_bytes, filling each
// to the limit. What the checks read of the open operation is kept in members, and its lengths are
// written out when it is closed. Layers that can never reach max_op_bytes take Unsplit below.
class Coalescer {
  public:
    Coalescer(Vec<Op> &ops, const Limits &limits)
        : ops_(ops), max_bytes_(limits.max_op_bytes), max_iov_(limits.max_iov) {}

    void add(const uint8_t *src, uint32_t src_region, uint32_t dst_region, uint64_t dst_offset, uint64_t len) {
        stats.segments++;
        stats.bytes += len;
        while (len) {
            uint64_t take;
            if (open_ && dst_region == dst_region_ && dst_offset == dst_end_ && len_ < max_bytes_) {
                take = std::min(max_bytes_ - len_, len);
                if (src == tail_end_ && src_region == tail_region_) {
                    // extends the last piece
                } else if (niov_ < max_iov_) {
                    close_tail();
                    cur_->iov[niov_++] = Iov{src, 0, src_region};
                    tail_region_ = src_region;
                } else {
                    take = std::min(max_bytes_, len);
                    open(src, src_region, dst_region, dst_offset, take);
                    goto next;
                }
                tail_end_ = src + take;
                len_ += take;
                dst_end_ += take;
            } else {
                take = std::min(max_bytes_, len);
                open(src, src_region, dst_region, dst_offset, take);
            }
        next:
            src += take;
            dst_offset += take;
            len -= take;
        }
    }

    // Closes the open operation and opens one for this segment (len <= max_bytes_).
    [[gnu::always_inline]] void open(const uint8_t *src, uint32_t src_region, uint32_t dst_region, uint64_t dst_offset,
                                     uint64_t len) {
        flush();
        ops_.push_back(kBlankOp);
        cur_ = &ops_.back();
        cur_->dst_region = dst_region;
        cur_->dst_offset = dst_offset;
        cur_->iov[0] = Iov{src, len, src_region};
        open_ = true;
        niov_ = 1;
        dst_region_ = dst_region;
        tail_region_ = src_region;
        tail_end_ = src + len;
        len_ = len;
        dst_end_ = dst_offset + len;
    }

    // Writes the open operation out; call once after the last add.
    void flush() {
        if (!open_) return;
        close_tail();
        cur_->niov = niov_;
        cur_->len = len_;
        open_ = false;
    }

    LayerPlanStats stats;

  private:
    void close_tail() {
        Iov &t = cur_->iov[niov_ - 1];
        t.len = uint64_t(tail_end_ - t.addr);
    }

    Vec<Op> &ops_;
    const uint64_t max_bytes_;
    const uint32_t max_iov_;
    Op *cur_ = nullptr;  // the open operation, ops_.back() while open_
    bool open_ = false;
    uint32_t niov_ = 0, dst_region_ = 0, tail_region_ = 0;
    uint64_t len_ = 0, dst_end_ = 0;
    const uint8_t *tail_end_ = nullptr;
};

// One side's addressing with every layout branch taken once per layer: plane p of block b starts at
// b * block_stride + plane_offset[p] in region[p]; row (t, h) of a plane at t * token_step +
// h * head_step (kv::Layout::plane and row_offset, unrolled).
struct Geometry {
    const uint32_t *blocks;
    uint32_t tokens_per_block;
    uint32_t region[2];
    uint64_t plane_offset[2];
    uint64_t block_stride, token_step, head_step;
};

Geometry geometry(const kv::Layout &l, std::span<const uint32_t> blocks) {
    Geometry g;
    g.blocks = blocks.data();
    g.tokens_per_block = l.tokens_per_block;
    for (uint32_t p = 0; p < 2; ++p) {
        const kv::Layout::Loc loc = l.plane(p, 0);
        g.region[p] = loc.region;
        g.plane_offset[p] = loc.offset;
    }
    g.block_stride = l.block_stride;
    g.token_step = l.row_offset(1, 0) - l.row_offset(0, 0);
    g.head_step = l.num_kv_heads > 1 ? l.row_offset(0, 1) - l.row_offset(0, 0) : 0;
    return g;
}

// Walks the request in runs that end where either side's block ends, each side's position kept as
// (table index, token within that block) and advanced by the run's length: no division per run.
template <Unit U, class Sink>
[[gnu::always_inline]] inline void walk(const Geometry &s, const Geometry &d, const uint8_t *const src_bases[2],
                                        uint64_t num_tokens, bool planes_inner, uint64_t row, uint32_t heads,
                                        Sink &out) {
    auto emit = [&](uint32_t p, uint64_t si, uint32_t st, uint64_t di, uint32_t dt, uint64_t n)
        __attribute__((always_inline)) {
        const uint32_t sr = s.region[p], dr = d.region[p];
        const uint8_t *sp = src_bases[sr] + s.blocks[si] * s.block_stride + s.plane_offset[p] + st * s.token_step;
        const uint64_t doff = d.blocks[di] * d.block_stride + d.plane_offset[p] + dt * d.token_step;
        if constexpr (U == Unit::TokenRows) {
            out.add(sp, sr, dr, doff, n * heads * row);
        } else if constexpr (U == Unit::HeadRuns) {
            for (uint32_t h = 0; h < heads; ++h) out.add(sp + h * s.head_step, sr, dr, doff + h * d.head_step, n * row);
        } else {
            for (uint64_t k = 0; k < n; ++k)
                for (uint32_t h = 0; h < heads; ++h)
                    out.add(sp + k * s.token_step + h * s.head_step, sr, dr, doff + k * d.token_step + h * d.head_step,
                            row);
        }
    };
    auto pass = [&](auto &&fn) __attribute__((always_inline)) {
        uint64_t si = 0, di = 0;
        uint32_t st = 0, dt = 0;
        const uint32_t stpb = s.tokens_per_block, dtpb = d.tokens_per_block;
        for (uint64_t t = 0; t < num_tokens;) {
            const uint64_t n = std::min({uint64_t(stpb - st), uint64_t(dtpb - dt), num_tokens - t});
            fn(si, st, di, dt, n);
            t += n;
            st += uint32_t(n);
            dt += uint32_t(n);
            if (st == stpb) st = 0, si++;
            if (dt == dtpb) dt = 0, di++;
        }
    };
    // Fused on both sides: K and V of a block are neighbours, so walk planes innermost to let them
    // coalesce; otherwise walk planes outermost so consecutive blocks of one region coalesce.
    if (planes_inner) {
        pass([&](uint64_t si, uint32_t st, uint64_t di, uint32_t dt, uint64_t n) __attribute__((always_inline)) {
            emit(0, si, st, di, dt, n);
            emit(1, si, st, di, dt, n);
        });
    } else {
        for (uint32_t p = 0; p < 2; ++p)
            pass([&](uint64_t si, uint32_t st, uint64_t di, uint32_t dt, uint64_t n)
                     __attribute__((always_inline)) { emit(p, si, st, di, dt, n); });
    }
}

// The Coalescer for a layer none of whose operations can reach max_op_bytes (its K and V together
// fit in one), which is every layer of a real model at the default limit: no segment is ever split,
// so each is one branch — extend, add a piece, or open an operation. It lives only inside
// walk_unsplit, its address never taken, so its state stays in registers; Coalescer's fields had
// to be reloaded after every store into an Op, which might have aliased them.
class Unsplit {
  public:
    Unsplit(Vec<Op> &ops, uint32_t max_iov) : ops_(ops), max_iov_(max_iov) {}

    [[gnu::always_inline]] void add(const uint8_t *src, uint32_t src_region, uint32_t dst_region, uint64_t dst_offset,
                                    uint64_t len) {
        stats.segments++;
        stats.bytes += len;
        if (cur_ && dst_region == dst_region_ && dst_offset == dst_end_) {
            if (src == tail_end_ && src_region == tail_region_) {
                tail_end_ += len;
                len_ += len;
                dst_end_ += len;
                return;
            }
            if (niov_ < max_iov_) {
                cur_->iov[niov_ - 1].len = uint64_t(tail_end_ - tail_start_);
                cur_->iov[niov_++] = Iov{src, 0, src_region};
                tail_region_ = src_region;
                tail_start_ = src;
                tail_end_ = src + len;
                len_ += len;
                dst_end_ += len;
                return;
            }
        }
        flush();
        ops_.push_back(kBlankOp);
        cur_ = &ops_.back();
        cur_->dst_region = dst_region;
        cur_->dst_offset = dst_offset;
        cur_->iov[0] = Iov{src, len, src_region};
        niov_ = 1;
        dst_region_ = dst_region;
        tail_region_ = src_region;
        tail_start_ = src;
        tail_end_ = src + len;
        len_ = len;
        dst_end_ = dst_offset + len;
    }

    void flush() {
        if (!cur_) return;
        cur_->iov[niov_ - 1].len = uint64_t(tail_end_ - tail_start_);
        cur_->niov = niov_;
        cur_->len = len_;
    }

    LayerPlanStats stats;

  private:
    Vec<Op> &ops_;
    const uint32_t max_iov_;
    Op *cur_ = nullptr;  // the open operation, ops_.back()
    uint32_t niov_ = 0, dst_region_ = 0, tail_region_ = 0;
    uint64_t len_ = 0, dst_end_ = 0;
    const uint8_t *tail_start_ = nullptr, *tail_end_ = nullptr;
};

template <Unit U>
[[gnu::noinline]] LayerPlanStats walk_unsplit(const Geometry &s, const Geometry &d, const uint8_t *const src_bases[2],
                                              uint64_t num_tokens, bool planes_inner, uint64_t row, uint32_t heads,
                                              uint32_t max_iov, Vec<Op> &ops) {
    Unsplit out(ops, max_iov);
    walk<U>(s, d, src_bases, num_tokens, planes_inner, row, heads, out);
    out.flush();
    return out.stats;
}

template <Unit U>
[[gnu::noinline]] LayerPlanStats walk_general(const Geometry &s, const Geometry &d, const uint8_t *const src_bases[2],
                                              uint64_t num_tokens, bool planes_inner, uint64_t row, uint32_t heads,
                                              const Limits &limits, Vec<Op> &ops) {
    Coalescer out(ops, limits);
    walk<U>(s, d, src_bases, num_tokens, planes_inner, row, heads, out);
    out.flush();
    return out.stats;
}

template <Unit U>
LayerPlanStats walk_layer(const Geometry &s, const Geometry &d, const uint8_t *const src_bases[2], uint64_t num_tokens,
                          bool planes_inner, uint64_t row, uint32_t heads, const Limits &limits, Vec<Op> &ops) {
    // An operation never holds more than the layer's K and V bytes.
    const uint64_t layer_bytes = 2 * num_tokens * heads * row;
    if (layer_bytes <= limits.max_op_bytes)
        return walk_unsplit<U>(s, d, src_bases, num_tokens, planes_inner, row, heads, limits.max_iov, ops);
    return walk_general<U>(s, d, src_bases, num_tokens, planes_inner, row, heads, limits, ops);
}

}  // namespace

uint64_t max_ops_per_layer(const Side &src, const Side &dst, uint64_t num_tokens) {
    const kv::Layout &s = *src.layout, &d = *dst.layout;
    const uint64_t runs = kv::blocks_for(num_tokens, s.tokens_per_block) + kv::blocks_for(num_tokens, d.tokens_per_block);
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
    const uint64_t s_need = kv::blocks_for(num_tokens, s.tokens_per_block);
    const uint64_t d_need = kv::blocks_for(num_tokens, d.tokens_per_block);
    if (src.blocks.size() < s_need || dst.blocks.size() < d_need)
        fail(SG_ERR_OUT_OF_RANGE, "block table too short for num_tokens");
    ops.clear();
    const uint64_t bound = max_ops_per_layer(src, dst, num_tokens);
    if (ops.capacity() < bound) ops.reserve(bound);

    const uint64_t row = s.row_bytes();
    const bool planes_inner = s.packing == SG_KV_FUSED && d.packing == SG_KV_FUSED;
    const Geometry sg = geometry(s, src.blocks), dg = geometry(d, dst.blocks);
    switch (unit_for(s, d)) {
        case Unit::TokenRows:
            return walk_layer<Unit::TokenRows>(sg, dg, src_bases, num_tokens, planes_inner, row, s.num_kv_heads, limits,
                                               ops);
        case Unit::HeadRuns:
            return walk_layer<Unit::HeadRuns>(sg, dg, src_bases, num_tokens, planes_inner, row, s.num_kv_heads, limits,
                                              ops);
        case Unit::Rows:
            break;
    }
    return walk_layer<Unit::Rows>(sg, dg, src_bases, num_tokens, planes_inner, row, s.num_kv_heads, limits, ops);
}

}  // namespace sg::plan
