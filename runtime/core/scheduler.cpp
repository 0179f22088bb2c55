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
            flush_outbox(*s);
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
                any = (t.selective() ? pump_selective(t, pass, plan::kTurnQuota)
                                     : pass == int(plan::PathClass::Bulk) && pump(t, plan::kTurnQuota)) || any;
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
bool Context::start_next_layer(Transfer &t) {
    Transfer::Prefill &P = t.prefill();
    if (P.order_pos >= P.order.size()) return false;
    const uint32_t layer = P.order[P.order_pos];
    if (!t.layers[layer].out.written) return false;
    P.order_pos++;
    const uint32_t rpl = t.pool->layout.regions_per_layer();
    const uint8_t *bases[2] = {t.pool->region(layer, 0), t.pool->region(layer, rpl - 1)};
    plan::Side src{&t.pool->layout, t.table};
    plan::Side dst{&P.dst->layout, P.dst_table};
    plan::Limits limits;
    limits.max_op_bytes = std::min(max_op_bytes_, t.session->tp->caps().max_msg_size);
    // A staged-only write (quantized, or device memory) is packed into one staging slot: no op may be
    // larger than a slot.
    if (t.staged_only()) limits.max_op_bytes = std::min<uint64_t>(limits.max_op_bytes, StagingArea::kSlotBytes);
    limits.max_iov = uint32_t(std::min<uint64_t>(plan::kMaxIov, std::max<uint64_t>(1, t.session->tp->caps().rma_iov_limit)));
    const plan::LayerPlanStats ps = plan::compile_layer(src, bases, dst, t.num_tokens, limits, P.ops);
    t.stats.segments += ps.segments;
    P.cur_layer = layer;
    P.next_op = 0;
    const uint64_t mean = P.ops.empty() ? 0 : ps.bytes / P.ops.size();
    Transfer::Layer &L = t.layers[layer];
    if (t.staged_only()) {
        // Quantization and device copies happen while packing, so every op is staged (the staging
        // policy does not apply), and the layer's rate says nothing about plain writes against
        // staging.
        L.out.candidate = false;
        L.out.staged = true;
    } else {
        L.out.candidate = staging_threshold_ && t.session->have_peer_staging && mean < staging_threshold_ &&
                          staging_policy_ != SG_STAGING_NEVER;
        L.out.staged = L.out.candidate && (staging_policy_ == SG_STAGING_ALWAYS || choose_staging(*t.session));
    }
    L.out.start_ns = now_ns();
    L.out.bytes = ps.bytes;
    P.cur_staged = L.out.staged;
    if (P.ops.empty()) L.out.posted = true;
    return true;
}

// One RMA write of ops[next_op], of the full path's current layer (unit NULL) or of a selective
// send unit; advances next_op when the provider took it.
bool Context::post_write_op(Transfer &t, uint32_t layer, const Vec<plan::Op> &ops, size_t &next_op, SendUnit *unit) {
    if (tx_full(*t.session->tp)) return false;
    Transfer::Prefill &P = t.prefill();
    const plan::Op &op = ops[next_op];
    Session &s = *t.session;
    const Session::LocalReg &lr = *P.src_reg;
    const uint32_t rpl = t.pool->layout.regions_per_layer();
    transport::LocalIov iov[plan::kMaxIov];
    for (uint32_t i = 0; i < op.niov; ++i)
        iov[i] = {op.iov[i].addr, op.iov[i].len, lr.regions[size_t(layer) * rpl + op.iov[i].src_region].desc};
    const wire::Region &dr = P.dst->regions[size_t(layer) * P.dst->regions_per_layer + op.dst_region];
    OpCookie *c = take_cookie();
    c->kind = OpCookie::Kind::Write;
    c->xfer = &t;
    c->session = &s;
    c->layer = layer;
    c->unit = unit;
    int rc;
    try {
        rc = s.tp->post_write_as(write_class(unit), s.peer, std::span(iov, op.niov), dr.base + op.dst_offset, dr.key,
                                 c);
    } catch (const Error &e) {
        give_cookie(c);
        lose_session(s, SG_ERR_PEER_LOST, "writing to the peer failed: " + e.message());
        return false;
    }
    if (rc == -EAGAIN) {
        give_cookie(c);
        note_tx_full(*s.tp);
        return false;
    }
    c->len = op.len;
    budget_.posted(op.len);
    s.bytes_inflight += op.len;
    t.inflight++;
    if (unit) {
        unit->outstanding++;
        count_unit_bytes(t, *unit, op.len, op.len);
    } else {
        t.layers[layer].out.outstanding++;
    }
    t.stats.rma_ops++;
    t.stats.bytes += op.len;
    counters.rma_ops++;
    counters.bytes_direct += op.len;
    next_op++;
    return true;
}

bool Context::may_post_bytes(const Session &s, uint64_t len) const {
    return budget_.may_post_bytes(s.bytes_inflight, len);
}

// Posts up to `quota` operations of t; returns whether it posted any (so the caller may give the
// transfer another turn).
bool Context::pump(Transfer &t, uint32_t quota) {
    if (!t.matched() || t.finished()) return false;
    Transfer::Prefill &P = t.prefill();
    flush_outbox(*t.session);
    uint32_t posted = 0;
    for (;;) {
        if (P.cur_layer < 0 || t.layers[size_t(P.cur_layer)].out.posted) {
            if (!start_next_layer(t)) break;
        }
        Transfer::Layer &L = t.layers[size_t(P.cur_layer)];
        while (P.next_op < P.ops.size() && budget_.has_op_slot() && posted < quota &&
               may_post_bytes(*t.session, P.ops[P.next_op].len)) {
            const uint32_t layer = uint32_t(P.cur_layer);
            if (!(P.cur_staged ? post_staged_chunk(t, layer, P.ops, P.next_op, nullptr)
                               : post_write_op(t, layer, P.ops, P.next_op, nullptr)))
                break;
            posted++;
        }
        if (P.next_op < P.ops.size()) {  // out of resources or of this turn's quota
            const bool stalled = posted < quota && !may_post_bytes(*t.session, P.ops[P.next_op].len);
            if (stalled && !P.stalled) counters.stalls++;
            P.stalled = stalled;
            break;
        }
        P.stalled = false;
        L.out.posted = true;
        maybe_send_notices(t);
        if (t.finished()) return posted > 0;
    }
    maybe_send_notices(t);
    return posted > 0;
}

}  // namespace sg::core
