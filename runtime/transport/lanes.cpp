// Striping: one Transport over several endpoints ("lanes"), each with its own connection to a peer.
// On loopback tcp one stream is bound by the one thread that copies its bytes; the same bytes over
// two or four connections, each driven by its own thread, move 1.6-1.8x more on two cores
// (measured: tools/bench xfer's striped baseline, docs/benchmarks.md). On a host with several NICs
// each lane binds to one of them (rails).
//
// What the runtime above sees is one transport:
// - Lane 0 is driven by the caller (the runtime's progress thread) exactly as a plain endpoint is:
//   control messages and small writes (OpenOptions::lane_small_write_bytes) are posted on it in
//   the call. Every other lane
//   has a thread of its own that posts and progresses its operations; a write handed to one is
//   queued and that thread woken.
// - A large write goes to the live lane with the fewest bytes outstanding to that peer, so a faster
//   lane (rail) takes a larger share by itself.
// - Notices go on lane 0 after writes that may be on another lane, which no provider orders: writes
//   on lanes > 0 ask for delivery completion and this transport reports no send-after-write
//   ordering, so the runtime sends a layer's notice only once its writes have completed (lane 0's
//   own writes are ordered before its notices by the provider, as on a plain endpoint).
// - A write that fails on lane k > 0 marks lane k failed for that peer and waits until the peer
//   shows it is alive on another lane (a completion there since), then is posted again on a live
//   lane: the same bytes to the same place, so the transfer stays byte-exact, and the runtime sees
//   one completion. This assumes a connection-class error (reset, EIO, ...) means the first copy
//   will not land later: true of a TCP connection once reset, which is what fails a lane here.
//   Other errors fail the write as on a plain endpoint. Lane 0's failure is the session's.
//
// Locks: lane.mu serialises calls into one lane's endpoint (FI_THREAD_DOMAIN); peers_mu_, events_mu_
// and each lane's queue_mu are leaves. The runtime's calls arrive one at a time (transport.hpp) and
// take at most one lane.mu at a time; lane threads take only their own.
#include "transport/transport.hpp"

#include <poll.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <deque>
#include <mutex>
#include <thread>
#include <unordered_map>

namespace sg::transport {

namespace {


// A registration on every lane; the runtime holds a pointer to it as its Registration's mr (and
// desc, when the provider needs local descriptors).
struct LaneRegistrations {
    std::vector<Registration> per_lane;
};

class StripedTransport final : public Transport {
  public:
    StripedTransport(const OpenOptions &opt, std::unique_ptr<Transport> (*open_one)(const OpenOptions &))
        : threads_(opt.lane_threads), small_write_bytes_(opt.lane_small_write_bytes) {
        const uint32_t n = std::max<uint32_t>({opt.lanes, uint32_t(opt.rail_addrs.size()), 1});
        if (n > kMaxLanes) fail(SG_ERR_INVALID_ARGUMENT, "at most " + std::to_string(kMaxLanes) + " lanes");
        for (uint32_t i = 0; i < n; ++i) {
            OpenOptions one = opt;
            one.lanes = 1;
            one.rail_addrs.clear();
            // Lane 0 carries the notices, so the provider's own send-after-write ordering covers
            // its writes; writes on other lanes must be at the target before they complete.
            one.delivery_complete = i > 0;
            // Messages travel on lane 0 only; the others keep a couple of receive buffers, not 32.
            if (i > 0) one.recv_buffers = 2;
            if (!opt.rail_addrs.empty()) one.local_addr = opt.rail_addrs[i % opt.rail_addrs.size()];
            auto lane = std::make_unique<Lane>();
            lane->t = open_one(one);
            lanes_.push_back(std::move(lane));
        }
        caps_ = lanes_[0]->t->caps();
        if (caps_.provider_keys && n > 1)
            fail(SG_ERR_INVALID_ARGUMENT, "provider " + caps_.provider +
                                              " chooses its own memory keys, which differ per endpoint: "
                                              "striping over lanes needs application-chosen keys");
        caps_.send_after_write = false;
        caps_.lanes = n;
        caps_.bulk_apart = n > 1;
        event_fd_ = ::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
        if (event_fd_ < 0) fail(SG_ERR_INTERNAL, std::string("eventfd: ") + std::strerror(errno));
        // The caller's wait descriptor: our events, and lane 0's endpoint, which poll() drives.
        wait_epoll_ = ::epoll_create1(EPOLL_CLOEXEC);
        if (wait_epoll_ < 0) fail(SG_ERR_INTERNAL, std::string("epoll_create1: ") + std::strerror(errno));
        epoll_event ev{};
        ev.events = EPOLLIN;
        ::epoll_ctl(wait_epoll_, EPOLL_CTL_ADD, event_fd_, &ev);
        if (lanes_[0]->t->wait_fd() >= 0) ::epoll_ctl(wait_epoll_, EPOLL_CTL_ADD, lanes_[0]->t->wait_fd(), &ev);
        for (size_t i = 0; i < lanes_.size(); ++i) lanes_[i]->inline_driven = !threads_ || i == 0;
        if (threads_) {
            for (size_t i = 1; i < lanes_.size(); ++i) {
                lanes_[i]->kick_fd = ::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
                if (lanes_[i]->kick_fd < 0) fail(SG_ERR_INTERNAL, std::string("eventfd: ") + std::strerror(errno));
            }
            try {
                for (size_t i = 1; i < lanes_.size(); ++i) lanes_[i]->thread = std::thread([this, i] { lane_loop(i); });
            } catch (...) {
                stop_threads();
                throw;
            }
        }
    }

