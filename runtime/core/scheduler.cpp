// The scheduler's mechanics on the prefill side: each pass serves transfers by priority and by
// path class (on-demand, then proactive and full, then speculative) within the in-flight bounds,
// compiling the next written layer of a full transfer and posting its writes.
#include "core/core.hpp"

#include <algorithm>
#include <cerrno>

namespace sg::core {

void Context::schedule_locked() {
    check_timers_locked();
    // rxm answers EAGAIN while a connection is being set up, so queued control messages are retried
    // on every pass.
    for (auto &[peer_id, weak] : sessions_)
        if (auto s = weak.lock(); s && (!s->outbox.empty() || !s->bulk_outbox.empty() || !s->auth_outbox.empty()))
            s->flush_outbox();
    // Highest priority first; stable so equal priorities keep arrival order. Sorted only when a
    // transfer joined since the last pass (removals keep the order).
    if (active_unsorted_) {
        std::stable_sort(active_.begin(), active_.end(),
                         [](const auto &a, const auto &b) { return a->options.priority > b->options.priority; });
        active_unsorted_ = false;
    }
    // Transfers take turns, a quota of operations each, so equal priorities share a session fairly
    // and a higher priority is served first on every pass.
    // Passes by path: on-demand units of every transfer first, then proactive and full-path work,
    // then speculative units.
    for (int pass = 0; pass < plan::kPathClasses; ++pass) {
        for (bool any = true; any;) {
            any = false;
            for (size_t i = 0; i < active_.size(); ++i) {
                Transfer &t = *active_[i];
                any = t.path().pump(t, pass, plan::kTurnQuota) || any;
            }
        }
    }
    active_.erase(std::remove_if(active_.begin(), active_.end(),
                                 [](const auto &t) {
                                     return t->finished() || (t->prefill().done_sent() && !t->inflight);
                                 }),
                  active_.end());
}

// Compiles the next written layer in send order into t.ops. Returns false when none is ready.
bool Transfer::start_next_layer() {
    Transfer::Prefill &P = prefill();
    if (P.order_pos >= P.order.size()) return false;
    const uint32_t layer = P.order[P.order_pos];
    if (!layers[layer].out.written()) return false;
    P.order_pos++;
    const uint32_t rpl = pool->layout.regions_per_layer();
    const uint8_t *bases[2] = {pool->region(layer, 0), pool->region(layer, rpl - 1)};
    plan::Side src{&pool->layout, table};
    plan::Side dst{&P.dst->layout, P.dst_table};
    plan::Limits limits;
    limits.max_op_bytes = std::min(ctx->max_op_bytes_, session->tp->caps().max_msg_size);
    // A staged-only write (quantized, or device memory) is packed into one staging slot: no op may be
    // larger than a slot.
    if (staged_only()) limits.max_op_bytes = std::min<uint64_t>(limits.max_op_bytes, StagingArea::kSlotBytes);
    limits.max_iov = uint32_t(std::min<uint64_t>(plan::kMaxIov, std::max<uint64_t>(1, session->tp->caps().rma_iov_limit)));
    const plan::LayerPlanStats ps = plan::compile_layer(src, bases, dst, num_tokens, limits, P.ops);
    stats.segments += ps.segments;
    P.cur_layer = layer;
    P.next_op = 0;
    const uint64_t mean = P.ops.empty() ? 0 : ps.bytes / P.ops.size();
    Transfer::Layer &L = layers[layer];
    if (staged_only()) {
        // Quantization and device copies happen while packing, so every op is staged (the staging
        // policy does not apply), and the layer's rate says nothing about plain writes against
        // staging.
        L.out.candidate = false;
        L.out.staged = true;
    } else {
        L.out.candidate = ctx->staging_threshold_ && session->have_peer_staging && mean < ctx->staging_threshold_ &&
                          ctx->staging_policy_ != SG_STAGING_NEVER;
        L.out.staged = L.out.candidate && (ctx->staging_policy_ == SG_STAGING_ALWAYS || session->choose_staging());
    }
    L.out.start_ns = now_ns();
    L.out.bytes = ps.bytes;
    P.cur_staged = L.out.staged;
    return true;
}

// One RMA write of ops[next_op], of the full path's current layer (unit NULL) or of a selective
// send unit; advances next_op when the provider took it.
bool Transfer::post_write_op(uint32_t layer, const Vec<plan::Op> &ops, size_t &next_op, SendUnit *unit) {
    if (ctx->tx_full(*session->tp)) return false;
    Transfer::Prefill &P = prefill();
    const plan::Op &op = ops[next_op];
    Session &s = *session;
    const Session::LocalReg &lr = *P.src_reg;
    const uint32_t rpl = pool->layout.regions_per_layer();
    transport::LocalIov iov[plan::kMaxIov];
    for (uint32_t i = 0; i < op.niov; ++i)
        iov[i] = {op.iov[i].addr, op.iov[i].len, lr.regions[size_t(layer) * rpl + op.iov[i].src_region].desc};
    const wire::Region &dr = P.dst->regions[size_t(layer) * P.dst->regions_per_layer + op.dst_region];
    OpCookie *c = ctx->take_cookie();
    c->kind = OpCookie::Kind::Write;
    c->xfer = this;
    c->session = &s;
    c->layer = layer;
    c->unit = unit;
    int rc;
    try {
        rc = s.tp->post_write_as(write_class(unit), s.peer, std::span(iov, op.niov), dr.base + op.dst_offset, dr.key,
                                 c);
    } catch (const Error &e) {
        ctx->give_cookie(c);
        s.lose(SG_ERR_PEER_LOST, "writing to the peer failed: " + e.message());
        return false;
    }
    if (rc == -EAGAIN) {
        ctx->give_cookie(c);
        ctx->note_tx_full(*s.tp);
        return false;
    }
    c->len = op.len;
    ctx->budget_.posted(op.len);
    s.bytes_inflight += op.len;
    inflight++;
    if (unit) {
        unit->outstanding++;
        count_unit_bytes(*unit, op.len, op.len);
    } else {
        layers[layer].out.outstanding++;
    }
    stats.rma_ops++;
    stats.bytes += op.len;
    ctx->counters.rma_ops++;
    ctx->counters.bytes_direct += op.len;
    next_op++;
    return true;
}

bool Session::may_post_bytes(uint64_t len) const {
    return ctx->budget_.may_post_bytes(bytes_inflight, len);
}

// Posts up to `quota` operations of t; returns whether it posted any (so the caller may give the
// transfer another turn).
bool Transfer::pump(uint32_t quota) {
    if (!matched() || finished()) return false;
    Transfer::Prefill &P = prefill();
    session->flush_outbox();
    uint32_t posted = 0;
    for (;;) {
        if (P.cur_layer < 0 || layers[size_t(P.cur_layer)].out.step() >= LayerStep::Posted) {
            if (!start_next_layer()) break;
        }
        Transfer::Layer &L = layers[size_t(P.cur_layer)];
        while (P.next_op < P.ops.size() && ctx->budget_.has_op_slot() && posted < quota &&
               session->may_post_bytes(P.ops[P.next_op].len)) {
            const uint32_t layer = uint32_t(P.cur_layer);
            if (!(P.cur_staged ? post_staged_chunk(layer, P.ops, P.next_op, nullptr)
                               : post_write_op(layer, P.ops, P.next_op, nullptr)))
                break;
            posted++;
        }
        if (P.next_op < P.ops.size()) {  // out of resources or of this turn's quota
            const bool stalled = posted < quota && !session->may_post_bytes(P.ops[P.next_op].len);
            if (stalled && !P.stalled) ctx->counters.stalls++;
            P.stalled = stalled;
            break;
        }
        P.stalled = false;
        L.out.advance(LayerStep::Posted);
        maybe_send_notices();
        if (finished()) return posted > 0;
    }
    maybe_send_notices();
    return posted > 0;
}

}  // namespace sg::core
