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
void Session::lose(sg_status_t status, const std::string &why, bool peer_closed) {
    if (closed()) return;
    advance(SessionState::Closed);
    lost_ns = now_ns();
    forget_held_frames();
    // A peer given up is fenced now. One that said Bye has stopped writing and read what we sent:
    // its connection stays for the next session between the two endpoints, and the keys close
    // once our own writes completed (check_timers).
    peer_said_bye = peer_closed;
    if (!peer_closed) fence();
    if (status == SG_ERR_PEER_LOST && !peer_closed) ctx->counters.peers_lost++;
    if (!peer_closed && tp->caps().local_only && ctx->transports[transport_index].get() == tp)
        ctx->renew_transport(transport_index);
    ctx->signal_event();
    error = status;
    error_message = why;
    if (!peer_closed) ctx->log.log(SG_LOG_ERROR, "session with peer " + std::to_string(peer_ctx_id) + " lost: " + why);
    // fail_transfer takes unmatched posts out of the book: a copy.
    for (auto &t : matchbook.transfers()) t->fail_with(status, why, false);
    drop_unsent(true);
    for (auto &[k, t] : matchbook.expects()) t->note_quiesced();
    for (auto &[k, t] : matchbook.matched_posts()) t->note_quiesced();
    ctx->cv.notify_all();
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
    using LaneProtocol = transport::Transport::LaneProtocol;
    peer = tp->insert_peer_lanes(lanes, hello.proto_minor >= 7   ? LaneProtocol::Healing
                                        : hello.proto_minor >= 6 ? LaneProtocol::Fencing
                                        : hello.proto_minor >= 5 ? LaneProtocol::Framed
                                                                 : LaneProtocol::Plain);
    // Staging areas come on first use, by role (Session::offer_staging, Session::ensure_send_staging):
    // a session that only posts never receives staged writes, one that only expects never packs.
    free_send_slots = (1u << StagingArea::kSlots) - 1;
}

// The session was detached under the context's lock, which fenced it (detach_locked): what is
// deregistered and unmapped here no longer has a connection that could write into it.
Session::~Session() {
    for (auto &[id, reg] : local_regs)
        for (auto &r : reg.regions) tp->deregister(r);
    recv_staging.release(tp);
    send_staging.release(tp);
    if (tp) tp->remove_peer(peer);
}

void Session::fence() {
    if (!connections_fenced) {
        // Writes of ours that the provider held complete as failed (their transfers have failed
        // or will), and no write moves to another lane.
        tp->peer_lost(peer);
        connections_fenced = tp->fence(peer);
    }
    drop_registrations();
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
    s->last_sent_ns = now_ns();
    s->liveness.start(s->last_sent_ns);
    s->proven = authenticated || key_.empty();
    if (s->proven) {
        s->advance(SessionState::Open);
    } else {
        s->auth_nonce = auth::random_nonce();
        std::vector<uint8_t> challenge;
        wire::encode(challenge, id, wire::AuthChallenge{s->auth_nonce});
        s->send_auth(challenge);
    }
    s->deliver_orphans();
    log.log(SG_LOG_INFO, "session with peer " + std::to_string(peer.ctx_id) + " over " + s->provider);
    wake();
    return s;
}

// Sends that never left are dropped — all of them when the session ends here, or only those of
// transfers when it was lost (its transfers have failed; a Bye answer may still go out) — their
// cookies go back to the pool and their transfers stop counting them, so those can quiesce.
void Session::drop_unsent(bool transfer_frames_only) {
    for (auto *queue : {&outbox, &bulk_outbox, &auth_outbox}) {
        auto keep = queue->begin();
        for (OpCookie *c : *queue) {
            if (transfer_frames_only && !c->xfer) {
                *keep++ = c;
                continue;
            }
            if (c->xfer) c->xfer->inflight--;
            ctx->give_cookie(c);
        }
        queue->erase(keep, queue->end());
    }
    for (auto &[k, t] : matchbook.expects()) t->note_quiesced();
    for (auto &[k, t] : matchbook.matched_posts()) t->note_quiesced();
}

size_t Session::unfinished() const {
    size_t n = 0;
    for (auto *filed : {&matchbook.matched_posts(), &matchbook.waiting_posts()})
        for (auto &[k, t] : *filed) n += !t->finished();
    for (auto &[k, t] : matchbook.expects()) n += !t->finished();
    return n;
}

// Closes an ended session's registrations, so that a peer that is only silent, not gone, cannot
// start a write into our blocks any more: at once after a fence closed its connections (the
// provider then holds no operation of ours on them), otherwise once none of our writes uses them.
// Transfers waiting for that quiesce now.
void Session::drop_registrations() {
    if (regs_dropped || (bytes_inflight && !connections_fenced)) return;
    for (auto &[pool_id, reg] : local_regs) {
        for (auto &r : reg.regions) tp->deregister(r);
        reg.regions.clear();
    }
    // The staging slots' keys close here too, under the lock, with the peer fenced or done: ~Session
    // runs on whatever thread drops the last reference, and there it only unmaps memory no key
    // reaches any more.
    if (recv_staging.reg.mr) tp->deregister(recv_staging.reg);
    if (send_staging.reg.mr) tp->deregister(send_staging.reg);
    regs_dropped = true;
    for (auto &[k, t] : matchbook.expects()) t->note_quiesced();
    for (auto &[k, t] : matchbook.matched_posts()) t->note_quiesced();
}

