// runtime/core: the context and what it owns — sessions and their bootstrap, KV pools, transfers and
// the progress engine that runs them. Uses every other runtime folder; abi/ is its only user.
//
// Locking: one mutex per context guards all of its state and every call into its transports (which
// are opened FI_THREAD_DOMAIN). The progress thread and API threads take it for short sections and
// never block while holding it; waiting happens on the context's condition variable or the
// transports' wait descriptors.
#pragma once

#include "common/common.hpp"
#include "core/auth.hpp"
#include "core/selection.hpp"
#include "kv/kv.hpp"
#include "plan/plan.hpp"
#include "plan/transfer_state.hpp"
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

// A registered paged KV pool.
class KvPool {
  public:
    KvPool(Context *ctx, const sg_kv_layout_t &pub);
    Context *ctx;
    kv::Layout layout;
    // Region r of layer l at bases[l * regions_per_layer + r].
    std::vector<uint8_t *> bases;
    uint64_t id;  // exported to peers in HandleExport
    std::atomic<int> transfers_using{0};
    uint8_t *region(uint32_t layer, uint32_t r) const { return bases[size_t(layer) * layout.regions_per_layer() + r]; }
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
};

// Selective paths, prefill side: blocks of one layer that go under one path and end with one
// BlocksReady notice. Units of the on-demand path go before everything else, speculative ones last.
struct SendUnit {
    uint32_t layer = 0;
    uint32_t path = 0;             // one SG_PATH_* bit
    std::vector<uint32_t> blocks;  // logical indices, ascending
    Vec<plan::Op> ops;
    bool compiled = false;
    size_t next_op = 0;
    uint32_t outstanding = 0;      // writes posted and not completed
    bool notice_sent = false;
    uint32_t digest_chunks = 0;    // proactive: Digests messages sent ahead of the notice
    uint64_t bytes = 0;
    bool staged = false;           // small ops: packed into staging slots
    bool urgent = false;           // speculative, under way, holds blocks a fetch asked for
    bool fully_posted() const { return compiled && next_op == ops.size(); }
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
    // complete it, see Context::abandon_ops); if the completion comes after all, it only returns
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
    uint64_t last_heard_ns = 0;  // any frame from the peer
    uint64_t last_sent_ns = 0;   // any frame to the peer accepted by the provider

    // Our pools registered for this session (one registration per region) and exported.
    struct LocalReg {
        std::vector<transport::Registration> regions;
    };
    std::map<uint64_t, LocalReg> local_regs;         // pool id -> registrations
    std::map<uint64_t, RemotePool> remote_pools;      // peer's pool id -> descriptor
    std::map<std::string, std::shared_ptr<Transfer>> unmatched_posts;  // prefill: waiting for Expect
    std::map<std::string, wire::Expect> unmatched_expects;             // prefill: waiting for post
    // prefill: posts canceled before their Expect arrived. Until the decode side acknowledges the
    // cancel (CancelAck), any Expect of the id was sent before it heard of the cancel and is
    // answered with Cancel + Quiesced, even when the id has been posted again meanwhile.
    std::map<std::string, std::pair<sg_status_t, std::string>> canceled_unmatched;
    std::set<std::string> repost_needed;  // prefill: ids whose cancel the decode side remembers
    // decode: cancels by request id that arrived before any expect of the id.
    std::map<std::string, std::pair<sg_status_t, std::string>> peer_canceled;
    std::map<uint64_t, std::shared_ptr<Transfer>> expects;             // decode: by decode xfer id
    std::map<std::string, std::shared_ptr<Transfer>> posts;            // prefill: matched, by request id
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
    bool bye_sent = false;       // we are closing: the peer's Bye (answer or its own) ends the session
    bool bye_received = false;

