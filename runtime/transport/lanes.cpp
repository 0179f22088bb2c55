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
// - A lane given up for a peer (an error of ours, or the peer's notice) is fenced here: its
//   connection to that peer closes (Transport::fence on that lane's endpoint), so nothing the peer
//   sent on it lands from then on. A broken connection does not stop the receiver by itself: the
//   tcp provider checks a write's key once, when its header arrives, and goes on copying the rest
//   from the socket, whose queue a reset does not purge.
// - A write that fails on a lane with a connection error is held; whichever side gives a lane up
//   tells the other (LaneLost), and each side, once its own connection on the lane is closed,
//   answers LaneFenced (wire 1.6). The held write is posted again on a live lane only after the
//   peer's LaneFenced says its connection closed: the same bytes to the same place, so the
//   transfer stays byte-exact, the runtime sees one completion, and no late first copy can land
//   after the second (in a staging slot the runtime has reused, say). Without the answer within
//   kFenceWaitNs, with a peer that cannot fence (1.5 and older), or for a write that already moved
//   once, the write fails instead. Other errors fail the write as on a plain endpoint. Every lane's
//   writes ask for delivery completion, so a write reported complete has landed and a lane that
//   breaks later loses none.
// - With a 1.7 peer a lane given up comes back (advance_repairs): rxm connects again by itself, so
//   the peer may have opened a new connection on the lane after our fence and before its own; once
//   each side has heard the other's first fence, it closes the lane a second time (inserting the
//   peer's name finds that connection; fencing the entry closes it), and once both have, it inserts
//   the name for good in the lane's next epoch. Held writes of a 1.7 peer move on its second fence.
// - Messages to a peer that frames its own (a 0.5 peer: wire minor 1.5) travel in an envelope:
//   a sequence number per (sender, peer), cumulative acks from the receiver, and lane-loss notices.
//   The sender keeps every message until it is acked. When the lane carrying a peer's messages
//   (its control lane, lane 0 at first) breaks, the next live lane becomes the control lane and
//   every unacked message is sent again on it, in order; the receiver delivers each sequence
//   number once, in order, so the runtime above sees neither a loss nor a duplicate. Whichever
//   side sees a lane break tells the other at once (a notice on the control lane), so both stop
//   using it. Only when no lane to a peer is left is the peer lost. With an older peer, lane 0's
//   failure is the session's, as before.
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
#include <map>
#include <optional>
#include <random>
#include <tuple>
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

// The envelope of a message between two framing striped transports (40 bytes, little-endian):
//   u32 magic 'SGL1' | u8 kind | u8 lane | u16 stage | u32 stream | u32 epoch | u64 origin | u64 nonce | u64 seq
// origin names the sender (a hash of its lane-0 address: the receiver knows its peers by those),
// nonce the sending transport's life (a restarted process at the same address starts afresh), and
// stream the sender's peer entry for the receiver. Data carries seq and a runtime message after
// the envelope; Ack acks every seq up to its own; LaneLost says the sender gave up `lane`;
// LaneFenced (1.6) says the sender's connection on `lane` to the receiver is closed, seq 1, or that
// it could not close it (another of its sessions with the receiver shares it), seq 0.
// Since 1.7 a lane notice names the lane's epoch (how many times the lane has healed) and a
// LaneFenced its stage: 1 after the sender's first fence of that epoch, 2 after its closing fence,
// with kStageReply set when it answers a notice about an epoch the sender has left (never answered).
// Before 1.7 both fields were 0.
// A runtime frame starts with 'SGW1', so a receiver tells framed from plain by the first word.
constexpr uint32_t kLaneMagic = 0x314C4753u;  // "SGL1"
constexpr size_t kEnvelopeBytes = 40;
enum class FrameKind : uint8_t { Data = 1, Ack = 2, LaneLost = 3, LaneFenced = 4 };

constexpr uint16_t kStageReply = 0x100;

struct Envelope {
    FrameKind kind = FrameKind::Data;
    uint8_t lane = 0;
    uint16_t stage = 0;
    uint32_t stream = 0;
    uint32_t epoch = 0;
    uint64_t origin = 0, nonce = 0, seq = 0;
};

inline void put_le(uint8_t *p, uint64_t v, int bytes) {
    for (int i = 0; i < bytes; ++i) p[i] = uint8_t(v >> (8 * i));
}
inline uint64_t get_le(const uint8_t *p, int bytes) {
    uint64_t v = 0;
    for (int i = 0; i < bytes; ++i) v |= uint64_t(p[i]) << (8 * i);
    return v;
}

std::vector<uint8_t> seal(const Envelope &e, std::span<const uint8_t> payload) {
    std::vector<uint8_t> out(kEnvelopeBytes + payload.size(), 0);
    put_le(&out[0], kLaneMagic, 4);
    out[4] = uint8_t(e.kind);
    out[5] = e.lane;
    put_le(&out[6], e.stage, 2);
    put_le(&out[8], e.stream, 4);
    put_le(&out[12], e.epoch, 4);
    put_le(&out[16], e.origin, 8);
    put_le(&out[24], e.nonce, 8);
    put_le(&out[32], e.seq, 8);
    if (!payload.empty()) std::memcpy(out.data() + kEnvelopeBytes, payload.data(), payload.size());
    return out;
}

bool open_envelope(std::span<const uint8_t> bytes, Envelope &e) {
    if (bytes.size() < kEnvelopeBytes || get_le(bytes.data(), 4) != kLaneMagic) return false;
    e.kind = FrameKind(bytes[4]);
    e.lane = bytes[5];
    e.stage = uint16_t(get_le(&bytes[6], 2));
    e.stream = uint32_t(get_le(&bytes[8], 4));
    e.epoch = uint32_t(get_le(&bytes[12], 4));
    e.origin = get_le(&bytes[16], 8);
    e.nonce = get_le(&bytes[24], 8);
    e.seq = get_le(&bytes[32], 8);
    return true;
}

uint64_t address_hash(std::span<const uint8_t> address) {
    uint64_t h = 0xcbf29ce484222325ull;  // FNV-1a
    for (uint8_t b : address) h = (h ^ b) * 0x100000001b3ull;
    return h;
}

// Provider context space for the transport's own sends (acks, notices, messages sent again).
struct OwnCookie {
    alignas(16) uint8_t space[kCookieBytes];
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
            // A notice on one lane cannot be ordered after writes on another, and a lane may break
            // after a write completed: every write must be at the target before it completes.
            one.delivery_complete = n > 1;
            // Messages travel on lane 0 until it breaks; the others keep a few receive buffers, not 32.
            if (i > 0) one.recv_buffers = 8;
            one.recv_buffer_bytes = (opt.recv_buffer_bytes ? opt.recv_buffer_bytes : 256 * 1024) + kEnvelopeBytes;
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
        nonce_ = (uint64_t(std::random_device{}()) << 32) ^ std::random_device{}() ^ now_ns();
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
        // Each endpoint closes before the operations it still holds are freed: closing may complete
        // them into their cookies' provider space, and the transport's own sends (acks, notices,
        // messages sent again) own theirs in the lane's in_flight map.
        for (auto &lane : lanes_) {
            std::lock_guard lock(lane->mu);
            lane->t.reset();
        }
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