    ~StripedTransport() override {
        stop_threads();
        for (auto &lane : lanes_)
            if (lane->kick_fd >= 0) ::close(lane->kick_fd);
        if (event_fd_ >= 0) ::close(event_fd_);
        if (wait_epoll_ >= 0) ::close(wait_epoll_);
    }

    void stop_threads() noexcept {
        stop_.store(true);
        for (auto &lane : lanes_) {
            kick(*lane);
            if (lane->thread.joinable()) lane->thread.join();
        }
    }

    const Capabilities &caps() const override { return caps_; }

    std::vector<uint8_t> local_address() const override { return lanes_[0]->t->local_address(); }

    std::vector<std::vector<uint8_t>> lane_addresses() const override {
        std::vector<std::vector<uint8_t>> out;
        for (auto &lane : lanes_) out.push_back(lane->t->local_address());
        return out;
    }

    PeerAddr insert_peer(std::span<const uint8_t> address) override {
        std::vector<std::vector<uint8_t>> one{std::vector<uint8_t>(address.begin(), address.end())};
        return insert_peer_lanes(one);
    }

    // Lane i talks to the peer's lane i; lanes beyond the shorter side's count stay unused for it.
    PeerAddr insert_peer_lanes(std::span<const std::vector<uint8_t>> addresses) override {
        if (addresses.empty()) fail(SG_ERR_PROTOCOL, "the peer named no endpoint");
        const size_t n = std::min(addresses.size(), lanes_.size());
        auto peer = std::make_unique<Peer>();
        for (size_t i = 0; i < n; ++i) {
            std::lock_guard lock(lanes_[i]->mu);
            try {
                peer->addr.push_back(lanes_[i]->t->insert_peer(addresses[i]));
            } catch (...) {
                for (size_t k = 0; k < peer->addr.size(); ++k) {
                    std::lock_guard undo(lanes_[k]->mu);
                    lanes_[k]->t->remove_peer(peer->addr[k]);
                }
                throw;
            }
        }
        peer->failed.assign(n, false);
        peer->outstanding.assign(n, 0);
        peer->last_ok_ns.assign(n, 0);
        std::lock_guard lock(peers_mu_);
        peers_.push_back(std::move(peer));
        return PeerAddr(peers_.size() - 1);
    }