    StagingArea recv_staging;  // the peer writes here
    StagingArea send_staging;  // we pack here
    RemotePool peer_staging;   // the peer's recv_staging (regions[0])
    bool have_peer_staging = false;
    uint32_t free_peer_slots = 0;  // bitmask of the peer's free receive slots
    uint32_t free_send_slots = 0;  // bitmask of our free pack slots
    // Measured throughput (bytes per ns, smoothed) of candidate layers sent directly [0] and
    // staged [1] on this session; 0 while unmeasured. Drives SG_STAGING_AUTO.
    double path_rate[2] = {0, 0};
    uint64_t probe_ns[2] = {0, 0};  // when a candidate layer last went down a path still unmeasured
    uint32_t candidate_layers = 0;
    uint64_t bytes_inflight = 0;
    uint64_t speculative_inflight = 0;
    uint64_t last_fetch_ns = 0;  // the peer's last on-demand fetch (the speculative path yields after it)  // bytes of speculative writes in flight (bounded, so a fetch waits little)
    bool regs_dropped = false;  // registrations closed after the session was lost
    uint64_t lost_ns = 0;       // when the session was lost (CLOCK_MONOTONIC), 0 while it lives
    // Unfinished transfers of the session, against max_transfers_per_session.
    size_t unfinished() const;

  private:
    SessionState state_ = SessionState::Authenticating;
};

class Transfer : public std::enable_shared_from_this<Transfer> {
  public:
    Transfer(Context *ctx, std::shared_ptr<Session> s, bool post_side, std::string request_id,
             std::shared_ptr<KvPool> pool, std::span<const uint32_t> table, uint64_t num_tokens,
             const sg_transfer_options_t &opt);
    ~Transfer();
    Context *ctx;
    std::shared_ptr<Session> session;
    const bool post_side;  // prefill: posted; decode: expected
    const std::string request_id;
    std::shared_ptr<KvPool> pool;
    Vec<uint32_t> table;
    const uint64_t num_tokens;
    sg_transfer_options_t options{};
    uint64_t id = 0;  // decode side: our id, sent in Expect; prefill side: the peer's, from Expect
    uint64_t deadline_abs_ns = 0;  // CLOCK_MONOTONIC; 0 = none

    // The state (plan/transfer_state.hpp). Changed only through advance(), with the context's
    // mutex held, which throws SG_ERR_INTERNAL for a transition the machine does not have; read
    // without the mutex only by the event dispatcher.
    plan::TransferState state() const { return state_.load(std::memory_order_acquire); }
    void advance(plan::TransferState to);
    sg_status_t status = SG_IN_PROGRESS;  // final once Finished
    std::string error;
    bool finished() const { return state() >= plan::TransferState::Finished; }
    // No operation of it is in flight and the peer can no longer write into the decode side's
    // blocks for it: its blocks may be reused.
    bool is_quiesced() const { return state() >= plan::TransferState::Quiesced; }
    // What moves a Finished transfer to Quiesced (Context::note_quiesced makes the move).
    bool quiesce_condition() const;
    // The host released it (sg_transfer_release): its events are dropped from then on.
    std::atomic<bool> released{false};

