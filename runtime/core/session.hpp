// Internal to core/ (core.hpp is the folder's header): a session with one peer context and what
// it holds — its state, the provider and peer address, its outbox, the pools exported to it and
// the peer's, staging slots, the transfers by role, and authentication of blob-made sessions.
#pragma once

#include "common/common.hpp"
#include "core/liveness.hpp"
#include "core/matchbook.hpp"
#include "kv/kv.hpp"
#include "transport/transport.hpp"
#include "wire/wire.hpp"

#include <smartgen/smartgen.h>

#include <atomic>
#include <condition_variable>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

namespace sg::core {

class Context;
class Session;
class Transfer;
class KvPool;
struct SendUnit;

// A transfer's or session's status and its detail, as one snapshot.
struct Outcome {
    sg_status_t status;
    std::string message;
};

// Staging: a peer writes packed segments into one of our receive slots, then tells us which
// segments they are; we unpack and return the slot.
struct StagingArea {
    // The id a session's receive slots are exported under (KV pools have random nonzero ids).
    static constexpr uint64_t kHandleId = 0;
    static constexpr uint64_t kSlotBytes = 4ull << 20;
    static constexpr uint32_t kSlots = 8;
    uint8_t *base = nullptr;  // mmap'd kSlots * kSlotBytes
    transport::Registration reg;
    void allocate();
    void release(transport::Transport *tp) noexcept;
};

struct RemotePool {
    kv::Layout layout;
    uint32_t regions_per_layer = 0;
    std::vector<wire::Region> regions;
    bool device_direct = false;  // an SG_MEM_CUDA pool with keys: written by RMA, not staged
};

// Cookie for every posted operation; starts with the provider's context space.
struct OpCookie {
    alignas(16) uint8_t provider_ctx[transport::kCookieBytes];
    enum class Kind : uint8_t { Write, StagedWrite, Send } kind = Kind::Write;
    Transfer *xfer = nullptr;  // kept alive by Transfer::inflight until the completion
    Session *session = nullptr;
    uint32_t layer = 0;
    uint32_t staging_slot = 0;
    uint64_t len = 0;  // payload bytes of a write, for the in-flight bounds
    SendUnit *unit = nullptr;  // selective paths: the unit this write belongs to
    Vec<uint8_t> bytes;  // message body for sends; segment list encoding for staged writes
    bool in_use = false;
    // Settled without the provider's completion (its peer is gone and the provider will never
    // complete it, see Session::abandon_ops); if the completion comes after all, it only returns
    // the cookie.
    bool abandoned = false;
};

// A session's life (docs/protocol.md draws it):
//   Authenticating  made from a metadata blob; the peer's fabric proof not checked yet (only auth
//                   frames are taken; the rest wait in held_frames)
//   Open            transfers run
//   Draining        closing: sg_session_close waits for its transfers, or a Bye went out and its
//                   answer is awaited; no new transfers
//   Closed          lost, refused or closed: nothing more is sent; its registrations are dropped
enum class SessionState : uint8_t { Authenticating, Open, Draining, Closed };
bool legal_transition(SessionState from, SessionState to);
const char *state_name(SessionState s);

// Our side of the close handshake, each step once and in this order:
//   None      no Bye sent
//   ByeSent   we are closing: the peer's Bye (its answer, or its own crossing ours) ends it
//   Answered  that Bye came: the peer has read everything we sent before ours
// (A Bye the peer starts while we are in None loses the session at once: no step here.)
enum class ByeExchange : uint8_t { None, ByeSent, Answered };

class Session {
  public:
    Session(Context *ctx, const wire::Hello &peer, const sg_session_options_t &opt);
    ~Session();
    Context *ctx;
    uint64_t peer_ctx_id = 0;
    size_t transport_index = 0;
    transport::Transport *tp = nullptr;
    std::shared_ptr<transport::Transport> tp_owner;  // keeps a renewed transport open while we use it
    transport::PeerAddr peer = 0;
    std::string provider;
    // The state: changed only through advance(), with the context's mutex held, which throws
    // SG_ERR_INTERNAL for a transition the machine does not have (legal_transition below).
    SessionState state() const { return state_; }
    void advance(SessionState to);
    bool closed() const { return state_ == SessionState::Closed; }
    sg_status_t error = SG_OK;
    std::string error_message;
    std::deque<std::vector<uint8_t>> notifications;  // received, not yet taken by the host
    uint64_t notifications_dropped = 0;
    PeerLiveness liveness;       // any frame from the peer keeps it alive (liveness.hpp)
    uint64_t last_sent_ns = 0;   // any frame to the peer accepted by the provider
    // How often the peer needs a frame from us (its Ping, 1.7): its peer timeout may be shorter
    // than ours, and our keep-alives must keep *its* clock, not ours. 0: not said.
    uint64_t peer_keepalive_ns = 0;
    static constexpr uint64_t kMinKeepaliveNs = 20000000;