    void remove_peer(PeerAddr id) override {
        Peer *p = peer(id);
        for (size_t i = 0; i < p->addr.size(); ++i) {
            std::lock_guard lock(lanes_[i]->mu);
            // Operations still queued for this peer complete as canceled: their cookies come back.
            for (Op &op : take_pending(*lanes_[i], id)) fail_op(std::move(op), -ECANCELED, "the peer was removed");
            lanes_[i]->t->remove_peer(p->addr[i]);
        }
        std::lock_guard lock(peers_mu_);
        p->removed = true;
    }

    Registration register_memory(void *addr, uint64_t len, uint64_t requested_key) override {
        return register_on_every_lane([&](Transport &t) { return t.register_memory(addr, len, requested_key); }, false);
    }

    Registration register_device_memory(void *addr, uint64_t len, uint64_t requested_key, int32_t cuda_device) override {
        return register_on_every_lane(
            [&](Transport &t) { return t.register_device_memory(addr, len, requested_key, cuda_device); }, true);
    }

    template <class RegisterOne>
    Registration register_on_every_lane(RegisterOne register_one, bool device) {
        auto regs = std::make_unique<LaneRegistrations>();
        try {
            for (auto &lane : lanes_) {
                std::lock_guard lock(lane->mu);
                regs->per_lane.push_back(register_one(*lane->t));
                if (regs->per_lane.back().key != regs->per_lane[0].key)
                    fail(SG_ERR_TRANSPORT, "lanes registered one buffer under different keys");
            }
        } catch (...) {
            release(*regs);
            throw;
        }
        Registration r;
        r.key = regs->per_lane[0].key;
        r.remote_base = regs->per_lane[0].remote_base;
        // Device buffers always pass their descriptor (FI_MR_HMEM), host ones under FI_MR_LOCAL.
        r.desc = caps_.needs_local_desc || (device && regs->per_lane[0].desc) ? regs.get() : nullptr;
        r.mr = regs.release();
        return r;
    }

    void deregister(Registration &reg) noexcept override {
        if (auto *regs = static_cast<LaneRegistrations *>(reg.mr)) {
            release(*regs);
            delete regs;
        }
        reg = Registration{};
    }

    uint64_t live_registrations() const override {
        std::lock_guard lock(lanes_[0]->mu);
        return lanes_[0]->t->live_registrations();
    }

    int post_write(PeerAddr id, std::span<const LocalIov> local, uint64_t remote_addr, uint64_t key,
                   void *cookie) override {
        return post_write_as(WriteClass::Default, id, local, remote_addr, key, cookie);
    }

    // Urgent writes go on lane 0 with the messages, whatever their size; bulk goes on the other lanes
    // (lane 0 only when every other lane to the peer has failed), so a fetch's reply and the notices
    // that follow it never wait in lane 0's socket buffer behind bulk bytes.
    int post_write_as(WriteClass cls, PeerAddr id, std::span<const LocalIov> local, uint64_t remote_addr,
                      uint64_t key, void *cookie) override {
        Peer *p = peer(id);
        Op op;
        op.peer = id;
        op.local.assign(local.begin(), local.end());
        op.remote_addr = remote_addr;
        op.key = key;
        op.cookie = cookie;
        for (const LocalIov &v : local) op.bytes += v.len;
        // Small writes stay on lane 0, posted in this call like a plain endpoint's: striping them buys
        // nothing and a handover to another lane's thread costs more than the write.
        const bool on_lane0 = cls == WriteClass::Urgent || (cls == WriteClass::Default && op.bytes < small_write_bytes_);
        const int lane = on_lane0 ? 0 : pick_lane(*p, op.bytes, cls == WriteClass::Bulk ? 1 : 0);
        if (on_lane0) add_outstanding(*p, 0, op.bytes);
        if (lane < 0) fail(SG_ERR_TRANSPORT, "every lane to this peer has failed");
        enqueue(size_t(lane), std::move(op));
        post_now_if_inline(size_t(lane));
        return 0;
    }