    struct Layer {
        bool ready = false;          // every byte of the layer is in place (decode) or delivered (prefill)
        uint64_t ready_ns = 0;
        uint32_t staged_chunks = 0;  // prefill: chunk notices sent; decode: chunks unpacked
        bool essential = false;      // prefill: proactive unit delivered; decode: it and the digests are here
        std::vector<uint8_t> digests;  // prefill: to send; decode: received (the pool's dtype)
        // Prefill side.
        struct Out {
            bool written = false;        // the engine wrote the layer (sg_transfer_layer_written)
            uint64_t written_ns = 0;
            bool posted = false;         // every op of the layer posted
            bool notice_sent = false;    // LayerReady sent
            uint32_t outstanding = 0;    // ops of this layer not yet completed
            bool candidate = false;      // small ops, so its path was chosen by measurement
            bool staged = false;
            uint64_t start_ns = 0, bytes = 0;  // first op posted, bytes of the layer
            // Selective paths.
            std::vector<uint8_t> claimed;     // block is in some send unit
            uint32_t claimed_count = 0;
            uint32_t delivered_count = 0;     // blocks whose notice went and writes completed
            uint32_t spec_cursor = 0;         // next block the speculative path looks at
            std::vector<uint32_t> selected;   // essential blocks, chosen when the layer was written
            std::vector<uint32_t> demand_waiting;  // fetched before the layer was written
        } out;
        // Decode side.
        struct In {
            bool notice_received = false;  // LayerReady arrived
            uint32_t chunks_announced = 0; // staged_chunks from LayerReady
            // Selective paths.
            std::vector<uint32_t> proactive_blocks;  // blocks the proactive notices named (digested here)
            uint32_t resident_count = 0;
            std::vector<uint8_t> requested;   // fetched and not yet resident
            bool essential_notice = false;    // the proactive BlocksReady arrived
            uint32_t digest_chunks_announced = 0, digest_chunks_received = 0;
            // BlocksReady notices whose staged chunks (counted per layer) are not all unpacked yet
            std::vector<wire::BlocksReady> held_notices;
        } in;
    };
    std::vector<Layer> layers;
    kv::Residency residency;
    sg_transfer_stats_t stats{};
    uint32_t inflight = 0;  // ops and sends of this transfer not yet completed

    // Paths: prefill, from the options; decode, from the peer's Selective message (0 until then).
    uint32_t paths = 0;
    bool selective() const { return paths && paths != SG_PATH_FULL; }

    // Prefill side.
    struct Prefill {
        const RemotePool *dst = nullptr;  // the decode side's pool, set at the match
        Vec<uint32_t> dst_table;
        std::vector<uint32_t> order;  // layers in send order
        size_t order_pos = 0;   // next entry of `order` to compile
        size_t notice_pos = 0;  // entries of `order` whose notice went and whose writes all completed
        const Session::LocalReg *src_reg = nullptr;  // the source pool's registration on the session
        int64_t cur_layer = -1;  // full path: the layer being posted
        bool cur_staged = false;
        Vec<plan::Op> ops;
        size_t next_op = 0;
        bool done_sent = false;
        // The decode side confirmed that every byte is in place (TransferAck, peers of 1.1 and
        // newer): only then is a prefill transfer complete, so a prefill process that exits after
        // its wait and a graceful close loses nothing.
        bool done_acked = false;
        bool quiesce_sent = false;  // Quiesced sent after a failure or a release
        bool stalled = false;       // waiting for the in-flight bounds (counted once per episode)
        bool peer_released = false; // the decode side released a selective transfer
        uint64_t lease_deadline_ns = 0;  // set when the last layer is written and lease_ns > 0
    } prefill;
    bool matched() const { return prefill.dst != nullptr; }

    // Prefill side, selective paths: the profile applied to this request (selection runs on the
    // thread that marks a layer written, serialized by select_mu) and the send units by path.
    struct Selective {
        std::unique_ptr<LayerSelector> selector;
        std::mutex select_mu;
        std::deque<std::unique_ptr<SendUnit>> demand_queue, proactive_queue, speculative_queue;
        std::vector<std::unique_ptr<SendUnit>> posted_units;  // posted; notice or completions pending
        uint32_t layers_written = 0;
        uint32_t spec_order_pos = 0;  // first entry of `order` the speculative path has not exhausted
    } sel;

    // Decode side.
    struct Decode {
        bool done_received = false;
        // The peer confirmed that no write for this transfer will come any more (TransferDone or
        // Quiesced), or it never learned of it.
        bool peer_quiesced = false;
        struct PendingFetch {
            uint32_t layer;
            std::vector<uint32_t> blocks;
        };
        std::vector<PendingFetch> fetches;  // BLOCKS_READY goes when all of one are resident
    } decode;

    // The C handle, for event callbacks: set once the ABI has registered the transfer; events
    // wait until then and are dropped once the host released it.
    std::atomic<void *> api_handle{nullptr};

