// The fake fabric (fake.hpp): one state behind one mutex, shared by the installed handle and every
// endpoint. Operations wait in one list in posting order; a target's poll lands what is ready and
// allowed by the ordering the capabilities promise, an initiator's poll reaps its completions.
// Sink callbacks run after the mutex is let go, since they post again.
#include "transport/fake.hpp"

#include <rdma/fabric.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <deque>
#include <map>
#include <mutex>
#include <string>

namespace sg::transport::fake {

namespace {

// Addresses are 8 bytes: the endpoint id under a tag, so a peer's address from another provider
// is refused instead of read as an id.
constexpr uint64_t kAddressTag = 0x46414b45ull << 32;  // "FAKE"

struct Region {
    uint64_t addr = 0, len = 0, key = 0;
    bool device = false;  // registered through register_device_memory
};

struct Op {
    uint64_t seq = 0;
    uint32_t from = 0, to = 0;
    PeerAddr via = 0;                 // the initiator's address-vector entry (remove_peer cancels it)
    bool send = false;
    std::vector<LocalIov> iov;        // a write's source, read when it lands or completes early
    std::vector<uint8_t> data;        // a send's bytes (copied at post), or a write's snapshot
    bool snapped = false;
    bool device_src = false;          // some of the source is registered device memory
    uint64_t remote_addr = 0, key = 0, len = 0;
    void *cookie = nullptr;
    uint64_t ready_at = 0;            // the target's poll count from which it may land
    bool early = false;               // completes at the initiator's next poll, before it lands
    bool completed = false;           // its completion is queued already (early)
    bool late = false;                // its link dropped: it lands anyway (Knobs::late_landing_polls)
    // A partial landing (Knobs::partial_landing): the first `landed` bytes are in the target at
    // `pinned`, where the key sent it when the first byte came; the rest lands there later
    // whatever became of the key, as a TCP receiver copies a write whose header it accepted.
    uint8_t *pinned = nullptr;
    bool pinned_device = false;
    uint64_t landed = 0;
};

struct Completion {
    uint32_t endpoint = 0;
    void *cookie = nullptr;
    int status = 0;
    std::string text;
    uint64_t ready_at = 0;  // the initiator's poll count from which it is reported
    bool write = false;
    uint64_t len = 0;
};

struct Endpoint {
    bool open = true;
    bool dead = false;
    uint64_t polls = 0;
    size_t recv_bytes = 0;
    uint64_t next_region = 1;
    std::map<uint64_t, Region> regions;  // by registration id (the desc and mr handles)
    PeerAddr next_av = 1;
    std::map<PeerAddr, uint32_t> av;     // address-vector entry -> endpoint id
    Flow flow;
};

struct Link {
    bool broken = false;
    bool posts_throw = false;  // after breaking: posts throw (else they fail at completion)
    // Since it broke, which ends fenced the other (the lower endpoint id's, the higher's). Once
    // both have, the next insert of one by the other connects anew, as TCP would: the link works.
    bool fenced_lo = false, fenced_hi = false;
};

std::mutex g_install_mu;
// The installed fabric. A mutable global, against STYLE.md 16, because a test fabric is what every
// context of the process must meet without the context knowing it is under test: open() finds it
// here when a context asks for provider "fake". Never set outside tests.
std::shared_ptr<Fabric::State> g_installed;

thread_local bool t_in_hook = false;

}  // namespace

struct Fabric::State {
    mutable std::mutex mu;
    Rng rng;
    Knobs knobs;
    uint64_t next_seq = 1;
    uint32_t next_endpoint = 1;
    std::map<uint32_t, Endpoint> endpoints;
    std::deque<Op> ops;  // posted, not landed, in posting order
    std::deque<Completion> completions;
    std::map<std::pair<uint32_t, uint32_t>, Link> links;
    std::vector<WriteRecord> log;
    std::function<void()> hook;
    uint64_t eagains = 0;
    struct Reused {
        uintptr_t lo, hi;
        std::string what;
    };
    std::vector<Reused> reused;
    std::vector<std::string> stale_landings;