    int post_send(PeerAddr id, const void *buf, uint64_t len, void *desc, void *cookie) override {
        Peer *p = peer(id);
        Op op;
        op.peer = id;
        op.send = true;
        op.message.assign(static_cast<const uint8_t *>(buf), static_cast<const uint8_t *>(buf) + len);
        op.message_desc = desc;
        op.cookie = cookie;
        (void)p;
        enqueue(0, std::move(op));
        post_now_if_inline(0);
        return 0;
    }

    size_t poll(CompletionSink &sink) override {
        for (size_t i = 0; i < lanes_.size(); ++i)
            if (lanes_[i]->inline_driven) drive_lane(i);
        resolve_held();
        uint64_t drained;
        (void)!::read(event_fd_, &drained, sizeof drained);
        std::deque<Event> batch;
        {
            std::lock_guard lock(events_mu_);
            batch.swap(events_);
        }
        size_t n = 0;
        for (Event &e : batch) {
            ++n;
            if (e.is_message)
                sink.on_message(e.message);
            else
                sink.on_complete(e.cookie, e.status, e.text.empty() ? nullptr : e.text.c_str());
        }
        return n;
    }

    int wait_fd() const override { return wait_epoll_; }

    bool prepare_wait() override {
        if (!threads_) return false;  // poll() drives the lanes: callers must keep calling it
        {
            std::lock_guard lock(peers_mu_);
            if (!held_.empty()) return false;  // poll() decides their fate on a clock
        }
        {
            std::lock_guard lock(events_mu_);
            if (!events_.empty()) return false;
        }
        Lane &first = *lanes_[0];
        if (has_pending(first)) return false;
        std::lock_guard lock(first.mu);
        return first.t->prepare_wait();
    }

    // Writes to a lost peer are canceled; messages still go (a Bye's answer, say), for a while.
    void peer_lost(PeerAddr id) override { kill_peer(id, -ECANCELED, "the session with the peer is lost"); }

    LaneStats lane_stats() const override {
        LaneStats s;
        s.lanes = uint32_t(lanes_.size());
        s.failovers = failovers_.load();
        s.lanes_lost = lanes_lost_.load();
        for (auto &lane : lanes_) s.bytes_per_lane.push_back(lane->bytes_completed.load());
        return s;
    }

  private:
    static constexpr uint32_t kMaxLanes = 16;
    // How long a write that failed on one lane waits for the peer to show it is alive elsewhere
    // before it moves anyway. A dead peer fails lane 0 (or the whole session) well within it.
    static constexpr uint64_t kFailoverWaitNs = 200000000;
    // How long messages to a peer given up still try to leave (a Bye's answer behind a full queue).
    static constexpr uint64_t kDeadSendGraceNs = 1000000000;

    struct Op {
        PeerAddr peer = 0;
        bool send = false;
        std::vector<LocalIov> local;  // as the runtime gave them; translated per lane when posted
        uint64_t remote_addr = 0, key = 0, bytes = 0;
        std::vector<uint8_t> message;
        void *message_desc = nullptr;
        void *cookie = nullptr;
        uint32_t lane = 0;
    };

    struct Peer {
        std::vector<PeerAddr> addr;  // per lane, in that lane's address vector
        std::vector<bool> failed;
        std::vector<uint64_t> outstanding;  // bytes posted and not completed, per lane
        std::vector<uint64_t> last_ok_ns;   // when a lane last completed something for this peer
        bool removed = false;
        bool dead = false;  // lane 0 failed, or the runtime gave the peer up: no write moves to it now
        uint64_t dead_ns = 0;
    };

    // A write that failed on a lane > 0, waiting to learn whether only that lane broke (then it
    // moves) or the peer died (then its error goes up as it is).
    struct Held {
        Op op;
        int status = 0;
        std::string text;
        uint64_t since_ns = 0;
    };