  private:
    std::atomic<plan::TransferState> state_{plan::TransferState::Unmatched};
};

struct PendingHandshake;
struct Listener {
    Context *ctx;
    int fd = -1;
    uint16_t port = 0;
    std::mutex mu;  // one accept at a time advances the handshakes
    std::vector<std::unique_ptr<PendingHandshake>> pending;  // accepted, handshake under way
    ~Listener();
};

class Context : public transport::CompletionSink {
  public:
    explicit Context(const sg_context_options_t &opt);
    ~Context() override;

    // ---- API operations (each takes the lock itself) ----
    // authenticated: the peer proved the key during bootstrap (or neither side has one); false makes
    // the session run the fabric challenge-response before anything else.
    std::shared_ptr<Session> open_session(const wire::Hello &peer, const sg_session_options_t &opt, bool authenticated);
    // Waits until the session is authenticated (SG_OK); throws its error when it failed, and
    // SG_ERR_TIMEOUT when timeout_ns passed first.
    sg_status_t wait_ready(Session &s, uint64_t timeout_ns);
    void export_kv(Session &s, KvPool &pool);
    // Says Bye and closes; waits until the peer answered the Bye (or was lost) and our sends that
    // name the session drained, or until deadline_ns (CLOCK_MONOTONIC; 0: kDestroyDrainNs from now,
    // what sg_session_destroy allows).
    void close_session(Session &s, uint64_t deadline_ns = 0);
    // Forgets a session the peer never opened (bootstrap outcome): no Bye, nothing drained.
    void discard_session(Session &s);
    void detach_session(Session &s);
    static constexpr uint64_t kDestroyDrainNs = 200000000ull;
    std::shared_ptr<Transfer> expect(const std::shared_ptr<Session> &s, const char *request_id,
                                     const std::shared_ptr<KvPool> &pool, std::span<const uint32_t> table,
                                     uint64_t num_tokens, const sg_transfer_options_t &opt);
    // profile: for SG_PATH_PROACTIVE (NULL: default_profile).
    std::shared_ptr<Transfer> post(const std::shared_ptr<Session> &s, const char *request_id,
                                   const std::shared_ptr<KvPool> &pool, std::span<const uint32_t> table,
                                   uint64_t num_tokens, const sg_transfer_options_t &opt,
                                   const select::Profile *profile = nullptr);
    void layer_written(Transfer &t, uint32_t layer, const float *queries = nullptr, uint32_t num_queries = 0,
                       uint32_t num_q_heads = 0);
    // Selective paths (paths.cpp).
    void fetch(Transfer &t, uint32_t layer, std::span<const uint32_t> blocks);
    // Copies the layer's received digests as fp32; false before the layer is essential.
    bool digests(Transfer &t, uint32_t layer, std::vector<float> &out);
    // Waits until pred() (evaluated with mu held) or the transfer finished; SG_IN_PROGRESS on timeout.
    sg_status_t wait_for(Transfer &t, uint64_t timeout_ns, const std::function<bool()> &pred);
    sg_status_t wait(Transfer &t, int64_t layer, uint64_t timeout_ns);  // layer -1: whole transfer
    void cancel(Transfer &t, sg_status_t why, const std::string &message);
    void release(Transfer &t);
    // sg_session_close: drain, then say Bye. Throws SG_ERR_TIMEOUT (still draining) on timeout.
    void close_gracefully(Session &s, uint64_t timeout_ns);
    void set_api_handle(Transfer &t, void *handle);
    // Runs queued transfer event callbacks; call without mu held.
    void dispatch_events();
    // Waits until t is quiesced; throws SG_ERR_TIMEOUT when timeout_ns passes first.
    void wait_quiesced(Transfer &t, uint64_t timeout_ns);
    // One pass of progress on the caller's thread. Event callbacks run only when run_callbacks is
    // set (sg_context_progress) and the context has no progress thread: the header promises they
    // run on the progress thread, or without one inside sg_context_progress, nowhere else.
    void progress_once(bool run_callbacks = false);
    // Handles `frame` as if it had arrived from the fabric, from the context its header names: for
    // the handler fuzzer and for tests that play a hostile but authenticated peer. Takes mu.
    void inject_frame(std::span<const uint8_t> frame);
    // Bytes held for senders that have not proven themselves (orphan and held frames). Takes mu.
    uint64_t unauthenticated_bytes();
    // What the context holds at most for unproven senders, all together and for one sender. A
    // peer that is really bootstrapping sends a HandleExport or two and some Expects before its
    // proof arrives: well under a megabyte.
    static constexpr uint64_t kUnauthenticatedBytes = 16ull << 20;
    static constexpr uint64_t kUnauthenticatedShare = 4ull << 20;
    // A frame's cost in those budgets: its bytes plus the bookkeeping around it, so that floods of
    // tiny frames count too.
    static constexpr uint64_t frame_cost(size_t bytes) { return uint64_t(bytes) + 64; }
    void notify(Session &s, std::span<const uint8_t> data);
    int event_fd() const { return event_fd_; }
    void signal_event();