void Session::send(const std::vector<uint8_t> &frame, Transfer *t, bool bulk) {
    if (closed()) return;
    OpCookie *c = ctx->take_cookie();
    c->kind = OpCookie::Kind::Send;
    c->session = this;
    c->xfer = t;
    c->bytes.assign(frame.begin(), frame.end());
    if (t) t->inflight++;
    (bulk ? bulk_outbox : outbox).push_back(c);
    flush_outbox();
}

void Session::send_auth(const std::vector<uint8_t> &frame) {
    OpCookie *c = ctx->take_cookie();
    c->kind = OpCookie::Kind::Send;
    c->session = this;
    c->bytes.assign(frame.begin(), frame.end());
    auth_outbox.push_back(c);
    flush_outbox();
}

void Session::flush_outbox() {
    // A full transmit queue is shared by messages and writes: retrying a message on every pass
    // spins just as a write would (46,049 retries for 702 writes with 16 threads on one loaded shm
    // session), so a message waits for the same completion or short wait as a write.
    if (ctx->tx_full(*tp)) return;
    // Sends the queue's head until the provider pushes back; false when it did.
    auto drain = [&](std::deque<OpCookie *> &queue) {
        while (!queue.empty()) {
            OpCookie *c = queue.front();
            // Messages are small and the provider copies or registers them itself unless FI_MR_LOCAL.
            int rc;
            try {
                rc = tp->post_send(peer, c->bytes.data(), c->bytes.size(), nullptr, c);
            } catch (const Error &e) {
                lose(SG_ERR_PEER_LOST, "sending to the peer failed: " + e.message());
                // What is left cannot reach the peer either; kept, it would be retried on every pass.
                drop_unsent(false);
                return false;
            }
            if (rc == -EAGAIN) {
                ctx->note_tx_full(*tp);
                return false;
            }
            queue.pop_front();
            last_sent_ns = now_ns();
            ctx->counters.messages_sent++;
        }
        return true;
    };
    if (!may_send || !drain(auth_outbox)) return;
    if (proven && drain(outbox)) drain(bulk_outbox);
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
        if (s && s->closed() && !s->regs_dropped) s->drop_registrations();
        if (s && s->closed() && s->tp->caps().local_only && now - s->lost_ns > kAbandonAfterLossNs) s->abandon_ops();
        if (!s || s->closed()) continue;
        s->liveness.watch(now);
        if (s->liveness.lost(peer_timeout_ns_)) {
            const PeerLiveness &l = s->liveness;
            s->lose(SG_ERR_PEER_LOST,
                    "peer sent nothing for " + std::to_string(l.silence_ns() / 1000000) + " ms (" +
                        std::to_string((now - l.last_heard_ns()) / 1000000) + " ms since its last frame; peer_timeout_ms " +
                        std::to_string(peer_timeout_ns_ / 1000000) + ", allowed " +
                        std::to_string(l.timeout_ns(peer_timeout_ns_) / 1000000) + " after gaps of up to " +
                        std::to_string(l.largest_gap_ns() / 1000000) + " ms)");
            continue;
        }
        // Eight keep-alives per timeout, ours or the peer's when it is shorter: the side with the
        // shorter timeout judges us, and a keep-alive a link or a busy host delays by more than
        // its timeout less our period loses the session (a 12 s side pinging every 1.5 s kept a
        // 2 s side's session with half a second to spare).
        const uint64_t keepalive_ns = peer_timeout_ns_ / 8;
        const uint64_t period_ns = s->peer_keepalive_ns ? std::min(keepalive_ns, s->peer_keepalive_ns) : keepalive_ns;
        if (s->may_send && s->outbox.empty() && now - s->last_sent_ns > period_ns) {
            wire::Ping ping;
            ping.sent_ns = now;
            ping.keepalive_ns = keepalive_ns;
            std::vector<uint8_t> out;
            wire::encode(out, id, ping);
            s->send(out);
        }
        // Failing a transfer takes an unmatched post out of the book: walk a copy.
        for (auto &t : s->matchbook.transfers()) {
            if (t->deadline_abs_ns && now > t->deadline_abs_ns && !t->finished())
                t->fail_with(SG_ERR_DEADLINE, "transfer '" + t->request_id + "' missed its deadline", true);
            if (!t->post_side) continue;  // leases are the prefill side's
            // A transfer whose bytes are all delivered and that only waits for the decode side's
            // acknowledgement holds the decode side to nothing more: its lease cannot end it.
            const Transfer::Prefill &P = t->prefill();
            const bool delivered = P.done_sent() && t->inflight == 0;
            if (P.lease_deadline_ns && now > P.lease_deadline_ns && !t->finished() && !delivered) {
                t->emit(SG_EVENT_LEASE_EXPIRED, 0, SG_ERR_LEASE_EXPIRED);
                t->fail_with(SG_ERR_LEASE_EXPIRED,
                              "the lease of '" + t->request_id + "' ended (" +
                                  std::to_string(t->options.lease_ns / 1000000) +
                                  " ms after its last layer was written) before the decode side held every block",
                              true);
            }
        }
    }
}

}  // namespace sg::core