    struct Lane {
        std::unique_ptr<Transport> t;
        mutable std::mutex mu;        // one thread in t at a time
        std::mutex queue_mu;          // pending (a leaf)
        std::deque<Op> pending;       // queued by post_*, posted by the lane's thread
        std::unordered_map<void *, Op> in_flight;  // by cookie; touched under mu
        std::thread thread;
        bool inline_driven = false;  // driven by poll() on the caller's thread (lane 0, or all without threads)
        std::atomic<bool> queue_full{false};  // the endpoint refused its queue's head (EAGAIN)
        int kick_fd = -1;
        std::atomic<bool> sleeping{false};
        std::atomic<uint64_t> bytes_completed{0};
    };

    struct Event {
        bool is_message = false;
        std::vector<uint8_t> message;
        void *cookie = nullptr;
        int status = 0;
        std::string text;
    };

    // Collects one lane's completions while its mu is held; failed writes on a lane > 0 become retries.
    class LaneSink final : public CompletionSink {
      public:
        LaneSink(StripedTransport &owner, size_t lane) : owner_(owner), lane_(lane) {}
        void on_complete(void *cookie, int status, const char *error_text) override {
            owner_.lane_completed(lane_, cookie, status, error_text);
        }
        void on_message(std::span<const uint8_t> bytes) override {
            Event e;
            e.is_message = true;
            e.message.assign(bytes.begin(), bytes.end());
            owner_.push_event(std::move(e));
        }

      private:
        StripedTransport &owner_;
        size_t lane_;
    };

    Peer *peer(PeerAddr id) {
        std::lock_guard lock(peers_mu_);
        if (id >= peers_.size() || peers_[id]->removed) fail(SG_ERR_INTERNAL, "striped transport: unknown peer");
        return peers_[id].get();
    }

    void add_outstanding(Peer &p, size_t lane, uint64_t bytes) {
        std::lock_guard lock(peers_mu_);
        p.outstanding[lane] += bytes;
    }

    // The live lane from `first` on with the fewest bytes outstanding to this peer, else any live lane
    // (lane 0 included); -1 when none is left.
    int pick_lane(Peer &p, uint64_t bytes, size_t first = 0) {
        std::lock_guard lock(peers_mu_);
        int best = -1;
        for (size_t from = std::min(first, p.addr.size());; from = 0) {
            for (size_t i = from; i < p.addr.size(); ++i)
                if (!p.failed[i] && (best < 0 || p.outstanding[i] < p.outstanding[size_t(best)])) best = int(i);
            if (best >= 0 || from == 0) break;
        }
        if (best >= 0) p.outstanding[size_t(best)] += bytes;
        return best;
    }

    void enqueue(size_t lane_index, Op op) {
        Lane &lane = *lanes_[lane_index];
        op.lane = uint32_t(lane_index);
        {
            std::lock_guard lock(lane.queue_mu);
            lane.pending.push_back(std::move(op));
        }
        kick(lane);
    }

    void kick(Lane &lane) {
        if (lane.kick_fd < 0 || !lane.sleeping.load()) return;
        const uint64_t one = 1;
        (void)!::write(lane.kick_fd, &one, sizeof one);
    }

    void wake_caller() {
        const uint64_t one = 1;
        (void)!::write(event_fd_, &one, sizeof one);
    }

    void push_event(Event e) {
        bool was_empty;
        {
            std::lock_guard lock(events_mu_);
            was_empty = events_.empty();
            events_.push_back(std::move(e));
        }
        if (was_empty) {
            const uint64_t one = 1;
            (void)!::write(event_fd_, &one, sizeof one);
        }
    }

    void release(LaneRegistrations &regs) noexcept {
        for (size_t i = 0; i < regs.per_lane.size(); ++i) {
            std::lock_guard lock(lanes_[i]->mu);
            lanes_[i]->t->deregister(regs.per_lane[i]);
        }
        regs.per_lane.clear();
    }