    State(uint64_t seed, const Knobs &k) : rng(seed), knobs(k) {}

    bool alive(uint32_t id) const {
        auto it = endpoints.find(id);
        return it != endpoints.end() && it->second.open && !it->second.dead;
    }
    Link &link(uint32_t a, uint32_t b) {
        auto [it, fresh] = links.try_emplace({std::min(a, b), std::max(a, b)});
        if (fresh) it->second.posts_throw = rng.chance(knobs.broken_posts_throw);
        return it->second;
    }
    // Whether an operation between the two can no longer land.
    bool cut(uint32_t from, uint32_t to) {
        if (!alive(from) || !alive(to)) return true;
        return link(from, to).broken;
    }
    uint64_t hold_for() {
        return rng.chance(knobs.hold) ? 1 + rng.below(std::max<uint32_t>(1, knobs.max_hold_polls)) : 0;
    }
    void complete(const Op &op, int status, const std::string &text) {
        auto it = endpoints.find(op.from);
        if (it == endpoints.end() || !it->second.open) return;  // nobody left to tell
        Completion c;
        c.endpoint = op.from;
        c.cookie = op.cookie;
        c.status = status;
        c.text = text;
        c.ready_at = it->second.polls + hold_for();
        c.write = !op.send;
        c.len = op.len;
        completions.push_back(std::move(c));
    }
    // A network fabric fails what can no longer land; a local_only one leaves operations addressed
    // to a dead peer where they are, as shm does (only their initiator's own death settles them).
    void fail_cut_ops() {
        for (auto it = ops.begin(); it != ops.end();) {
            const bool initiator_gone = !alive(it->from);
            if (it->late && alive(it->to)) {  // in the target's socket already: only its fence stops it
                ++it;
                continue;
            }
            if (!cut(it->from, it->to) || (knobs.local_only && !initiator_gone)) {
                ++it;
                continue;
            }
            if (knobs.late_landing_polls && !it->send && alive(it->from) && alive(it->to)) {
                snapshot(*it);  // the bytes left the initiator before the link dropped
                if (!it->completed) complete(*it, -ECONNRESET, "fake: connection reset by peer");
                it->completed = true;
                it->late = true;
                it->ready_at = endpoints[it->to].polls + knobs.late_landing_polls;
                if (it->len > 1 && rng.chance(knobs.partial_landing)) land_prefix(*it);
                ++it;
                continue;
            }
            if (!it->completed) complete(*it, -ECONNRESET, "fake: connection reset by peer");
            it = ops.erase(it);
        }
    }
    void copy(void *dst, const void *src, uint64_t len, bool device) const {
        if (device && knobs.device_copy)
            knobs.device_copy(dst, src, len);
        else
            std::memcpy(dst, src, len);
    }
    // A write's bytes arriving in a target's memory: through here only, so the oracle sees them all.
    void land(void *dst, const void *src, uint64_t len, bool device) {
        const uintptr_t lo = reinterpret_cast<uintptr_t>(dst), hi = lo + len;
        for (const Reused &r : reused)
            if (lo < r.hi && r.lo < hi && stale_landings.size() < 64)
                stale_landings.push_back(r.what + ": " + std::to_string(std::min(hi, r.hi) - std::max(lo, r.lo)) +
                                         " bytes at +" + std::to_string(std::max(lo, r.lo) - r.lo));
        copy(dst, src, len, device);
    }
    void snapshot(Op &op) {
        if (op.send || op.snapped) return;
        op.data.resize(op.len);
        uint64_t at = 0;
        for (const LocalIov &v : op.iov) {
            copy(op.data.data() + at, v.addr, v.len, op.device_src);
            at += v.len;
        }
        op.snapped = true;
    }
    // The key is checked now, at the first byte; a prefix lands, the rest waits at that address.
    void land_prefix(Op &op) {
        uint64_t offset = 0;
        const Region *r = target(op.to, op.key, op.remote_addr, op.len, offset);
        if (!r) return;  // refused at the first byte: nothing lands, then or later
        op.pinned = reinterpret_cast<uint8_t *>(r->addr) + offset;
        op.pinned_device = r->device;
        op.landed = 1 + rng.below(op.len - 1);
        land(op.pinned, op.data.data(), op.landed, op.pinned_device);
    }
    // The registration of `to` that `key` names and the offset remote_addr means in it.
    const Region *target(uint32_t to, uint64_t key, uint64_t remote_addr, uint64_t len, uint64_t &offset) {
        auto ep = endpoints.find(to);
        if (ep == endpoints.end()) return nullptr;
        for (auto &[id, r] : ep->second.regions) {
            if (r.key != key) continue;
            const uint64_t base = knobs.virt_addr ? r.addr : 0;
            if (remote_addr < base) return nullptr;
            offset = remote_addr - base;
            return in_bounds(offset, len, r.len) ? &r : nullptr;
        }
        return nullptr;
    }
};

namespace {

class FakeTransport final : public Transport {
  public:
    FakeTransport(std::shared_ptr<Fabric::State> fabric, const OpenOptions &opt) : f_(std::move(fabric)) {
        std::lock_guard lock(f_->mu);
        const Knobs &k = f_->knobs;
        caps_.provider = "fake";
        caps_.fabric = "fake";
        caps_.domain = "fake0";
        caps_.caps = FI_MSG | FI_RMA | FI_READ | FI_WRITE | FI_REMOTE_READ | FI_REMOTE_WRITE | FI_SEND | FI_RECV |
                     (k.local_only ? FI_LOCAL_COMM : FI_LOCAL_COMM | FI_REMOTE_COMM);
        caps_.mr_mode = (k.needs_local_desc ? FI_MR_LOCAL : 0) | (k.virt_addr ? FI_MR_VIRT_ADDR : 0) |
                        (k.provider_keys ? FI_MR_PROV_KEY | FI_MR_ALLOCATED : 0);
        caps_.msg_order = FI_ORDER_SAS | (k.send_after_write ? FI_ORDER_SAW : 0);
        caps_.max_msg_size = k.max_msg_size;
        caps_.rma_iov_limit = k.rma_iov_limit;
        caps_.iov_limit = k.rma_iov_limit;
        caps_.inject_size = 64;
        caps_.needs_local_desc = k.needs_local_desc;
        caps_.virt_addr = k.virt_addr;
        caps_.provider_keys = k.provider_keys;
        caps_.send_after_write = k.send_after_write;
        caps_.local_only = k.local_only;
        caps_.hmem = k.hmem;
        if (k.hmem) {
            caps_.caps |= FI_HMEM;
            caps_.mr_mode |= FI_MR_HMEM;
        }
        id_ = f_->next_endpoint++;
        Endpoint &e = f_->endpoints[id_];
        e.recv_bytes = opt.recv_buffer_bytes ? opt.recv_buffer_bytes : 256 * 1024;
        delivery_complete_ = opt.delivery_complete;
    }

