// What the host does with a session (session.hpp, "The host's verbs"): the ABI's calls on one,
// each taking the context's mutex itself.
#include <algorithm>
#include <cstring>

#include "core/core.hpp"

namespace sg::core {

Outcome Session::outcome() const {
    std::lock_guard lock(ctx->mu);
    return {error, error_message};
}

sg_status_t Session::next_notification(void *buf, size_t cap, bool query, size_t &len) {
    std::lock_guard lock(ctx->mu);
    if (notifications.empty()) return SG_ERR_AGAIN;
    const auto &front = notifications.front();
    len = front.size();
    if (query) return SG_OK;  // the notification stays for the call that takes it
    if (cap < front.size())
        fail(SG_ERR_BUFFER_TOO_SMALL, "notification needs " + std::to_string(front.size()) + " bytes");
    std::memcpy(buf, front.data(), front.size());
    notifications.pop_front();
    return SG_OK;
}

sg_status_t Session::wait_ready(uint64_t timeout_ns) {
    const uint64_t deadline = now_ns() + std::min<uint64_t>(timeout_ns, uint64_t(1) << 62);
    std::unique_lock lock(ctx->mu);
    for (;;) {
        if (closed()) fail(error ? error : SG_ERR_PEER_LOST, "session failed: " + error_message);
        if (proven) return SG_OK;
        const uint64_t now = now_ns();
        if (now >= deadline) fail(SG_ERR_TIMEOUT, "the session is not authenticated yet");
        ctx->wait_step(lock, deadline);
    }
}

void Session::export_kv(KvPool &pool) {
    std::unique_lock lock(ctx->mu);
    // The same status as a post or expect on the session gets (one status per state).
    if (closed()) fail(error ? error : SG_ERR_PEER_LOST, "session is closed: " + error_message);
    if (local_regs.count(pool.id)) return;
    Session::LocalReg reg;
    const uint64_t bytes = pool.layout.region_bytes();
    const bool device = pool.layout.mem_kind == SG_MEM_CUDA;
    // Device memory is registered only where the provider reaches it (FI_HMEM: GPUDirect RDMA);
    // otherwise, or when the provider refuses it, its bytes go through the staging slots.
    const bool register_regions = !device || tp->caps().hmem;
    try {
        // One region at a time with the lock let go in between: registering a large pool (pinning,
        // on some providers) must not keep the progress thread from keep-alives for that long.
        for (uint8_t *base : register_regions ? pool.bases : std::vector<uint8_t *>{}) {
            reg.regions.push_back(device ? tp->register_device_memory(base, bytes, random_u64(), pool.layout.device)
                                         : tp->register_memory(base, bytes, random_u64()));
            lock.unlock();
            lock.lock();
            if (closed()) fail(error ? error : SG_ERR_PEER_LOST, "session is closed: " + error_message);
        }
        reg.device_direct = device && register_regions;
    } catch (const Error &e) {
        for (auto &r : reg.regions) tp->deregister(r);
        if (!device || e.status() == SG_ERR_PEER_LOST) throw;
        reg.regions.clear();
        ctx->log.log(SG_LOG_WARN, "device pool " + std::to_string(pool.id) + " stays staged: " + e.message());
    } catch (...) {
        for (auto &r : reg.regions) tp->deregister(r);
        throw;
    }
    if (local_regs.count(pool.id)) {  // exported by another thread meanwhile
        for (auto &r : reg.regions) tp->deregister(r);
        return;
    }
    wire::HandleExport ex;
    ex.handle_id = pool.id;
    ex.layout = pool.layout.to_desc();
    ex.regions_per_layer = pool.layout.regions_per_layer();
    for (auto &r : reg.regions) ex.regions.push_back({r.key, r.remote_base, bytes});
    ex.device_direct = reg.device_direct;
    if (device && !reg.device_direct)
        ex.regions.assign(pool.bases.size(), wire::Region{0, 0, bytes});  // no key: never written directly
    local_regs[pool.id] = std::move(reg);
    std::vector<uint8_t> out;
    wire::encode(out, ctx->id, ex);
    send(out);
}

void Session::close(uint64_t deadline) {
    if (!deadline) deadline = now_ns() + Context::kDestroyDrainNs;
    std::unique_lock lock(ctx->mu);
    if (!closed() && bye() == ByeExchange::None) {
        wire::Bye bye;
        std::vector<uint8_t> out;
        wire::encode(out, ctx->id, bye);
        send(out);
        advance_bye(ByeExchange::ByeSent);
        if (state() == SessionState::Open) advance(SessionState::Draining);
    }
    // fail_transfer takes an unmatched post out of the book: walk a copy.
    for (auto &t : matchbook.transfers()) t->fail_with(SG_ERR_CANCELED, "session closed", false);
    // Let queued sends (the Bye) and in-flight writes that name this session drain, and the peer
    // answer the Bye (peers of 1.1 and newer): until it has, frames we sent may still be in the
    // provider's or the kernel's buffers, and closing the endpoint could drop them.
    auto busy = [&] {
        // A Bye that cannot leave — the peer has not proven its key, or we may not speak first and
        // never heard from it — gets no answer to wait for.
        if (!closed() && proven && may_send && peer_minor >= 1 && bye() != ByeExchange::Answered) return true;
        for (auto &c : ctx->cookie_store_)
            if (c->in_use && !c->abandoned && c->session == this) return true;
        return false;
    };
    while (busy() && now_ns() < deadline) {
        if (ctx->progress_.joinable()) {
            ctx->cv.wait_for(lock, std::chrono::milliseconds(1));
        } else {
            ctx->poll_locked();
            ctx->run_copies(lock);
            flush_outbox();
        }
    }
    detach_locked();
}

void Session::discard() {
    std::lock_guard lock(ctx->mu);
    detach_locked();
}

void Session::close_gracefully(uint64_t timeout_ns) {
    const uint64_t deadline = now_ns() + std::min<uint64_t>(timeout_ns, uint64_t(1) << 62);
    {
        std::unique_lock lock(ctx->mu);
        if (state() == SessionState::Open || state() == SessionState::Authenticating) advance(SessionState::Draining);
        auto running = [&] {
            size_t n = matchbook.waiting_posts().size();
            auto count = [&](auto &transfers) {
                for (auto &[k, t] : transfers) {
                    t->note_quiesced();
                    n += !t->is_quiesced();
                }
            };
            count(matchbook.expects());
            count(matchbook.matched_posts());
            return n;
        };
        for (size_t n; !closed() && (n = running()) > 0;) {
            const uint64_t now = now_ns();
            if (now >= deadline)
                fail(SG_ERR_TIMEOUT,
                     std::to_string(n) + " transfer(s) still running on the session; it keeps draining");
            ctx->wait_step(lock, deadline);
        }
    }
    close(deadline);  // nothing left to cancel: says Bye and closes
    std::lock_guard lock(ctx->mu);
    if (error == SG_OK) {
        error = SG_ERR_INVALID_STATE;
        error_message = "closed by sg_session_close";
    }
}

void Session::notify(std::span<const uint8_t> data) {
    if (data.empty() || data.size() > wire::kMaxNotifyBytes)
        fail(SG_ERR_INVALID_ARGUMENT, "a notification holds 1 to SG_NOTIFY_MAX (4096) bytes");
    std::lock_guard lock(ctx->mu);
    if (closed()) fail(error ? error : SG_ERR_PEER_LOST, "session is closed: " + error_message);
    wire::Notify m;
    m.payload.assign(data.begin(), data.end());
    std::vector<uint8_t> out;
    wire::encode(out, ctx->id, m);
    send(out);
    ctx->wake();
}

void Session::detach_locked() {
    if (!closed()) {
        lost_ns = now_ns();
        advance(SessionState::Closed);
    }
    forget_held_frames();
    drop_unsent(false);
    // Under the lock, before ~Session unmaps the staging slots on whatever thread drops the last
    // reference: nothing the peer still sends may land in what is handed back, and every key
    // closes here (drop_registrations). A close both sides
    // finished (our Bye answered: the peer read all we sent and stopped) needs no fence, and keeps
    // the connection for the next session between the two endpoints; its keys still close.
    if (bye() == ByeExchange::Answered || peer_said_bye)
        drop_registrations();
    else
        fence();
    // The session object goes away with its handle; a provider that never completes operations to
    // a peer that stopped answering would leave them naming it forever.
    if (tp->caps().local_only) abandon_ops();
    forget_in_ops();
    auto it = ctx->sessions_.find(peer_ctx_id);
    if (it != ctx->sessions_.end() && it->second.lock().get() == this) {
        ctx->sessions_.erase(it);
        ctx->counters.sessions_open--;
    }
}

}  // namespace sg::core