    // With lane.mu held: posts what is queued, in order, until the endpoint's queue is full.
    void post_pending(size_t lane_index) {
        Lane &lane = *lanes_[lane_index];
        for (;;) {
            Op op;
            {
                std::lock_guard q(lane.queue_mu);
                if (lane.pending.empty()) return;
                op = std::move(lane.pending.front());
                lane.pending.pop_front();
            }
            Peer *p = nullptr;
            {
                std::lock_guard lock(peers_mu_);
                p = op.peer < peers_.size() && !peers_[op.peer]->removed ? peers_[op.peer].get() : nullptr;
            }
            if (!p) continue;  // removed while queued
            bool dead, give_up_sends;
            {
                std::lock_guard lock(peers_mu_);
                dead = p->dead;
                give_up_sends = dead && now_ns() - p->dead_ns > kDeadSendGraceNs;
            }
            if (dead && (!op.send || give_up_sends)) {
                fail_op(std::move(op), -ECANCELED, "the peer is gone");
                continue;
            }
            int rc;
            try {
                if (op.send) {
                    rc = lane.t->post_send(p->addr[lane_index], op.message.data(), op.message.size(), op.message_desc,
                                           op.cookie);
                } else {
                    LocalIov iov[8];
                    if (op.local.size() > 8) fail(SG_ERR_INTERNAL, "striped transport: more than 8 local iovs in one write");
                    const size_t n = op.local.size();
                    for (size_t i = 0; i < n; ++i) {
                        iov[i] = op.local[i];
                        if (iov[i].desc) iov[i].desc = static_cast<LaneRegistrations *>(iov[i].desc)->per_lane[lane_index].desc;
                    }
                    rc = lane.t->post_write(p->addr[lane_index], std::span<const LocalIov>(iov, n), op.remote_addr, op.key,
                                            op.cookie);
                }
            } catch (const Error &e) {
                // A post the endpoint refuses outright is the operation's failure, reported (or
                // retried elsewhere) like a failed completion.
                void *cookie = op.cookie;
                lane.in_flight.emplace(cookie, std::move(op));
                lane_completed(lane_index, cookie, -EIO, e.message().c_str());
                continue;
            }
            if (rc == -EAGAIN) {
                std::lock_guard q(lane.queue_mu);
                lane.pending.push_front(std::move(op));
                lane.queue_full = true;  // only a completion frees it: the lane's thread may sleep
                return;
            }
            lane.queue_full = false;
            lane.in_flight.emplace(op.cookie, std::move(op));
        }
    }

    // With lane.mu held (from the lane's poll or a post's failure).
    void lane_completed(size_t lane_index, void *cookie, int status, const char *error_text) {
        Lane &lane = *lanes_[lane_index];
        auto it = lane.in_flight.find(cookie);
        if (it == lane.in_flight.end()) {
            // Not ours to track (the lane's own receive errors): pass it on as it is.
            Event e;
            e.cookie = cookie;
            e.status = status;
            e.text = error_text ? error_text : "";
            push_event(std::move(e));
            return;
        }
        Op op = std::move(it->second);
        lane.in_flight.erase(it);
        if (!op.send) {
            std::lock_guard lock(peers_mu_);
            if (op.peer < peers_.size()) {
                auto &out = peers_[op.peer]->outstanding[lane_index];
                out -= std::min(out, op.bytes);
            }
        }
        if (status == 0) {
            if (!op.send) lane.bytes_completed.fetch_add(op.bytes, std::memory_order_relaxed);
            {
                std::lock_guard lock(peers_mu_);
                if (op.peer < peers_.size()) peers_[op.peer]->last_ok_ns[lane_index] = now_ns();
            }
            Event e;
            e.cookie = cookie;
            push_event(std::move(e));
            return;
        }
        const std::string text = error_text ? error_text : "";
        if (!is_connection_error(status)) {
            // This operation's own failure (a protection error, say): the transfer's, not the lane's.
            fail_op(std::move(op), status, text);
            return;
        }
        if (op.send || lane_index == 0) {
            // Lane 0 carries the session's messages: its failure is the session's.
            const PeerAddr id = op.peer;
            fail_op(std::move(op), status, text);
            kill_peer(id, status, text);
            return;
        }
        {
            std::lock_guard lock(peers_mu_);
            Peer *p = op.peer < peers_.size() ? peers_[op.peer].get() : nullptr;
            if (p && !p->removed && !p->dead) {
                if (!p->failed[lane_index]) {
                    p->failed[lane_index] = true;
                    lanes_lost_.fetch_add(1);
                }
                const bool another = std::any_of(p->failed.begin(), p->failed.end(), [](bool f) { return !f; });
                if (another) {
                    held_.push_back({std::move(op), status, text, now_ns()});
                    wake_caller();  // poll() decides its fate
                    return;
                }
            }
        }
        fail_op(std::move(op), status, text);
    }

