// Progress: the progress thread's loop and its exception barrier, one pass on the caller's thread
// (sg_context_progress), the blocking waits of the API, polling the transports (with the EAGAIN
// backoff and the renewal of a local_only endpoint after a peer died on it), and transfer events.
#include "core/core.hpp"

#include <sys/epoll.h>
#include <unistd.h>

#include <algorithm>

namespace sg::core {

namespace {

thread_local bool t_in_event_callback = false;

}  // namespace

bool in_event_callback() { return t_in_event_callback; }

// Nothing thrown on the progress thread may end the host process: an exception that reaches the
// loop fails every session of the context with the error (readable through sg_session_error and
// each transfer's status) and the loop goes on, backing off so a persistent fault cannot spin.
void Context::fail_all_sessions(sg_status_t status, const std::string &why) noexcept {
    try {
        std::lock_guard lock(mu);
        for (auto &[peer_id, weak] : sessions_)
            if (auto s = weak.lock(); s && !s->closed()) s->lose(status, why);
        cv.notify_all();
    } catch (...) {
        log.log(SG_LOG_ERROR, "failing the sessions after an internal error failed too: " + why);
    }
}

void Context::progress_loop() {
    for (;;) {
        try {
            progress_loop_body();
            return;
        } catch (const Error &e) {
            fail_all_sessions(e.status() == SG_ERR_NO_MEMORY ? SG_ERR_NO_MEMORY : SG_ERR_INTERNAL,
                              "progress thread: " + e.message());
        } catch (const std::bad_alloc &) {
            fail_all_sessions(SG_ERR_NO_MEMORY, "progress thread: out of memory");
        } catch (const std::exception &e) {
            fail_all_sessions(SG_ERR_INTERNAL, std::string("progress thread: ") + e.what());
        } catch (...) {
            fail_all_sessions(SG_ERR_INTERNAL, "progress thread: unknown exception");
        }
        ::usleep(10000);
    }
}

void Context::progress_loop_body() {
    uint64_t last_work = now_ns();
    // Last pass that completed or received something: none yet, so the loop blocks at once instead
    // of napping through a busy window (a host may fork right after creating the context).
    uint64_t last_real_work = 0;
    while (!stop_) {
        size_t n;
        {
            std::unique_lock lock(mu);
            n = poll_locked();
            run_copies(lock);  // chunks reserved by the last pass go before this pass's new writes
            schedule_locked();
            run_copies(lock);
        }
        if (events_pending_.load(std::memory_order_acquire)) dispatch_events();
        const uint64_t now = now_ns();
        if (n) {
            last_work = last_real_work = now;
            cv.notify_all();
            continue;
        }
        if (now - last_work < uint64_t(spin_us_) * 1000) continue;
        bool can_block = true;
        bool copies_waiting = false;  // chunks to pack or unpack, or packed ones the provider refused
        {
            std::lock_guard lock(mu);
            copies_waiting = !packs_.empty() || !unpacks_.empty();
            for (auto &t : transports) {
                // A local_only transport cannot wake us for a peer's writes, so it keeps us napping
                // briefly — but only while a session uses it: an idle context must cost nothing.
                // (A new session wakes the loop itself.)
                if (t->caps().local_only && !has_sessions_on(*t)) continue;
                can_block = t->prepare_wait() && can_block;
            }
            for (auto &t : retired_transports_) can_block = t->prepare_wait() && can_block;
        }
        epoll_event evs[4];
        // Some providers (shm) do not signal their wait object when the peer writes, so a wait can
        // oversleep a message by its whole timeout. Within kBusyWindowNs of real work (a transfer
        // is likely running) nap briefly; later sleep until a wait object fires, or briefly
        // without one.
        constexpr uint64_t kBusyWindowNs = 20000000;
        timespec nap{};
        if (now - last_real_work < kBusyWindowNs || copies_waiting)
            nap.tv_nsec = 50000;
        else if (can_block)
            nap.tv_nsec = 100000000;
        else
            nap.tv_nsec = 1000000;
        // What woke us does not matter: the next pass polls everything. The wake descriptor is
        // drained either way (non-blocking), so it cannot stay readable.
        (void)::epoll_pwait2(epoll_fd_, evs, 4, &nap, nullptr);
        uint64_t v;
        (void)!::read(wake_fd_, &v, sizeof v);
        last_work = now_ns();
    }
}

void Context::progress_once(bool run_callbacks) {
    size_t n;
    {
        std::unique_lock lock(mu);
        n = poll_locked();
        run_copies(lock);
        schedule_locked();
        run_copies(lock);
    }
    if (n) cv.notify_all();
    if (run_callbacks && !progress_.joinable() && events_pending_.load(std::memory_order_acquire)) dispatch_events();
}

// One step of a blocking call's wait, with mu held through `lock`: with a progress thread, sleep
// until it signals (at most 10 ms, never past the deadline); without one, make progress here.
void Context::wait_step(std::unique_lock<std::mutex> &lock, uint64_t deadline) {
    if (progress_.joinable()) {
        const uint64_t now = now_ns();
        cv.wait_for(lock, std::chrono::nanoseconds(std::min<uint64_t>(deadline > now ? deadline - now : 0, 10000000)));
    } else {
        poll_locked();
        schedule_locked();
        run_copies(lock);
    }
}

void Transfer::drain_events(std::unique_lock<std::mutex> &lock, uint64_t deadline) {
    if (!ctx->opt_.event_fn) return;
    while (events_queued.load(std::memory_order_acquire) > 0) {
        const uint64_t now = now_ns();
        if (now >= deadline) return;  // the wait's own result stands; the events follow
        if (!ctx->progress_.joinable()) {
            // No progress thread: the waiting thread is the host's, as in sg_context_progress.
            lock.unlock();
            ctx->dispatch_events();
            lock.lock();
            if (events_queued.load(std::memory_order_acquire) == 0) return;
        }
        // Another thread is running the callbacks (the progress thread, or a host's
        // sg_context_progress): it notifies when it has delivered them.
        ctx->cv.wait_for(lock, std::chrono::nanoseconds(std::min<uint64_t>(deadline - now, 1000000)));
    }
}

void Transfer::emit(sg_event_kind_t kind, uint32_t layer, sg_status_t status,
                   std::span<const uint32_t> blocks) {
    if (!ctx->opt_.event_fn || released.load(std::memory_order_relaxed)) return;
    ctx->events_.push_back({shared_from_this(), kind, layer, status, {blocks.begin(), blocks.end()}});
    events_queued.fetch_add(1, std::memory_order_relaxed);
    ctx->events_pending_.store(true, std::memory_order_release);
    ctx->wake();
}

// Finished -> Quiesced, once what it waits for has happened; called wherever that can change (a
// completion, the peer's TransferDone or Quiesced, the session closing) and by the waits.
void Transfer::note_quiesced() {
    if (state() != plan::TransferState::Finished || !quiesce_condition()) return;
    advance(plan::TransferState::Quiesced);
    emit(SG_EVENT_QUIESCED, 0, status);
}

void Context::dispatch_events() {
    // One dispatcher at a time keeps each transfer's events in order.
    if (t_in_event_callback) return;
    std::unique_lock dispatching(dispatch_mu_, std::try_to_lock);
    if (!dispatching.owns_lock()) return;
    std::vector<Event> batch, later;
    {
        std::lock_guard lock(mu);
        batch.swap(events_);
        events_pending_.store(false, std::memory_order_relaxed);
    }
    t_in_event_callback = true;
    size_t done = 0;  // delivered or dropped: no longer queued
    for (Event &e : batch) {
        if (e.t->released.load(std::memory_order_acquire)) {
            e.t->events_queued.fetch_sub(1, std::memory_order_acq_rel);
            ++done;
            continue;
        }
        void *h = e.t->api_handle.load(std::memory_order_acquire);
        if (!h) {
            // The ABI has not handed the transfer out yet; a transfer nobody else holds never will.
            if (e.t.use_count() > 1) {
                later.push_back(std::move(e));
            } else {
                e.t->events_queued.fetch_sub(1, std::memory_order_acq_rel);
                ++done;
            }
            continue;
        }
        sg_event_t event{};
        event.struct_size = sizeof event;
        event.kind = e.kind;
        event.layer = e.layer;
        event.status = e.status;
        event.transfer = static_cast<sg_transfer_t>(h);
        event.request_id = e.t->request_id.c_str();
        event.blocks = e.blocks.empty() ? nullptr : e.blocks.data();
        event.num_blocks = e.blocks.size();
        opt_.event_fn(opt_.event_user, &event);
        e.t->events_queued.fetch_sub(1, std::memory_order_acq_rel);
        ++done;
    }
    t_in_event_callback = false;
    if (done) {
        // Waits in drain_events check the counts under mu: taking it orders this notify after
        // their check, so none sleeps through the last delivery.
        { std::lock_guard lock(mu); }
        cv.notify_all();
    }
    if (!later.empty()) {
        std::lock_guard lock(mu);
        events_.insert(events_.begin(), std::make_move_iterator(later.begin()), std::make_move_iterator(later.end()));
        events_pending_.store(true, std::memory_order_release);
    }
}

size_t Context::poll_locked() {
    size_t n = 0;
    auto poll_one = [&](transport::Transport &t) {
        const size_t k = t.poll(*this);
        if (k && !tx_full_.empty()) tx_full_.erase(&t);  // completions free queue entries
        n += k;
    };
    for (auto &t : transports) poll_one(*t);
    for (auto &t : retired_transports_) poll_one(*t);
    return n;
}

// A provider that answered EAGAIN to a write has a full transmit queue: only a completion (or a
// connection set up meanwhile, so also a short wait) frees it. Retrying on every pass spun
// millions of times and took the CPU the peer needed (16 threads on one shm session: 2.25 million
// retries for 6057 writes).
bool Context::tx_full(const transport::Transport &t) {
    if (tx_full_.empty()) return false;
    auto it = tx_full_.find(&t);
    if (it == tx_full_.end()) return false;
    if (now_ns() - it->second < kTxFullRetryNs) return true;
    tx_full_.erase(it);
    return false;
}

void Context::note_tx_full(const transport::Transport &t) {
    counters.retries++;
    tx_full_.emplace(&t, now_ns());
}

bool Context::has_sessions_on(const transport::Transport &t) const {
    for (auto &[peer_id, weak] : sessions_)
        if (auto s = weak.lock(); s && s->tp == &t) return true;
    return false;
}

void Context::renew_transport(size_t index) {
    std::shared_ptr<transport::Transport> fresh;
    try {
        fresh = transport::open(transport_options_[index]);
    } catch (const Error &e) {
        log.log(SG_LOG_ERROR, "could not open a fresh " + transport_options_[index].provider +
                                  " endpoint after losing a peer on it: " + e.message());
        return;
    }
    epoll_event ev{};
    ev.events = EPOLLIN;
    if (fresh->wait_fd() >= 0) ::epoll_ctl(epoll_fd_, EPOLL_CTL_ADD, fresh->wait_fd(), &ev);
    retired_transports_.push_back(std::move(transports[index]));
    transports[index] = std::move(fresh);
    log.log(SG_LOG_INFO, "new sessions use a fresh " + transport_options_[index].provider +
                             " endpoint (a peer died on the previous one)");
}

void Context::drop_unused_retired_transports() {
    for (auto it = retired_transports_.begin(); it != retired_transports_.end();) {
        if (it->use_count() > 1) {  // a session still holds it
            ++it;
            continue;
        }
        if ((*it)->wait_fd() >= 0) ::epoll_ctl(epoll_fd_, EPOLL_CTL_DEL, (*it)->wait_fd(), nullptr);
        it = retired_transports_.erase(it);
    }
}

}  // namespace sg::core