    std::vector<uint8_t> local_address() override { return lane_addresses()[0]; }

    // The first call opens every lane's endpoint, each under its lane's lock (its thread polls it).
    std::vector<std::vector<uint8_t>> lane_addresses() override {
        std::vector<std::vector<uint8_t>> out;
        for (auto &lane : lanes_) {
            std::lock_guard lock(lane->mu);
            out.push_back(lane->t->local_address());
        }
        if (origin_.load(std::memory_order_acquire) == 0) origin_.store(address_hash(out[0]), std::memory_order_release);
        return out;
    }

    // Opens every lane's endpoint and fixes this side's origin, once: origin_ is set only after
    // the last lane opened, so later sessions skip the lanes' locks and addresses.
    void open_endpoints() {
        if (origin_.load(std::memory_order_acquire) == 0) (void)lane_addresses();
    }

    PeerAddr insert_peer(std::span<const uint8_t> address) override {
        std::vector<std::vector<uint8_t>> one{std::vector<uint8_t>(address.begin(), address.end())};
        return insert_peer_lanes(one, LaneProtocol::Plain);
    }

    // Lane i talks to the peer's lane i; lanes beyond the shorter side's count stay unused for it.
    PeerAddr insert_peer_lanes(std::span<const std::vector<uint8_t>> addresses, LaneProtocol peer_protocol) override {
        if (addresses.empty()) fail(SG_ERR_PROTOCOL, "the peer named no endpoint");
        open_endpoints();
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
        for (size_t i = 0; i < n; ++i) peer->failed[i] = lanes_[i]->broken.load();
        peer->outstanding.assign(n, 0);
        peer->told_lost.assign(n, false);
        peer->heard.assign(n, PeerWord{});
        peer->epoch.assign(n, 0);
        peer->fence_stage.assign(n, FenceStage::None);
        peer->fence_open.assign(n, false);
        peer->notice_ns.assign(n, 0);
        peer->names.assign(addresses.begin(), addresses.begin() + ptrdiff_t(n));
        // Framed copies are this transport's own memory, which a provider wanting local
        // descriptors could not send.
        peer->framed = peer_protocol != LaneProtocol::Plain && n > 1 && !caps_.needs_local_desc;
        peer->fences = peer->framed && (peer_protocol == LaneProtocol::Fencing || peer_protocol == LaneProtocol::Healing);
        peer->heals = peer->fences && peer_protocol == LaneProtocol::Healing;
        peer->origin = address_hash(addresses[0]);
        for (size_t i = 0; i < n && peer->failed[peer->control]; ++i) peer->control = i;
        std::lock_guard lock(peers_mu_);
        peers_.push_back(std::move(peer));
        const PeerAddr id = PeerAddr(peers_.size() - 1);
        if (peers_.back()->framed) by_origin_[peers_.back()->origin] = id;
        return id;
    }

    void remove_peer(PeerAddr id) override {
        Peer *p = peer(id);
        // Removed first, so nothing is queued for it from now on (acks, notices, messages sent again)
        // and nothing still queued is posted to an address the endpoint no longer has.
        // Another live entry for the same peer (a new session while this one ends) keeps the
        // peer's streams: a receiver cannot tell which of its entries a stream belongs to, and
        // erasing the new one's would hold its next messages back for good.
        bool origin_still_used = false;
        {
            std::lock_guard lock(peers_mu_);
            p->removed = true;
            p->unacked.clear();
            PeerAddr other = id;
            for (PeerAddr q = 0; q < peers_.size(); ++q)
                if (q != id && !peers_[q]->removed && peers_[q]->framed && peers_[q]->origin == p->origin) other = q;
            origin_still_used = other != id;
            auto it = by_origin_.find(p->origin);
            if (it != by_origin_.end() && it->second == id) {
                if (origin_still_used)
                    it->second = other;
                else
                    by_origin_.erase(it);
            }
        }
        for (size_t i = 0; i < p->addr.size(); ++i) {
            Lane &lane = *lanes_[i];
            std::lock_guard lock(lane.mu);
            // Operations still queued for this peer complete as canceled: their cookies come back.
            for (Op &op : take_pending(lane, id)) fail_op(std::move(op), -ECANCELED, "the peer was removed");
            // The provider keeps a peer's connection state until its operations complete; the
            // transport's own sends (acks) are unknown to the runtime, which may remove the peer
            // while one is in flight. Its address goes once none is left (drive_lane).
            if (has_in_flight(lane, id))
                lane.removals.push_back({id, p->addr[i], UINT32_MAX});
            else
                lane.t->remove_peer(p->addr[i]);
        }
        if (origin_still_used) return;
        std::lock_guard lock(streams_mu_);
        for (auto it = streams_.begin(); it != streams_.end();) {
            if (it->first.origin != p->origin) {
                ++it;
                continue;
            }
            early_bytes_all_ -= it->second.early_bytes;
            it = streams_.erase(it);
        }
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
        // (Lane 0 is the control lane until it breaks; then the messages' new lane takes its part.)
        const bool on_control = cls == WriteClass::Urgent || (cls == WriteClass::Default && op.bytes < small_write_bytes_);
        const int lane = on_control ? control_lane(*p, op.bytes) : pick_lane(*p, op.bytes, cls == WriteClass::Bulk ? 1 : 0);
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
        op.cookie = cookie;
        const std::span<const uint8_t> bytes(static_cast<const uint8_t *>(buf), len);
        size_t lane = 0;
        if (!p->framed) {
            op.message.assign(bytes.begin(), bytes.end());
            op.message_desc = desc;
            enqueue(0, std::move(op));
        } else {
            // Numbered, kept and queued under peers_mu_, so a failover either sends it again or
            // finds it queued on the new control lane, never neither.
            std::lock_guard lock(peers_mu_);
            Envelope e;
            e.stream = id;
            e.origin = origin_.load(std::memory_order_relaxed);
            e.nonce = nonce_;
            e.seq = ++p->next_seq;
            op.message = seal(e, bytes);
            op.framed_data = true;
            p->unacked.emplace_back(e.seq, op.message);
            p->unacked_bytes += op.message.size();
            while (p->unacked_bytes > kMaxUnackedBytes) {
                p->unacked_bytes -= p->unacked.front().second.size();
                p->dropped_through = p->unacked.front().first;
                p->unacked.pop_front();
                p->replay_incomplete = true;
            }
            lane = p->control;
            enqueue(lane, std::move(op));
        }
        post_now_if_inline(lane);
        return 0;
    }

