// runtime/transport: the one interface every fabric sits behind, and its libfabric implementation.
// Depends on common/ only. Order of use: capabilities -> register -> post -> poll -> release.
//
// A Transport is driven by one thread at a time (the context serialises calls); it never calls back
// into the runtime except through the CompletionSink passed to poll().
#pragma once

#include "common/common.hpp"

#include <cerrno>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

namespace sg::transport {

// What a provider offers, as the runtime needs to know it.
struct Capabilities {
    std::string provider;  // e.g. "tcp;ofi_rxm"
    std::string fabric;
    std::string domain;
    uint64_t caps = 0;
    uint64_t mr_mode = 0;
    uint64_t msg_order = 0;
    uint64_t max_msg_size = 0;
    uint64_t rma_iov_limit = 0;
    uint64_t iov_limit = 0;
    uint64_t inject_size = 0;
    uint64_t mr_key_size = 8;
    // FI_HMEM with the CUDA interface: device memory registers and moves by RMA (GPUDirect).
    // Asked for at open unless SG_FI_HMEM=0; a provider that does not offer it opens without.
    bool hmem = false;
    // Derived from the bits above.
    bool needs_local_desc = false;    // FI_MR_LOCAL: local buffers need a registration descriptor
    bool virt_addr = false;           // FI_MR_VIRT_ADDR: remote addresses are virtual addresses
    bool provider_keys = false;       // FI_MR_PROV_KEY: keys come from the provider
    bool send_after_write = false;    // FI_ORDER_SAW: a send never overtakes an earlier write
    // FI_LOCAL_COMM without FI_REMOTE_COMM: peers on this host only (shm). Such a provider has no
    // connection that breaks when a peer dies: operations addressed to a dead peer never complete,
    // and its wait object does not fire when a peer writes into our queues.
    bool local_only = false;
    // Lanes a transport stripes writes over (lanes.cpp); 1 for a plain endpoint.
    uint32_t lanes = 1;
    // post_write_as keeps background bulk off the connection that carries the messages and urgent
    // writes (lanes.cpp: lanes > 1), so neither queues behind bulk in a socket buffer.
    bool bulk_apart = false;
};

// What a write is to the session, for transports that can keep classes apart (post_write_as).
enum class WriteClass {
    Default,  // the full path: striped over every lane as throughput asks
    Urgent,   // an on-demand fetch's reply: with the session's messages, ahead of any bulk
    Bulk,     // background bulk (proactive, speculative): apart from the messages and urgent writes
};

// A candidate as ranked for the runtime, with the reason it was kept or rejected.
struct Candidate {
    Capabilities caps;
    bool rdm = false;       // endpoint type FI_EP_RDM
    bool usable = false;
    int rank = -1;          // lower is better for a remote peer
    std::string reason;
};

// Ranks what fi_getinfo found (or a fake table in tests): usable needs RDM + FI_RMA + FI_MSG and an
// MR regime this runtime implements; verbs;ofi_rxm and efa come first, then tcp;ofi_rxm, and shm is
// kept for peers on the same host only. The result keeps the input order stable within a rank.
std::vector<Candidate> rank_candidates(std::vector<Candidate> found);
// The candidate to use for a peer on another host (index into ranked, or -1), and for one on this host.
int choose_remote(const std::vector<Candidate> &ranked);
int choose_local(const std::vector<Candidate> &ranked);
// Normalises a provider name the user typed ("tcp" -> "tcp;ofi_rxm", "verbs" -> "verbs;ofi_rxm").
std::string canonical_provider(const std::string &name);

// Everything libfabric reports for an RDM endpoint with FI_RMA | FI_MSG, bound near local_addr.
std::vector<Candidate> discover(const char *local_addr);

using PeerAddr = uint64_t;  // fi_addr_t

struct Registration {
    uint64_t key = 0;          // the remote key the peer uses
    uint64_t remote_base = 0;  // what the peer adds offsets to (virtual address, or 0)
    void *desc = nullptr;      // local descriptor for FI_MR_LOCAL providers
    void *mr = nullptr;        // provider's handle
};

struct LocalIov {
    const void *addr;
    uint64_t len;
    void *desc;
};

// The runtime's side of poll(): told about every completion, in completion order.
class CompletionSink {
  public:
    virtual ~CompletionSink() = default;
    // cookie is what was passed to post_*; status 0 or a negative errno-style code with text.
    virtual void on_complete(void *cookie, int status, const char *error_text) = 0;
    // A message arrived; bytes are valid only during the call.
    virtual void on_message(std::span<const uint8_t> bytes) = 0;
};

class Transport {
  public:
    virtual ~Transport() = default;
    virtual const Capabilities &caps() const = 0;
    // The endpoint's name for peers. A libfabric endpoint opens on the first call (this, or
    // insert_peer): until a context makes its first session it has a fabric, domain and completion
    // queue but no endpoint, whose provider buffers (rxm: ~70 MB a tcp lane) it does not need yet.
    // Callers serialize it with poll() as with every other call.
    virtual std::vector<uint8_t> local_address() = 0;
    virtual PeerAddr insert_peer(std::span<const uint8_t> address) = 0;
    virtual void remove_peer(PeerAddr peer) = 0;
    // Registers [addr, addr+len) for local and remote read/write. requested_key is used unless the
    // provider chooses keys. Throws Error(SG_ERR_TRANSPORT) with the provider's text.
    virtual Registration register_memory(void *addr, uint64_t len, uint64_t requested_key) = 0;
    // The same for CUDA device memory of `cuda_device` (FI_HMEM with the CUDA interface: GPUDirect
    // RDMA on verbs/EFA). Only where caps().hmem; otherwise, or when the provider refuses that
    // memory, throws (SG_ERR_UNSUPPORTED / SG_ERR_TRANSPORT) and the runtime stages the pool.
    virtual Registration register_device_memory(void *addr, uint64_t len, uint64_t requested_key, int32_t cuda_device) {
        (void)addr, (void)len, (void)requested_key, (void)cuda_device;
        fail(SG_ERR_UNSUPPORTED, "provider '" + caps().provider + "' cannot register CUDA memory (no FI_HMEM)");
    }
    virtual void deregister(Registration &reg) noexcept = 0;
    // Posting returns 0, or -EAGAIN when the provider's queue is full (retry after poll), or throws.
    // cookie must point at storage of at least kCookieBytes that stays valid until completion.
    virtual int post_write(PeerAddr peer, std::span<const LocalIov> local, uint64_t remote_addr, uint64_t key,
                           void *cookie) = 0;
    // The same, saying what the write is; a transport with one connection treats every class alike.
    virtual int post_write_as(WriteClass cls, PeerAddr peer, std::span<const LocalIov> local, uint64_t remote_addr,
                              uint64_t key, void *cookie) {
        (void)cls;
        return post_write(peer, local, remote_addr, key, cookie);
    }
    virtual int post_send(PeerAddr peer, const void *buf, uint64_t len, void *desc, void *cookie) = 0;
    // Reaps completions and arrived messages without blocking; returns how many events were handled.
    virtual size_t poll(CompletionSink &sink) = 0;
    // A file descriptor that becomes readable when poll() has work, after prepare_wait() returned
    // true; -1 when the provider offers none (then callers poll with short sleeps).
    virtual int wait_fd() const = 0;
    virtual bool prepare_wait() = 0;
    // Registrations made through register_memory and not yet deregistered (the runtime's own
    // receive buffers excluded): a leak check for soaks and tests.
    virtual uint64_t live_registrations() const = 0;