    // A Hello with a fresh nonce (bootstrap) and the metadata blob: a Hello frame, followed by its
    // HMAC when the context has a key.
    wire::Hello hello() const;
    std::vector<uint8_t> metadata() const;
    const auth::Key &key() const { return key_; }
    void set_param(sg_param_t p, uint64_t v);
    uint64_t peer_timeout_ns() const { return peer_timeout_ns_; }
    uint64_t get_param(sg_param_t p) const;

    // The counters, with the registrations the transports hold now. Takes mu.
    sg_context_stats_t stats();

    std::mutex mu;
    std::condition_variable cv;
    sg_context_stats_t counters{};  // guarded by mu
    Logger log;
    uint64_t id;
    // Guarded by mu once the context exists: a local_only transport is renewed (renew_transport)
    // after a peer on it was lost, and the one it replaces stays in retired_transports_ while
    // sessions still use it.
    std::vector<std::shared_ptr<transport::Transport>> transports;
    std::string primary_provider;

  private:
    // CompletionSink, called with mu held.
    void on_complete(void *cookie, int status, const char *error_text) override;
    void on_message(std::span<const uint8_t> bytes) override;
    // The effects of an operation's completion, without returning its cookie.
    void settle(OpCookie *c, int status, const char *error_text);
    // Settles the session's operations still in flight as failed, for providers that never
    // complete operations addressed to a dead peer (local_only): otherwise they would hold the
    // context's operation budget and keep their transfers from quiescing forever.
    void abandon_ops(Session &s);
    void forget_session_in_cookies(Session &s);
    // How long after a session on such a provider was lost its operations are abandoned: time for
    // completions already queued to arrive.
    static constexpr uint64_t kAbandonAfterLossNs = 100000000ull;
    // A peer that dies inside a local_only provider (shm) can leave that endpoint's shared queues
    // locked or full for good: 1.17's shm then delivers nothing more to anyone. New sessions get a
    // fresh endpoint; sessions that still use the old one keep it (retired_transports_).
    void renew_transport(size_t index);
    void drop_unused_retired_transports();
    bool tx_full(const transport::Transport &t);
    void note_tx_full(const transport::Transport &t);
    // How long a transport that answered EAGAIN is left alone when no completion comes first (rxm
    // answers EAGAIN while it sets up a connection, which completes nothing).
    static constexpr uint64_t kTxFullRetryNs = 200000ull;
    // How often a path still unmeasured on a session gets another candidate layer to measure it
    // (a probe that never completes, its transfer failed, must not block measuring for good).
    static constexpr uint64_t kProbeSpacingNs = 1000000000ull;
    std::unordered_map<const transport::Transport *, uint64_t> tx_full_;  // transport -> when it said EAGAIN
    bool has_sessions_on(const transport::Transport &t) const;
    std::vector<transport::OpenOptions> transport_options_;
    std::vector<std::shared_ptr<transport::Transport>> retired_transports_;