    // Our pools registered for this session (one registration per region) and exported.
    struct LocalReg {
        std::vector<transport::Registration> regions;
        bool device_direct = false;  // an SG_MEM_CUDA pool registered with the provider (FI_HMEM)
    };
    std::map<uint64_t, LocalReg> local_regs;         // pool id -> registrations
    std::map<uint64_t, RemotePool> remote_pools;      // peer's pool id -> descriptor
    // The transfers it runs by request id and transfer id, the halves still waiting for each other
    // and the cancels remembered across the match (matchbook.hpp).
    Matchbook matchbook;
    std::deque<OpCookie *> outbox;  // sends not yet accepted by the provider, kept in order
    // Page digests: megabytes of messages that may wait; the outbox (notices, fetches, the host's
    // notifications) goes first.
    std::deque<OpCookie *> bulk_outbox;
    // Authentication. Sessions bootstrapped over TCP are proven before they exist; sessions made
    // from metadata blobs prove themselves over the fabric first: until the peer's proof arrives,
    // only auth messages leave (auth_outbox) and the peer's other frames wait in held_frames.
    // The peer proved the key (or neither side has one). A fact, not a state: frames of a session
    // that closed before its peer proved itself are still refused.
    bool proven = true;
    std::vector<uint8_t> auth_nonce;  // our challenge to the peer
    std::deque<OpCookie *> auth_outbox;
    std::deque<std::vector<uint8_t>> held_frames;
    uint64_t held_bytes = 0;  // held_frames, counted as Context::frame_cost
    // Only one side may open the fabric connection: when both RDM endpoints connect to each other at
    // once, tcp;ofi_rxm can lose both connections. The context with the lower id speaks first; the
    // other holds its outbox until it hears from the peer.
    bool may_send = false;
    uint16_t peer_minor = 0;     // the peer's wire protocol minor (what it understands)
    ByeExchange bye() const { return bye_; }
    // The next step of the close handshake; SG_ERR_INTERNAL for any other.
    void advance_bye(ByeExchange to);

    StagingArea recv_staging;  // the peer writes here
    StagingArea send_staging;  // we pack here
    RemotePool peer_staging;   // the peer's recv_staging (regions[0])
    bool have_peer_staging = false;
    uint32_t free_peer_slots = 0;  // bitmask of the peer's free receive slots
    uint32_t free_send_slots = 0;  // bitmask of our free pack slots
    // Each slot's generation (StagedChunk, 1.7): the last one we wrote into the peer's slot, and
    // the last one the peer wrote into ours. A chunk notice whose generation did not grow names
    // bytes that are not the ones it describes.
    uint32_t peer_slot_generation[StagingArea::kSlots] = {};
    uint32_t recv_slot_generation[StagingArea::kSlots] = {};
    // Measured throughput (bytes per ns, smoothed) of candidate layers sent directly [0] and
    // staged [1] on this session; 0 while unmeasured. Drives SG_STAGING_AUTO.
    double path_rate[2] = {0, 0};
    uint64_t probe_ns[2] = {0, 0};  // when a candidate layer last went down a path still unmeasured
    uint32_t candidate_layers = 0;
    uint64_t bytes_inflight = 0;
    uint64_t speculative_inflight = 0;
    uint64_t proactive_inflight = 0;  // bytes of proactive writes in flight (bounded once decode may fetch)
    uint64_t last_fetch_ns = 0;  // the peer's last on-demand fetch (the speculative path yields after it)
    // The rate at which the speculative path's units were delivered (bytes per ns, smoothed; 0 while
    // unmeasured), over windows of at least kRateWindowNs: a lower bound of what the link carries,
    // which decides whether a selective transfer's next layer goes whole (paths_prefill.cpp).
    double bulk_rate = 0;
    uint64_t rate_window_ns = 0, rate_window_bytes = 0;
    bool regs_dropped = false;  // registrations closed after the session was lost
    // Every connection to the peer closed (Transport::fence): nothing it sent still lands here and
    // nothing of ours is still read by the provider. Set when the session is lost or detached.
    bool connections_fenced = false;
    bool peer_said_bye = false;  // the session ended by the peer's Bye (graceful: no fence)
    uint64_t lost_ns = 0;       // when the session was lost (CLOCK_MONOTONIC), 0 while it lives
    // Unfinished transfers of the session, against max_transfers_per_session.
    size_t unfinished() const;

    // ---- The host's verbs (session_host.cpp): the ABI's calls, each taking the context's mutex
    // itself. ----
    // Until the peer proved its key (SG_OK); throws the session's error when it failed, and
    // SG_ERR_TIMEOUT when timeout_ns passed first.
    sg_status_t wait_ready(uint64_t timeout_ns);
    // Registers the pool for this session and tells the peer (HandleExport); once per pool.
    void export_kv(KvPool &pool);
    void notify(std::span<const uint8_t> data);
    // The oldest notification into buf (SG_ERR_AGAIN when none; query: only its size into len).
    sg_status_t next_notification(void *buf, size_t cap, bool query, size_t &len);
    Outcome outcome() const;  // the session's error, if any
    // sg_session_close: drain, then say Bye. Throws SG_ERR_TIMEOUT (still draining) on timeout.
    void close_gracefully(uint64_t timeout_ns);
    // Says Bye and closes; waits until the peer answered the Bye (or was lost) and our sends that
    // name the session drained, or until deadline_ns (CLOCK_MONOTONIC; 0: kDestroyDrainNs from
    // now, what sg_session_destroy allows).
    void close(uint64_t deadline_ns = 0);
    // Forgets a session the peer never opened (bootstrap outcome): no Bye, nothing drained.
    void discard();