    ~FakeTransport() override {
        std::lock_guard lock(f_->mu);
        f_->endpoints[id_].open = false;
        f_->endpoints[id_].regions.clear();
        // Its own operations and completions die with it, but for late writes: their bytes are in
        // the target's socket already, which the target still reads until it fences us (TCP: a
        // close sends what was sent before it). What peers sent it fails or stays.
        for (auto it = f_->ops.begin(); it != f_->ops.end();)
            it = it->from == id_ && !it->late ? f_->ops.erase(it) : std::next(it);
        for (auto it = f_->completions.begin(); it != f_->completions.end();)
            it = it->endpoint == id_ ? f_->completions.erase(it) : std::next(it);
        f_->fail_cut_ops();
    }

    const Capabilities &caps() const override { return caps_; }

    std::vector<uint8_t> local_address() override {
        const uint64_t v = kAddressTag | id_;
        std::vector<uint8_t> out(sizeof v);
        std::memcpy(out.data(), &v, sizeof v);
        return out;
    }

    PeerAddr insert_peer(std::span<const uint8_t> address) override {
        const uint32_t peer = Fabric::endpoint_id(address);
        if (!peer) fail(SG_ERR_PROTOCOL, "the peer's fake endpoint name is not one");
        std::lock_guard lock(f_->mu);
        // Both ends closed their side of a broken connection: a new one forms (looked up, not made:
        // making a link draws from the schedule's generator).
        if (auto l = f_->links.find({std::min(id_, peer), std::max(id_, peer)});
            l != f_->links.end() && l->second.broken && l->second.fenced_lo && l->second.fenced_hi) {
            l->second.broken = l->second.fenced_lo = l->second.fenced_hi = false;
        }
        Endpoint &e = f_->endpoints[id_];
        const PeerAddr a = e.next_av++;
        e.av[a] = peer;
        return a;
    }

