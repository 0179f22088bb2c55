// The control protocol: every frame a peer sends enters through on_message, which decodes its
// header, holds frames of senders not yet known or proven (within a budget), and hands the rest
// to the handler of its message type.
#include "core/core.hpp"

#include <array>
#include <cstring>

namespace sg::core {

namespace {

constexpr const char *kPeerClosed = "peer closed the session";

}  // namespace

void Context::on_message(std::span<const uint8_t> bytes) {
    wire::FrameHeader h;
    std::span<const uint8_t> body;
    wire::DecodeError e = wire::decode_header(bytes, h, body);
    if (e != wire::DecodeError::None) {
        log.log(SG_LOG_WARN, std::string("dropped a malformed control message: ") + wire::decode_error_str(e));
        return;
    }
    auto it = sessions_.find(h.sender_ctx);
    std::shared_ptr<Session> s = it == sessions_.end() ? nullptr : it->second.lock();
    const uint64_t cost = frame_cost(bytes.size());
    if (!s) {
        auto q = orphans_.find(h.sender_ctx);
        const uint64_t queued = q == orphans_.end() ? 0 : q->second.bytes;
        if (queued + cost > kUnauthenticatedShare || unauthenticated_bytes_ + cost > kUnauthenticatedBytes) {
            if (log.enabled(SG_LOG_DEBUG))
                log.log(SG_LOG_DEBUG, "dropped a frame from unknown context " + std::to_string(h.sender_ctx) +
                                          ": the budget for senders without a session is spent");
            return;
        }
        if (q == orphans_.end()) {
            q = orphans_.emplace(h.sender_ctx, OrphanQueue{}).first;
            q->second.first_ns = now_ns();
        }
        q->second.frames.emplace_back(bytes.begin(), bytes.end());
        q->second.bytes += cost;
        unauthenticated_bytes_ += cost;
        return;
    }
    const Session::Route &r = Session::route(h.type);
    if (!s->proven && !r.auth) {
        if (s->closed()) return;  // it never proved itself, and never will on this session
        // The peer proved itself to us already and spoke; its proof to us may still be on its way.
        if (s->held_bytes + cost > kUnauthenticatedShare || unauthenticated_bytes_ + cost > kUnauthenticatedBytes) {
            s->lose(SG_ERR_PROTOCOL,
                         "the peer sent more than " + std::to_string(kUnauthenticatedShare >> 20) +
                             " MiB before proving its key (or the context's budget for unproven peers is spent)");
            return;
        }
        s->liveness.heard(now_ns());
        s->held_frames.emplace_back(bytes.begin(), bytes.end());
        s->held_bytes += cost;
        unauthenticated_bytes_ += cost;
        return;
    }
    if (log.enabled(SG_LOG_DEBUG)) log.log(SG_LOG_DEBUG, std::string(r.name) + " from peer " + std::to_string(s->peer_ctx_id));
    try {
        s->heard_from();
        // Authentication frames count only on sessions that run the fabric challenge, open ones.
        if (r.auth && (s->closed() || key_.empty())) return;
        if (r.run) (s.get()->*r.run)(body, r.name);
    } catch (const Error &err) {
        // A peer that sends what the protocol does not allow (a value out of range, a message that
        // does not decode) cannot be trusted with the session any more.
        s->lose(SG_ERR_PROTOCOL, "the peer broke the protocol: " + err.message());
    } catch (const std::bad_alloc &) {
        s->lose(SG_ERR_NO_MEMORY, "out of memory handling a message from the peer");
    }
}

void Context::inject_frame(std::span<const uint8_t> frame) {
    std::lock_guard lock(mu);
    on_message(frame);
}

uint64_t Context::unauthenticated_bytes() {
    std::lock_guard lock(mu);
    return unauthenticated_bytes_;
}

void Session::forget_held_frames() {
    ctx->unauthenticated_bytes_ -= held_bytes;
    held_bytes = 0;
    held_frames.clear();
}

void Session::deliver_orphans() {
    auto it = ctx->orphans_.find(peer_ctx_id);
    if (it == ctx->orphans_.end()) return;
    auto frames = std::move(it->second.frames);
    ctx->unauthenticated_bytes_ -= it->second.bytes;
    ctx->orphans_.erase(it);
    for (auto &f : frames) ctx->on_message(f);
}

// The protocol as a table: one entry per message type with its name, whether it is part of
// authentication (the only frames a session takes before the peer proved its key), and its
// handler. Every frame goes through one step, decode_then, that decodes its body into the
// message's struct or fails the session: handlers receive checked messages only.
template <class M, void (Session::*Handler)(M &)>
void Session::decode_then(std::span<const uint8_t> body, const char *name) {
    M m;
    const wire::DecodeError e = wire::decode(body, m);
    if (e != wire::DecodeError::None) sg::fail(SG_ERR_PROTOCOL, std::string(name) + ": " + wire::decode_error_str(e));
    (this->*Handler)(m);
}

template <class M, void (Session::*Handler)(M &)>
constexpr Session::Route Session::route_to(const char *name, bool auth) {
    return Route{name, auth, &Session::decode_then<M, Handler>};
}

const Session::Route &Session::route(wire::MsgType type) {
    using T = wire::MsgType;
    using namespace wire;
    static const std::array<Route, size_t(kLastMsgType) + 1> table = [] {
        std::array<Route, size_t(kLastMsgType) + 1> r{};
        auto at = [&](T t) -> Route & { return r[size_t(t)]; };
        // Bootstrap only (the socket handshake): nothing to do on the fabric.
        at(T::Hello) = Route{"Hello", false, nullptr};
        at(T::Opened) = Route{"Opened", false, nullptr};
        // Authentication of sessions made from metadata blobs (session_auth.cpp).
        at(T::AuthChallenge) = route_to<AuthChallenge, &Session::on_auth_challenge>("AuthChallenge", true);
        at(T::AuthProof) = route_to<AuthProof, &Session::on_auth_proof>("AuthProof", true);
        at(T::AuthResult) = route_to<AuthResult, &Session::on_auth_result>("AuthResult", true);
        // The session.
        at(T::HandleExport) = route_to<HandleExport, &Session::on_handle_export>("HandleExport");
        at(T::Bye) = route_to<Bye, &Session::on_bye>("Bye");
        at(T::Ping) = route_to<Ping, &Session::on_ping>("Ping");
        at(T::Notify) = route_to<Notify, &Session::on_notify>("Notify");
        // Transfers.
        at(T::Expect) = route_to<Expect, &Session::on_expect>("Expect");
        at(T::LayerReady) = route_to<LayerReady, &Session::on_layer_ready>("LayerReady");
        at(T::TransferDone) = route_to<TransferDone, &Session::on_transfer_done>("TransferDone");
        at(T::TransferAck) = route_to<TransferAck, &Session::on_transfer_ack>("TransferAck");
        at(T::Quiesced) = route_to<Quiesced, &Session::on_quiesced>("Quiesced");
        at(T::Cancel) = route_to<TransferError, &Session::on_cancel>("Cancel");
        at(T::Error) = route_to<TransferError, &Session::on_error>("Error");
        at(T::Release) = route_to<Release, &Session::on_release>("Release");
        at(T::CancelAck) = route_to<CancelAck, &Session::on_cancel_ack>("CancelAck");
        at(T::Reposted) = route_to<Reposted, &Session::on_reposted>("Reposted");
        // Staging (staging.cpp).
        at(T::StagedChunk) = route_to<StagedChunk, &Session::on_staged_chunk>("StagedChunk");
        at(T::StagingCredit) = route_to<StagingCredit, &Session::on_staging_credit>("StagingCredit");
        // Selective paths (paths_prefill.cpp, paths_decode.cpp).
        at(T::Selective) = route_to<Selective, &Session::on_selective>("Selective");
        at(T::Digests) = route_to<Digests, &Session::on_digests>("Digests");
        at(T::BlocksReady) = route_to<BlocksReady, &Session::on_blocks_ready>("BlocksReady");
        at(T::Fetch) = route_to<Fetch, &Session::on_fetch>("Fetch");
        // Verification (verify.cpp).
        at(T::BlockCrcs) = route_to<BlockCrcs, &Session::on_block_crcs>("BlockCrcs");
        return r;
    }();
    return table[size_t(type)];
}

// Frames that reach a session: the peer is alive, and its connection exists, so ours may follow.
void Session::heard_from() {
    liveness.heard(now_ns());
    ctx->counters.messages_received++;
    if (!may_send) {
        may_send = true;
        flush_outbox();
    }
}

void Session::on_cancel(wire::TransferError &m) { on_transfer_error(m, wire::MsgType::Cancel); }
void Session::on_error(wire::TransferError &m) { on_transfer_error(m, wire::MsgType::Error); }

void Session::on_handle_export(wire::HandleExport &m) {
    if (m.handle_id == StagingArea::kHandleId) {
        if (m.regions.size() != 1 || m.regions[0].length < StagingArea::kSlots * StagingArea::kSlotBytes)
            fail(SG_ERR_PROTOCOL, "peer's staging area has the wrong size");
        peer_staging.regions = m.regions;
        have_peer_staging = true;
        free_peer_slots = (1u << StagingArea::kSlots) - 1;
        return;
    }
    RemotePool rp;
    rp.layout = kv::from_desc(m.layout);
    rp.regions_per_layer = m.regions_per_layer;
    if (m.regions_per_layer != rp.layout.regions_per_layer() ||
        m.regions.size() != size_t(rp.layout.num_layers) * m.regions_per_layer)
        fail(SG_ERR_PROTOCOL, "HandleExport region count does not match its layout");
    for (auto &r : m.regions)
        if (r.length < rp.layout.region_bytes()) fail(SG_ERR_PROTOCOL, "HandleExport region smaller than its layout");
    rp.regions = std::move(m.regions);
    rp.device_direct = m.device_direct;
    remote_pools[m.handle_id] = std::move(rp);
}

void Session::on_bye(wire::Bye &m) {
    if (bye() != ByeExchange::None) {
        // The answer to ours, or the peer closing at the same time: either way it has read
        // everything we sent before our Bye. (A second one changes nothing.)
        if (bye() == ByeExchange::ByeSent) advance_bye(ByeExchange::Answered);
        ctx->cv.notify_all();
        return;
    }
    if (m.reply) return;  // answers a Bye of an earlier session between the two contexts
    if (peer_minor >= 1) {
        wire::Bye answer;
        answer.reply = 1;
        std::vector<uint8_t> out;
        wire::encode(out, ctx->id, answer);
        send(out);
    }
    lose(SG_ERR_PEER_LOST, kPeerClosed, true);
}

// A Ping proves the peer alive, which heard_from has recorded, and says how often it must hear
// from us. A peer asking for more than a frame per kMinKeepaliveNs gets one per kMinKeepaliveNs:
// the timers run every 10 ms and a peer may not make us spin.
void Session::on_ping(wire::Ping &m) {
    if (m.keepalive_ns) peer_keepalive_ns = std::max(m.keepalive_ns, kMinKeepaliveNs);
}

void Session::on_notify(wire::Notify &m) {
    if (notifications.size() >= 4096) {
        notifications.pop_front();
        if (notifications_dropped++ % 1024 == 0)
            ctx->log.log(SG_LOG_WARN, "notifications are not being taken; dropping the oldest (" +
                                     std::to_string(notifications_dropped) + " so far)");
    }
    notifications.push_back(std::move(m.payload));
    ctx->signal_event();
}

void Session::on_expect(wire::Expect &m) {
    matchbook.forget_expect_canceled(m.request_id);
    if (const RememberedCancel *c = matchbook.our_cancel(m.request_id)) {
        wire::TransferError e;
        e.request_id = m.request_id;
        e.decode_xfer_id = m.decode_xfer_id;
        e.status = c->status;
        e.message = c->message;
        e.from_post_side = 1;
        std::vector<uint8_t> out;
        wire::encode(out, ctx->id, e, e.status == SG_ERR_CANCELED ? wire::MsgType::Cancel : wire::MsgType::Error);
        send(out);
        send_quiesced(m.decode_xfer_id);
        return;
    }
    if (auto t = matchbook.take_waiting_post(m.request_id))
        match(t, m);
    else
        matchbook.hold_expect(std::move(m));
}

void Session::on_layer_ready(wire::LayerReady &m) {
    Transfer *running = running_expect(m.decode_xfer_id);
    if (!running) return;  // released or finished meanwhile
    Transfer &t = *running;
    if (m.layer >= t.layers.size()) fail(SG_ERR_PROTOCOL, "LayerReady names a layer that does not exist");
    Transfer::Layer &L = t.layers[m.layer];
    if (!L.in.notice_received) {
        L.in.notice_received = true;
        L.in.chunks_announced = m.staged_chunks;
        t.stats.bytes += m.bytes;
        t.decode().noticed.push_back(m.layer);
    }
    t.layers_ready_in_order();
}

void Session::on_transfer_done(wire::TransferDone &m) {
    running_expect(m.decode_xfer_id);
    Transfer *t = matchbook.expect(m.decode_xfer_id);
    if (!t) return;
    t->decode().done_received = true;
    t->decode().peer_quiesced = true;  // every write completed before the peer sent this
    t->complete_if_done();
    t->note_quiesced();
    ctx->cv.notify_all();
}

void Session::on_transfer_ack(wire::TransferAck &m) {
    for (auto &[rid, t] : matchbook.matched_posts())
        if (t->id == m.decode_xfer_id) {
            using End = Transfer::Prefill::End;
            if (t->prefill().end == End::DoneSent) t->prefill().end = End::Confirmed;
            t->complete_if_done();
            break;
        }
}

void Session::on_quiesced(wire::Quiesced &m) {
    Transfer *t = matchbook.expect(m.decode_xfer_id);
    if (!t) return;
    t->decode().peer_quiesced = true;
    t->note_quiesced();
    ctx->signal_event();
    ctx->cv.notify_all();
}

void Session::on_transfer_error(wire::TransferError &m, wire::MsgType type) {
    if (!m.from_post_side && m.status == 0 && type == wire::MsgType::Cancel) {
        // How peers before 1.2 say Release.
        wire::Release r{m.request_id, m.decode_xfer_id};
        on_release(r);
        return;
    }
    const sg_status_t st = peer_error_status(m.status);
    const std::string why = std::string(type == wire::MsgType::Cancel ? "peer canceled" : "peer failed") +
                            " the transfer: " + m.message;
    if (m.from_post_side) {
        // We expect: the prefill side gave up. Its Quiesced (or, for a cancel before the
        // match, the answer to our Expect) tells us when its writes have stopped.
        if (m.decode_xfer_id) {
            if (Transfer *t = matchbook.expect(m.decode_xfer_id)) {
                if (st == SG_ERR_LEASE_EXPIRED && !t->finished()) t->emit(SG_EVENT_LEASE_EXPIRED, 0, st);
                t->fail_with(st, why, false);
            }
            return;
        }
        // It gave up before it knew our id: match by request id, and acknowledge so that
        // it knows which of our Expects were sent before we heard of this.
        bool any = false;
        for (auto &[k, t] : matchbook.expects())
            if (t->request_id == m.request_id && !t->finished()) {
                t->fail_with(st, why, false);
                any = true;
            }
        wire::CancelAck ack;
        ack.request_id = m.request_id;
        if (!any && matchbook.remember_peer_cancel(m.request_id, {st, why})) ack.recorded = 1;
        std::vector<uint8_t> out;
        wire::encode(out, ctx->id, ack);
        send(out);
        return;
    }
    // We post: the decode side withdrew its Expect. Answer Quiesced once nothing of ours
    // can still land in its blocks.
    Transfer *p = matchbook.matched_post(m.request_id);
    const bool matched_here = p && p->id == m.decode_xfer_id;
    if (matched_here && !p->is_quiesced()) {
        p->fail_with(st, why, false);  // Quiesced follows from maybe_send_quiesced
        if (p->status != SG_OK) return;
    }
    if (!matched_here) matchbook.remember_expect_canceled(m.request_id, {st, why});
    matchbook.drop_held_expect(m.request_id, m.decode_xfer_id);
    send_quiesced(m.decode_xfer_id);
}

// The decode side released a selective transfer: done, not canceled. Quiesced answers once no
// write of ours can still land in its blocks.
void Session::on_release(wire::Release &m) {
    Transfer *p = matchbook.matched_post(m.request_id);
    if (!p || p->id != m.decode_xfer_id) {
        send_quiesced(m.decode_xfer_id);
        return;
    }
    Transfer &t = *p;
    if (!t.finished()) {
        t.prefill().peer_released = true;
        t.finish(SG_OK, {});
        t.maybe_send_quiesced();
        t.note_quiesced();
    } else if (t.is_quiesced() && t.status == SG_OK) {
        send_quiesced(m.decode_xfer_id);
    }
}

void Session::on_cancel_ack(wire::CancelAck &m) {
    matchbook.our_cancel_acknowledged(m.request_id);
    if (m.recorded) {
        if (matchbook.posted(m.request_id)) {
            // Posted again before the acknowledgement came: lift the remembered cancel now.
            std::vector<uint8_t> out;
            wire::encode(out, ctx->id, wire::Reposted{m.request_id});
            send(out);
        } else {
            matchbook.remember_repost_needed(m.request_id);
        }
    }
}

void Session::on_reposted(wire::Reposted &m) {
    matchbook.forget_peer_cancel(m.request_id);
}

}  // namespace sg::core
