// Sessions: choosing the provider a session runs on, opening one, exporting pools to it, its
// outbox of control messages (in order, across EAGAIN, auth frames first), its timers (keep-alives,
// peer loss, deadlines and leases of its transfers), losing it and closing it (Bye, drain, detach).
#include "core/core.hpp"

#include <algorithm>
#include <cerrno>

namespace sg::core {

bool legal_transition(SessionState from, SessionState to) {
    using S = SessionState;
    switch (from) {
        case S::Authenticating: return to == S::Open || to == S::Draining || to == S::Closed;
        case S::Open: return to == S::Draining || to == S::Closed;
        case S::Draining: return to == S::Closed;
        case S::Closed: return false;
    }
    return false;
}

const char *state_name(SessionState s) {
    switch (s) {
        case SessionState::Authenticating: return "Authenticating";
        case SessionState::Open: return "Open";
        case SessionState::Draining: return "Draining";
        case SessionState::Closed: return "Closed";
    }
    return "?";
}

void Session::advance(SessionState to) {
    if (!legal_transition(state_, to))
        fail(SG_ERR_INTERNAL, "session with peer " + std::to_string(peer_ctx_id) + ": no transition " +
                                  state_name(state_) + " -> " + state_name(to));
    state_ = to;
}

void Session::advance_bye(ByeExchange to) {
    if (uint8_t(to) != uint8_t(bye_) + 1)
        fail(SG_ERR_INTERNAL, "session with peer " + std::to_string(peer_ctx_id) + ": close handshake step " +
                                  std::to_string(int(bye_)) + " -> " + std::to_string(int(to)));
    bye_ = to;
}

// The peer is gone (silent, connection broken, or closed): every pending transfer on the session
// fails at once, and nothing more is sent on it.
void Context::lose_session(Session &s, sg_status_t status, const std::string &why, bool peer_closed) {
    if (s.closed()) return;
    s.advance(SessionState::Closed);
    s.lost_ns = now_ns();
    forget_held_frames(s);
    s.tp->peer_lost(s.peer);
    if (status == SG_ERR_PEER_LOST && !peer_closed) counters.peers_lost++;
    if (!peer_closed && s.tp->caps().local_only && transports[s.transport_index].get() == s.tp)
        renew_transport(s.transport_index);
    signal_event();
    s.error = status;
    s.error_message = why;
    if (!peer_closed) log.log(SG_LOG_ERROR, "session with peer " + std::to_string(s.peer_ctx_id) + " lost: " + why);
    // fail_transfer takes unmatched posts out of the book: a copy.
    for (auto &t : s.matchbook.transfers()) fail_transfer(*t, status, why, false);
    drop_unsent(s, true);
    drop_registrations(s);
    for (auto &[k, t] : s.matchbook.expects()) note_quiesced(*t);
    for (auto &[k, t] : s.matchbook.matched_posts()) note_quiesced(*t);
    cv.notify_all();
}

Session::Session(Context *c, const wire::Hello &hello, const sg_session_options_t &opt)
    : ctx(c), peer_ctx_id(hello.ctx_id), peer_minor(hello.proto_minor) {
    const bool same_host = !hello.boot_id.empty() && hello.boot_id == read_boot_id() && hello.netns_inode == read_netns_inode();
    std::string want = opt.provider ? transport::canonical_provider(opt.provider) : "";
    int chosen = -1;
    size_t peer_ep = 0;
    // Whether the peer offers one of our same-host-only providers: then a same-host peer uses it.
    auto peer_offers = [&](const std::string &name) {
        for (auto &e : hello.endpoints)
            if (e.provider == name) return true;
        return false;
    };
    bool local_in_common = false;
    for (auto &t : ctx->transports) local_in_common = local_in_common || (t->caps().local_only && peer_offers(t->caps().provider));
    for (size_t i = 0; i < ctx->transports.size() && chosen < 0; ++i) {
        const std::string &name = ctx->transports[i]->caps().provider;
        const bool local_only = ctx->transports[i]->caps().local_only;
        if (!want.empty() ? name != want : (local_only && !same_host)) continue;
        // Prefer a same-host provider (shm) for a same-host peer when both sides have one.
        if (want.empty() && same_host && !local_only && local_in_common) continue;
        for (size_t k = 0; k < hello.endpoints.size(); ++k)
            if (hello.endpoints[k].provider == name) {
                chosen = int(i);
                peer_ep = k;
                break;
            }
    }
    if (chosen < 0) {
        std::string theirs;
        for (auto &e : hello.endpoints) theirs += (theirs.empty() ? "" : ", ") + e.provider;
        fail(SG_ERR_NO_PROVIDER, "no provider in common with the peer (" + (want.empty() ? std::string("auto") : want) +
                                     " here; peer offers " + theirs + ")");
    }
    transport_index = size_t(chosen);
    tp_owner = ctx->transports[transport_index];
    tp = tp_owner.get();
    provider = tp->caps().provider;
    std::vector<std::vector<uint8_t>> lanes;  // the peer's lanes on this provider, lane 0 first
    for (size_t k = peer_ep; k < hello.endpoints.size(); ++k)
        if (hello.endpoints[k].provider == provider) lanes.push_back(hello.endpoints[k].address);
    peer = tp->insert_peer_lanes(lanes, hello.proto_minor >= 5);
    // Staging areas come on first use, by role (Context::offer_staging, Context::send_staging_of):
    // a session that only posts never receives staged writes, one that only expects never packs.
    free_send_slots = (1u << StagingArea::kSlots) - 1;
}

Session::~Session() {
    for (auto &[id, reg] : local_regs)
        for (auto &r : reg.regions) tp->deregister(r);
    recv_staging.release(tp);
    send_staging.release(tp);
    if (tp) tp->remove_peer(peer);
}

std::shared_ptr<Session> Context::open_session(const wire::Hello &peer, const sg_session_options_t &opt,
                                               bool authenticated) {
    if (peer.ctx_id == id) fail(SG_ERR_INVALID_ARGUMENT, "a context cannot open a session with itself");
    std::lock_guard lock(mu);
    auto it = sessions_.find(peer.ctx_id);
    if (it != sessions_.end() && !it->second.expired())
        fail(SG_ERR_DUPLICATE, "a session with this peer context already exists");
    auto s = std::make_shared<Session>(this, peer, opt);
    sessions_[peer.ctx_id] = s;
    counters.sessions_open++;
    s->may_send = id < peer.ctx_id;
    s->last_heard_ns = s->last_sent_ns = now_ns();
    s->proven = authenticated || key_.empty();
    if (s->proven) {
        s->advance(SessionState::Open);
    } else {
        s->auth_nonce = auth::random_nonce();
        std::vector<uint8_t> challenge;
        wire::encode(challenge, id, wire::AuthChallenge{s->auth_nonce});
        send_auth(*s, challenge);
    }
    deliver_orphans(*s);
    log.log(SG_LOG_INFO, "session with peer " + std::to_string(peer.ctx_id) + " over " + s->provider);
    wake();
    return s;
}

// Sends that never left are dropped — all of them when the session ends here, or only those of
// transfers when it was lost (its transfers have failed; a Bye answer may still go out) — their
// cookies go back to the pool and their transfers stop counting them, so those can quiesce.
void Context::drop_unsent(Session &s, bool transfer_frames_only) {
    for (auto *queue : {&s.outbox, &s.bulk_outbox, &s.auth_outbox}) {
        auto keep = queue->begin();
        for (OpCookie *c : *queue) {
            if (transfer_frames_only && !c->xfer) {
                *keep++ = c;
                continue;
            }
            if (c->xfer) c->xfer->inflight--;
            give_cookie(c);
        }
        queue->erase(keep, queue->end());
    }
    for (auto &[k, t] : s.matchbook.expects()) note_quiesced(*t);
    for (auto &[k, t] : s.matchbook.matched_posts()) note_quiesced(*t);
}

size_t Session::unfinished() const {
    size_t n = 0;
    for (auto *filed : {&matchbook.matched_posts(), &matchbook.waiting_posts()})
        for (auto &[k, t] : *filed) n += !t->finished();
    for (auto &[k, t] : matchbook.expects()) n += !t->finished();
    return n;
}

// Closes a lost session's registrations as soon as none of our writes uses them, so a peer that
// is only silent, not gone, cannot write into our blocks any more.
void Context::drop_registrations(Session &s) {
    if (s.regs_dropped || s.bytes_inflight) return;
    for (auto &[pool_id, reg] : s.local_regs) {
        for (auto &r : reg.regions) s.tp->deregister(r);
        reg.regions.clear();
    }
    s.regs_dropped = true;
}

void Context::send(Session &s, const std::vector<uint8_t> &frame, Transfer *t, bool bulk) {
    if (s.closed()) return;
    OpCookie *c = take_cookie();
    c->kind = OpCookie::Kind::Send;
    c->session = &s;
    c->xfer = t;
    c->bytes.assign(frame.begin(), frame.end());
    if (t) t->inflight++;
    (bulk ? s.bulk_outbox : s.outbox).push_back(c);
    flush_outbox(s);
}

void Context::send_auth(Session &s, const std::vector<uint8_t> &frame) {
    OpCookie *c = take_cookie();
    c->kind = OpCookie::Kind::Send;
    c->session = &s;
    c->bytes.assign(frame.begin(), frame.end());
    s.auth_outbox.push_back(c);
    flush_outbox(s);
}

void Context::flush_outbox(Session &s) {
    // A full transmit queue is shared by messages and writes: retrying a message on every pass
    // spins just as a write would (46,049 retries for 702 writes with 16 threads on one loaded shm
    // session), so a message waits for the same completion or short wait as a write.
    if (tx_full(*s.tp)) return;
    // Sends the queue's head until the provider pushes back; false when it did.
    auto drain = [&](std::deque<OpCookie *> &queue) {
        while (!queue.empty()) {
            OpCookie *c = queue.front();
            // Messages are small and the provider copies or registers them itself unless FI_MR_LOCAL.
            int rc;
            try {
                rc = s.tp->post_send(s.peer, c->bytes.data(), c->bytes.size(), nullptr, c);
            } catch (const Error &e) {
                lose_session(s, SG_ERR_PEER_LOST, "sending to the peer failed: " + e.message());
                // What is left cannot reach the peer either; kept, it would be retried on every pass.
                drop_unsent(s, false);
                return false;
            }
            if (rc == -EAGAIN) {
                note_tx_full(*s.tp);
                return false;
            }
            queue.pop_front();
            s.last_sent_ns = now_ns();
            counters.messages_sent++;
        }
        return true;
    };
    if (!s.may_send || !drain(s.auth_outbox)) return;
    if (s.proven && drain(s.outbox)) drain(s.bulk_outbox);
}

// Keep-alives, peer loss and deadlines; cheap, and run at most every 10 ms.
void Context::check_timers_locked() {
    const uint64_t now = now_ns();
    if (now < next_timer_check_ns_) return;
    next_timer_check_ns_ = now + 10000000;
    if (!retired_transports_.empty()) drop_unused_retired_transports();
    // Frames for a session nobody opened within two peer timeouts are not waiting for one.
    for (auto it = orphans_.begin(); it != orphans_.end();) {
        if (now - it->second.first_ns > 2 * peer_timeout_ns_) {
            unauthenticated_bytes_ -= it->second.bytes;
            it = orphans_.erase(it);
        } else {
            ++it;
        }
    }
    for (auto &[peer_id, weak] : sessions_) {
        auto s = weak.lock();
        if (s && s->closed() && !s->regs_dropped) drop_registrations(*s);
        if (s && s->closed() && s->tp->caps().local_only && now - s->lost_ns > kAbandonAfterLossNs) abandon_ops(*s);
        if (!s || s->closed()) continue;
        if (now - s->last_heard_ns > peer_timeout_ns_) {
            lose_session(*s, SG_ERR_PEER_LOST,
                         "peer sent nothing for " + std::to_string((now - s->last_heard_ns) / 1000000) +
                             " ms (peer_timeout_ms " + std::to_string(peer_timeout_ns_ / 1000000) + ")");
            continue;
        }
        if (s->may_send && s->outbox.empty() && now - s->last_sent_ns > peer_timeout_ns_ / 4) {
            wire::Ping ping;
            ping.sent_ns = now;
            std::vector<uint8_t> out;
            wire::encode(out, id, ping);
            send(*s, out);
        }
        // Failing a transfer takes an unmatched post out of the book: walk a copy.
        for (auto &t : s->matchbook.transfers()) {
            if (t->deadline_abs_ns && now > t->deadline_abs_ns && !t->finished())
                fail_transfer(*t, SG_ERR_DEADLINE, "transfer '" + t->request_id + "' missed its deadline", true);
            if (!t->post_side) continue;  // leases are the prefill side's
            // A transfer whose bytes are all delivered and that only waits for the decode side's
            // acknowledgement holds the decode side to nothing more: its lease cannot end it.
            const Transfer::Prefill &P = t->prefill();
            const bool delivered = P.done_sent() && t->inflight == 0;
            if (P.lease_deadline_ns && now > P.lease_deadline_ns && !t->finished() && !delivered) {
                emit(*t, SG_EVENT_LEASE_EXPIRED, 0, SG_ERR_LEASE_EXPIRED);
                fail_transfer(*t, SG_ERR_LEASE_EXPIRED,
                              "the lease of '" + t->request_id + "' ended (" +
                                  std::to_string(t->options.lease_ns / 1000000) +
                                  " ms after its last layer was written) before the decode side held every block",
                              true);
            }
        }
    }
}

}  // namespace sg::core