    // Like fi_av_remove: what is still pending to the entry is canceled.
    void remove_peer(PeerAddr peer) override {
        std::lock_guard lock(f_->mu);
        Endpoint &e = f_->endpoints[id_];
        e.av.erase(peer);
        // A late write has left: its bytes are the target's to read (or fence) now.
        fail_pending([&](const Op &op) { return op.from == id_ && op.via == peer && !op.late; },
                     [](const Op &) { return std::make_pair(-ECANCELED, "fake: peer removed from the address vector"); });
    }

    // With f_->mu held: the operations `which` picks fail now (`why`: status and text) and leave.
    template <class Which, class Why>
    void fail_pending(Which which, Why why) {
        for (auto it = f_->ops.begin(); it != f_->ops.end();) {
            if (!which(*it)) {
                ++it;
                continue;
            }
            if (!it->completed) {
                const auto [status, text] = why(*it);
                f_->complete(*it, status, text);
            }
            it = f_->ops.erase(it);
        }
    }

    // Like rxm's fence: the entry leaves the address vector (posts to it fail from now on), what
    // is pending to it is canceled, and so is every write of the peer's to us that has not landed
    // (a connection closed under it), which its sender sees fail.
    // A local_only fabric (shm) has no connection to close: nothing changes, as there.
    bool fence(PeerAddr peer) override {
        std::lock_guard lock(f_->mu);
        if (f_->knobs.local_only) return false;
        Endpoint &e = f_->endpoints[id_];
        auto av = e.av.find(peer);
        if (av == e.av.end()) return true;
        const uint32_t other = av->second;
        e.av.erase(av);
        if (auto l = f_->links.find({std::min(id_, other), std::max(id_, other)}); l != f_->links.end() && l->second.broken)
            (id_ < other ? l->second.fenced_lo : l->second.fenced_hi) = true;
        auto ours = [&](const Op &op) { return op.from == id_ && op.via == peer && !op.late; };
        fail_pending([&](const Op &op) { return ours(op) || (op.from == other && op.to == id_ && !op.send); },
                     [&](const Op &op) {
                         return ours(op) ? std::make_pair(-ECANCELED, "fake: the peer was fenced")
                                         : std::make_pair(-ECONNRESET, "fake: the target closed the connection");
                     });
        return true;
    }

    Registration register_memory(void *addr, uint64_t len, uint64_t requested_key) override {
        return add_region(addr, len, requested_key, false);
    }

    Registration register_device_memory(void *addr, uint64_t len, uint64_t requested_key, int32_t cuda_device) override {
        if (!caps_.hmem) Transport::register_device_memory(addr, len, requested_key, cuda_device);
        {
            std::lock_guard lock(f_->mu);
            if (f_->knobs.refuse_device_memory)
                fail(SG_ERR_TRANSPORT, "fi_mr_regattr of " + std::to_string(len) + " bytes of CUDA device " +
                                           std::to_string(cuda_device) + ": Function not implemented (fake)");
        }
        return add_region(addr, len, requested_key, true);
    }

