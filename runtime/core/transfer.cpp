// Transfers: expect (decode) and post (prefill), matching the two by request id, layers written,
// the LayerReady/TransferDone notices and their ordering rule, completion, failure and cancel,
// quiescing, and release.
#include "core/core.hpp"

#include <algorithm>
#include <cstring>

namespace sg::core {

namespace {

void check_request_id(const char *rid) {
    if (!rid || !*rid) fail(SG_ERR_INVALID_ARGUMENT, "request_id is empty");
    if (std::strlen(rid) > SG_REQUEST_ID_MAX)
        fail(SG_ERR_INVALID_ARGUMENT, "request_id is longer than SG_REQUEST_ID_MAX (255) bytes");
}

// Both sides refuse what the other could not honour before anything is sent.
void check_wire_quant(uint32_t wire_quant, const kv::Layout &pool) {
    if (wire_quant == SG_WIRE_QUANT_NONE) return;
    kernels::QuantCode code;
    if (!quant::code_of(wire_quant, code))
        fail(SG_ERR_INVALID_ARGUMENT, "options.wire_quant " + std::to_string(wire_quant) + " is not an SG_WIRE_QUANT_* value");
    if (pool.dtype != SG_DTYPE_FP32 && pool.dtype != SG_DTYPE_FP16 && pool.dtype != SG_DTYPE_BF16)
        fail(SG_ERR_INVALID_ARGUMENT, std::string("options.wire_quant ") + quant::name_of(wire_quant) +
                                          " needs an fp32, fp16 or bf16 pool");
}

}  // namespace

Transfer::Transfer(Context *c, std::shared_ptr<Session> s, bool post, std::string rid, std::shared_ptr<KvPool> p,
                   std::span<const uint32_t> tbl, uint64_t ntok, const sg_transfer_options_t &opt)
    : ctx(c), session(std::move(s)), post_side(post), request_id(std::move(rid)), pool(std::move(p)),
      table(tbl.begin(), tbl.end()), num_tokens(ntok), options(opt) {
    if (post_side) {
        prefill_ = std::make_unique<Prefill>();
        sel_ = std::make_unique<Selective>();
    } else {
        decode_ = std::make_unique<Decode>();
    }
    layers.resize(pool->layout.num_layers);
    residency.reset(pool->layout.num_layers, table.size());
    stats.struct_size = sizeof stats;
    pool->transfers_using++;
}

Transfer::~Transfer() { let_go_of_pool(); }

// The pool counts the transfers that may still touch its memory (sg_kv_deregister refuses while any
// do). A released, quiesced transfer no longer does, even if an event queued for it keeps the
// object alive a moment longer: the release lets go then, not the destructor.
void Transfer::let_go_of_pool() {
    if (holds_pool_.exchange(false, std::memory_order_acq_rel)) pool->transfers_using--;
}

std::shared_ptr<Transfer> Context::expect(const std::shared_ptr<Session> &s, const char *rid,
                                          const std::shared_ptr<KvPool> &pool, std::span<const uint32_t> table,
                                          uint64_t num_tokens, const sg_transfer_options_t &opt) {
    check_request_id(rid);
    kv::check_block_table(pool->layout, table, num_tokens);
    check_wire_quant(opt.wire_quant, pool->layout);
    std::lock_guard lock(mu);
    if (s->closed()) fail(s->error ? s->error : SG_ERR_PEER_LOST, "session is closed");
    if (s->state() == SessionState::Draining) fail(SG_ERR_INVALID_STATE, "session is closing (sg_session_close)");
    if (!s->local_regs.count(pool->id))
        fail(SG_ERR_INVALID_STATE, "the destination pool was not exported to this session (sg_session_export_kv)");
    if (s->unfinished() >= max_transfers_per_session_)
        fail(SG_ERR_AGAIN, "the session has " + std::to_string(max_transfers_per_session_) +
                               " unfinished transfers (max_transfers_per_session); retry after some finish");
    for (auto &[k, t] : s->matchbook.expects())
        if (t->request_id == rid && !t->finished()) fail(SG_ERR_DUPLICATE, std::string("request '") + rid + "' is already expected");
    auto t = std::make_shared<Transfer>(this, s, false, rid, pool, table, num_tokens, opt);
    t->id = next_xfer_id_++;
    t->stats.start_ns = now_ns();
    if (opt.deadline_ns) t->deadline_abs_ns = saturating_add(t->stats.start_ns, opt.deadline_ns);
    if (auto c = s->matchbook.take_peer_cancel(rid)) {
        // The prefill side canceled this request before we expected it: nothing will be sent.
        s->matchbook.add_expect(t);
        t->decode().peer_quiesced = true;
        t->fail_with(c->status, c->message, false);
        return t;
    }
    s->offer_staging();
    s->matchbook.add_expect(t);
    wire::Expect m;
    m.request_id = rid;
    m.decode_xfer_id = t->id;
    m.handle_id = pool->id;
    m.num_tokens = num_tokens;
    m.block_ids.assign(table.begin(), table.end());
    m.wire_quant = opt.wire_quant;
    // A device pool is not for the CPU to read, and quantized bytes are not the sent ones.
    m.verify = verify_transfers() && pool->layout.mem_kind == SG_MEM_HOST && !opt.wire_quant;
    std::vector<uint8_t> out;
    wire::encode(out, id, m);
    if (out.size() > wire::kMaxFrameBytes) {
        s->matchbook.forget_expect(t->id);
        fail(SG_ERR_OUT_OF_RANGE, "block table too large for one control message (max about 60000 blocks)");
    }
    s->send(out);
    wake();
    return t;
}

std::shared_ptr<Transfer> Context::post(const std::shared_ptr<Session> &s, const char *rid,
                                        const std::shared_ptr<KvPool> &pool, std::span<const uint32_t> table,
                                        uint64_t num_tokens, const sg_transfer_options_t &opt,
                                        const select::Profile *profile) {
    check_request_id(rid);
    kv::check_block_table(pool->layout, table, num_tokens);
    check_wire_quant(opt.wire_quant, pool->layout);
    const uint32_t nl = pool->layout.num_layers;
    std::vector<uint32_t> order(nl);
    if (opt.layer_order) {
        if (opt.layer_order_count != nl) fail(SG_ERR_INVALID_ARGUMENT, "layer_order_count must equal num_layers");
        std::vector<bool> seen(nl);
        for (uint32_t i = 0; i < nl; ++i) {
            const uint32_t l = opt.layer_order[i];
            if (l >= nl || seen[l]) fail(SG_ERR_INVALID_ARGUMENT, "layer_order is not a permutation of the layers");
            seen[l] = true;
            order[i] = l;
        }
    } else {
        for (uint32_t i = 0; i < nl; ++i) order[i] = i;
    }
    const uint32_t all_paths = SG_PATH_FULL | SG_PATH_PROACTIVE | SG_PATH_ON_DEMAND | SG_PATH_SPECULATIVE;
    const uint32_t paths = opt.paths ? opt.paths : SG_PATH_FULL;
    if (paths & ~all_paths) fail(SG_ERR_INVALID_ARGUMENT, "options.paths holds bits that are not SG_PATH_*");
    if ((paths & SG_PATH_FULL) && paths != SG_PATH_FULL)
        fail(SG_ERR_INVALID_ARGUMENT, "SG_PATH_FULL excludes the selective paths");
    // Built before taking the lock: selecting the layers of an already written request takes time.
    auto t = std::make_shared<Transfer>(this, s, true, rid, pool, table, num_tokens, opt);
    t->set_paths(paths);
    t->options.profile = nullptr;  // the handle is the caller's; the transfer holds its own copy
    t->options.layer_order = nullptr;
    std::vector<PreparedLayer> prepared;
    t->path().prepare(*t, profile, prepared);
    std::lock_guard lock(mu);
    if (s->closed()) fail(s->error ? s->error : SG_ERR_PEER_LOST, "session is closed");
    if (s->state() == SessionState::Draining) fail(SG_ERR_INVALID_STATE, "session is closing (sg_session_close)");
    if (s->matchbook.posted(rid))
        fail(SG_ERR_DUPLICATE, std::string("request '") + rid + "' is already posted on this session");
    if (!s->local_regs.count(pool->id))
        fail(SG_ERR_INVALID_STATE, "the source pool was not exported to this session (sg_session_export_kv)");
    if (s->unfinished() >= max_transfers_per_session_)
        fail(SG_ERR_AGAIN, "the session has " + std::to_string(max_transfers_per_session_) +
                               " unfinished transfers (max_transfers_per_session); retry after some finish");
    if (auto c = s->matchbook.take_expect_canceled(rid)) {
        // The decode side canceled its Expect of this id before any post: this post answers that
        // cancel and ends with it.
        t->fail_with(c->status, c->message, false);
        return t;
    }
    if (s->matchbook.take_repost_needed(rid)) {
        // The decode side remembers that the id was canceled; this post is a new request.
        std::vector<uint8_t> out;
        wire::encode(out, id, wire::Reposted{rid});
        s->send(out);
    }
    t->prefill().order = std::move(order);
    t->prefill().src_reg = &s->local_regs.at(pool->id);  // map nodes are stable for the session's life
    if (opt.deadline_ns) t->deadline_abs_ns = saturating_add(now_ns(), opt.deadline_ns);
    t->path().commit_written(*t, prepared);
    if (auto m = s->matchbook.take_held_expect(rid)) {
        s->match(t, *m);
        if (t->status == SG_ERR_LAYOUT_MISMATCH || t->status == SG_ERR_OUT_OF_RANGE) {
            // The caller gets the error, not a handle: nothing of this post may stay behind, or the
            // id could never be posted again on the session.
            s->matchbook.forget_post(*t);
            fail(t->status, t->error);
        }
    } else {
        s->matchbook.add_waiting_post(t);
    }
    wake();
    return t;
}

void Session::match(const std::shared_ptr<Transfer> &t, const wire::Expect &e) {
    t->id = e.decode_xfer_id;
    matchbook.add_matched_post(t);
    t->stats.start_ns = now_ns();
    try {
        auto rp = remote_pools.find(e.handle_id);
        if (rp == remote_pools.end())
            fail(SG_ERR_PROTOCOL, "the decode side expected into a pool it never exported");
        kv::check_mappable(t->pool->layout, rp->second.layout);
        if (e.num_tokens != t->num_tokens)
            fail(SG_ERR_LAYOUT_MISMATCH, "token counts differ: posted " + std::to_string(t->num_tokens) + ", expected " +
                                             std::to_string(e.num_tokens));
        kv::check_block_table(rp->second.layout, e.block_ids, e.num_tokens);
        if (e.wire_quant != t->options.wire_quant)
            fail(SG_ERR_LAYOUT_MISMATCH, std::string("wire quantization differs: posted ") +
                                             quant::name_of(t->options.wire_quant) + ", expected " +
                                             quant::name_of(e.wire_quant) + " (options.wire_quant)");
        t->prefill().dst = &rp->second;
        t->prefill().dst_table.assign(e.block_ids.begin(), e.block_ids.end());
        // Verification, asked by either side: only a 1.8 peer knows BlockCrcs.
        t->prefill().send_crcs = peer_minor >= 8 && (e.verify || (ctx->verify_transfers() &&
                                                                    rp->second.layout.mem_kind == SG_MEM_HOST)) &&
                                 t->pool->layout.mem_kind == SG_MEM_HOST && !t->options.wire_quant;
        t->announce_paths();
        t->advance(plan::TransferState::Running);
        ctx->active_.push_back(t);
        ctx->active_unsorted_ = true;
    } catch (const Error &err) {
        ctx->log.log(SG_LOG_ERROR, "transfer '" + t->request_id + "' cannot start: " + err.message());
        t->fail_with(err.status(), err.message(), true);
    }
}

void Context::queue_job(SelectJob job) {
    std::lock_guard lock(select_mu_);
    if (!select_thread_.joinable()) select_thread_ = std::thread([this] { select_loop(); });
    select_jobs_.push_back(std::move(job));
    select_cv_.notify_one();
}

void Transfer::Layer::Out::advance(Step to) {
    if (uint8_t(to) != uint8_t(step_) + 1) [[unlikely]]
        fail(SG_ERR_INTERNAL, "a layer may not go from step " + std::to_string(int(step_)) + " to " +
                                  std::to_string(int(to)) + " (Unwritten, Written, Posted, Noticed)");
    step_ = to;
}

void SendUnit::advance(Step to) {
    if (uint8_t(to) != uint8_t(step_) + 1) [[unlikely]]
        fail(SG_ERR_INTERNAL, "a send unit may not go from step " + std::to_string(int(step_)) + " to " +
                                  std::to_string(int(to)) + " (Claimed, Compiled, Noticed)");
    step_ = to;
}

void Transfer::mark_written(uint32_t layer) {
    std::lock_guard lock(ctx->mu);
    if (!layers[layer].out.written()) {
        layers[layer].out.advance(LayerStep::Written);
        layers[layer].out.written_ns = now_ns();
        if (matched() && !finished()) pump(plan::kTurnQuota);
    }
    ctx->wake();
}

// Sends LayerReady for every posted layer whose notice may go now, in send order, and TransferDone
// after the last. With FI_ORDER_SAW the notice may follow the writes at once; otherwise it waits
// until the layer's writes (issued with delivery completion) have completed.
void Transfer::maybe_send_notices() {
    if (finished() || !matched()) return;
    Transfer::Prefill &P = prefill();
    const bool saw = session->tp->caps().send_after_write;
    // Layers before notice_pos are settled; each call only looks at the few still in flight.
    for (size_t i = P.notice_pos; i < P.order.size(); ++i) {
        const uint32_t l = P.order[i];
        Transfer::Layer &L = layers[l];
        if (L.out.step() < LayerStep::Posted) break;  // notices go in send order
        const bool may_notice = L.out.packs_pending == 0 && (saw || L.out.outstanding == 0);
        if (L.out.step() == LayerStep::Posted && may_notice) {
            send_block_crcs(l);
            wire::LayerReady m;
            m.decode_xfer_id = id;
            m.layer = l;
            m.bytes = pool->layout.plane_bytes / pool->layout.tokens_per_block * num_tokens * 2;
            m.staged_chunks = L.staged_chunks;
            std::vector<uint8_t> out;
            wire::encode(out, ctx->id, m);
            session->send(out, this);
            L.out.advance(LayerStep::Noticed);
        }
        if (L.out.step() != LayerStep::Noticed) break;
        if (L.out.outstanding == 0 && !L.ready) {
            record_layer_rate(L);
            residency.set_layer(l);
            mark_ready(l);
        }
        if (i == P.notice_pos && L.ready) P.notice_pos++;
    }
    if (P.notice_pos == P.order.size()) send_done();
}

void Transfer::send_done() {
    if (prefill().done_sent()) return;
    wire::TransferDone m;
    m.decode_xfer_id = id;
    m.bytes = stats.bytes;
    std::vector<uint8_t> out;
    wire::encode(out, ctx->id, m);
    prefill().end = Transfer::Prefill::End::DoneSent;
    session->send(out, this);
}

void Transfer::mark_ready(uint32_t layer) {
    Transfer::Layer &L = layers[layer];
    L.ready = true;
    L.ready_ns = now_ns();
    stats.layers_ready++;
    emit(SG_EVENT_LAYER_READY, layer, SG_OK);
}

// Decode side: a layer is ready once its notice arrived and every staged chunk it announced has
// been unpacked, in whatever order the provider completed those messages.
// Decode side: layers become ready in the order their notices came (the prefill side's send
// order), each once every staged chunk it announced is unpacked, in whatever order the provider
// completed those messages. A layer whose chunks are still being copied (outside the mutex, see
// run_unpacks) holds back the layers noticed after it, so readiness never runs ahead of that order.
void Transfer::layers_ready_in_order() {
    auto &noticed = decode().noticed;
    bool any = false;
    while (!noticed.empty()) {
        const uint32_t layer = noticed.front();
        Transfer::Layer &L = layers[layer];
        if (L.staged_chunks < L.in.chunks_announced) break;
        if (!L.ready) {
            if (!verify_layer(layer)) return;
            residency.set_layer(layer);
            mark_ready(layer);
            any = true;
        }
        noticed.pop_front();
    }
    if (!any) return;
    complete_if_done();
    ctx->signal_event();
    ctx->cv.notify_all();
}

void Transfer::complete_if_done() {
    if (finished()) return;
    if (post_side) {
        if (!prefill().done_sent() || inflight) return;
        if (session->peer_minor >= 1 && prefill().end != Transfer::Prefill::End::Confirmed) return;
    } else {
        if (!decode().done_received || stats.layers_ready < layers.size()) return;
        // Digests travel behind the notices: a layer whose proactive notice came is not complete
        // before its digests are (SG_LAYER_ESSENTIAL then holds for every such layer at completion).
        for (const auto &L : layers)
            if (L.in.essential_notice && !L.essential) return;
        if (session->peer_minor >= 1) {
            std::vector<uint8_t> out;
            wire::encode(out, ctx->id, wire::TransferAck{id});
            session->send(out);
        }
    }
    finish(SG_OK, {});
    note_quiesced();
}

// Unmatched or Running -> Finished with its final status: the one place a transfer's outcome is
// set, counted and announced.
void Transfer::finish(sg_status_t status, const std::string &message) {
    this->status = status;
    error = message;
    stats.end_ns = now_ns();
    advance(plan::TransferState::Finished);
    if (status == SG_OK) {
        ctx->counters.transfers_completed++;
    } else {
        ctx->counters.transfers_failed++;
        if (status == SG_ERR_CANCELED) ctx->counters.transfers_canceled++;
        if (status == SG_ERR_DEADLINE) ctx->counters.deadlines_hit++;
    }
    emit(SG_EVENT_FINISHED, 0, status);
    ctx->signal_event();
    ctx->cv.notify_all();
}

void Transfer::fail_with(sg_status_t status, const std::string &message, bool tell_peer) {
    if (finished()) return;
    const bool was_matched = state() != plan::TransferState::Unmatched;
    finish(status, message);
    if (post_side && !was_matched) {
        Session &s = *session;
        s.matchbook.forget_waiting_post(*this);
        // The decode side may not have expected yet; its Expect will be answered when it comes.
        // (A post that failed at its match knows the decode side's id: its Error names it, and no
        // later Expect of the id is about this one.)
        if (tell_peer && !id) s.matchbook.remember_our_cancel(request_id, {status, message});
    }
    if (tell_peer && !session->closed()) {
        wire::TransferError m;
        m.request_id = request_id;
        m.decode_xfer_id = id;
        m.status = status;
        m.message = message;
        m.from_post_side = post_side ? 1 : 0;
        std::vector<uint8_t> out;
        wire::encode(out, ctx->id, m, status == SG_ERR_CANCELED ? wire::MsgType::Cancel : wire::MsgType::Error);
        session->send(out);
    }
    maybe_send_quiesced();
    note_quiesced();
}

void Session::send_quiesced(uint64_t decode_xfer_id) {
    std::vector<uint8_t> out;
    wire::encode(out, ctx->id, wire::Quiesced{decode_xfer_id});
    send(out);
}

// Prefill: after a transfer that answered an Expect failed, tell the decode side once its last
// write completed.
void Transfer::maybe_send_quiesced() {
    if (!post_side || !id || !finished() || (status == SG_OK && !prefill().peer_released) || inflight ||
        prefill().quiesce_sent)
        return;
    prefill().quiesce_sent = true;
    session->send_quiesced(id);
}

void Transfer::advance(plan::TransferState to) {
    const plan::TransferState from = state();
    if (!plan::legal_transition(from, to))
        fail(SG_ERR_INTERNAL, "transfer '" + request_id + "': no transition " + plan::state_name(from) + " -> " +
                                  plan::state_name(to));
    state_.store(to, std::memory_order_release);
    SG_ASSERT(invariant_violation().empty(), "transfer '" + request_id + "' entering " + plan::state_name(to) + ": " +
                                                 invariant_violation());
}

std::string Transfer::invariant_violation() const {
    // Every write is counted in `inflight` and in exactly one of its layer's `out` (full path) or
    // its send unit (selective paths); a staged one from its slot's reservation, when it also
    // becomes a pending pack until handed to the provider. Sends count in `inflight` only.
    uint64_t outstanding = 0;
    for (size_t l = 0; l < layers.size(); ++l) {
        const auto &o = layers[l].out;
        if (o.packs_pending > o.outstanding)
            return "layer " + std::to_string(l) + ": " + std::to_string(o.packs_pending) + " packs pending of " +
                   std::to_string(o.outstanding) + " writes outstanding";
        outstanding += o.outstanding;
    }
    auto units = [&](const auto &list) -> std::string {
        for (const auto &u : list) {
            if (u->packs_pending > u->outstanding)
                return "a unit of layer " + std::to_string(u->layer) + ": " + std::to_string(u->packs_pending) +
                       " packs pending of " + std::to_string(u->outstanding) + " writes outstanding";
            outstanding += u->outstanding;
        }
        return "";
    };
    if (post_side) {
        for (const auto *list : {&sel().demand_queue, &sel().proactive_queue, &sel().speculative_queue})
            if (std::string why = units(*list); !why.empty()) return why;
        if (std::string why = units(sel().posted_units); !why.empty()) return why;
    }
    // Once finished, operations still queued are dropped from `inflight` alone (drop_queued): the
    // per-layer and per-unit counts no longer matter, only `inflight` (the quiesce condition).
    if (!finished() && outstanding > inflight)
        return std::to_string(outstanding) + " writes outstanding but " + std::to_string(inflight) +
               " operations in flight (" + plan::state_name(state()) + ")";
    // Quiesced only: Released may follow Finished directly when operations outlived the release
    // wait (kept until the context goes), which is no quiesce.
    const bool quiesced_now = state() == plan::TransferState::Quiesced;
    if (post_side && quiesced_now && inflight)
        return "quiesced with " + std::to_string(inflight) + " operations in flight";
    if (!post_side && quiesced_now && decode().unpacks_pending)
        return "quiesced with " + std::to_string(decode().unpacks_pending) + " staged chunks still to unpack";
    return "";
}

bool Transfer::quiesce_condition() const {
    if (post_side) return inflight == 0;
    // An ended session quiesces only once it is fenced and its keys closed (Session::fence):
    // until then a write the provider accepted may still land.
    return (decode().peer_quiesced || session->writes_stopped()) && decode().unpacks_pending == 0;
}

}  // namespace sg::core