    void fail_op(Op op, int status, const std::string &text) {
        Event e;
        e.cookie = op.cookie;
        e.status = status;
        e.text = text;
        push_event(std::move(e));
    }

    // Nothing more moves to this peer: held writes fail with their own errors and queued ones with
    // `status`. Takes peers_mu_ and the lanes' queue locks (leaves), never a lane's mu.
    void kill_peer(PeerAddr id, int status, const std::string &text) {
        std::vector<Held> held;
        {
            std::lock_guard lock(peers_mu_);
            if (id >= peers_.size() || peers_[id]->dead) return;
            peers_[id]->dead = true;
            peers_[id]->dead_ns = now_ns();
            for (auto it = held_.begin(); it != held_.end();) {
                if (it->op.peer == id) {
                    held.push_back(std::move(*it));
                    it = held_.erase(it);
                } else {
                    ++it;
                }
            }
        }
        for (Held &h : held) fail_op(std::move(h.op), h.status, h.text);
        for (auto &lane : lanes_)
            for (Op &op : take_pending(*lane, id, /*writes_only=*/true))
                fail_op(std::move(op), status ? status : -ECANCELED, text);
    }

    // Takes a peer's queued operations (or only its writes) out of a lane's queue.
    std::deque<Op> take_pending(Lane &lane, PeerAddr id, bool writes_only = false) {
        std::deque<Op> taken;
        std::lock_guard q(lane.queue_mu);
        for (auto it = lane.pending.begin(); it != lane.pending.end();) {
            if (it->peer == id && !(writes_only && it->send)) {
                taken.push_back(std::move(*it));
                it = lane.pending.erase(it);
            } else {
                ++it;
            }
        }
        return taken;
    }

    // Moves a held write once the peer shows it is alive on another lane (a completion there since
    // the failure), or after kFailoverWaitNs without lane 0 failing; fails it if the peer died.
    void resolve_held() {
        std::vector<std::pair<Op, int>> moves;
        std::vector<Held> failures;
        {
            std::lock_guard lock(peers_mu_);
            if (held_.empty()) return;
            const uint64_t now = now_ns();
            for (auto it = held_.begin(); it != held_.end();) {
                Peer &p = *peers_[it->op.peer];
                if (p.dead || p.removed) {
                    failures.push_back(std::move(*it));
                    it = held_.erase(it);
                    continue;
                }
                bool alive_elsewhere = now - it->since_ns >= kFailoverWaitNs;
                for (size_t i = 0; i < p.addr.size() && !alive_elsewhere; ++i)
                    alive_elsewhere = !p.failed[i] && p.last_ok_ns[i] > it->since_ns;
                if (!alive_elsewhere) {
                    ++it;
                    continue;
                }
                int best = -1;
                for (size_t i = 0; i < p.addr.size(); ++i)
                    if (!p.failed[i] && (best < 0 || p.outstanding[i] < p.outstanding[size_t(best)])) best = int(i);
                if (best < 0) {
                    failures.push_back(std::move(*it));
                } else {
                    p.outstanding[size_t(best)] += it->op.bytes;
                    moves.emplace_back(std::move(it->op), best);
                }
                it = held_.erase(it);
            }
        }
        for (Held &h : failures) fail_op(std::move(h.op), h.status, h.text);
        for (auto &[op, lane] : moves) {
            failovers_.fetch_add(1);
            enqueue(size_t(lane), std::move(op));
            post_now_if_inline(size_t(lane));
        }
    }