    Registration add_region(void *addr, uint64_t len, uint64_t requested_key, bool device) {
        std::lock_guard lock(f_->mu);
        Endpoint &e = f_->endpoints[id_];
        uint64_t key = requested_key;
        auto taken = [&](uint64_t k) {
            for (auto &[id, r] : e.regions)
                if (r.key == k) return true;
            return false;
        };
        if (caps_.provider_keys) {
            do key = f_->rng.next(); while (taken(key));
        } else if (taken(key)) {
            fail(SG_ERR_TRANSPORT, "fi_mr_reg of " + std::to_string(len) + " bytes: key in use (fake)");
        }
        const uint64_t rid = e.next_region++;
        e.regions[rid] = Region{reinterpret_cast<uint64_t>(addr), len, key, device};
        Registration r;
        r.key = key;
        r.remote_base = caps_.virt_addr ? reinterpret_cast<uint64_t>(addr) : 0;
        // Opaque ids, never dereferenced: a stale descriptor is found out, not followed.
        r.mr = reinterpret_cast<void *>(uintptr_t(rid));
        r.desc = caps_.needs_local_desc || device ? r.mr : nullptr;
        return r;
    }

    void deregister(Registration &reg) noexcept override {
        if (reg.mr) {
            std::lock_guard lock(f_->mu);
            f_->endpoints[id_].regions.erase(uint64_t(reinterpret_cast<uintptr_t>(reg.mr)));
        }
        reg = Registration{};
    }

    uint64_t live_registrations() const override {
        std::lock_guard lock(f_->mu);
        return f_->endpoints.at(id_).regions.size();
    }

    int post_write(PeerAddr peer, std::span<const LocalIov> local, uint64_t remote_addr, uint64_t key,
                   void *cookie) override {
        if (local.empty() || local.size() > caps_.rma_iov_limit)
            fail(SG_ERR_TRANSPORT, "fi_writemsg: " + std::to_string(local.size()) + " iovs (fake's limit " +
                                       std::to_string(caps_.rma_iov_limit) + ")");
        uint64_t len = 0;
        for (const LocalIov &v : local) len += v.len;
        if (len > caps_.max_msg_size) fail(SG_ERR_TRANSPORT, "fi_writemsg: longer than max_msg_size (fake)");
        std::lock_guard lock(f_->mu);
        Op op;
        op.iov.assign(local.begin(), local.end());
        op.remote_addr = remote_addr;
        op.key = key;
        op.len = len;
        if (int rc = admit(peer, cookie, op); rc) return rc;
        Endpoint &e = f_->endpoints[id_];
        e.flow.ops++;
        e.flow.bytes += len;
        e.flow.max_ops = std::max(e.flow.max_ops, e.flow.ops);
        e.flow.max_bytes = std::max(e.flow.max_bytes, e.flow.bytes);
        const Region *target = nullptr;
        uint64_t offset = remote_addr;
        if (f_->alive(op.to)) target = f_->target(op.to, key, remote_addr, len, offset);
        f_->log.push_back({op.seq, id_, op.to, key, target ? offset : remote_addr, len, target ? target->addr + offset : 0});
        if (caps_.needs_local_desc && !local_descs_cover(e, local)) {
            f_->complete(op, -EACCES, "fake: local protection error (a local buffer without its registration)");
            return 0;
        }
        for (const LocalIov &v : local) {
            if (!in_device_region(e, v)) continue;
            if (!local_descs_cover(e, std::span(&v, 1))) {
                f_->complete(op, -EACCES, "fake: a device buffer written without its registration's descriptor (FI_MR_HMEM)");
                return 0;
            }
            op.device_src = true;
        }
        op.early = caps_.send_after_write && !delivery_complete_ && f_->rng.chance(f_->knobs.early_completion);
        enqueue(std::move(op));
        return 0;
    }