    void progress_loop();
    void progress_loop_body();
    void fail_all_sessions(sg_status_t status, const std::string &why) noexcept;
    void wait_step(std::unique_lock<std::mutex> &lock, uint64_t deadline);
    size_t poll_locked();
    void schedule_locked();
    bool pump(Transfer &t, uint32_t quota);
    bool may_post_bytes(const Session &s, uint64_t len) const;
    bool start_next_layer(Transfer &t);
    bool post_write_op(Transfer &t, uint32_t layer, const Vec<plan::Op> &ops, size_t &next_op, SendUnit *unit);
    bool post_staged_chunk(Transfer &t, uint32_t layer, const Vec<plan::Op> &ops, size_t &next_op, SendUnit *unit);
    void maybe_send_notices(Transfer &t);
    void send_done(Transfer &t);                   // TransferDone, once
    void mark_ready(Transfer &t, uint32_t layer);  // the layer's bytes are all in place (or delivered)
    // Selective paths (paths.cpp).
    struct PreparedLayer {
        std::vector<uint32_t> selected;
        std::vector<uint8_t> digests;
    };
    PreparedLayer prepare_layer(Transfer &t, uint32_t layer, const float *queries, uint32_t num_queries,
                                uint32_t num_q_heads);
    void commit_layer(Transfer &t, uint32_t layer, PreparedLayer &&prep);
    void release_unposted_speculative(Transfer &t, uint32_t layer, std::span<const uint32_t> wanted);
    void check_selection_inputs(Transfer &t, uint32_t layer, const float *queries, uint32_t num_queries,
                                uint32_t num_q_heads);
    std::unique_ptr<SendUnit> claim(Transfer &t, uint32_t layer, uint32_t path, std::span<const uint32_t> want);
    bool pump_selective(Transfer &t, int pass, uint32_t quota);
    SendUnit *next_unit(Transfer &t, int pass);
    void compile_unit(Transfer &t, SendUnit &u);
    void count_unit_bytes(Transfer &t, const SendUnit &u, uint64_t len);
    void apply_held_notices(Transfer &t, uint32_t layer);
    void apply_blocks_ready(Transfer &t, const wire::BlocksReady &m);
    void selective_notices(Transfer &t);
    void start_selective(Transfer &t);
    void decode_block_resident(Transfer &t, uint32_t layer, std::span<const uint32_t> blocks, uint32_t path,
                               uint64_t bytes);
    void maybe_essential(Transfer &t, uint32_t layer);
    void offer_staging(Session &s);
    bool ensure_send_staging(Session &s);
    void digest_proactive_blocks(Transfer &t, uint32_t layer);
    void check_fetches(Transfer &t, uint32_t layer);
    void end_by_release(Transfer &t);
    void send(Session &s, const std::vector<uint8_t> &frame, Transfer *t = nullptr, bool bulk = false);
    void send_auth(Session &s, const std::vector<uint8_t> &frame);
    void flush_outbox(Session &s);
    void fail_transfer(Transfer &t, sg_status_t status, const std::string &message, bool tell_peer);
    void finish(Transfer &t, sg_status_t status, const std::string &message);
    void maybe_send_quiesced(Transfer &t);
    void emit(Transfer &t, sg_transfer_event_t type, uint32_t layer, sg_status_t status);
    void note_quiesced(Transfer &t);
    void drop_registrations(Session &s);
    void send_quiesced(Session &s, uint64_t decode_xfer_id);
    void complete_if_done(Transfer &t);
    void maybe_layer_ready(Transfer &t, uint32_t layer);
    bool choose_staging(Session &s);
    void check_timers_locked();
    // peer_closed: the peer said Bye (not a failure: no error log, not counted as a lost peer).
    void lose_session(Session &s, sg_status_t status, const std::string &why, bool peer_closed = false);
    void record_layer_rate(Transfer &t, Transfer::Layer &L);
    void match(Session &s, const std::shared_ptr<Transfer> &t, const wire::Expect &e);
    // The protocol (protocol.cpp): message type -> handler, each handler given a decoded message.
    struct Route {
        const char *name = nullptr;
        bool auth = false;  // taken before the peer proved its key
        void (Context::*run)(Session &, std::span<const uint8_t>, const char *) = nullptr;
    };
    static const Route &route(wire::MsgType type);
    template <class M, void (Context::*Handler)(Session &, M &)>
    static constexpr Route route_to(const char *name, bool auth = false);
    template <class M, void (Context::*Handler)(Session &, M &)>
    void decode_then(Session &s, std::span<const uint8_t> body, const char *name);
    void heard_from(Session &s);
    void on_auth_challenge(Session &s, wire::AuthChallenge &m);
    void on_auth_proof(Session &s, wire::AuthProof &m);
    void on_auth_result(Session &s, wire::AuthResult &m);
    void on_handle_export(Session &s, wire::HandleExport &m);
    void on_bye(Session &s, wire::Bye &m);
    void on_ping(Session &s, wire::Ping &m);
    void on_notify(Session &s, wire::Notify &m);
    void on_expect(Session &s, wire::Expect &m);
    void on_layer_ready(Session &s, wire::LayerReady &m);
    void on_transfer_done(Session &s, wire::TransferDone &m);
    void on_transfer_ack(Session &s, wire::TransferAck &m);
    void on_quiesced(Session &s, wire::Quiesced &m);
    void on_cancel(Session &s, wire::TransferError &m);
    void on_error(Session &s, wire::TransferError &m);
    void on_transfer_error(Session &s, wire::TransferError &m, wire::MsgType type);
    void on_cancel_ack(Session &s, wire::CancelAck &m);
    void on_release(Session &s, wire::Release &m);
    void on_reposted(Session &s, wire::Reposted &m);
    void on_staged_chunk(Session &s, wire::StagedChunk &m);
    void on_staging_credit(Session &s, wire::StagingCredit &m);
    void on_selective(Session &s, wire::Selective &m);
    void on_digests(Session &s, wire::Digests &m);
    void on_blocks_ready(Session &s, wire::BlocksReady &m);
    void on_fetch(Session &s, wire::Fetch &m);
    // Decode side: the session's unfinished transfer with this id (moved to Running: the prefill
    // side speaks of it), or NULL.
    Transfer *running_expect(Session &s, uint64_t decode_xfer_id);
    void deliver_orphans(Session &s);
    OpCookie *take_cookie();
    void give_cookie(OpCookie *c);
    void wake();