    // One round of a lane's work: post what is queued, reap what completed. Returns events handled.
    size_t drive_lane(size_t lane_index) {
        Lane &lane = *lanes_[lane_index];
        std::lock_guard lock(lane.mu);
        post_pending(lane_index);
        LaneSink sink(*this, lane_index);
        const size_t n = lane.t->poll(sink);
        if (n) post_pending(lane_index);  // completions free queue entries
        return n;
    }

    // A lane the caller drives gets the post in the call, as a plain endpoint would.
    void post_now_if_inline(size_t lane_index) {
        if (!lanes_[lane_index]->inline_driven) return;
        std::lock_guard lock(lanes_[lane_index]->mu);
        post_pending(lane_index);
    }

    bool has_pending(Lane &lane) {
        std::lock_guard q(lane.queue_mu);
        return !lane.pending.empty();
    }

    // A lane's thread: drive the lane; when idle, sleep on its endpoint's wait object and the kick
    // descriptor. Within 20 ms of work it naps 50 us at most (shm-like providers do not signal
    // their wait object when a peer writes), later it blocks until woken.
    void lane_loop(size_t lane_index) {
        Lane &lane = *lanes_[lane_index];
        // Nothing has happened yet: sleep until a post wakes us rather than polling the endpoint for
        // the busy window. A host that forks right after creating a context (the recovery tests
        // do) then finds no lane thread inside libfabric holding a lock the child would inherit.
        uint64_t last_work = 0;
        while (!stop_.load(std::memory_order_acquire)) {
            size_t n = drive_lane(lane_index);
            const uint64_t now = now_ns();
            if (n) {
                last_work = now;
                continue;
            }
            bool can_block;
            {
                std::lock_guard lock(lane.mu);
                can_block = lane.t->prepare_wait();
            }
            lane.sleeping.store(true);  // then look at the queue: enqueue pushes, then reads this
            if ((has_pending(lane) && !lane.queue_full) || stop_.load()) {
                lane.sleeping.store(false);
                continue;
            }
            pollfd fds[2] = {{lane.kick_fd, POLLIN, 0}, {lane.t->wait_fd(), POLLIN, 0}};
            const int nfds = fds[1].fd >= 0 ? 2 : 1;
            timespec nap{};
            // A refused post waits for progress the wait object need not signal (rxm's own queues):
            // nap briefly rather than spin on the endpoint, or sleep until a completion.
            if (now - last_work < 20000000 || lane.queue_full)
                nap.tv_nsec = 50000;
            else if (can_block)
                nap.tv_sec = 1;
            else
                nap.tv_nsec = 1000000;
            (void)::ppoll(fds, nfds_t(nfds), &nap, nullptr);
            lane.sleeping.store(false);
            uint64_t v;
            (void)!::read(lane.kick_fd, &v, sizeof v);
        }
    }

    const bool threads_;
    const uint64_t small_write_bytes_;
    std::vector<std::unique_ptr<Lane>> lanes_;
    Capabilities caps_;
    std::mutex peers_mu_;  // a leaf
    std::vector<std::unique_ptr<Peer>> peers_;
    std::vector<Held> held_;  // under peers_mu_
    std::mutex events_mu_;  // a leaf
    std::deque<Event> events_;
    int event_fd_ = -1;
    int wait_epoll_ = -1;
    std::atomic<bool> stop_{false};
    std::atomic<uint64_t> failovers_{0}, lanes_lost_{0};
};

}  // namespace

std::unique_ptr<Transport> open_striped(const OpenOptions &options,
                                        std::unique_ptr<Transport> (*open_one)(const OpenOptions &)) {
    return std::make_unique<StripedTransport>(options, open_one);
}

}  // namespace sg::transport