    size_t poll(CompletionSink &sink) override {
        for (size_t i = 0; i < lanes_.size(); ++i)
            if (lanes_[i]->inline_driven) drive_lane(i);
        run_lane_fences();
        advance_repairs();
        resolve_held();
        send_acks(false);
        uint64_t drained;
        (void)!::read(event_fd_, &drained, sizeof drained);
        // An idle poll allocates nothing (a std::deque allocates when it is made): the progress
        // thread polls all the time, and a host that forks under a sanitizer's allocator, which
        // does not hand its locks over at fork, must find none held by this loop.
        {
            std::lock_guard lock(events_mu_);
            if (events_.empty()) return 0;
        }
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
        // About to sleep: ack what arrived, so the peer lets go of its copies in one message.
        if (send_acks(true)) return false;
        {
            std::lock_guard lock(peers_mu_);
            if (!held_.empty() || !lane_fences_.empty()) return false;  // poll()'s to settle, held ones on a clock
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

    // Every lane's connection to the peer closes, each under its lane's lock (the lane's thread
    // polls that endpoint): what the peer still sends lands nowhere, and every operation to it,
    // queued here or held by a provider, completes as failed, none posted again on another lane.
    bool fence(PeerAddr id) override {
        kill_peer(id, -ECANCELED, "the peer's connections are fenced");
        Peer *p = peer(id);
        {
            std::lock_guard lock(peers_mu_);
            p->fenced = true;
            p->unacked.clear();
            p->unacked_bytes = 0;
        }
        bool closed = true;
        for (size_t i = 0; i < p->addr.size(); ++i) {
            Lane &lane = *lanes_[i];
            std::lock_guard lock(lane.mu);
            for (Op &op : take_pending(lane, id)) fail_op(std::move(op), -ECANCELED, "the peer's connections are fenced");
            if (lane.t) closed = lane.t->fence(p->addr[i]) && closed;
        }
        return closed;
    }

    LaneStats lane_stats() const override {
        LaneStats s;
        s.lanes = uint32_t(lanes_.size());
        s.failovers = failovers_.load();
        s.lanes_lost = lanes_lost_.load();
        s.lanes_healed = lanes_healed_.load();
        for (auto &lane : lanes_) s.bytes_per_lane.push_back(lane->bytes_completed.load());
        std::lock_guard lock(streams_mu_);
        s.streams = streams_.size();
        s.early_bytes = early_bytes_all_;
        return s;
    }

  private:
    static constexpr uint32_t kMaxLanes = 16;
    // How long a write that broke its lane waits for the peer's LaneFenced before it fails. The
    // answer takes one round trip on a live lane; a peer that died is lost (and the write failed)
    // by its peer timeout, which this outlasts on a busy host too.
    static constexpr uint64_t kFenceWaitNs = 5000000000ull;
    // How often a side repairing a lane sends its last notice again while it waits for the peer's.
    static constexpr uint64_t kNoticeAgainNs = 250000000;
    // How long messages to a peer given up still try to leave (a Bye's answer behind a full queue).
    static constexpr uint64_t kDeadSendGraceNs = 1000000000;
    // A receiver acks after this many messages even while busy (and always before it sleeps).
    static constexpr uint64_t kAckEvery = 16;
    // A peer that never acks is not framing-capable after all, or stuck: past this many bytes kept
    // for it, the oldest copies go and a control-lane failure loses the peer as an older one would.
    static constexpr uint64_t kMaxUnackedBytes = 64ull << 20;
    // Messages a receiver holds while an earlier sequence number is missing (legitimately only
    // those a broken lane overtook: a few).
    static constexpr size_t kMaxReordered = 4096;
    static constexpr uint64_t kMaxReorderedBytes = 16ull << 20;
    static constexpr uint64_t kMaxEarlyBytesAll = 64ull << 20;
    // Streams a receiver keeps state for beyond its peers' own.
    static constexpr size_t kMaxStreams = 1024;

    struct Op {
        PeerAddr peer = 0;
        bool send = false;
        std::vector<LocalIov> local;  // as the runtime gave them; translated per lane when posted
        uint64_t remote_addr = 0, key = 0, bytes = 0;
        std::vector<uint8_t> message;
        void *message_desc = nullptr;
        void *cookie = nullptr;
        uint32_t lane = 0;
        uint32_t epoch = 0;        // the lane's epoch for the peer when it was posted (1.7)
        bool framed_data = false;  // a numbered message: kept until acked, sent again on failover
        bool moved = false;        // a write already moved once off a lane that failed it
        std::unique_ptr<OwnCookie> own;  // set for the transport's own sends: no event goes up
    };

    enum class PeerFence : uint8_t { Unknown, Closed, Open };  // the peer's connection on a lane

    // What the peer last said of one lane, for the newest epoch it named (a 1.6 peer names 0).
    struct PeerWord {
        uint32_t epoch = 0;
        bool lost = false;  // it gave the lane up (LaneLost)
        uint8_t stage = 0;  // its fences of the epoch: 1 first, 2 closing (LaneFenced)
        bool open = false;  // it could not close its connection: the lane stays down
    };
    // How far this side's own fences of a lane's epoch got (1.7 repairs; 1.6 uses First alone).
    enum class FenceStage : uint8_t { None, First, ClosingQueued, Closing };

    struct Peer {
        std::vector<PeerAddr> addr;  // per lane, in that lane's address vector
        std::vector<bool> failed;
        std::vector<uint64_t> outstanding;  // bytes posted and not completed, per lane
        std::vector<bool> told_lost;        // a LaneLost for the lane went to the peer
        std::vector<PeerWord> heard;        // what the peer's notices said of each lane
        // Repairs (1.7): per lane, the epoch both sides count its connections by (one more each
        // time it heals), this side's fences of it, and when this side last sent its notice
        // (sent again while it waits for the peer's).
        std::vector<uint32_t> epoch;
        std::vector<FenceStage> fence_stage;
        std::vector<bool> fence_open;  // one of our fences of this epoch could not close the connection
        std::vector<uint64_t> notice_ns;
        std::vector<std::vector<uint8_t>> names;  // the peer's lane addresses, inserted again on healing
        bool heals = false;  // both sides repair lanes (1.7)
        bool removed = false;
        bool dead = false;  // no lane left, or the runtime gave the peer up: no write moves to it now
        uint64_t dead_ns = 0;
        bool fenced = false;  // every lane's connection to it closed (fence): nothing more is posted
        bool framed = false;  // both sides frame messages (envelope above)
        bool fences = false;  // and the peer answers LaneLost with LaneFenced (1.6)
        uint64_t origin = 0;  // address_hash of its lane 0: how its envelopes name it
        size_t control = 0;   // the lane its messages and urgent writes go on
        uint64_t next_seq = 0;
        std::deque<std::pair<uint64_t, std::vector<uint8_t>>> unacked;  // (seq, sealed message)
        uint64_t unacked_bytes = 0;
        bool replay_incomplete = false;  // copies were dropped (kMaxUnackedBytes) and not yet acked
        uint64_t dropped_through = 0;    // the last seq whose copy was dropped
        uint64_t peer_nonce = 0;  // from its first numbered message: its notices must carry it
    };

    // What a receiver knows of one sender's stream of numbered messages.
    struct StreamKey {
        uint64_t origin, nonce;
        uint32_t stream;
        bool operator<(const StreamKey &o) const {
            return std::tie(origin, nonce, stream) < std::tie(o.origin, o.nonce, o.stream);
        }
    };
    struct Stream {
        uint64_t delivered = 0;  // every seq up to this one went up, once
        uint64_t owed = 0;       // delivered since the last ack
        std::map<uint64_t, std::vector<uint8_t>> early;  // arrived before a missing earlier seq
        uint64_t early_bytes = 0;
    };

    // A write that broke its lane, waiting for the peer's LaneFenced for that lane (then it moves)
    // or its loss (then its error goes up as it is). op.lane is the lane it was posted on.
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
        std::atomic<bool> broken{false};  // its thread failed (lose_lane_everywhere): no peer uses it
        // Addresses to remove from the endpoint once no operation posted to them is in flight
        // (before_epoch: those of the peer's ops posted in an earlier epoch; all, for a removed
        // peer). Under mu.
        struct Removal {
            PeerAddr peer, addr;
            uint32_t before_epoch;
        };
        std::vector<Removal> removals;
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
        void on_message(std::span<const uint8_t> bytes) override { owner_.lane_message(lane_, bytes); }

      private:
        StripedTransport &owner_;
        size_t lane_;
    };

    Peer *peer(PeerAddr id) {
        std::lock_guard lock(peers_mu_);
        if (id >= peers_.size() || peers_[id]->removed) fail(SG_ERR_INTERNAL, "striped transport: unknown peer");
        return peers_[id].get();
    }

    int control_lane(Peer &p, uint64_t bytes) {
        std::lock_guard lock(peers_mu_);
        if (p.failed[p.control]) return -1;
        p.outstanding[p.control] += bytes;
        return int(p.control);
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
            if (lanes_[i]->t) lanes_[i]->t->deregister(regs.per_lane[i]);  // closed: its registrations went with it
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
                give_up_sends = p->fenced || (dead && now_ns() - p->dead_ns > kDeadSendGraceNs);
                // The connection it goes on (the epoch changes only under this lane's mu, held here).
                op.epoch = lane_index < p->epoch.size() ? p->epoch[lane_index] : 0;
            }
            if (dead && (!op.send || give_up_sends)) {
                fail_op(std::move(op), -ECANCELED, "the peer is gone");
                continue;
            }
            if (!op.send) {
                bool lane_failed;
                {
                    std::lock_guard lock(peers_mu_);
                    lane_failed = lane_index < p->failed.size() && p->failed[lane_index];
                }
                if (lane_failed) {  // given up since it was queued: never posted, so it moves
                    reroute_unposted(std::move(op));
                    continue;
                }
            }
            if (op.framed_data || op.own) {
                // Sent again on the new control lane when this one broke: this copy stays home.
                bool lane_failed;
                {
                    std::lock_guard lock(peers_mu_);
                    lane_failed = lane_index < p->failed.size() && p->failed[lane_index] && !p->dead;
                }
                if (lane_failed) {
                    if (!op.own) push_completion(op.cookie);
                    continue;
                }
            }
            int rc;
            try {
                if (op.send) {
                    rc = lane.t->post_send(p->addr[lane_index], op.message.data(), op.message.size(), op.message_desc,
                                           op.own ? static_cast<void *>(op.own.get()) : op.cookie);
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
                void *cookie = op.own ? static_cast<void *>(op.own.get()) : op.cookie;
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
            void *cookie = op.own ? static_cast<void *>(op.own.get()) : op.cookie;
            lane.in_flight.emplace(cookie, std::move(op));
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
            if (!op.own) push_completion(cookie);
            return;
        }
        const std::string text = error_text ? error_text : "";
        if (!is_connection_error(status)) {
            // This operation's own failure (a protection error, say): the transfer's, not the lane's.
            fail_op(std::move(op), status, text);
            return;
        }
        if (!op.send && op.moved) {
            // The second lane this write breaks: the write is the cause (a target that refuses it
            // closes the connection, as the tcp provider does for a key it does not know), so it
            // fails by itself and costs no further lane. A lane that broke for another reason
            // shows it with its other operations.
            fail_op(std::move(op), kLaneWriteGivenUp, text + " (the write failed on a second lane: given up, that lane kept)");
            return;
        }
        const PeerAddr id = op.peer;
        bool framed = false, fences = false;
        {
            std::lock_guard lock(peers_mu_);
            framed = id < peers_.size() && peers_[id]->framed && !peers_[id]->replay_incomplete;
            fences = framed && peers_[id]->fences;
            Peer *p = id < peers_.size() ? peers_[id].get() : nullptr;
            if (p && p->heals && lane_index < p->epoch.size() && op.epoch < p->epoch[lane_index]) {
                // Posted on a connection of an earlier epoch, which both sides have closed twice
                // since (the lane healed): its failure says nothing of the lane now. A message's
                // copy went again when that epoch's lane was given up; a write has no copy that
                // can still land and moves (resolve_held), once.
                if (op.send) {
                    if (!op.own) push_completion(op.cookie);
                    return;
                }
                if (!p->dead && !p->removed) {
                    held_.push_back({std::move(op), status, text, now_ns()});
                    wake_caller();
                    return;
                }
            }
        }
        if (!framed && (op.send || lane_index == 0)) {
            // An older peer's messages travel on lane 0 alone: its failure is the session's.
            fail_op(std::move(op), status, text);
            kill_peer(id, status, text);
            return;
        }
        const bool live_lane_left = lose_lane(id, lane_index, /*tell_peer=*/true);
        if (op.send) {
            if (!live_lane_left) {
                fail_op(std::move(op), status, text);
                kill_peer(id, status, text);
            } else if (!op.own) {
                push_completion(op.cookie);  // its copy was sent again on the new control lane
            }
            return;
        }
        if (!fences) {
            // Its first copy may still land, and a peer that cannot fence cannot say when it no
            // longer can: the write fails rather than land twice (the session goes on).
            fail_op(std::move(op), live_lane_left ? kLaneWriteGivenUp : status,
                    text + " (its lane broke; the peer cannot confirm the lane is fenced, so the write is not sent "
                           "again)");
            if (!live_lane_left) kill_peer(id, status, text);
            return;
        }
        {
            std::lock_guard lock(peers_mu_);
            Peer *p = id < peers_.size() ? peers_[id].get() : nullptr;
            if (p && !p->removed && !p->dead && live_lane_left) {
                // The peer learnt of the lane from us (lose_lane above) or told us itself; either
                // way it answers a LaneLost of ours, which it may not have had yet.
                if (!p->told_lost[lane_index]) tell_lane_lost(id, *p, lane_index);
                held_.push_back({std::move(op), status, text, now_ns()});
                wake_caller();  // poll() decides its fate
                return;
            }
        }
        fail_op(std::move(op), status, text);
        if (!live_lane_left) kill_peer(id, status, text);
    }

    // With peers_mu_ held: a notice about `lane` (LaneLost, LaneFenced) goes to the peer on its
    // control lane.
    void send_lane_notice(PeerAddr id, const Peer &p, FrameKind kind, size_t lane, uint64_t seq = 0, uint16_t stage = 0,
                          std::optional<uint32_t> epoch = std::nullopt) {
        Envelope e;
        e.kind = kind;
        e.lane = uint8_t(lane);
        e.stage = stage;
        e.epoch = epoch ? *epoch : (lane < p.epoch.size() ? p.epoch[lane] : 0);
        e.stream = id;
        e.origin = origin_.load(std::memory_order_relaxed);
        e.nonce = nonce_;
        e.seq = seq;
        enqueue(p.control, own_send(id, seal(e, {})));
    }

    void tell_lane_lost(PeerAddr id, Peer &p, size_t lane) {
        p.told_lost[lane] = true;
        p.notice_ns[lane] = now_ns();
        send_lane_notice(id, p, FrameKind::LaneLost, lane);
    }

    // Gives up `lane` to a peer. If it carried the peer's messages, the first live lane takes them
    // over and every unacked message is queued on it again, in order. tell_peer: a notice goes to
    // the peer on the control lane (it saw no error of its own, or not yet). Returns whether a live
    // lane is left. Takes peers_mu_ and queue locks (leaves), never a lane's mu.
    bool lose_lane(PeerAddr id, size_t lane, bool tell_peer) {
        std::vector<void *> done;  // runtime sends queued on the broken lane, now sent again
        {
            std::lock_guard lock(peers_mu_);
            if (id >= peers_.size()) return false;
            Peer &p = *peers_[id];
            if (p.removed || p.dead) return false;
            if (lane >= p.failed.size()) return true;
            if (!p.failed[lane]) {
                p.failed[lane] = true;
                lanes_lost_.fetch_add(1);
                if (p.heals) lanes_in_repair_.fetch_add(1, std::memory_order_relaxed);
                lane_fences_.push_back({id, lane, p.epoch[lane], FenceStage::First});  // poll() closes our connection on it
            } else if (p.told_lost[lane]) {
                tell_peer = false;  // already done
            }
            int live = -1;
            for (size_t i = 0; i < p.failed.size() && live < 0; ++i)
                if (!p.failed[i]) live = int(i);
            if (live < 0) return false;
            if (p.framed && p.failed[p.control]) {
                const size_t old = p.control;
                p.control = size_t(live);
                for (Op &q : take_pending(*lanes_[old], id)) {
                    if (q.send) {
                        if (!q.own) done.push_back(q.cookie);  // sent again below, from unacked
                        continue;
                    }
                    // A write queued on the broken lane and never posted: the new control lane takes it.
                    p.outstanding[old] -= std::min(p.outstanding[old], q.bytes);
                    p.outstanding[p.control] += q.bytes;
                    enqueue(p.control, std::move(q));
                }
                // Queued on the new lane behind whatever waits there (acks, notices), before any
                // message posted from now on.
                for (auto &[seq, bytes] : p.unacked) {
                    Op again;
                    again.peer = id;
                    again.send = true;
                    again.framed_data = true;
                    again.message = bytes;
                    again.own = std::make_unique<OwnCookie>();
                    enqueue(p.control, std::move(again));
                }
            }
            if (tell_peer && p.framed) tell_lane_lost(id, p, lane);
        }
        for (void *c : done) push_completion(c);
        wake_caller();  // poll() posts on an inline lane
        return true;
    }

    // A lane whose thread cannot go on: what is queued on it and not yet posted goes through the path
    // of a broken connection, so writes move to live lanes and sends to the new control lane, and no
    // more is queued on it. What the provider already holds stays where it is: the provider keeps
    // its own state in those operations' cookies until they complete, so they are neither freed nor
    // reported here (their transfers end by their deadline or the peer's loss).
    void lose_lane_everywhere(size_t lane_index) noexcept {
        Lane &lane = *lanes_[lane_index];
        lane.broken = true;
        try {
            size_t n;
            {
                std::lock_guard lock(peers_mu_);
                n = peers_.size();
            }
            for (size_t id = 0; id < n; ++id) lose_lane(PeerAddr(id), lane_index, /*tell_peer=*/true);
            std::lock_guard lock(lane.mu);
            std::deque<Op> queued;
            {
                std::lock_guard q(lane.queue_mu);
                queued.swap(lane.pending);
            }
            for (Op &op : queued) {
                void *cookie = op.own ? static_cast<void *>(op.own.get()) : op.cookie;
                lane.in_flight.emplace(cookie, std::move(op));
                lane_completed(lane_index, cookie, -ECONNRESET, "the lane's thread failed");
            }
        } catch (...) {
        }
    }

    Op own_send(PeerAddr id, std::vector<uint8_t> bytes) {
        Op op;
        op.peer = id;
        op.send = true;
        op.message = std::move(bytes);
        op.own = std::make_unique<OwnCookie>();
        return op;
    }

    void push_completion(void *cookie) {
        Event e;
        e.cookie = cookie;
        push_event(std::move(e));
    }

    // A message from a lane's endpoint (with that lane's mu held). Plain ones go up as they are;
    // an envelope's data goes up once and in order, its acks and notices stay here.
    void lane_message(size_t lane_index, std::span<const uint8_t> bytes) {
        (void)lane_index;
        Envelope e;
        if (!open_envelope(bytes, e)) {
            Event ev;
            ev.is_message = true;
            ev.message.assign(bytes.begin(), bytes.end());
            push_event(std::move(ev));
            return;
        }
        switch (e.kind) {
        case FrameKind::Data: {
            std::lock_guard lock(streams_mu_);
            const StreamKey key{e.origin, e.nonce, e.stream};
            auto found = streams_.find(key);
            if (found == streams_.end()) {
                // Anyone who reaches the endpoint can name new streams, and an origin is a hash of a
                // public address: past kMaxStreams only a peer's own life (its origin and the nonce
                // its first message carried) gets state; the rest go up unnumbered, like bare frames.
                bool own;
                {
                    std::lock_guard plock(peers_mu_);
                    auto it = by_origin_.find(e.origin);
                    if (it != by_origin_.end() && !peers_[it->second]->peer_nonce) peers_[it->second]->peer_nonce = e.nonce;
                    own = it != by_origin_.end() && peers_[it->second]->peer_nonce == e.nonce;
                }
                if (!own && streams_.size() >= kMaxStreams) {
                    Event ev;
                    ev.is_message = true;
                    ev.message.assign(bytes.begin() + kEnvelopeBytes, bytes.end());
                    push_event(std::move(ev));
                    return;
                }
                found = streams_.emplace(key, Stream{}).first;
            }
            Stream &st = found->second;
            if (e.seq <= st.delivered) return;  // a copy sent again that had arrived the first time
            if (e.seq > st.delivered + 1) {
                const size_t len = bytes.size() - kEnvelopeBytes;
                // Bounded per stream and for all streams together: a sender that forges streams
                // (any nonce under a known origin) cannot make the transport hold more than
                // kMaxEarlyBytesAll. Legitimately only the few messages a broken lane overtook wait.
                if (st.early.size() < kMaxReordered && st.early_bytes + len <= kMaxReorderedBytes &&
                    early_bytes_all_ + len <= kMaxEarlyBytesAll) {
                    st.early_bytes += len;
                    early_bytes_all_ += len;
                    st.early.emplace(e.seq, std::vector<uint8_t>(bytes.begin() + kEnvelopeBytes, bytes.end()));
                }
                return;
            }
            deliver(st, bytes.subspan(kEnvelopeBytes));
            for (auto it = st.early.begin(); it != st.early.end() && it->first <= st.delivered + 1;) {
                if (it->first == st.delivered + 1) deliver(st, it->second);
                st.early_bytes -= it->second.size();
                early_bytes_all_ -= it->second.size();
                it = st.early.erase(it);
            }
            if (st.owed >= kAckEvery) wake_caller();
            return;
        }
        case FrameKind::Ack: {
            if (e.nonce != nonce_) return;  // meant for an earlier life of this address
            std::lock_guard lock(peers_mu_);
            if (e.stream >= peers_.size()) return;
            Peer &p = *peers_[e.stream];
            // Only the peer the stream goes to acks it, and only what was sent on it: an ack erases
            // the copies a broken control lane would send again.
            if (!p.framed || e.origin != p.origin || e.seq > p.next_seq) return;
            while (!p.unacked.empty() && p.unacked.front().first <= e.seq) {
                p.unacked_bytes -= p.unacked.front().second.size();
                p.unacked.pop_front();
            }
            // Every dropped copy has arrived: a control lane that breaks from now on can send
            // again all that is unacked, as before the drop.
            if (p.replay_incomplete && e.seq >= p.dropped_through) p.replay_incomplete = false;
            return;
        }
        case FrameKind::LaneLost: {
            PeerAddr id;
            {
                std::lock_guard lock(peers_mu_);
                const auto known = notice_sender(e);
                if (!known) return;
                id = *known;
                Peer &p = *peers_[id];
                if (e.lane >= p.failed.size()) return;
                if (p.heals) {
                    // An epoch this side has left was closed twice on both sides: say so again
                    // (the peer waits for a notice it missed). One the peer reached first (it
                    // healed, then lost the lane again) is taken up when this side heals into it.
                    if (e.epoch < p.epoch[e.lane]) {
                        send_lane_notice(id, p, FrameKind::LaneFenced, e.lane, 1, 2 | kStageReply, e.epoch);
                        return;
                    }
                    if (PeerWord *w = hear(p, e.lane, e.epoch)) w->lost = true;
                    if (e.epoch > p.epoch[e.lane]) {
                        wake_caller();
                        return;
                    }
                    // Asked again: our notice may be lost; the next poll sends it again.
                    if (p.fence_stage[e.lane] != FenceStage::None) p.notice_ns[e.lane] = 0;
                } else if (p.fences && p.failed[e.lane]) {
                    // Answered once our connection on the lane is closed, however often it is asked
                    // (the fence is idempotent): the peer may hold writes since our first answer.
                    lane_fences_.push_back({id, e.lane, 0, FenceStage::First});
                }
            }
            lose_lane(id, e.lane, /*tell_peer=*/false);
            wake_caller();
            return;
        }
        case FrameKind::LaneFenced: {
            PeerAddr id;
            {
                std::lock_guard lock(peers_mu_);
                const auto known = notice_sender(e);
                if (!known) return;
                id = *known;
                Peer &p = *peers_[id];
                if (!p.fences || e.lane >= p.heard.size()) return;
                if (!p.heals) {
                    // 1.6: seq 1, closed; 0, it could not close it. The last word counts.
                    p.heard[e.lane] = PeerWord{0, false, 1, e.seq != 1};
                    wake_caller();
                    return;
                }
                if (e.epoch < p.epoch[e.lane]) {
                    if (!(e.stage & kStageReply))
                        send_lane_notice(id, p, FrameKind::LaneFenced, e.lane, 1, 2 | kStageReply, e.epoch);
                    return;
                }
                PeerWord *w = hear(p, e.lane, e.epoch);
                if (!w) return;
                w->stage = std::max<uint8_t>(w->stage, uint8_t(std::clamp<int>(e.stage & 0xff, 1, 2)));
                if (e.seq != 1) w->open = true;
                // A fence of the lane is also word that the peer gave it up (its LaneLost may have
                // been lost with the control lane it went on).
                if (e.epoch > p.epoch[e.lane] || p.failed[e.lane]) {
                    wake_caller();  // poll() moves the writes held for it and goes on with the repair
                    return;
                }
            }
            lose_lane(id, e.lane, /*tell_peer=*/false);
            wake_caller();
            return;
        }
        }
    }

    // Closes our connection on each lane given up for a peer (lose_lane), each under its lane's
    // lock, and tells a peer that fences whether it closed. On the caller's thread (poll), which
    // holds no lane's lock. A 1.7 job belongs to its epoch: one queued before the lane healed must
    // not close the new connection.
    void run_lane_fences() {
        std::vector<FenceJob> todo;
        {
            std::lock_guard lock(peers_mu_);
            if (lane_fences_.empty()) return;
            todo.swap(lane_fences_);
        }
        for (const FenceJob &job : todo) {
            std::vector<uint8_t> name;
            {
                std::lock_guard lock(peers_mu_);
                const Peer &p = *peers_[job.id];
                if (p.removed || job.lane >= p.addr.size() || (p.heals && job.epoch != p.epoch[job.lane])) continue;
                if (job.stage == FenceStage::Closing) name = p.names[job.lane];
            }
            Lane &lane = *lanes_[job.lane];
            bool closed = false;
            {
                std::lock_guard lock(lane.mu);
                if (job.stage == FenceStage::First) {
                    // Writes queued on the lane and never posted have no first copy: they move.
                    for (Op &op : take_pending(lane, job.id, /*writes_only=*/true)) reroute_unposted(std::move(op));
                    PeerAddr addr;
                    {
                        std::lock_guard plock(peers_mu_);
                        addr = peers_[job.id]->addr[job.lane];
                    }
                    if (lane.t) closed = lane.t->fence(addr);
                } else if (lane.t) {
                    closed = close_again(*lane.t, name);
                }
            }
            std::lock_guard lock(peers_mu_);
            Peer &p = *peers_[job.id];
            if (p.removed || p.dead || !p.fences) continue;
            if (!p.heals) {
                send_lane_notice(job.id, p, FrameKind::LaneFenced, job.lane, closed ? 1 : 0);
                continue;
            }
            if (job.epoch != p.epoch[job.lane]) continue;
            if (!closed) p.fence_open[job.lane] = true;  // the lane stays down, its held writes fail
            p.fence_stage[job.lane] = std::max(p.fence_stage[job.lane], job.stage);
            p.notice_ns[job.lane] = now_ns();
            send_lane_notice(job.id, p, FrameKind::LaneFenced, job.lane, closed ? 1 : 0,
                             job.stage == FenceStage::Closing ? 2 : 1);
        }
    }

    // The closing fence (1.7). Our first fence closed the connections the lane had; the peer, until
    // its own first fence, may have opened another (rxm connects again by itself on its next post,
    // and accepts a connection from an address its vector no longer has), on which a write of its
    // could still land. Inserting the peer's name again finds that connection, and fencing the
    // entry closes it; after the peer's first fence it posts nothing more on the lane's epoch.
    static bool close_again(Transport &t, std::span<const uint8_t> name) {
        PeerAddr h;
        try {
            h = t.insert_peer(name);
        } catch (const Error &) {
            return false;
        }
        const bool closed = t.fence(h);
        t.remove_peer(h);
        return closed;
    }

    // With peers_mu_ held: the peer a lane notice comes from. Taken only from the peer's own life
    // (the nonce its messages carry): an origin is a hash of a public address, which anyone could
    // put in an envelope.
    std::optional<PeerAddr> notice_sender(const Envelope &e) const {
        auto it = by_origin_.find(e.origin);
        if (it == by_origin_.end() || !peers_[it->second]->peer_nonce || peers_[it->second]->peer_nonce != e.nonce)
            return std::nullopt;
        return it->second;
    }

    // With peers_mu_ held: the peer's word on a lane about `epoch`, nullptr when it has said
    // something of a later epoch already (an old notice, sent again).
    static PeerWord *hear(Peer &p, size_t lane, uint32_t epoch) {
        PeerWord &w = p.heard[lane];
        if (epoch < w.epoch) return nullptr;
        if (epoch > w.epoch) w = PeerWord{epoch, false, 0, false};
        return &w;
    }

    // With peers_mu_ held: whether a write posted on `lane` in `epoch` can still land at the peer.
    // Closed: no (the peer's fences of that epoch are done: its first with a 1.6 peer, its closing
    // one with a 1.7 peer, which moves only past an epoch both sides closed twice). Open: the peer
    // or this side could not close a connection, so it may. Unknown: not yet said.
    static PeerFence fence_for(const Peer &p, size_t lane, uint32_t epoch) {
        if (lane >= p.heard.size()) return PeerFence::Open;
        const PeerWord &w = p.heard[lane];
        if (p.heals) {
            if (epoch < p.epoch[lane] || w.epoch > epoch) return PeerFence::Closed;
            if (p.fence_open[lane] || (w.epoch == epoch && w.open)) return PeerFence::Open;
            return w.epoch == epoch && w.stage >= 2 ? PeerFence::Closed : PeerFence::Unknown;
        }
        if (w.open) return PeerFence::Open;
        return w.stage >= 1 ? PeerFence::Closed : PeerFence::Unknown;
    }

    // Lane repairs (1.7), on the caller's thread after run_lane_fences. A lane given up goes
    // Live -> First (our fence done, LaneFenced stage 1 sent) -> Closing (the peer's stage 1 heard:
    // our closing fence done, stage 2 sent) -> Live again in the next epoch once the peer's stage
    // 2 is heard, or once the peer names a later epoch (it healed, which it does only after both
    // sides' closing fences). A lane either side could not close stays down. While this side waits,
    // its last notice goes again every kNoticeAgainNs: notices are not numbered, and one sent on a
    // control lane that broke under it is lost.
    void advance_repairs() {
        // The progress thread polls all the time: nothing to scan while no lane is down.
        if (lanes_in_repair_.load(std::memory_order_relaxed) == 0) return;
        std::vector<std::pair<PeerAddr, size_t>> heals;
        bool closing = false;
        {
            std::lock_guard lock(peers_mu_);
            const uint64_t now = now_ns();
            for (PeerAddr id = 0; id < peers_.size(); ++id) {
                Peer &p = *peers_[id];
                if (!p.heals || p.removed || p.dead) continue;
                for (size_t l = 0; l < p.failed.size(); ++l) {
                    if (!p.failed[l] || lanes_[l]->broken) continue;
                    const PeerWord &w = p.heard[l];
                    const bool said_now = w.epoch == p.epoch[l];
                    if (p.fence_open[l] || (said_now && w.open)) continue;
                    const bool again = now - p.notice_ns[l] >= kNoticeAgainNs;
                    if (p.fence_stage[l] == FenceStage::First) {
                        if (said_now && w.stage >= 1) {
                            p.fence_stage[l] = FenceStage::ClosingQueued;
                            lane_fences_.push_back({id, l, p.epoch[l], FenceStage::Closing});
                            closing = true;
                        } else if (again) {
                            p.notice_ns[l] = now;
                            send_lane_notice(id, p, FrameKind::LaneFenced, l, 1, 1);
                        }
                    } else if (p.fence_stage[l] == FenceStage::Closing) {
                        if (w.epoch > p.epoch[l] || (said_now && w.stage >= 2)) {
                            heals.emplace_back(id, l);
                        } else if (again) {
                            p.notice_ns[l] = now;
                            send_lane_notice(id, p, FrameKind::LaneFenced, l, 1, 2);
                        }
                    }
                }
            }
        }
        if (closing) run_lane_fences();
        for (auto &[id, l] : heals) heal_lane(id, l);
    }

    // The lane comes back for the peer in the next epoch: its name inserted anew (the first post
    // connects), the old entry removed once nothing posted to it is in flight. If the peer has
    // already given up the new epoch (it healed first, then lost the lane again), so does this side.
    void heal_lane(PeerAddr id, size_t l) {
        Lane &lane = *lanes_[l];
        bool lost_again = false;
        uint32_t epoch = 0;
        {
            std::lock_guard lock(lane.mu);
            std::vector<uint8_t> name;
            {
                std::lock_guard plock(peers_mu_);
                const Peer &p = *peers_[id];
                if (p.removed || p.dead || !p.failed[l]) return;
                name = p.names[l];
            }
            PeerAddr fresh;
            try {
                fresh = lane.t->insert_peer(name);
            } catch (const Error &) {
                std::lock_guard plock(peers_mu_);
                peers_[id]->fence_open[l] = true;  // cannot come back: stays down
                return;
            }
            std::lock_guard plock(peers_mu_);
            Peer &p = *peers_[id];
            if (p.removed || p.dead) {
                lane.t->remove_peer(fresh);
                return;
            }
            epoch = ++p.epoch[l];
            lane.removals.push_back({id, p.addr[l], epoch});
            p.addr[l] = fresh;
            p.failed[l] = false;
            p.told_lost[l] = false;
            p.fence_stage[l] = FenceStage::None;
            p.notice_ns[l] = 0;
            lost_again = p.heard[l].epoch == epoch && p.heard[l].lost;
            lanes_healed_.fetch_add(1);
            lanes_in_repair_.fetch_sub(1, std::memory_order_relaxed);
        }
        if (lost_again) lose_lane(id, l, /*tell_peer=*/false);
        wake_caller();
    }

    // A write that was queued on a lane given up before it was posted: no copy of it exists, so it
    // goes to the live lane with the fewest bytes outstanding, or fails when none is left.
    void reroute_unposted(Op op) {
        Peer *p;
        bool gone;
        {
            std::lock_guard lock(peers_mu_);
            p = peers_[op.peer].get();
            p->outstanding[op.lane] -= std::min(p->outstanding[op.lane], op.bytes);
            gone = p->dead || p->removed;
        }
        const int lane = gone ? -1 : pick_lane(*p, op.bytes);
        if (lane < 0) {
            fail_op(std::move(op), -ECONNRESET, "every lane to the peer has failed");
            return;
        }
        enqueue(size_t(lane), std::move(op));
    }

    // With streams_mu_ held.
    void deliver(Stream &st, std::span<const uint8_t> payload) {
        Event ev;
        ev.is_message = true;
        ev.message.assign(payload.begin(), payload.end());
        push_event(std::move(ev));
        ++st.delivered;
        ++st.owed;
    }

    // Acks every stream owed one (all: however few it is owed). Returns whether any was queued.
    bool send_acks(bool all) {
        std::vector<std::pair<StreamKey, uint64_t>> acks;
        {
            std::lock_guard lock(streams_mu_);
            for (auto &[key, st] : streams_)
                if (st.owed && (all || st.owed >= kAckEvery)) {
                    acks.emplace_back(key, st.delivered);
                    st.owed = 0;
                }
        }
        bool queued = false;
        for (auto &[key, seq] : acks) {
            size_t control;
            PeerAddr id;
            {
                std::lock_guard lock(peers_mu_);
                auto it = by_origin_.find(key.origin);
                if (it == by_origin_.end() || peers_[it->second]->dead) continue;  // not (or no longer) a peer
                id = it->second;
                control = peers_[id]->control;
                Envelope e;
                e.kind = FrameKind::Ack;
                e.stream = key.stream;
                e.origin = origin_.load(std::memory_order_relaxed);
                e.nonce = key.nonce;
                e.seq = seq;
                enqueue(control, own_send(id, seal(e, {})));
            }
            post_now_if_inline(control);
            queued = true;
        }
        return queued;
    }

    void fail_op(Op op, int status, const std::string &text) {
        if (op.own) return;  // the transport's own send: nobody above waits for it
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

    // With lane.mu held.
    // Whether an operation of the peer's posted before `before_epoch` is in the provider's hands.
    static bool has_in_flight(const Lane &lane, PeerAddr id, uint32_t before_epoch = UINT32_MAX) {
        for (const auto &[cookie, op] : lane.in_flight)
            if (op.peer == id && op.epoch < before_epoch) return true;
        return false;
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

    // Moves a held write once the peer's LaneFenced says its connection on the write's lane is
    // closed (no late first copy can land after the second); fails it if the peer could not close
    // it, did not answer within kFenceWaitNs, or died.
    void resolve_held() {
        std::vector<std::pair<Op, int>> moves;
        std::vector<Held> failures;
        {
            std::lock_guard lock(peers_mu_);
            if (held_.empty()) return;
            const uint64_t now = now_ns();
            for (auto it = held_.begin(); it != held_.end();) {
                Peer &p = *peers_[it->op.peer];
                const PeerFence fence = fence_for(p, it->op.lane, it->op.epoch);
                if (p.dead || p.removed || fence == PeerFence::Open || now - it->since_ns >= kFenceWaitNs) {
                    if (!p.dead && !p.removed) {
                        it->status = kLaneWriteGivenUp;  // the lane's loss, not the session's
                        it->text += fence == PeerFence::Open
                                        ? " (its lane broke and the peer could not close that connection: not sent again)"
                                        : " (its lane broke and the peer did not confirm the lane fenced in time: not "
                                          "sent again)";
                    }
                    failures.push_back(std::move(*it));
                    it = held_.erase(it);
                    continue;
                }
                if (fence != PeerFence::Closed) {
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
                    it->op.moved = true;
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
        for (auto it = lane.removals.begin(); it != lane.removals.end();) {
            if (has_in_flight(lane, it->peer, it->before_epoch)) {
                ++it;
                continue;
            }
            lane.t->remove_peer(it->addr);
            it = lane.removals.erase(it);
        }
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
            size_t n;
            try {
                n = drive_lane(lane_index);
            } catch (...) {
                // Out of memory inside the provider or our queues, say: never the host's end from
                // this thread. The lane is given up for every peer (its writes move, its loss is
                // told), and the thread idles until the transport closes.
                lose_lane_everywhere(lane_index);
                while (!stop_.load(std::memory_order_acquire)) {
                    pollfd kick{lane.kick_fd, POLLIN, 0};
                    (void)::poll(&kick, 1, 1000);
                    uint64_t v;
                    (void)!::read(lane.kick_fd, &v, sizeof v);
                }
                return;
            }
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
    // A fence of one lane's connection to a peer, for run_lane_fences (under peers_mu_).
    struct FenceJob {
        PeerAddr id;
        size_t lane;
        uint32_t epoch;
        FenceStage stage;  // First, or Closing (1.7: once the peer has fenced too)
    };
    std::vector<FenceJob> lane_fences_;
    std::mutex events_mu_;  // a leaf
    std::deque<Event> events_;
    int event_fd_ = -1;
    int wait_epoll_ = -1;
    std::atomic<bool> stop_{false};
    std::atomic<uint64_t> failovers_{0}, lanes_lost_{0}, lanes_healed_{0};
    // Lanes of 1.7 peers given up and not yet healed (those of peers since lost or removed stay
    // counted: then advance_repairs scans and skips them).
    std::atomic<uint64_t> lanes_in_repair_{0};
    std::atomic<uint64_t> origin_{0};  // lane 0's address hashed, once its endpoint is open
    uint64_t nonce_ = 0;
    std::unordered_map<uint64_t, PeerAddr> by_origin_;  // framed peers by their origin; under peers_mu_
    mutable std::mutex streams_mu_;  // taken before peers_mu_ and events_mu_, never while holding either
    std::map<StreamKey, Stream> streams_;
    uint64_t early_bytes_all_ = 0;  // Stream::early_bytes over every stream; under streams_mu_
};

}  // namespace

std::unique_ptr<Transport> open_striped(const OpenOptions &options,
                                        std::unique_ptr<Transport> (*open_one)(const OpenOptions &)) {
    return std::make_unique<StripedTransport>(options, open_one);
}

}  // namespace sg::transport