    int post_send(PeerAddr peer, const void *buf, uint64_t len, void *desc, void *cookie) override {
        (void)desc;  // messages are copied (rxm's bounce buffers): no registration needed
        if (len > caps_.max_msg_size) fail(SG_ERR_TRANSPORT, "fi_send: longer than max_msg_size (fake)");
        std::lock_guard lock(f_->mu);
        Op op;
        op.send = true;
        op.len = len;
        if (int rc = admit(peer, cookie, op); rc) return rc;
        op.data.assign(static_cast<const uint8_t *>(buf), static_cast<const uint8_t *>(buf) + len);
        enqueue(std::move(op));
        return 0;
    }

    size_t poll(CompletionSink &sink) override;

    int wait_fd() const override { return -1; }
    bool prepare_wait() override { return false; }

  private:
    // The checks every post makes, with f_->mu held: EAGAIN by chance, the peer known, the link.
    // Returns -EAGAIN, or 0 with op's sequence, target and cookie set (op.to == 0: already failed).
    int admit(PeerAddr peer, void *cookie, Op &op) {
        Endpoint &e = f_->endpoints[id_];
        auto av = e.av.find(peer);
        if (av == e.av.end()) fail(SG_ERR_TRANSPORT, "fake: post to an address not in the address vector");
        if (f_->rng.chance(f_->knobs.eagain)) {
            f_->eagains++;
            return -EAGAIN;
        }
        op.seq = f_->next_seq++;
        op.from = id_;
        op.to = av->second;
        op.via = peer;
        op.cookie = cookie;
        if (!f_->knobs.local_only && f_->alive(id_) && f_->cut(id_, op.to) && f_->link(id_, op.to).posts_throw)
            fail(SG_ERR_TRANSPORT, "fake: connection to the peer was reset");
        return 0;
    }

    void enqueue(Op &&op) {
        Endpoint &target = f_->endpoints[op.to];
        op.ready_at = target.polls + (f_->rng.chance(f_->knobs.delay)
                                          ? 1 + f_->rng.below(std::max<uint32_t>(1, f_->knobs.max_delay_polls))
                                          : 0);
        f_->ops.push_back(std::move(op));
        f_->fail_cut_ops();
    }

    static bool in_device_region(const Endpoint &e, const LocalIov &v) {
        const uint64_t a = reinterpret_cast<uint64_t>(v.addr);
        for (auto &[id, r] : e.regions)
            if (r.device && a + v.len > r.addr && a < r.addr + r.len) return true;
        return false;
    }

    bool local_descs_cover(const Endpoint &e, std::span<const LocalIov> local) const {
        for (const LocalIov &v : local) {
            auto r = e.regions.find(uint64_t(reinterpret_cast<uintptr_t>(v.desc)));
            const uint64_t a = reinterpret_cast<uint64_t>(v.addr);
            if (!v.desc || r == e.regions.end() || a < r->second.addr ||
                !in_bounds(a - r->second.addr, v.len, r->second.len))
                return false;
        }
        return true;
    }

