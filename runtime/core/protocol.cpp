// The control protocol: every frame a peer sends enters through on_message, which decodes its
// header, holds frames of senders not yet known or proven (within a budget), and hands the rest
// to the handler of its message type.
#include "core/core.hpp"

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
    const bool auth_frame = h.type == wire::MsgType::AuthChallenge || h.type == wire::MsgType::AuthProof ||
                            h.type == wire::MsgType::AuthResult;
    if (!s->authenticated && !auth_frame) {
        if (s->closed) return;  // it never proved itself, and never will on this session
        // The peer proved itself to us already and spoke; its proof to us may still be on its way.
        if (s->held_bytes + cost > kUnauthenticatedShare || unauthenticated_bytes_ + cost > kUnauthenticatedBytes) {
            lose_session(*s, SG_ERR_PROTOCOL,
                         "the peer sent more than " + std::to_string(kUnauthenticatedShare >> 20) +
                             " MiB before proving its key (or the context's budget for unproven peers is spent)");
            return;
        }
        s->last_heard_ns = now_ns();
        s->held_frames.emplace_back(bytes.begin(), bytes.end());
        s->held_bytes += cost;
        unauthenticated_bytes_ += cost;
        return;
    }
    try {
        if (auth_frame)
            handle_auth(*s, h, body);
        else
            handle(*s, h, body);
    } catch (const Error &err) {
        // A peer that sends what the protocol does not allow (a value out of range, a message that
        // does not decode) cannot be trusted with the session any more.
        lose_session(*s, SG_ERR_PROTOCOL, "the peer broke the protocol: " + err.message());
    } catch (const std::bad_alloc &) {
        lose_session(*s, SG_ERR_NO_MEMORY, "out of memory handling a message from the peer");
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

void Context::forget_held_frames(Session &s) {
    unauthenticated_bytes_ -= s.held_bytes;
    s.held_bytes = 0;
    s.held_frames.clear();
}

void Context::deliver_orphans(Session &s) {
    auto it = orphans_.find(s.peer_ctx_id);
    if (it == orphans_.end()) return;
    auto frames = std::move(it->second.frames);
    unauthenticated_bytes_ -= it->second.bytes;
    orphans_.erase(it);
    for (auto &f : frames) on_message(f);
}

void Context::handle(Session &s, const wire::FrameHeader &h, std::span<const uint8_t> body) {
    if (log.enabled(SG_LOG_DEBUG)) log.log(SG_LOG_DEBUG, "message type " + std::to_string(int(h.type)) + " from peer");
    s.last_heard_ns = now_ns();
    counters.messages_received++;
    if (!s.may_send) {
        s.may_send = true;  // the peer's connection exists now; ours can follow on it
        flush_outbox(s);
    }
    auto check = [](wire::DecodeError e, const char *what) {
        if (e != wire::DecodeError::None) fail(SG_ERR_PROTOCOL, std::string(what) + ": " + wire::decode_error_str(e));
    };
    switch (h.type) {
        case wire::MsgType::HandleExport: {
            wire::HandleExport m;
            check(wire::decode(body, m), "HandleExport");
            if (m.handle_id == StagingArea::kHandleId) {
                if (m.regions.size() != 1 || m.regions[0].length < StagingArea::kSlots * StagingArea::kSlotBytes)
                    fail(SG_ERR_PROTOCOL, "peer's staging area has the wrong size");
                s.peer_staging.regions = m.regions;
                s.have_peer_staging = true;
                s.free_peer_slots = (1u << StagingArea::kSlots) - 1;
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
            s.remote_pools[m.handle_id] = std::move(rp);
            return;
        }
        case wire::MsgType::Expect: {
            wire::Expect m;
            check(wire::decode(body, m), "Expect");
            if (auto c = s.canceled_unmatched.find(m.request_id); c != s.canceled_unmatched.end()) {
                wire::TransferError e;
                e.request_id = m.request_id;
                e.decode_xfer_id = m.decode_xfer_id;
                e.status = c->second.first;
                e.message = c->second.second;
                e.from_post_side = 1;
                std::vector<uint8_t> out;
                wire::encode(out, id, e, e.status == SG_ERR_CANCELED ? wire::MsgType::Cancel : wire::MsgType::Error);
                send(s, out);
                send_quiesced(s, m.decode_xfer_id);
                return;
            }
            auto p = s.unmatched_posts.find(m.request_id);
            if (p != s.unmatched_posts.end()) {
                auto t = p->second;
                s.unmatched_posts.erase(p);
                match(s, t, m);
            } else {
                s.unmatched_expects[m.request_id] = std::move(m);
            }
            return;
        }
        case wire::MsgType::LayerReady: {
            wire::LayerReady m;
            check(wire::decode(body, m), "LayerReady");
            auto it = s.expects.find(m.decode_xfer_id);
            if (it == s.expects.end()) return;  // released meanwhile
            Transfer &t = *it->second;
            if (m.layer >= t.layers.size() || t.finished()) return;
            Transfer::Layer &L = t.layers[m.layer];
            if (!L.notice_received) {
                L.notice_received = true;
                L.chunks_announced = m.staged_chunks;
                t.stats.bytes += m.bytes;
            }
            maybe_layer_ready(t, m.layer);
            return;
        }
        case wire::MsgType::StagedChunk: {
            wire::StagedChunk m;
            check(wire::decode(body, m), "StagedChunk");
            if (m.slot >= StagingArea::kSlots) fail(SG_ERR_PROTOCOL, "StagedChunk names a slot that does not exist");
            if (!s.recv_staging.base) fail(SG_ERR_PROTOCOL, "StagedChunk on a session that offered no staging slots");
            auto it = s.expects.find(m.decode_xfer_id);
            if (it != s.expects.end() && !it->second->finished()) {
                Transfer &t = *it->second;
                const kv::Layout &L = t.pool->layout;
                const uint8_t *src = s.recv_staging.base + m.slot * StagingArea::kSlotBytes;
                uint64_t pos = m.slot_offset;
                // The peer is trusted with the keys of this pool, not with our address space: every
                // segment must fall inside the slot and inside the pool's region. All are checked
                // before the first byte is copied.
                for (const wire::Segment &seg : m.segments) {
                    const uint32_t layer = seg.region / L.regions_per_layer();
                    if (layer >= L.num_layers || !in_bounds(seg.offset, seg.length, L.region_bytes()) ||
                        !in_bounds(pos, seg.length, StagingArea::kSlotBytes))
                        fail(SG_ERR_PROTOCOL, "StagedChunk segment outside the pool or the staging slot");
                    pos += seg.length;
                }
                pos = m.slot_offset;
                for (const wire::Segment &seg : m.segments) {
                    const uint32_t layer = seg.region / L.regions_per_layer();
                    std::memcpy(t.pool->region(layer, seg.region % L.regions_per_layer()) + seg.offset, src + pos,
                                seg.length);
                    pos += seg.length;
                    counters.staging_copies++;
                    t.stats.staging_copies++;
                    t.stats.staged_bytes += seg.length;
                }
                if (m.layer < t.layers.size()) {
                    t.layers[m.layer].staged_chunks++;
                    if (t.selective())
                        apply_held_notices(t, m.layer);
                    else
                        maybe_layer_ready(t, m.layer);
                }
            }
            wire::StagingCredit credit;
            credit.slot = m.slot;
            std::vector<uint8_t> out;
            wire::encode(out, id, credit);
            send(s, out);
            return;
        }
        case wire::MsgType::StagingCredit: {
            wire::StagingCredit m;
            check(wire::decode(body, m), "StagingCredit");
            if (m.slot < StagingArea::kSlots) s.free_peer_slots |= 1u << m.slot;
            return;
        }
        case wire::MsgType::TransferDone: {
            wire::TransferDone m;
            check(wire::decode(body, m), "TransferDone");
            auto it = s.expects.find(m.decode_xfer_id);
            if (it == s.expects.end()) return;
            it->second->done_received = true;
            it->second->quiesced = true;  // every write completed before the peer sent this
            complete_if_done(*it->second);
            note_quiesced(*it->second);
            cv.notify_all();
            return;
        }
        case wire::MsgType::Quiesced: {
            wire::Quiesced m;
            check(wire::decode(body, m), "Quiesced");
            auto it = s.expects.find(m.decode_xfer_id);
            if (it == s.expects.end()) return;
            it->second->quiesced = true;
            note_quiesced(*it->second);
            signal_event();
            cv.notify_all();
            return;
        }
        case wire::MsgType::CancelAck: {
            wire::CancelAck m;
            check(wire::decode(body, m), "CancelAck");
            s.canceled_unmatched.erase(m.request_id);
            if (m.recorded) {
                if (s.unmatched_posts.count(m.request_id) || s.posts.count(m.request_id)) {
                    // Posted again before the acknowledgement came: lift the remembered cancel now.
                    std::vector<uint8_t> out;
                    wire::encode(out, id, wire::Reposted{m.request_id});
                    send(s, out);
                } else if (s.repost_needed.size() < 65536) {
                    s.repost_needed.insert(m.request_id);
                }
            }
            return;
        }
        case wire::MsgType::Reposted: {
            wire::Reposted m;
            check(wire::decode(body, m), "Reposted");
            s.peer_canceled.erase(m.request_id);
            return;
        }
        case wire::MsgType::Cancel:
        case wire::MsgType::Error: {
            wire::TransferError m;
            check(wire::decode(body, m), "TransferError");
            if (!m.from_post_side && m.status == 0) {
                // The decode side released a selective transfer: done, not canceled.
                auto p = s.posts.find(m.request_id);
                if (p == s.posts.end() || p->second->id != m.decode_xfer_id) {
                    send_quiesced(s, m.decode_xfer_id);
                    return;
                }
                Transfer &t = *p->second;
                if (!t.finished()) {
                    t.peer_released = true;
                    t.status = SG_OK;
                    t.stats.end_ns = now_ns();
                    counters.transfers_completed++;
                    emit(t, SG_EVENT_FINISHED, 0, SG_OK);
                    signal_event();
                    cv.notify_all();
                    maybe_send_quiesced(t);
                    note_quiesced(t);
                } else if (t.is_quiesced() && t.status == SG_OK) {
                    send_quiesced(s, m.decode_xfer_id);
                }
                return;
            }
            const sg_status_t st = peer_error_status(m.status);
            const std::string why = std::string(h.type == wire::MsgType::Cancel ? "peer canceled" : "peer failed") +
                                    " the transfer: " + m.message;
            if (m.from_post_side) {
                // We expect: the prefill side gave up. Its Quiesced (or, for a cancel before the
                // match, the answer to our Expect) tells us when its writes have stopped.
                if (m.decode_xfer_id) {
                    auto it = s.expects.find(m.decode_xfer_id);
                    if (it != s.expects.end()) {
                        if (st == SG_ERR_LEASE_EXPIRED && !it->second->finished())
                            emit(*it->second, SG_EVENT_LEASE_EXPIRED, 0, st);
                        fail_transfer(*it->second, st, why, false);
                    }
                    return;
                }
                // It gave up before it knew our id: match by request id, and acknowledge so that
                // it knows which of our Expects were sent before we heard of this.
                bool any = false;
                for (auto &[k, t] : s.expects)
                    if (t->request_id == m.request_id && !t->finished()) {
                        fail_transfer(*t, st, why, false);
                        any = true;
                    }
                wire::CancelAck ack;
                ack.request_id = m.request_id;
                if (!any && s.peer_canceled.size() < 65536) {
                    s.peer_canceled[m.request_id] = {st, why};
                    ack.recorded = 1;
                }
                std::vector<uint8_t> out;
                wire::encode(out, id, ack);
                send(s, out);
                return;
            }
            // We post: the decode side withdrew its Expect. Answer Quiesced once nothing of ours
            // can still land in its blocks.
            auto p = s.posts.find(m.request_id);
            if (p != s.posts.end() && p->second->id == m.decode_xfer_id && !p->second->is_quiesced()) {
                fail_transfer(*p->second, st, why, false);  // Quiesced follows from maybe_send_quiesced
                if (p->second->status != SG_OK) return;
            }
            auto u = s.unmatched_expects.find(m.request_id);
            if (u != s.unmatched_expects.end() && u->second.decode_xfer_id == m.decode_xfer_id) s.unmatched_expects.erase(u);
            send_quiesced(s, m.decode_xfer_id);
            return;
        }
        case wire::MsgType::Bye: {
            wire::Bye m;
            check(wire::decode(body, m), "Bye");
            if (s.bye_sent) {
                // The answer to ours, or the peer closing at the same time: either way it has read
                // everything we sent before our Bye.
                s.bye_received = true;
                cv.notify_all();
                return;
            }
            if (m.reply) return;  // answers a Bye of an earlier session between the two contexts
            if (s.peer_minor >= 1) {
                wire::Bye answer;
                answer.reply = 1;
                std::vector<uint8_t> out;
                wire::encode(out, id, answer);
                send(s, out);
            }
            lose_session(s, SG_ERR_PEER_LOST, kPeerClosed, true);
            return;
        }
        case wire::MsgType::TransferAck: {
            wire::TransferAck m;
            check(wire::decode(body, m), "TransferAck");
            for (auto &[rid, t] : s.posts)
                if (t->id == m.decode_xfer_id) {
                    t->done_acked = true;
                    complete_if_done(*t);
                    break;
                }
            return;
        }
        case wire::MsgType::Ping: {
            wire::Ping m;
            check(wire::decode(body, m), "Ping");
            return;
        }
        case wire::MsgType::Notify: {
            wire::Notify m;
            check(wire::decode(body, m), "Notify");
            if (s.notifications.size() >= 4096) {
                s.notifications.pop_front();
                if (s.notifications_dropped++ % 1024 == 0)
                    log.log(SG_LOG_WARN, "notifications are not being taken; dropping the oldest (" +
                                             std::to_string(s.notifications_dropped) + " so far)");
            }
            s.notifications.push_back(std::move(m.payload));
            signal_event();
            return;
        }
        case wire::MsgType::Selective:
        case wire::MsgType::Digests:
        case wire::MsgType::BlocksReady:
        case wire::MsgType::Fetch: handle_selective(s, h, body); return;
        case wire::MsgType::Hello:
        case wire::MsgType::Opened: return;  // only meaningful at bootstrap
        case wire::MsgType::AuthChallenge:
        case wire::MsgType::AuthProof:
        case wire::MsgType::AuthResult: return;  // on_message routes them to handle_auth
    }
}

}  // namespace sg::core