    // Lanes (several endpoints striped as one, lanes.cpp). A plain endpoint has one lane and these
    // fall back to the calls above. lane_addresses()[0] is local_address(); a peer that names only
    // its first lane (an older or single-lane peer) gets every operation on lane 0.
    virtual std::vector<std::vector<uint8_t>> lane_addresses() { return {local_address()}; }
    // What the peer's striped transport speaks (its wire minor, docs/protocol.md 3.1):
    // - Plain (before 1.5): plain messages on lane 0 alone; lane 0's failure is the session's.
    // - Framed (1.5): messages in the envelope (sequence numbers, acks, lane-loss notices), so a
    //   session's messages move off a lane that breaks; a write that breaks a lane fails.
    // - Fencing (1.6): also answers a lane-loss notice once it has closed its own connection on that
    //   lane (LaneFenced), so a write that broke a lane is sent again on another, at most once, only
    //   after no late copy of it can land.
    // - Healing (1.7): a lane given up is closed in two steps (each side fences, then, once the
    //   other has, closes again whatever connection the other opened meanwhile) and then comes back:
    //   its address is inserted anew, so a session survives any number of lane resets as long as
    //   one lane is up at a time.
    enum class LaneProtocol : uint8_t { Plain, Framed, Fencing, Healing };
    virtual PeerAddr insert_peer_lanes(std::span<const std::vector<uint8_t>> addresses, LaneProtocol peer_protocol) {
        (void)peer_protocol;
        if (addresses.empty()) fail(SG_ERR_PROTOCOL, "the peer named no endpoint");
        return insert_peer(addresses[0]);
    }
    struct LaneStats {
        uint32_t lanes = 1;
        uint64_t failovers = 0;    // writes moved off a failed lane and completed on another
        uint64_t lanes_lost = 0;   // (peer, lane) pairs given up after an error
        uint64_t lanes_healed = 0; // of those, the ones back in use (1.7 peers)
        std::vector<uint64_t> bytes_per_lane;
        uint64_t streams = 0;      // senders' message streams the envelope keeps state for
        uint64_t early_bytes = 0;  // messages held until an earlier one of their stream arrives
    };
    virtual LaneStats lane_stats() const { return {}; }
    // The runtime has given up on this peer (its session is lost): operations the transport still
    // holds for it and has not handed to the provider complete now with -ECANCELED. A plain
    // endpoint holds none.
    virtual void peer_lost(PeerAddr peer) { (void)peer; }
    // The fence: closes every connection to the peer, under the provider's lock, so that nothing
    // the peer sent lands here from the return on (a write whose header was accepted and whose
    // payload is still on its way included) and nothing this side posted to it is read from local
    // memory any more (those operations complete as failed). Idempotent; the handle stays the
    // caller's until remove_peer, and posts to it fail. Returns true when that holds; false where
    // the provider has no connection to close (shm, EFA) or may not close it (FI_AV_REMOVE_CLEANUP
    // set off by the host): then closing the keys the peer was given is the only fence, and the
    // caller may do so only once its own operations on them have completed.
    virtual bool fence(PeerAddr peer) {
        (void)peer;
        return false;
    }
};

// Cookies handed to post_* start with provider context space.
inline constexpr size_t kCookieBytes = 64;

// The status of a write a striped transport gave up because its lane broke while the peer lives
// (the peer could not confirm the lane fenced, or the write broke a second lane): the write's and
// its transfer's failure, not the session's. A connection error (is_connection_error) loses the
// session above, which only losing every lane may do.
inline constexpr int kLaneWriteGivenUp = -ENOLINK;

struct OpenOptions {
    std::string provider;    // canonical name; "" = best ranked for a remote peer
    std::string local_addr;  // "" = 127.0.0.1
    size_t recv_buffer_bytes = 0;
    size_t recv_buffers = 0;
    // Every write completes only once it is placed at the target (FI_DELIVERY_COMPLETE), whatever
    // ordering the provider offers: what a striped transport's lanes need, since a notice on one
    // lane cannot be ordered after writes on another.
    bool delivery_complete = false;
    // Striping (lanes.cpp): > 1 opens that many endpoints and spreads writes over them.
    uint32_t lanes = 1;
    // Writes smaller than this stay on lane 0 (posted in the caller's call, no handover).
    uint64_t lane_small_write_bytes = 256 * 1024;
    // Rails: local addresses the lanes bind to, round-robin (empty: local_addr for all).
    std::vector<std::string> rail_addrs;
    // true: each lane progresses on its own thread; false: poll() drives them (deterministic, for
    // the fake fabric's seeded schedules).
    bool lane_threads = true;
};

std::unique_ptr<Transport> open_libfabric(const OpenOptions &options);
// A striped transport over options.lanes endpoints that open_one opens (lanes.cpp).
std::unique_ptr<Transport> open_striped(const OpenOptions &options,
                                        std::unique_ptr<Transport> (*open_one)(const OpenOptions &));
// Opens the transport that options.provider names: a libfabric provider, or a test fabric that
// registered under that name.
std::unique_ptr<Transport> open(const OpenOptions &options);

// Test fabrics (transport/fake.hpp, "fake") live in a library only the tests link, and register
// their opener here when they are linked in; a name no libfabric provider has. nullptr removes it.
using OpenFn = std::unique_ptr<Transport> (*)(const OpenOptions &);
void register_test_provider(const std::string &name, OpenFn open);

}  // namespace sg::transport