    std::shared_ptr<Fabric::State> f_;
    Capabilities caps_;
    uint32_t id_ = 0;
    bool delivery_complete_ = false;  // OpenOptions::delivery_complete: no early completions
};

struct Event {
    enum class Kind { Message, ReceiveError, Completion } kind;
    std::vector<uint8_t> bytes;
    void *cookie = nullptr;
    int status = 0;
    std::string text;
};

size_t FakeTransport::poll(CompletionSink &sink) {
    {
        std::function<void()> hook;
        {
            std::lock_guard lock(f_->mu);
            hook = f_->hook;
        }
        if (hook && !t_in_hook) {
            t_in_hook = true;
            try {
                hook();
            } catch (...) {
                t_in_hook = false;
                throw;
            }
            t_in_hook = false;
        }
    }
    std::vector<Event> events;
    {
        std::lock_guard lock(f_->mu);
        Endpoint &me = f_->endpoints[id_];
        me.polls++;
        const uint32_t cap = std::max<uint32_t>(1, f_->knobs.max_events_per_poll);
        // A dead endpoint lands nothing (what it posted failed when it died or when it posted).
        if (!me.dead) {
            for (Op &op : f_->ops)
                if (op.from == id_ && op.early && !op.completed) {
                    f_->snapshot(op);
                    f_->complete(op, 0, "");
                    op.completed = true;
                }
            // Land what is ready, in posting order, unless an earlier operation on the same link must
            // land first: sends keep their order (FI_ORDER_SAS), and with send_after_write a send
            // waits for the writes posted before it.
            std::map<uint32_t, std::pair<bool, bool>> earlier;  // initiator -> (a send, a write) still waiting
            for (auto it = f_->ops.begin(); it != f_->ops.end() && events.size() < cap;) {
                Op &op = *it;
                if (op.to != id_) {
                    ++it;
                    continue;
                }
                auto &[send_waits, write_waits] = earlier[op.from];
                const bool blocked = op.send && (send_waits || (caps_.send_after_write && write_waits));
                if (op.ready_at > me.polls || blocked) {
                    (op.send ? send_waits : write_waits) = true;
                    ++it;
                    continue;
                }
                if (op.send) {
                    Event ev;
                    if (op.data.size() > me.recv_bytes) {
                        ev.kind = Event::Kind::ReceiveError;
                        ev.status = -EMSGSIZE;
                        ev.text = "fake: message truncated (larger than the receive buffers)";
                    } else {
                        ev.kind = Event::Kind::Message;
                        ev.bytes = std::move(op.data);
                    }
                    events.push_back(std::move(ev));
                    f_->complete(op, 0, "");
                } else if (op.pinned) {
                    // The rest of a partial landing: its key was checked at the first byte.
                    f_->land(op.pinned + op.landed, op.data.data() + op.landed, op.len - op.landed, op.pinned_device);
                } else {
                    uint64_t offset = 0;
                    const Region *r = f_->target(id_, op.key, op.remote_addr, op.len, offset);
                    if (r) {
                        uint8_t *const first = reinterpret_cast<uint8_t *>(r->addr) + offset;
                        uint8_t *dst = first;
                        if (op.snapped) {
                            f_->land(dst, op.data.data(), op.len, r->device);
                        } else {
                            for (const LocalIov &v : op.iov) {
                                f_->land(dst, v.addr, v.len, r->device || op.device_src);
                                dst += v.len;
                            }
                        }
                        // A byte the wire got wrong, as a torn or stale landing leaves it.
                        if (op.len && !r->device && f_->rng.chance(f_->knobs.corrupt_landing))
                            first[f_->rng.below(op.len)] ^= 0x40;
                    }
                    if (!op.completed)
                        f_->complete(op, r ? 0 : -EACCES,
                                     r ? "" : "fake: remote access error (unknown key, or outside the registration)");
                }
                it = f_->ops.erase(it);
            }
        }
        for (auto it = f_->completions.begin(); it != f_->completions.end() && events.size() < cap;) {
            if (it->endpoint != id_ || it->ready_at > me.polls) {
                ++it;
                continue;
            }
            if (it->write) {
                me.flow.ops--;
                me.flow.bytes -= it->len;
            }
            Event ev;
            ev.kind = Event::Kind::Completion;
            ev.cookie = it->cookie;
            ev.status = it->status;
            ev.text = std::move(it->text);
            events.push_back(std::move(ev));
            it = f_->completions.erase(it);
        }
    }
    for (Event &ev : events) {
        switch (ev.kind) {
            case Event::Kind::Message: sink.on_message(ev.bytes); break;
            case Event::Kind::ReceiveError: sink.on_complete(nullptr, ev.status, ev.text.c_str()); break;
            case Event::Kind::Completion:
                sink.on_complete(ev.cookie, ev.status, ev.status ? ev.text.c_str() : nullptr);
                break;
        }
    }
    return events.size();
}

}  // namespace

Fabric::Fabric(uint64_t seed, const Knobs &knobs) : state_(std::make_shared<State>(seed, knobs)) {
    std::lock_guard lock(g_install_mu);
    if (g_installed) fail(SG_ERR_INVALID_STATE, "a fake fabric is installed already");
    g_installed = state_;
}

Fabric::~Fabric() {
    std::lock_guard lock(g_install_mu);
    if (g_installed == state_) g_installed.reset();
}

void Fabric::set_knobs(const Knobs &knobs) {
    std::lock_guard lock(state_->mu);
    state_->knobs = knobs;
}

uint32_t Fabric::endpoint_id(std::span<const uint8_t> address) {
    uint64_t v = 0;
    if (address.size() != sizeof v) return 0;
    std::memcpy(&v, address.data(), sizeof v);
    return (v & ~uint64_t(UINT32_MAX)) == kAddressTag ? uint32_t(v) : 0;
}

void Fabric::drop_link(uint32_t a, uint32_t b) {
    std::lock_guard lock(state_->mu);
    if (state_->knobs.local_only) return;
    state_->link(a, b).broken = true;
    state_->fail_cut_ops();
}

void Fabric::kill(uint32_t endpoint) {
    std::lock_guard lock(state_->mu);
    state_->endpoints[endpoint].dead = true;
    state_->fail_cut_ops();
}

void Fabric::on_poll(std::function<void()> hook) {
    std::lock_guard lock(state_->mu);
    state_->hook = std::move(hook);
}

std::vector<WriteRecord> Fabric::writes() const {
    std::lock_guard lock(state_->mu);
    return state_->log;
}

void Fabric::watch_reused(const void *addr, uint64_t len, const std::string &what) {
    std::lock_guard lock(state_->mu);
    const uintptr_t lo = reinterpret_cast<uintptr_t>(addr);
    state_->reused.push_back({lo, lo + len, what});
}

std::vector<std::string> Fabric::landings_in_reused() const {
    std::lock_guard lock(state_->mu);
    return state_->stale_landings;
}

Flow Fabric::flow(uint32_t endpoint) const {
    std::lock_guard lock(state_->mu);
    auto it = state_->endpoints.find(endpoint);
    return it == state_->endpoints.end() ? Flow{} : it->second.flow;
}

size_t Fabric::stuck() const {
    std::lock_guard lock(state_->mu);
    size_t n = 0;
    for (const Op &op : state_->ops) n += !state_->alive(op.to) && state_->alive(op.from);
    return n;
}

size_t Fabric::pending() const {
    const size_t never = stuck();
    std::lock_guard lock(state_->mu);
    return state_->ops.size() + state_->completions.size() - never;
}

uint64_t Fabric::eagains() const {
    std::lock_guard lock(state_->mu);
    return state_->eagains;
}

std::unique_ptr<Transport> open_fake(const OpenOptions &options) {
    std::shared_ptr<Fabric::State> fabric;
    {
        std::lock_guard lock(g_install_mu);
        fabric = g_installed;
    }
    if (!fabric)
        fail(SG_ERR_NO_PROVIDER, "provider 'fake' is an in-memory fabric for tests: install one first "
                                 "(sg::transport::fake::Fabric)");
    return std::make_unique<FakeTransport>(std::move(fabric), options);
}

namespace {
// This file is linked into the tests only (smartgen_transport_fake): wherever it is, a context that
// names "fake" gets it.
const bool g_registered = (register_test_provider("fake", &open_fake), true);
}  // namespace

}  // namespace sg::transport::fake