  private:
    // ---- The engine's steps: what the context's progress does to a session, always with the
    // context's mutex held. The context drives them and its transfers call them; the host reaches
    // a session only through the verbs above. ----
    friend class Context;
    friend class Transfer;
    // Sending (session.cpp): the outboxes, in order, within the in-flight bounds.
    void send(const std::vector<uint8_t> &frame, Transfer *t = nullptr, bool bulk = false);
    void send_auth(const std::vector<uint8_t> &frame);
    void flush_outbox();
    void drop_unsent(bool transfer_frames_only);
    bool may_post_bytes(uint64_t len) const;
    void note_bulk_delivered(uint64_t bytes);
    void uncount_inflight(const SendUnit &u, uint64_t len);
    void send_quiesced(uint64_t decode_xfer_id);
    // Staging (staging.cpp).
    bool choose_staging();
    void offer_staging();
    bool ensure_send_staging();
    // The end of the session (session.cpp, completions.cpp).
    // peer_closed: the peer said Bye (not a failure: no error log, not counted as a lost peer).
    void lose(sg_status_t status, const std::string &why, bool peer_closed = false);
    // Settles the session's operations still in flight as failed, for providers that never
    // complete operations addressed to a dead peer (local_only): otherwise they would hold the
    // context's operation budget and keep their transfers from quiescing forever.
    void abandon_ops();
    // Operations still in the provider stop naming it (their completions then touch nothing of
    // the session); a write that belongs to no transfer is settled at once.
    void forget_in_ops();
    void drop_registrations();
    // Closes the peer's connections (Transport::fence) and then its keys: the one place memory
    // the peer could write becomes the host's again. Runs when the session is lost, or detached
    // without a finished close handshake.
    void fence();
    // The peer can no longer write into anything this session exported: the session ended and its
    // registrations are closed (after the fence, or once our own operations on them completed).
    bool writes_stopped() const { return closed() && regs_dropped; }
    // The protocol (protocol.cpp; the handlers also in session_auth.cpp, staging.cpp, paths_*.cpp): each
    // frame of the peer decoded by decode_then and handed to its message type's handler.
    void heard_from();
    void forget_held_frames();
    void deliver_orphans();
    void match(const std::shared_ptr<Transfer> &t, const wire::Expect &e);
    // Decode side: the session's unfinished transfer with this id (moved to Running: the prefill
    // side speaks of it), or NULL.
    Transfer *running_expect(uint64_t decode_xfer_id);
    struct Route {
        const char *name = nullptr;
        bool auth = false;  // taken before the peer proved its key
        void (Session::*run)(std::span<const uint8_t>, const char *) = nullptr;
    };
    static const Route &route(wire::MsgType type);
    template <class M, void (Session::*Handler)(M &)>
    static constexpr Route route_to(const char *name, bool auth = false);
    template <class M, void (Session::*Handler)(M &)>
    void decode_then(std::span<const uint8_t> body, const char *name);
    void on_auth_challenge(wire::AuthChallenge &m);
    void on_auth_proof(wire::AuthProof &m);
    void on_auth_result(wire::AuthResult &m);
    void on_handle_export(wire::HandleExport &m);
    void on_bye(wire::Bye &m);
    void on_ping(wire::Ping &m);
    void on_notify(wire::Notify &m);
    void on_expect(wire::Expect &m);
    void on_layer_ready(wire::LayerReady &m);
    void on_transfer_done(wire::TransferDone &m);
    void on_transfer_ack(wire::TransferAck &m);
    void on_quiesced(wire::Quiesced &m);
    void on_cancel(wire::TransferError &m);
    void on_error(wire::TransferError &m);
    void on_transfer_error(wire::TransferError &m, wire::MsgType type);
    void on_cancel_ack(wire::CancelAck &m);
    void on_release(wire::Release &m);
    void on_reposted(wire::Reposted &m);
    void on_staged_chunk(wire::StagedChunk &m);
    void on_staging_credit(wire::StagingCredit &m);
    void on_selective(wire::Selective &m);
    void on_digests(wire::Digests &m);
    void on_blocks_ready(wire::BlocksReady &m);
    void on_fetch(wire::Fetch &m);
    void on_block_crcs(wire::BlockCrcs &m);  // verify.cpp

  private:
    // The end of the session on this side, with the context's mutex held: closed, its unsent
    // frames dropped, operations still in the provider no longer naming it, and the context's
    // entry for the peer gone.
    void detach_locked();
    SessionState state_ = SessionState::Authenticating;
    ByeExchange bye_ = ByeExchange::None;
};

}  // namespace sg::core