    sg_context_options_t opt_{};
    auth::Key key_;
    uint64_t staging_threshold_ = 256 * 1024;
    uint64_t staging_policy_ = SG_STAGING_AUTO;
    uint64_t max_op_bytes_ = 16ull << 20;
    uint32_t max_ops_ = 64;
    uint32_t spin_us_ = 50;
    uint64_t peer_timeout_ns_ = 2000000000ull;
    uint64_t next_timer_check_ns_ = 0;
    uint32_t ops_inflight_ = 0;
    uint64_t bytes_inflight_ = 0;
    uint64_t max_bytes_ = 64ull << 20, max_session_bytes_ = 32ull << 20;
    uint32_t max_transfers_per_session_ = 1024;
    uint64_t next_xfer_id_ = 1;
    std::map<uint64_t, std::weak_ptr<Session>> sessions_;  // by peer context id
    std::vector<std::shared_ptr<Transfer>> active_;        // prefill transfers with work to do
    bool active_unsorted_ = false;                         // a transfer joined active_ since it was sorted
    std::vector<std::shared_ptr<Transfer>> lingering_;     // released with operations still in flight
    // Frames from peers this context has no session with yet (their session may be opened in a
    // moment), by sender id, and how much memory they and unauthenticated sessions' held frames take:
    // a sender names itself, so an unproven one must not be able to make the context hold without
    // bound (see kUnauthenticatedBytes).
    struct OrphanQueue {
        uint64_t first_ns = 0, bytes = 0;
        std::vector<std::vector<uint8_t>> frames;
    };
    std::map<uint64_t, OrphanQueue> orphans_;
    uint64_t unauthenticated_bytes_ = 0;
    void forget_held_frames(Session &s);
    struct Event {
        std::shared_ptr<Transfer> t;
        sg_transfer_event_t type;
        uint32_t layer;
        sg_status_t status;
    };
    std::vector<Event> events_;  // guarded by mu
    std::atomic<bool> events_pending_{false};
    std::mutex dispatch_mu_;
    std::vector<std::unique_ptr<OpCookie>> cookie_store_;
    std::vector<OpCookie *> free_cookies_;
    std::thread progress_;
    std::atomic<bool> stop_{false};
    int wake_fd_ = -1;
    int event_fd_ = -1;  // the host's: readable when something happened
    int epoll_fd_ = -1;
    std::string boot_id_;
    uint64_t netns_ = 0;

