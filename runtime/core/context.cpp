// The progress engine: sessions, matching of expect/post, layer streaming, the write and staging
// paths, and the ordering rule that a layer's "ready" notice never overtakes its data.
#include "core/core.hpp"

#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>

namespace sg::core {

namespace {

constexpr uint64_t kStagingHandleId = 0;
constexpr const char *kPeerClosed = "peer closed the session";
// Keeps a chunk notice (20 bytes a segment) well inside one receive buffer.
constexpr size_t kMaxSegmentsPerChunk = 4096;

}  // namespace

// ---------------------------------------------------------------------------------------------
// KV pools and staging areas
// ---------------------------------------------------------------------------------------------
KvPool::KvPool(Context *c, const sg_kv_layout_t &pub) : ctx(c), layout(kv::make_layout(pub)), id(random_u64()) {
    if (layout.mem_kind == SG_MEM_CUDA)
        fail(SG_ERR_UNSUPPORTED, "SG_MEM_CUDA pools are not supported by this version (host memory only)");
    const uint32_t rpl = layout.regions_per_layer();
    bases.resize(size_t(layout.num_layers) * rpl);
    for (uint32_t l = 0; l < layout.num_layers; ++l) {
        bases[size_t(l) * rpl] = static_cast<uint8_t *>(pub.layer_k_base[l]);
        if (rpl == 2) bases[size_t(l) * rpl + 1] = static_cast<uint8_t *>(pub.layer_v_base[l]);
    }
}

void StagingArea::allocate() {
    void *p = ::mmap(nullptr, kSlots * kSlotBytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) fail(SG_ERR_NO_MEMORY, "mmap of the staging area failed");
    base = static_cast<uint8_t *>(p);
}

void StagingArea::release(transport::Transport *tp) noexcept {
    if (reg.mr && tp) tp->deregister(reg);
    if (base) ::munmap(base, kSlots * kSlotBytes);
    base = nullptr;
}

ParamBounds param_bounds(sg_param_t p) {
    switch (p) {
        case SG_PARAM_STAGING_THRESHOLD: return {0, 64ull << 20};
        case SG_PARAM_MAX_OP_BYTES: return {4096, 1ull << 30};
        case SG_PARAM_MAX_OPS_IN_FLIGHT: return {1, 4096};
        case SG_PARAM_PROGRESS_SPIN_US: return {0, 1000000};
        case SG_PARAM_STAGING_POLICY: return {SG_STAGING_AUTO, SG_STAGING_NEVER};
    }
    fail(SG_ERR_INVALID_ARGUMENT, "unknown sg_param_t " + std::to_string(int(p)));
}

namespace {

// An SG_* tunable from the environment, held to the bounds sg_context_set_param enforces: a value
// that is not a plain decimal number inside them refuses the context instead of running with
// whatever strtoull made of it.
bool env_param(const char *name, sg_param_t p, uint64_t &out) {
    const char *text = std::getenv(name);
    if (!text) return false;
    const ParamBounds b = param_bounds(p);
    errno = 0;
    char *end = nullptr;
    const unsigned long long v = std::strtoull(text, &end, 10);
    if (!*text || *end || errno == ERANGE || text[0] == '-' || v < b.lo || v > b.hi)
        fail(SG_ERR_INVALID_ARGUMENT, std::string(name) + "='" + text + "' is not a number in [" + std::to_string(b.lo) +
                                          ", " + std::to_string(b.hi) + "]");
    out = v;
    return true;
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Context
// ---------------------------------------------------------------------------------------------
Context::Context(const sg_context_options_t &opt) : id(random_u64()), opt_(opt) {
    log = Logger(parse_log_level(std::getenv("SG_LOG_LEVEL"), opt.log_level), opt.log_fn, opt.log_user);
    std::string key_warning;
    key_ = auth::load_key(opt.auth_key, opt.auth_key_len, key_warning);
    if (!key_warning.empty()) log.log(SG_LOG_WARN, key_warning);
    if (key_.empty() && !opt.allow_unauthenticated)
        fail(SG_ERR_AUTH_REQUIRED, "no authentication key: set options.auth_key or SG_AUTH_KEY_FILE, or set "
                                   "options.allow_unauthenticated for a trusted network");
    // The options struct outlives nothing; the key now lives only in key_.
    opt_.auth_key = nullptr;
    opt_.auth_key_len = 0;
    spin_us_ = opt.progress_spin_us;
    if (uint64_t v; env_param("SG_PROGRESS_SPIN_US", SG_PARAM_PROGRESS_SPIN_US, v)) spin_us_ = uint32_t(v);
    max_ops_ = opt.max_ops_in_flight ? opt.max_ops_in_flight : 64;
    peer_timeout_ns_ = uint64_t(opt.peer_timeout_ms ? opt.peer_timeout_ms : 2000) * 1000000;
    if (opt.max_bytes_in_flight) max_bytes_ = opt.max_bytes_in_flight;
    if (opt.max_session_bytes_in_flight) max_session_bytes_ = opt.max_session_bytes_in_flight;
    if (opt.max_transfers_per_session) max_transfers_per_session_ = opt.max_transfers_per_session;
    boot_id_ = read_boot_id();
    netns_ = read_netns_inode();

    std::string prov = transport::canonical_provider(opt.provider ? opt.provider : "");
    const std::string addr = opt.local_addr ? opt.local_addr : "127.0.0.1";
    std::vector<std::string> to_open;
    if (prov.empty() || prov == "auto") {
        auto ranked = transport::rank_candidates(transport::discover(addr.c_str()));
        int r = transport::choose_remote(ranked);
        if (r < 0) fail(SG_ERR_NO_PROVIDER, "no usable libfabric provider (run smartgen-info for the reasons)");
        to_open.push_back(ranked[size_t(r)].caps.provider);
        // A same-host peer can use shared memory; open it too when present.
        int l = transport::choose_local(ranked);
        if (l >= 0 && ranked[size_t(l)].caps.provider == "shm") to_open.push_back("shm");
    } else {
        to_open.push_back(prov);
    }
    for (size_t i = 0; i < to_open.size(); ++i) {
        transport::OpenOptions o;
        o.provider = to_open[i];
        o.local_addr = addr;
        o.recv_buffer_bytes = wire::kMaxFrameBytes;
        try {
            transports.push_back(transport::open(o));
            transport_options_.push_back(o);
        } catch (const Error &e) {
            if (i == 0) throw;
            log.log(SG_LOG_INFO, "optional provider " + to_open[i] + " not opened: " + e.message());
        }
    }
    primary_provider = transports[0]->caps().provider;
    env_param("SG_STAGING_THRESHOLD", SG_PARAM_STAGING_THRESHOLD, staging_threshold_);
    env_param("SG_STAGING_POLICY", SG_PARAM_STAGING_POLICY, staging_policy_);
    max_op_bytes_ = 16ull << 20;  // each session holds it to its own provider's max_msg_size

    cookie_store_.reserve(size_t(max_ops_) + 64);
    wake_fd_ = ::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    event_fd_ = ::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    if (event_fd_ < 0) fail(SG_ERR_INTERNAL, std::string("eventfd: ") + std::strerror(errno));
    epoll_fd_ = ::epoll_create1(EPOLL_CLOEXEC);
    if (wake_fd_ < 0 || epoll_fd_ < 0) fail(SG_ERR_INTERNAL, std::string("eventfd/epoll: ") + std::strerror(errno));
    epoll_event ev{};
    ev.events = EPOLLIN;
    ::epoll_ctl(epoll_fd_, EPOLL_CTL_ADD, wake_fd_, &ev);
    for (auto &t : transports)
        if (t->wait_fd() >= 0) ::epoll_ctl(epoll_fd_, EPOLL_CTL_ADD, t->wait_fd(), &ev);
    log.log(SG_LOG_INFO, "context on " + primary_provider + (transports.size() > 1 ? " (+shm for same-host peers)" : ""));
    if (opt.progress_thread) progress_ = std::thread([this] { progress_loop(); });
}

Context::~Context() {
    {
        std::lock_guard lock(select_mu_);
        select_stop_ = true;
    }
    select_cv_.notify_all();
    if (select_thread_.joinable()) select_thread_.join();
    stop_ = true;
    wake();
    if (progress_.joinable()) progress_.join();
    {
        std::lock_guard lock(mu);
        active_.clear();
        lingering_.clear();
    }
    transports.clear();
    retired_transports_.clear();
    if (wake_fd_ >= 0) ::close(wake_fd_);
    if (event_fd_ >= 0) ::close(event_fd_);
    if (epoll_fd_ >= 0) ::close(epoll_fd_);
}

sg_context_stats_t Context::stats() {
    std::lock_guard lock(mu);
    sg_context_stats_t s = counters;
    s.registrations = 0;
    for (auto &t : transports) s.registrations += t->live_registrations();
    for (auto &t : retired_transports_) s.registrations += t->live_registrations();
    return s;
}

void Context::signal_event() {
    uint64_t one = 1;
    (void)!::write(event_fd_, &one, sizeof one);
}

void Context::notify(Session &s, std::span<const uint8_t> data) {
    if (data.empty() || data.size() > wire::kMaxNotifyBytes)
        fail(SG_ERR_INVALID_ARGUMENT, "a notification holds 1 to SG_NOTIFY_MAX (4096) bytes");
    std::lock_guard lock(mu);
    if (s.closed) fail(s.error ? s.error : SG_ERR_PEER_LOST, "session is closed: " + s.error_message);
    wire::Notify m;
    m.payload.assign(data.begin(), data.end());
    std::vector<uint8_t> out;
    wire::encode(out, id, m);
    send(s, out);
    wake();
}

void Context::wake() {
    uint64_t one = 1;
    if (wake_fd_ >= 0) (void)!::write(wake_fd_, &one, sizeof one);
}

wire::Hello Context::hello() const {
    std::lock_guard lock(const_cast<std::mutex &>(mu));  // transports may be renewed meanwhile
    wire::Hello h;
    h.ctx_id = id;
    h.boot_id = boot_id_;
    h.netns_inode = netns_;
    for (auto &t : transports) h.endpoints.push_back({t->caps().provider, t->local_address()});
    if (!key_.empty()) {
        h.auth = wire::AuthMode::HmacSha256;
        h.nonce = auth::random_nonce();
    }
    return h;
}

std::vector<uint8_t> Context::metadata() const {
    std::vector<uint8_t> out;
    wire::encode(out, id, hello());
    if (!key_.empty()) {
        const auth::Mac mac = auth::blob_mac(key_, out);
        out.insert(out.end(), mac.begin(), mac.end());
    }
    return out;
}

void Context::set_param(sg_param_t p, uint64_t v) {
    std::lock_guard lock(mu);
    switch (p) {
        case SG_PARAM_STAGING_THRESHOLD: staging_threshold_ = v; break;
        case SG_PARAM_MAX_OP_BYTES: max_op_bytes_ = v; break;
        case SG_PARAM_MAX_OPS_IN_FLIGHT: max_ops_ = uint32_t(v); break;
        case SG_PARAM_PROGRESS_SPIN_US: spin_us_ = uint32_t(v); break;
        case SG_PARAM_STAGING_POLICY: staging_policy_ = v; break;
    }
    wake();
}

uint64_t Context::get_param(sg_param_t p) const {
    std::lock_guard lock(const_cast<std::mutex &>(mu));
    switch (p) {
        case SG_PARAM_STAGING_THRESHOLD: return staging_threshold_;
        case SG_PARAM_MAX_OP_BYTES: return max_op_bytes_;
        case SG_PARAM_MAX_OPS_IN_FLIGHT: return max_ops_;
        case SG_PARAM_PROGRESS_SPIN_US: return spin_us_;
        case SG_PARAM_STAGING_POLICY: return staging_policy_;
    }
    return 0;
}

// ---------------------------------------------------------------------------------------------
// Progress
// ---------------------------------------------------------------------------------------------
// Nothing thrown on the progress thread may end the host process: an exception that reaches the
// loop fails every session of the context with the error (readable through sg_session_error and
// each transfer's status) and the loop goes on, backing off so a persistent fault cannot spin.
void Context::fail_all_sessions(sg_status_t status, const std::string &why) noexcept {
    try {
        std::lock_guard lock(mu);
        for (auto &[peer_id, weak] : sessions_)
            if (auto s = weak.lock(); s && !s->closed) lose_session(*s, status, why);
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
    uint64_t last_real_work = last_work;  // last pass that completed or received something
    while (!stop_) {
        size_t n;
        {
            std::lock_guard lock(mu);
            n = poll_locked();
            schedule_locked();
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
        {
            std::lock_guard lock(mu);
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
        if (now - last_real_work < kBusyWindowNs)
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
        std::lock_guard lock(mu);
        n = poll_locked();
        schedule_locked();
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
    }
}

namespace {
thread_local bool t_in_event_callback = false;
}

bool in_event_callback() { return t_in_event_callback; }

void Context::emit(Transfer &t, sg_transfer_event_t type, uint32_t layer, sg_status_t status) {
    if (!opt_.transfer_event_fn || t.released.load(std::memory_order_relaxed)) return;
    events_.push_back({t.shared_from_this(), type, layer, status});
    events_pending_.store(true, std::memory_order_release);
    wake();
}

void Context::note_quiesced(Transfer &t) {
    if (t.quiesced_event_sent || !t.is_quiesced()) return;
    t.quiesced_event_sent = true;
    emit(t, SG_EVENT_QUIESCED, 0, t.status);
}

void Context::set_api_handle(Transfer &t, void *handle) {
    t.api_handle.store(handle, std::memory_order_release);
    if (opt_.transfer_event_fn) wake();  // events that waited for the handle may go now
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
    for (Event &e : batch) {
        if (e.t->released.load(std::memory_order_acquire)) continue;
        void *h = e.t->api_handle.load(std::memory_order_acquire);
        if (!h) {
            // The ABI has not handed the transfer out yet; a transfer nobody else holds never will.
            if (e.t.use_count() > 1) later.push_back(std::move(e));
            continue;
        }
        opt_.transfer_event_fn(opt_.transfer_event_user, static_cast<sg_transfer_t>(h), e.t->request_id.c_str(), e.type,
                               e.layer, e.status);
    }
    t_in_event_callback = false;
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
        if (s && s->closed && !s->regs_dropped) drop_registrations(*s);
        if (s && s->closed && s->tp->caps().local_only && now - s->lost_ns > kAbandonAfterLossNs) abandon_ops(*s);
        if (!s || s->closed) continue;
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
        // Failing a transfer takes an unmatched post out of its map: walk a snapshot.
        std::vector<std::shared_ptr<Transfer>> timed;
        for (auto &[k, t] : s->expects) timed.push_back(t);
        for (auto &[k, t] : s->posts) timed.push_back(t);
        for (auto &[k, t] : s->unmatched_posts) timed.push_back(t);
        for (auto &t : timed) {
            if (t->deadline_abs_ns && now > t->deadline_abs_ns && !t->finished())
                fail_transfer(*t, SG_ERR_DEADLINE, "transfer '" + t->request_id + "' missed its deadline", true);
            if (t->lease_deadline_ns && now > t->lease_deadline_ns && !t->finished()) {
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

// The peer is gone (silent, connection broken, or closed): every pending transfer on the session
// fails at once, and nothing more is sent on it.
void Context::lose_session(Session &s, sg_status_t status, const std::string &why, bool peer_closed) {
    if (s.closed) return;
    s.closed = true;
    s.lost_ns = now_ns();
    forget_held_frames(s);
    if (status == SG_ERR_PEER_LOST && !peer_closed) counters.peers_lost++;
    if (!peer_closed && s.tp->caps().local_only && transports[s.transport_index].get() == s.tp)
        renew_transport(s.transport_index);
    signal_event();
    s.error = status;
    s.error_message = why;
    if (!peer_closed) log.log(SG_LOG_ERROR, "session with peer " + std::to_string(s.peer_ctx_id) + " lost: " + why);
    std::vector<std::shared_ptr<Transfer>> ts;  // fail_transfer takes unmatched posts out of their map
    for (auto &[k, t] : s.expects) ts.push_back(t);
    for (auto &[k, t] : s.posts) ts.push_back(t);
    for (auto &[k, t] : s.unmatched_posts) ts.push_back(t);
    for (auto &t : ts) fail_transfer(*t, status, why, false);
    drop_registrations(s);
    for (auto &[k, t] : s.expects) note_quiesced(*t);
    for (auto &[k, t] : s.posts) note_quiesced(*t);
    cv.notify_all();
}

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
    for (int pass = 0; pass < 3; ++pass) {
        for (bool any = true; any;) {
            any = false;
            for (size_t i = 0; i < active_.size(); ++i) {
                Transfer &t = *active_[i];
                any = (t.selective() ? pump_selective(t, pass, 16) : pass == 1 && pump(t, 16)) || any;
            }
        }
    }
    active_.erase(std::remove_if(active_.begin(), active_.end(),
                                 [](const auto &t) { return t->finished() || (t->done_sent && !t->inflight); }),
                  active_.end());
}

OpCookie *Context::take_cookie() {
    if (!free_cookies_.empty()) {
        OpCookie *c = free_cookies_.back();
        free_cookies_.pop_back();
        c->in_use = true;
        c->abandoned = false;
        return c;
    }
    cookie_store_.push_back(std::make_unique<OpCookie>());
    cookie_store_.back()->in_use = true;
    return cookie_store_.back().get();
}

void Context::give_cookie(OpCookie *c) {
    c->in_use = false;
    c->abandoned = false;
    c->xfer = nullptr;
    c->session = nullptr;
    c->unit = nullptr;
    c->len = 0;
    c->bytes.clear();
    free_cookies_.push_back(c);
}

// ---------------------------------------------------------------------------------------------
// Sending control messages (in order per session, even across EAGAIN)
// ---------------------------------------------------------------------------------------------
void Context::send(Session &s, const std::vector<uint8_t> &frame, Transfer *t, bool bulk) {
    if (s.closed) return;
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
                return false;
            }
            if (rc == -EAGAIN) {
                counters.retries++;
                return false;
            }
            queue.pop_front();
            s.last_sent_ns = now_ns();
            counters.messages_sent++;
        }
        return true;
    };
    if (!s.may_send || !drain(s.auth_outbox)) return;
    if (s.authenticated && drain(s.outbox)) drain(s.bulk_outbox);
}

// ---------------------------------------------------------------------------------------------
// Completions and messages
// ---------------------------------------------------------------------------------------------
void Context::on_complete(void *cookie, int status, const char *error_text) {
    if (!cookie) {
        log.log(SG_LOG_WARN, std::string("a control message could not be received: ") + (error_text ? error_text : "?"));
        return;
    }
    auto *c = static_cast<OpCookie *>(cookie);
    if (!c->abandoned) settle(c, status, error_text);
    give_cookie(c);
}

// Operations still in the provider when a session closes (a send to a peer whose connection is
// being replaced can stay there past close's deadline) may complete after the session object is
// gone. Those of a transfer keep the session alive through the transfer; the others stop naming it,
// so their completion only returns the cookie (found by the handler fuzzer: a use-after-free).
void Context::forget_session_in_cookies(Session &s) {
    for (auto &owned : cookie_store_) {
        OpCookie *c = owned.get();
        if (!c->in_use || c->session != &s || c->xfer) continue;
        if (c->kind != OpCookie::Kind::Send) {
            // A write without a transfer does not exist; settle it now so the budgets come back.
            settle(c, -ECANCELED, "the session closed");
            c->abandoned = true;
        }
        c->session = nullptr;
    }
}

void Context::abandon_ops(Session &s) {
    for (auto &owned : cookie_store_) {
        OpCookie *c = owned.get();
        if (!c->in_use || c->abandoned || c->session != &s) continue;
        if (c->kind == OpCookie::Kind::Send &&
            (std::find(s.outbox.begin(), s.outbox.end(), c) != s.outbox.end() ||
             std::find(s.bulk_outbox.begin(), s.bulk_outbox.end(), c) != s.bulk_outbox.end() ||
             std::find(s.auth_outbox.begin(), s.auth_outbox.end(), c) != s.auth_outbox.end()))
            continue;  // never posted: the outbox owns it
        settle(c, -ECANCELED, "the peer is gone and the provider will not complete this operation");
        c->abandoned = true;
    }
}

void Context::settle(OpCookie *c, int status, const char *error_text) {
    Transfer *t = c->xfer;
    if (log.enabled(SG_LOG_DEBUG))
        log.log(SG_LOG_DEBUG, "completion kind " + std::to_string(int(c->kind)) + " status " + std::to_string(status));
    if (c->kind != OpCookie::Kind::Send) {
        ops_inflight_--;
        bytes_inflight_ -= c->len;
        if (c->session) c->session->bytes_inflight -= c->len;
        if (c->unit && c->unit->path == SG_PATH_SPECULATIVE && c->session) c->session->speculative_inflight -= c->len;
    }
    // What providers report for operations on a connection that went away (rxm fails what was
    // queued on it with EIO or ECANCELED when the peer dies): the peer is lost, not the transport.
    const bool connection_broke = status == -ECONNRESET || status == -EPIPE || status == -ENOTCONN ||
                                  status == -ECONNABORTED || status == -ECONNREFUSED || status == -EHOSTUNREACH ||
                                  status == -ETIMEDOUT || status == -EIO || status == -ECANCELED ||
                                  status == -ESHUTDOWN || status == -ENETDOWN || status == -ENETUNREACH ||
                                  status == -EHOSTDOWN;
    if (connection_broke && c->session && !c->session->closed)
        lose_session(*c->session, SG_ERR_PEER_LOST,
                     std::string("connection to the peer broke: ") + (error_text ? error_text : ""));
    if (t) {
        t->inflight--;
        if (status) {
            // Once the transfer has failed (its session lost, say), the rest of its operations
            // failing too says nothing new: logged once, not once per operation.
            if (!t->finished()) {
                const std::string what = c->kind == OpCookie::Kind::Send ? "control message" : "RMA write";
                // On a session already lost, the operation failed because the peer is gone: the
                // transfer ends with the session's status, as documented, not SG_ERR_TRANSPORT.
                const bool lost = c->session && c->session->closed && c->session->error;
                if (!lost)
                    log.log(SG_LOG_ERROR, "transfer '" + t->request_id + "': " + what + " failed: " + (error_text ? error_text : ""));
                fail_transfer(*t, lost ? c->session->error : SG_ERR_TRANSPORT,
                              lost ? c->session->error_message : what + " failed: " + (error_text ? error_text : ""), false);
            }
        } else if (c->kind == OpCookie::Kind::Send) {
            // Completions may come in any order (a rendezvous-sized notice can finish after the
            // done notice), so whichever is last completes the transfer.
            if (t->done_sent) complete_if_done(*t);
        } else {
            if (c->kind == OpCookie::Kind::StagedWrite && !c->session->tp->caps().send_after_write) {
                // Without send-after-write ordering the chunk notice waits for the write's completion.
                send(*c->session, std::vector<uint8_t>(c->bytes.begin(), c->bytes.end()), t);
            }
            if (c->unit) {
                c->unit->outstanding--;
                selective_notices(*t);
            } else {
                t->layers[c->layer].outstanding--;
                maybe_send_notices(*t);
            }
        }
        if (t->finished()) {
            maybe_send_quiesced(*t);
            note_quiesced(*t);
        }
    } else if (status && !connection_broke) {
        log.log(SG_LOG_WARN, std::string("control message failed: ") + (error_text ? error_text : ""));
    }
    if (c->session && c->session->closed && !c->session->regs_dropped) drop_registrations(*c->session);
    if (c->kind == OpCookie::Kind::StagedWrite && c->session) c->session->free_send_slots |= 1u << c->staging_slot;
}

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
            if (m.handle_id == kStagingHandleId) {
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

// Fabric challenge-response of sessions made from metadata blobs: each side challenges with a fresh
// nonce and answers the other's challenge; a side trusts the peer once the peer's answer checks.
void Context::handle_auth(Session &s, const wire::FrameHeader &h, std::span<const uint8_t> body) {
    s.last_heard_ns = now_ns();
    counters.messages_received++;
    if (!s.may_send) {
        s.may_send = true;
        flush_outbox(s);
    }
    if (s.closed || key_.empty()) return;
    auto check = [](wire::DecodeError e, const char *what) {
        if (e != wire::DecodeError::None) fail(SG_ERR_PROTOCOL, std::string(what) + ": " + wire::decode_error_str(e));
    };
    switch (h.type) {
        case wire::MsgType::AuthChallenge: {
            // Only sessions the host opened from a blob answer: a bootstrapped session proved itself
            // already, and answering anyone would make this context an oracle.
            if (s.auth_nonce.empty()) return;
            wire::AuthChallenge m;
            check(wire::decode(body, m), "AuthChallenge");
            std::vector<uint8_t> out;
            wire::encode(out, id, wire::AuthProof{auth::fabric_proof(key_, id, s.peer_ctx_id, m.nonce)});
            send_auth(s, out);
            return;
        }
        case wire::MsgType::AuthProof: {
            if (s.authenticated || s.auth_nonce.empty()) return;
            wire::AuthProof m;
            check(wire::decode(body, m), "AuthProof");
            const bool ok = auth::mac_equal(m.mac, auth::fabric_proof(key_, s.peer_ctx_id, id, s.auth_nonce));
            std::vector<uint8_t> out;
            wire::encode(out, id, wire::AuthResult{ok ? 1u : 0u});
            send_auth(s, out);
            if (!ok) {
                counters.auth_failures++;
                lose_session(s, SG_ERR_AUTH_FAILED,
                             "the peer's key proof does not match this context's key (the two sides hold different keys)");
                return;
            }
            s.authenticated = true;
            log.log(SG_LOG_INFO, "session with peer " + std::to_string(s.peer_ctx_id) + " authenticated over the fabric");
            flush_outbox(s);
            auto held = std::move(s.held_frames);
            forget_held_frames(s);
            for (auto &f : held) on_message(f);
            cv.notify_all();
            signal_event();
            return;
        }
        case wire::MsgType::AuthResult: {
            wire::AuthResult m;
            check(wire::decode(body, m), "AuthResult");
            if (!m.accepted) {
                counters.auth_failures++;
                lose_session(s, SG_ERR_AUTH_FAILED,
                             "the peer rejected this context's key proof (the two sides hold different keys)");
            }
            return;
        }
        default: return;
    }
}

sg_status_t Context::wait_ready(Session &s, uint64_t timeout_ns) {
    const uint64_t deadline = now_ns() + std::min<uint64_t>(timeout_ns, uint64_t(1) << 62);
    std::unique_lock lock(mu);
    for (;;) {
        if (s.closed) fail(s.error ? s.error : SG_ERR_PEER_LOST, "session failed: " + s.error_message);
        if (s.authenticated) return SG_OK;
        const uint64_t now = now_ns();
        if (now >= deadline) fail(SG_ERR_TIMEOUT, "the session is not authenticated yet");
        wait_step(lock, deadline);
    }
}

// ---------------------------------------------------------------------------------------------
// Sessions
// ---------------------------------------------------------------------------------------------
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
    peer = tp->insert_peer(hello.endpoints[peer_ep].address);
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
    s->authenticated = authenticated || key_.empty();
    if (!s->authenticated) {
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

// Decode side, before its first Expect on the session: the receive slots the peer may stage into,
// and where they are (a HandleExport ahead of the Expect, so the peer knows them by the time it
// matches). Allocated and registered once per session, only by sessions that expect.
void Context::offer_staging(Session &s) {
    if (s.recv_staging.base) return;
    s.recv_staging.allocate();
    try {
        s.recv_staging.reg =
            s.tp->register_memory(s.recv_staging.base, StagingArea::kSlots * StagingArea::kSlotBytes, random_u64());
    } catch (...) {
        s.recv_staging.release(s.tp);
        throw;
    }
    wire::HandleExport ex;
    ex.handle_id = kStagingHandleId;
    // Described as a pool of opaque 4 KiB blocks so the descriptor passes the same checks as a KV
    // pool's (fp8, one fused block = two 2 KiB planes).
    ex.regions_per_layer = 1;
    ex.layout.num_layers = 1;
    ex.layout.num_kv_heads = 1;
    ex.layout.head_dim = 2048;
    ex.layout.tokens_per_block = 1;
    ex.layout.dtype = SG_DTYPE_FP8_E4M3;
    ex.layout.packing = SG_KV_FUSED;
    ex.layout.block_stride_bytes = 4096;
    ex.layout.num_blocks = StagingArea::kSlots * StagingArea::kSlotBytes / 4096;
    ex.regions.push_back({s.recv_staging.reg.key, s.recv_staging.reg.remote_base, StagingArea::kSlots * StagingArea::kSlotBytes});
    std::vector<uint8_t> out;
    wire::encode(out, id, ex);
    send(s, out);
}

// Prefill side, at the first staged chunk: the slots we pack into. False when they cannot be had
// (the layer then goes as plain writes).
bool Context::ensure_send_staging(Session &s) {
    if (s.send_staging.base) return true;
    try {
        s.send_staging.allocate();
        if (s.tp->caps().needs_local_desc)
            s.send_staging.reg =
                s.tp->register_memory(s.send_staging.base, StagingArea::kSlots * StagingArea::kSlotBytes, random_u64());
        return true;
    } catch (const Error &e) {
        s.send_staging.release(s.tp);
        s.have_peer_staging = false;
        log.log(SG_LOG_WARN, "staging turned off for this session: " + e.message());
        return false;
    }
}

void Context::export_kv(Session &s, KvPool &pool) {
    std::unique_lock lock(mu);
    if (s.closed) fail(SG_ERR_PEER_LOST, "session is closed");
    if (s.local_regs.count(pool.id)) return;
    Session::LocalReg reg;
    const uint64_t bytes = pool.layout.region_bytes();
    try {
        // One region at a time with the lock let go in between: registering a large pool (pinning,
        // on some providers) must not keep the progress thread from keep-alives for that long.
        for (uint8_t *base : pool.bases) {
            reg.regions.push_back(s.tp->register_memory(base, bytes, random_u64()));
            lock.unlock();
            lock.lock();
            if (s.closed) fail(SG_ERR_PEER_LOST, "session is closed");
        }
    } catch (...) {
        for (auto &r : reg.regions) s.tp->deregister(r);
        throw;
    }
    if (s.local_regs.count(pool.id)) {  // exported by another thread meanwhile
        for (auto &r : reg.regions) s.tp->deregister(r);
        return;
    }
    wire::HandleExport ex;
    ex.handle_id = pool.id;
    ex.layout = pool.layout.to_desc();
    ex.regions_per_layer = pool.layout.regions_per_layer();
    for (auto &r : reg.regions) ex.regions.push_back({r.key, r.remote_base, bytes});
    s.local_regs[pool.id] = std::move(reg);
    std::vector<uint8_t> out;
    wire::encode(out, id, ex);
    send(s, out);
}

void Context::close_session(Session &s, uint64_t deadline) {
    if (!deadline) deadline = now_ns() + kDestroyDrainNs;
    std::unique_lock lock(mu);
    if (!s.closed && !s.bye_sent) {
        wire::Bye bye;
        std::vector<uint8_t> out;
        wire::encode(out, id, bye);
        send(s, out);
        s.bye_sent = true;
    }
    // fail_transfer takes an unmatched post out of its map: walk a copy.
    auto fail_all = [&](auto &m) {
        std::vector<std::shared_ptr<Transfer>> ts;
        for (auto &[k, t] : m) ts.push_back(t);
        for (auto &t : ts) fail_transfer(*t, SG_ERR_CANCELED, "session closed", false);
    };
    fail_all(s.expects);
    fail_all(s.posts);
    fail_all(s.unmatched_posts);
    // Let queued sends (the Bye) and in-flight writes that name this session drain, and the peer
    // answer the Bye (peers of 1.1 and newer): until it has, frames we sent may still be in the
    // provider's or the kernel's buffers, and closing the endpoint could drop them.
    auto busy = [&] {
        if (!s.closed && s.peer_minor >= 1 && !s.bye_received) return true;
        for (auto &c : cookie_store_)
            if (c->in_use && !c->abandoned && c->session == &s) return true;
        return false;
    };
    while (busy() && now_ns() < deadline) {
        if (progress_.joinable()) {
            cv.wait_for(lock, std::chrono::milliseconds(1));
        } else {
            poll_locked();
            flush_outbox(s);
        }
    }
    detach_session(s);
}

void Context::discard_session(Session &s) {
    std::lock_guard lock(mu);
    detach_session(s);
}

// The end of a session on this side, with mu held: closed, its unsent frames dropped, operations
// still in the provider no longer naming it, and the context's entry for the peer gone.
void Context::detach_session(Session &s) {
    if (!s.closed) s.lost_ns = now_ns();
    s.closed = true;
    forget_held_frames(s);
    // Sends that never left are dropped; their cookies go back to the pool.
    for (auto *queue : {&s.outbox, &s.bulk_outbox, &s.auth_outbox}) {
        for (OpCookie *c : *queue) {
            if (c->xfer) c->xfer->inflight--;
            give_cookie(c);
        }
        queue->clear();
    }
    // The session object goes away with its handle; a provider that never completes operations to
    // a peer that stopped answering would leave them naming it forever.
    if (s.tp->caps().local_only) abandon_ops(s);
    forget_session_in_cookies(s);
    auto it = sessions_.find(s.peer_ctx_id);
    if (it != sessions_.end() && it->second.lock().get() == &s) {
        sessions_.erase(it);
        counters.sessions_open--;
    }
}

void Context::close_gracefully(Session &s, uint64_t timeout_ns) {
    const uint64_t deadline = now_ns() + std::min<uint64_t>(timeout_ns, uint64_t(1) << 62);
    {
        std::unique_lock lock(mu);
        s.draining = true;
        auto running = [&] {
            size_t n = s.unmatched_posts.size();
            for (auto &[k, t] : s.expects) n += !t->is_quiesced();
            for (auto &[k, t] : s.posts) n += !t->is_quiesced();
            return n;
        };
        for (size_t n; !s.closed && (n = running()) > 0;) {
            const uint64_t now = now_ns();
            if (now >= deadline)
                fail(SG_ERR_TIMEOUT, std::to_string(n) + " transfer(s) still running on the session; it keeps draining");
            wait_step(lock, deadline);
        }
    }
    close_session(s, deadline);  // nothing left to cancel: says Bye and closes
    std::lock_guard lock(mu);
    if (s.error == SG_OK) {
        s.error = SG_ERR_INVALID_STATE;
        s.error_message = "closed by sg_session_close";
    }
}

// ---------------------------------------------------------------------------------------------
// Transfers
// ---------------------------------------------------------------------------------------------
Transfer::Transfer(Context *c, std::shared_ptr<Session> s, bool post, std::string rid, std::shared_ptr<KvPool> p,
                   std::span<const uint32_t> tbl, uint64_t ntok, const sg_transfer_options_t &opt)
    : ctx(c), session(std::move(s)), post_side(post), request_id(std::move(rid)), pool(std::move(p)),
      table(tbl.begin(), tbl.end()), num_tokens(ntok), options(opt) {
    layers.resize(pool->layout.num_layers);
    residency.reset(pool->layout.num_layers, table.size());
    stats.struct_size = sizeof stats;
    pool->transfers_using++;
}

Transfer::~Transfer() { pool->transfers_using--; }

namespace {

void check_request_id(const char *rid) {
    if (!rid || !*rid) fail(SG_ERR_INVALID_ARGUMENT, "request_id is empty");
    if (std::strlen(rid) > SG_REQUEST_ID_MAX)
        fail(SG_ERR_INVALID_ARGUMENT, "request_id is longer than SG_REQUEST_ID_MAX (255) bytes");
}

}  // namespace

std::shared_ptr<Transfer> Context::expect(const std::shared_ptr<Session> &s, const char *rid,
                                          const std::shared_ptr<KvPool> &pool, std::span<const uint32_t> table,
                                          uint64_t num_tokens, const sg_transfer_options_t &opt) {
    check_request_id(rid);
    kv::check_block_table(pool->layout, table, num_tokens);
    std::lock_guard lock(mu);
    if (s->closed) fail(s->error ? s->error : SG_ERR_PEER_LOST, "session is closed");
    if (s->draining) fail(SG_ERR_INVALID_STATE, "session is closing (sg_session_close)");
    if (!s->local_regs.count(pool->id))
        fail(SG_ERR_INVALID_STATE, "the destination pool was not exported to this session (sg_session_export_kv)");
    if (s->unfinished() >= max_transfers_per_session_)
        fail(SG_ERR_AGAIN, "the session has " + std::to_string(max_transfers_per_session_) +
                               " unfinished transfers (max_transfers_per_session); retry after some finish");
    for (auto &[k, t] : s->expects)
        if (t->request_id == rid && !t->finished()) fail(SG_ERR_DUPLICATE, std::string("request '") + rid + "' is already expected");
    auto t = std::make_shared<Transfer>(this, s, false, rid, pool, table, num_tokens, opt);
    t->id = next_xfer_id_++;
    t->stats.start_ns = now_ns();
    if (opt.deadline_ns) t->deadline_abs_ns = saturating_add(t->stats.start_ns, opt.deadline_ns);
    if (auto c = s->peer_canceled.find(rid); c != s->peer_canceled.end()) {
        // The prefill side canceled this request before we expected it: nothing will be sent.
        s->expects[t->id] = t;
        t->quiesced = true;
        fail_transfer(*t, c->second.first, c->second.second, false);
        s->peer_canceled.erase(c);
        return t;
    }
    offer_staging(*s);
    s->expects[t->id] = t;
    wire::Expect m;
    m.request_id = rid;
    m.decode_xfer_id = t->id;
    m.handle_id = pool->id;
    m.num_tokens = num_tokens;
    m.block_ids.assign(table.begin(), table.end());
    std::vector<uint8_t> out;
    wire::encode(out, id, m);
    if (out.size() > wire::kMaxFrameBytes) {
        s->expects.erase(t->id);
        fail(SG_ERR_OUT_OF_RANGE, "block table too large for one control message (max about 60000 blocks)");
    }
    send(*s, out);
    wake();
    return t;
}

std::shared_ptr<Transfer> Context::post(const std::shared_ptr<Session> &s, const char *rid,
                                        const std::shared_ptr<KvPool> &pool, std::span<const uint32_t> table,
                                        uint64_t num_tokens, const sg_transfer_options_t &opt,
                                        const select::Profile *profile) {
    check_request_id(rid);
    kv::check_block_table(pool->layout, table, num_tokens);
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
    t->paths = paths;
    t->options.profile = nullptr;  // the handle is the caller's; the transfer holds its own copy
    t->options.layer_order = nullptr;
    std::vector<PreparedLayer> prepared;
    if (t->selective()) {
        const kv::Layout &L = pool->layout;
        const uint32_t nb = uint32_t(kernels::num_blocks(num_tokens, L.tokens_per_block));
        for (auto &layer : t->layers) layer.claimed.assign(nb, 0);
        if (paths & SG_PATH_PROACTIVE) {
            kernel_dtype(L.dtype);  // selection reads fp32, fp16 and bf16 keys
            const select::Profile p = profile ? *profile : default_profile(L.num_layers, L.num_kv_heads, L.tokens_per_block);
            if (p.num_layers != L.num_layers || p.block_tokens != L.tokens_per_block)
                fail(SG_ERR_LAYOUT_MISMATCH, "the profile is for " + std::to_string(p.num_layers) + " layers of " +
                                                 std::to_string(p.block_tokens) + "-token blocks, the pool has " +
                                                 std::to_string(L.num_layers) + " of " +
                                                 std::to_string(L.tokens_per_block));
            t->selector = std::make_unique<LayerSelector>(p, L.num_kv_heads, L.head_dim, num_tokens, 2 * L.row_bytes());
        }
        if (opt.flags & SG_TRANSFER_ALL_LAYERS_WRITTEN)
            for (uint32_t l = 0; l < nl; ++l) prepared.push_back(prepare_layer(*t, l, nullptr, 0, 0));
    }
    std::lock_guard lock(mu);
    if (s->closed) fail(s->error ? s->error : SG_ERR_PEER_LOST, "session is closed");
    if (s->draining) fail(SG_ERR_INVALID_STATE, "session is closing (sg_session_close)");
    if (s->unmatched_posts.count(rid) || s->posts.count(rid))
        fail(SG_ERR_DUPLICATE, std::string("request '") + rid + "' is already posted on this session");
    if (!s->local_regs.count(pool->id))
        fail(SG_ERR_INVALID_STATE, "the source pool was not exported to this session (sg_session_export_kv)");
    if (s->unfinished() >= max_transfers_per_session_)
        fail(SG_ERR_AGAIN, "the session has " + std::to_string(max_transfers_per_session_) +
                               " unfinished transfers (max_transfers_per_session); retry after some finish");
    if (s->repost_needed.erase(rid)) {
        // The decode side remembers that the id was canceled; this post is a new request.
        std::vector<uint8_t> out;
        wire::encode(out, id, wire::Reposted{rid});
        send(*s, out);
    }
    t->order = std::move(order);
    t->src_reg = &s->local_regs.at(pool->id);  // map nodes are stable for the session's life
    if (opt.deadline_ns) t->deadline_abs_ns = saturating_add(now_ns(), opt.deadline_ns);
    if (t->selective()) {
        for (uint32_t l = 0; l < prepared.size(); ++l) commit_layer(*t, l, std::move(prepared[l]));
    } else if (opt.flags & SG_TRANSFER_ALL_LAYERS_WRITTEN) {
        const uint64_t now = now_ns();
        for (auto &L : t->layers) {
            L.written = true;
            L.written_ns = now;
        }
    }
    auto e = s->unmatched_expects.find(rid);
    if (e != s->unmatched_expects.end()) {
        wire::Expect m = std::move(e->second);
        s->unmatched_expects.erase(e);
        match(*s, t, m);
        if (t->status == SG_ERR_LAYOUT_MISMATCH || t->status == SG_ERR_OUT_OF_RANGE) fail(t->status, t->error);
    } else {
        s->unmatched_posts[rid] = t;
    }
    wake();
    return t;
}

void Context::match(Session &s, const std::shared_ptr<Transfer> &t, const wire::Expect &e) {
    t->id = e.decode_xfer_id;
    s.posts[t->request_id] = t;
    t->stats.start_ns = now_ns();
    try {
        auto rp = s.remote_pools.find(e.handle_id);
        if (rp == s.remote_pools.end())
            fail(SG_ERR_PROTOCOL, "the decode side expected into a pool it never exported");
        kv::check_mappable(t->pool->layout, rp->second.layout);
        if (e.num_tokens != t->num_tokens)
            fail(SG_ERR_LAYOUT_MISMATCH, "token counts differ: posted " + std::to_string(t->num_tokens) + ", expected " +
                                             std::to_string(e.num_tokens));
        kv::check_block_table(rp->second.layout, e.block_ids, e.num_tokens);
        t->dst = &rp->second;
        t->dst_table.assign(e.block_ids.begin(), e.block_ids.end());
        start_selective(*t);
        t->matched = true;
        active_.push_back(t);
        active_unsorted_ = true;
    } catch (const Error &err) {
        log.log(SG_LOG_ERROR, "transfer '" + t->request_id + "' cannot start: " + err.message());
        fail_transfer(*t, err.status(), err.message(), true);
    }
}

void Context::layer_written(Transfer &t, uint32_t layer, const float *queries, uint32_t num_queries,
                            uint32_t num_q_heads) {
    if (!t.post_side) fail(SG_ERR_INVALID_STATE, "layer_written is for the prefill (posting) side");
    if (layer >= t.layers.size())
        fail(SG_ERR_OUT_OF_RANGE, "layer " + std::to_string(layer) + " >= num_layers " + std::to_string(t.layers.size()));
    if (t.selective()) {
        check_selection_inputs(t, layer, queries, num_queries, num_q_heads);
        SelectJob job{t.shared_from_this(), layer, {}, num_queries, num_q_heads};
        if (queries && num_queries)
            job.queries.assign(queries, queries + size_t(num_queries) * num_q_heads * t.pool->layout.head_dim);
        std::lock_guard lock(select_mu_);
        if (!select_thread_.joinable()) select_thread_ = std::thread([this] { select_loop(); });
        select_jobs_.push_back(std::move(job));
        select_cv_.notify_one();
        return;
    }
    std::lock_guard lock(mu);
    if (!t.layers[layer].written) {
        t.layers[layer].written = true;
        t.layers[layer].written_ns = now_ns();
        if (t.matched && !t.finished()) pump(t, 16);
    }
    wake();
}

// Compiles the next written layer in send order into t.ops. Returns false when none is ready.
bool Context::start_next_layer(Transfer &t) {
    if (t.order_pos >= t.order.size()) return false;
    const uint32_t layer = t.order[t.order_pos];
    if (!t.layers[layer].written) return false;
    t.order_pos++;
    const uint32_t rpl = t.pool->layout.regions_per_layer();
    const uint8_t *bases[2] = {t.pool->region(layer, 0), t.pool->region(layer, rpl - 1)};
    plan::Side src{&t.pool->layout, t.table};
    plan::Side dst{&t.dst->layout, t.dst_table};
    plan::Limits limits;
    limits.max_op_bytes = std::min(max_op_bytes_, t.session->tp->caps().max_msg_size);
    limits.max_iov = uint32_t(std::min<uint64_t>(plan::kMaxIov, std::max<uint64_t>(1, t.session->tp->caps().rma_iov_limit)));
    const plan::LayerPlanStats ps = plan::compile_layer(src, bases, dst, t.num_tokens, limits, t.ops);
    t.stats.segments += ps.segments;
    t.cur_layer = layer;
    t.next_op = 0;
    const uint64_t mean = t.ops.empty() ? 0 : ps.bytes / t.ops.size();
    Transfer::Layer &L = t.layers[layer];
    L.candidate = staging_threshold_ && t.session->have_peer_staging && mean < staging_threshold_ &&
                  staging_policy_ != SG_STAGING_NEVER;
    L.staged = L.candidate && (staging_policy_ == SG_STAGING_ALWAYS || choose_staging(*t.session));
    L.start_ns = now_ns();
    L.bytes = ps.bytes;
    t.cur_staged = L.staged;
    if (t.ops.empty()) L.posted = true;
    return true;
}

// Per-operation cost differs by provider and machine (tcp: kernel copies dominate, staging adds
// two memcpys; shm: every operation is a round trip, staging wins by far), so the path is chosen by
// the throughput each achieved on this session. Each unmeasured path is tried first, and the slower
// one is retried every 8th candidate layer (every 32nd when it lost by 25% or more) so a change in
// conditions is noticed.
bool Context::choose_staging(Session &s) {
    const uint32_t n = s.candidate_layers++;
    if (s.path_rate[0] == 0 || s.path_rate[1] == 0) {
        // One probe at a time per unmeasured path: when many transfers start at once they must not
        // all go down a path nobody has measured (16 threads on one shm session all went direct,
        // where every operation is a round trip through the peer, and moved 23 MiB/s against 1.4
        // GiB/s staged). The rest take the better guess until the probes report.
        const uint64_t now = now_ns();
        for (int path : {0, 1})
            if (s.path_rate[path] == 0 && now - s.probe_ns[path] > kProbeSpacingNs) {
                s.probe_ns[path] = now;
                return path == 1;
            }
        // A same-host provider with no connection to share pays a round trip per operation, so
        // packing small operations is the better guess there; elsewhere plain writes avoid copies.
        return s.tp->caps().local_only;
    }
    const bool faster = s.path_rate[1] > s.path_rate[0];
    // A close call is questioned every 8th layer. A clear winner is questioned less often the
    // clearer it is, so that re-measuring the loser costs at most ~1/8 of the time saved: at 25%
    // every 32nd layer, and a path 100 times slower (direct writes over shm) every 800th, never
    // rarer than every 4096th.
    const double margin = faster ? s.path_rate[1] / s.path_rate[0] : s.path_rate[0] / s.path_rate[1];
    const uint32_t every = margin < 1.25 ? 8 : uint32_t(std::clamp(8.0 * margin, 32.0, 4096.0));
    return n % every == every - 1 ? !faster : faster;
}

void Context::record_layer_rate(Transfer &t, Transfer::Layer &L) {
    if (!L.candidate || staging_policy_ != SG_STAGING_AUTO) return;
    const uint64_t ns = std::max<uint64_t>(1, now_ns() - L.start_ns);
    const double rate = double(L.bytes) / double(ns);
    double &r = t.session->path_rate[L.staged ? 1 : 0];
    r = r == 0 ? rate : 0.5 * r + 0.5 * rate;
}

// One RMA write of ops[next_op], of the full path's current layer (unit NULL) or of a selective
// send unit; advances next_op when the provider took it.
bool Context::post_write_op(Transfer &t, uint32_t layer, const Vec<plan::Op> &ops, size_t &next_op, SendUnit *unit) {
    if (tx_full(*t.session->tp)) return false;
    const plan::Op &op = ops[next_op];
    Session &s = *t.session;
    const Session::LocalReg &lr = *t.src_reg;
    const uint32_t rpl = t.pool->layout.regions_per_layer();
    transport::LocalIov iov[plan::kMaxIov];
    for (uint32_t i = 0; i < op.niov; ++i)
        iov[i] = {op.iov[i].addr, op.iov[i].len, lr.regions[size_t(layer) * rpl + op.iov[i].src_region].desc};
    const wire::Region &dr = t.dst->regions[size_t(layer) * t.dst->regions_per_layer + op.dst_region];
    OpCookie *c = take_cookie();
    c->kind = OpCookie::Kind::Write;
    c->xfer = &t;
    c->session = &s;
    c->layer = layer;
    c->unit = unit;
    int rc;
    try {
        rc = s.tp->post_write(s.peer, std::span(iov, op.niov), dr.base + op.dst_offset, dr.key, c);
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
    ops_inflight_++;
    c->len = op.len;
    bytes_inflight_ += op.len;
    s.bytes_inflight += op.len;
    t.inflight++;
    if (unit) {
        unit->outstanding++;
        count_unit_bytes(t, *unit, op.len);
    } else {
        t.layers[layer].outstanding++;
    }
    t.stats.rma_ops++;
    t.stats.bytes += op.len;
    counters.rma_ops++;
    counters.bytes_direct += op.len;
    next_op++;
    return true;
}

// Packs as many of the layer's remaining ops as fit into one staging slot and writes them with one
// operation; the chunk notice (segment list) follows in order. unit: the selective send unit the
// ops belong to (NULL: the full path's current layer).
bool Context::post_staged_chunk(Transfer &t, uint32_t layer, const Vec<plan::Op> &ops, size_t &next_op, SendUnit *unit) {
    Session &s = *t.session;
    if (tx_full(*s.tp)) return false;  // before packing: a refused write would waste the copies
    if (!ensure_send_staging(s)) return post_write_op(t, layer, ops, next_op, unit);
    if (!s.free_peer_slots || !s.free_send_slots) return false;
    const uint32_t rslot = uint32_t(__builtin_ctz(s.free_peer_slots));
    const uint32_t lslot = uint32_t(__builtin_ctz(s.free_send_slots));
    uint8_t *pack = s.send_staging.base + lslot * StagingArea::kSlotBytes;
    wire::StagedChunk chunk;
    chunk.decode_xfer_id = t.id;
    chunk.layer = layer;
    chunk.slot = rslot;
    uint64_t used = 0;
    const size_t first = next_op;
    size_t k = first;
    for (; k < ops.size() && chunk.segments.size() < kMaxSegmentsPerChunk; ++k) {
        const plan::Op &op = ops[k];
        if (used + op.len > StagingArea::kSlotBytes) {
            if (k == first) {
                // An op larger than a slot goes as a plain write.
                return post_write_op(t, layer, ops, next_op, unit);
            }
            break;
        }
        for (uint32_t i = 0; i < op.niov; ++i) {
            std::memcpy(pack + used, op.iov[i].addr, op.iov[i].len);
            used += op.iov[i].len;
            t.stats.staging_copies++;
            counters.staging_copies++;
        }
        chunk.segments.push_back({layer * t.dst->regions_per_layer + op.dst_region, op.dst_offset, op.len});
    }
    const wire::Region &peer_area = s.peer_staging.regions[0];
    OpCookie *c = take_cookie();
    c->kind = OpCookie::Kind::StagedWrite;
    c->xfer = &t;
    c->session = &s;
    c->layer = layer;
    c->unit = unit;
    c->staging_slot = lslot;
    transport::LocalIov iov{pack, used, s.send_staging.reg.desc};
    int rc;
    try {
        rc = s.tp->post_write(s.peer, std::span(&iov, 1), peer_area.base + rslot * StagingArea::kSlotBytes,
                              peer_area.key, c);
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
    counters.rma_ops++;
    counters.bytes_staged += used;
    c->len = used;
    bytes_inflight_ += used;
    s.bytes_inflight += used;
    s.free_peer_slots &= ~(1u << rslot);
    s.free_send_slots &= ~(1u << lslot);
    ops_inflight_++;
    t.inflight++;
    if (unit) {
        unit->outstanding++;
        count_unit_bytes(t, *unit, used);
    } else {
        t.layers[layer].outstanding++;
    }
    t.stats.rma_ops++;
    t.stats.bytes += used;
    t.stats.staged_bytes += used;
    next_op = k;
    t.layers[layer].staged_chunks++;
    std::vector<uint8_t> notice;
    wire::encode(notice, id, chunk);
    if (s.tp->caps().send_after_write) {
        send(s, notice, &t);
    } else {
        c->bytes.assign(notice.begin(), notice.end());  // sent when the write completes
    }
    return true;
}

bool Context::may_post_bytes(const Session &s, uint64_t len) const {
    if (bytes_inflight_ == 0) return true;  // an operation larger than the bound still goes alone
    return bytes_inflight_ + len <= max_bytes_ && s.bytes_inflight + len <= max_session_bytes_;
}

// Posts up to `quota` operations of t; returns whether it posted any (so the caller may give the
// transfer another turn).
bool Context::pump(Transfer &t, uint32_t quota) {
    if (!t.matched || t.finished()) return false;
    flush_outbox(*t.session);
    uint32_t posted = 0;
    for (;;) {
        if (t.cur_layer < 0 || t.layers[size_t(t.cur_layer)].posted) {
            if (!start_next_layer(t)) break;
        }
        Transfer::Layer &L = t.layers[size_t(t.cur_layer)];
        while (t.next_op < t.ops.size() && ops_inflight_ < max_ops_ && posted < quota &&
               may_post_bytes(*t.session, t.ops[t.next_op].len)) {
            const uint32_t layer = uint32_t(t.cur_layer);
            if (!(t.cur_staged ? post_staged_chunk(t, layer, t.ops, t.next_op, nullptr)
                               : post_write_op(t, layer, t.ops, t.next_op, nullptr)))
                break;
            posted++;
        }
        if (t.next_op < t.ops.size()) {  // out of resources or of this turn's quota
            const bool stalled = posted < quota && !may_post_bytes(*t.session, t.ops[t.next_op].len);
            if (stalled && !t.stalled) counters.stalls++;
            t.stalled = stalled;
            break;
        }
        t.stalled = false;
        L.posted = true;
        maybe_send_notices(t);
        if (t.finished()) return posted > 0;
    }
    maybe_send_notices(t);
    return posted > 0;
}

size_t Session::unfinished() const {
    size_t n = 0;
    for (auto &[k, t] : expects) n += !t->finished();
    for (auto &[k, t] : posts) n += !t->finished();
    for (auto &[k, t] : unmatched_posts) n += !t->finished();
    return n;
}

// Sends LayerReady for every posted layer whose notice may go now, in send order, and TransferDone
// after the last. With FI_ORDER_SAW the notice may follow the writes at once; otherwise it waits
// until the layer's writes (issued with delivery completion) have completed.
void Context::maybe_send_notices(Transfer &t) {
    if (t.finished() || !t.matched) return;
    const bool saw = t.session->tp->caps().send_after_write;
    // Layers before notice_pos are settled; each call only looks at the few still in flight.
    for (size_t i = t.notice_pos; i < t.order.size(); ++i) {
        const uint32_t l = t.order[i];
        Transfer::Layer &L = t.layers[l];
        if (!L.posted) break;  // notices go in send order
        if (!L.notice_sent && (saw || L.outstanding == 0)) {
            wire::LayerReady m;
            m.decode_xfer_id = t.id;
            m.layer = l;
            m.bytes = t.pool->layout.plane_bytes / t.pool->layout.tokens_per_block * t.num_tokens * 2;
            m.staged_chunks = L.staged_chunks;
            std::vector<uint8_t> out;
            wire::encode(out, id, m);
            send(*t.session, out, &t);
            L.notice_sent = true;
        }
        if (!L.notice_sent) break;
        if (L.outstanding == 0 && !L.ready) {
            record_layer_rate(t, L);
            t.residency.set_layer(l);
            mark_ready(t, l);
        }
        if (i == t.notice_pos && L.ready) t.notice_pos++;
    }
    if (t.notice_pos == t.order.size()) send_done(t);
}

void Context::send_done(Transfer &t) {
    if (t.done_sent) return;
    wire::TransferDone m;
    m.decode_xfer_id = t.id;
    m.bytes = t.stats.bytes;
    std::vector<uint8_t> out;
    wire::encode(out, id, m);
    t.done_sent = true;
    send(*t.session, out, &t);
}

void Context::mark_ready(Transfer &t, uint32_t layer) {
    Transfer::Layer &L = t.layers[layer];
    L.ready = true;
    L.ready_ns = now_ns();
    t.stats.layers_ready++;
    emit(t, SG_EVENT_LAYER_READY, layer, SG_OK);
}

// Decode side: a layer is ready once its notice arrived and every staged chunk it announced has
// been unpacked, in whatever order the provider completed those messages.
void Context::maybe_layer_ready(Transfer &t, uint32_t layer) {
    Transfer::Layer &L = t.layers[layer];
    if (L.ready || !L.notice_received || L.staged_chunks < L.chunks_announced) return;
    t.residency.set_layer(layer);
    mark_ready(t, layer);
    complete_if_done(t);
    signal_event();
    cv.notify_all();
}

void Context::complete_if_done(Transfer &t) {
    if (t.finished()) return;
    if (t.post_side) {
        if (!t.done_sent || t.inflight) return;
        if (t.session->peer_minor >= 1 && !t.done_acked) return;
    } else {
        if (!t.done_received || t.stats.layers_ready < t.layers.size()) return;
        // Digests travel behind the notices: a layer whose proactive notice came is not complete
        // before its digests are (SG_LAYER_ESSENTIAL then holds for every such layer at completion).
        for (const auto &L : t.layers)
            if (L.essential_notice && !L.essential) return;
        if (t.session->peer_minor >= 1) {
            std::vector<uint8_t> out;
            wire::encode(out, id, wire::TransferAck{t.id});
            send(*t.session, out);
        }
    }
    t.status = SG_OK;
    t.stats.end_ns = now_ns();
    counters.transfers_completed++;
    emit(t, SG_EVENT_FINISHED, 0, SG_OK);
    note_quiesced(t);
    signal_event();
    cv.notify_all();
}

void Context::fail_transfer(Transfer &t, sg_status_t status, const std::string &message, bool tell_peer) {
    if (t.finished()) return;
    t.status = status;
    t.error = message;
    counters.transfers_failed++;
    signal_event();
    if (status == SG_ERR_CANCELED) counters.transfers_canceled++;
    if (status == SG_ERR_DEADLINE) counters.deadlines_hit++;
    t.stats.end_ns = now_ns();
    if (t.post_side && !t.matched) {
        Session &s = *t.session;
        auto u = s.unmatched_posts.find(t.request_id);
        if (u != s.unmatched_posts.end() && u->second.get() == &t) s.unmatched_posts.erase(u);
        // The decode side may not have expected yet; its Expect will be answered when it comes.
        if (tell_peer && s.canceled_unmatched.size() < 65536) s.canceled_unmatched[t.request_id] = {status, message};
    }
    if (tell_peer && !t.session->closed) {
        wire::TransferError m;
        m.request_id = t.request_id;
        m.decode_xfer_id = t.id;
        m.status = status;
        m.message = message;
        m.from_post_side = t.post_side ? 1 : 0;
        std::vector<uint8_t> out;
        wire::encode(out, id, m, status == SG_ERR_CANCELED ? wire::MsgType::Cancel : wire::MsgType::Error);
        send(*t.session, out);
    }
    maybe_send_quiesced(t);
    emit(t, SG_EVENT_FINISHED, 0, status);
    note_quiesced(t);
    cv.notify_all();
}

void Context::send_quiesced(Session &s, uint64_t decode_xfer_id) {
    std::vector<uint8_t> out;
    wire::encode(out, id, wire::Quiesced{decode_xfer_id});
    send(s, out);
}

// Prefill: after a transfer that answered an Expect failed, tell the decode side once its last
// write completed.
void Context::maybe_send_quiesced(Transfer &t) {
    if (!t.post_side || !t.id || !t.finished() || (t.status == SG_OK && !t.peer_released) || t.inflight ||
        t.quiesce_sent)
        return;
    t.quiesce_sent = true;
    send_quiesced(*t.session, t.id);
}

bool Transfer::is_quiesced() const {
    if (!finished()) return false;
    if (post_side) return inflight == 0;
    // A lost session's registrations are closed (drop_registrations), so nothing can land.
    return quiesced || session->closed;
}

void Context::wait_quiesced(Transfer &t, uint64_t timeout_ns) {
    const uint64_t deadline = now_ns() + std::min<uint64_t>(timeout_ns, uint64_t(1) << 62);
    std::unique_lock lock(mu);
    while (!t.is_quiesced()) {
        const uint64_t now = now_ns();
        if (now >= deadline)
            fail(SG_ERR_TIMEOUT, t.finished() ? "the peer has not confirmed that its writes stopped"
                                              : "the transfer is still in progress");
        wait_step(lock, deadline);
    }
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

sg_status_t Context::wait(Transfer &t, int64_t layer, uint64_t timeout_ns) {
    const uint64_t deadline = now_ns() + std::min<uint64_t>(timeout_ns, uint64_t(1) << 62);
    std::unique_lock lock(mu);
    auto done = [&] {
        if (t.finished()) return true;
        return layer >= 0 && t.layers[size_t(layer)].ready;
    };
    while (!done()) {
        const uint64_t now = now_ns();
        if (now >= deadline) return SG_IN_PROGRESS;
        if (progress_.joinable()) {
            cv.wait_for(lock, std::chrono::nanoseconds(std::min<uint64_t>(deadline - now, 50000000)));
        } else {
            if (!poll_locked()) {
                lock.unlock();
                ::usleep(20);
                lock.lock();
            }
            schedule_locked();
        }
    }
    if (layer >= 0 && t.layers[size_t(layer)].ready) return SG_OK;
    return t.status;
}

void Context::cancel(Transfer &t, sg_status_t why, const std::string &message) {
    std::lock_guard lock(mu);
    if (t.finished()) return;
    t.canceled_locally = true;
    fail_transfer(t, why, message, true);
}

void Context::release(Transfer &t) {
    std::unique_lock lock(mu);
    if (!t.finished()) {
        if (!t.post_side && t.selective())
            end_by_release(t);
        else
            fail_transfer(t, SG_ERR_CANCELED, "released before completion", true);
    }
    // Quiesce: no operation of ours may still reference the transfer, and on the decode side the
    // peer must have confirmed that its writes stopped. A silent peer is lost after
    // peer_timeout_ms anyway; one that keeps talking but never confirms is treated as broken.
    const uint64_t deadline = now_ns() + std::max<uint64_t>(5000000000ull, 2 * peer_timeout_ns_ + 1000000000ull);
    while (!t.is_quiesced() && now_ns() < deadline) wait_step(lock, deadline);
    if (!t.post_side && !t.is_quiesced())
        lose_session(*t.session, SG_ERR_PROTOCOL,
                     "the peer did not confirm that its writes for '" + t.request_id + "' stopped");
    Session &s = *t.session;
    if (t.inflight) {
        // Completions still name this transfer: keep it alive until the context goes away rather
        // than let a late completion touch freed memory.
        log.log(SG_LOG_ERROR, "transfer '" + t.request_id + "' released with " + std::to_string(t.inflight) +
                                  " operation(s) still in flight after 5 s; kept until the context is destroyed");
        for (auto &p : active_)
            if (p.get() == &t) lingering_.push_back(p);
        if (t.post_side) {
            if (auto p = s.posts.find(t.request_id); p != s.posts.end() && p->second.get() == &t) lingering_.push_back(p->second);
        } else if (auto e = s.expects.find(t.id); e != s.expects.end()) {
            lingering_.push_back(e->second);
        }
    }
    if (t.post_side) {
        auto p = s.posts.find(t.request_id);
        if (p != s.posts.end() && p->second.get() == &t) s.posts.erase(p);
        auto u = s.unmatched_posts.find(t.request_id);
        if (u != s.unmatched_posts.end() && u->second.get() == &t) s.unmatched_posts.erase(u);
    } else {
        s.expects.erase(t.id);
    }
    active_.erase(std::remove_if(active_.begin(), active_.end(), [&](const auto &p) { return p.get() == &t; }),
                  active_.end());
}

}  // namespace sg::core