    // Proactive selection of written layers runs on a worker of its own (started with the first
    // such layer), so the engine's thread goes on with its next layer at once.
    struct SelectJob {
        std::shared_ptr<Transfer> t;
        uint32_t layer;
        std::vector<float> queries;
        uint32_t num_queries, num_q_heads;
    };
    void select_loop();
    std::thread select_thread_;
    std::mutex select_mu_;
    std::condition_variable select_cv_;
    std::deque<SelectJob> select_jobs_;
    bool select_stop_ = false;
};

// A tunable's bounds (sg_param_bounds); the same for sg_context_set_param and the SG_* environment
// variables read at context creation. Throws SG_ERR_INVALID_ARGUMENT for an unknown param.
struct ParamBounds {
    uint64_t lo, hi;
};
ParamBounds param_bounds(sg_param_t p);

// True on a thread that is running a transfer event callback: blocking calls refuse to run there.
bool in_event_callback();

// ---- bootstrap (bootstrap.cpp) ----
std::unique_ptr<Listener> listen_on(Context *ctx, const char *addr, uint16_t port);
// Accepts peers and runs their handshakes concurrently (bootstrap.cpp): Hello frames each way and,
// when the context has a key, proofs both ways (SG_ERR_AUTH_FAILED / SG_ERR_AUTH_REQUIRED
// otherwise); then opens the session and agrees with the peer that both sides did (Opened). Returns
// the first session whose bootstrap finished; a handshake still under way when timeout_ns passes
// stays with the listener for the next call, with its own deadline (timeout_ns from its arrival).
std::shared_ptr<Session> accept_session(Listener &l, Context &ctx, const sg_session_options_t &opt, uint64_t timeout_ns);
std::shared_ptr<Session> connect_session(const char *addr, uint16_t port, Context &ctx, const sg_session_options_t &opt,
                                         uint64_t timeout_ns);
// The handshake itself on a connected stream socket (fd stays the caller's), blocking until it
// succeeds, fails or timeout_ns passes. Exposed for the handshake fuzzer.
wire::Hello bootstrap_exchange(int fd, const Context &ctx, uint64_t timeout_ns, auth::Role role);
// A Hello frame (bootstrap, metadata blob) decoded and checked: SG_ERR_VERSION_MISMATCH for another
// protocol major, SG_ERR_PROTOCOL for anything malformed.
wire::Hello decode_hello_frame(std::span<const uint8_t> frame);
// Parses a peer's metadata blob and checks its signature against the context's key.
wire::Hello parse_metadata(const Context &ctx, std::span<const uint8_t> blob);
// Refuses a peer whose authentication mode does not match ours.
void check_auth_policy(const Context &ctx, const wire::Hello &peer);
std::string read_boot_id();
uint64_t read_netns_inode();
uint64_t random_u64();

}  // namespace sg::core
