// Internal to core/ (core.hpp is the folder's header): the context — one per engine — with its
// transports, sessions, progress thread, scheduler state, events and the selection worker. It
// owns what is shared by all sessions (the transports, the operation cookies, the event queue,
// the budgets) and drives the progress; what happens to one session or one transfer is a method
// of that object (session.hpp, transfer.hpp), which reaches the shared state through `ctx`. Its
// member functions are defined by responsibility across core/*.cpp (each file's header says which).
#pragma once

#include "core/auth.hpp"
#include "core/cuda_plugin.hpp"
#include "core/staging.hpp"
#include "core/transfer.hpp"
#include "quant/quant.hpp"

namespace sg::core {

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
    // How long sg_session_destroy lets a session's Bye and sends drain (Session::close).
    static constexpr uint64_t kDestroyDrainNs = 200000000ull;
    std::shared_ptr<Transfer> expect(const std::shared_ptr<Session> &s, const char *request_id,
                                     const std::shared_ptr<KvPool> &pool, std::span<const uint32_t> table,
                                     uint64_t num_tokens, const sg_transfer_options_t &opt);
    // profile: for SG_PATH_PROACTIVE (NULL: default_profile).
    std::shared_ptr<Transfer> post(const std::shared_ptr<Session> &s, const char *request_id,
                                   const std::shared_ptr<KvPool> &pool, std::span<const uint32_t> table,
                                   uint64_t num_tokens, const sg_transfer_options_t &opt,
                                   const select::Profile *profile = nullptr);
    // Runs queued transfer event callbacks; call without mu held.
    void dispatch_events();
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
    int event_fd() const { return event_fd_; }
    void signal_event();

    // A Hello with a fresh nonce (bootstrap) and the metadata blob: a Hello frame, followed by its
    // HMAC when the context has a key.
    wire::Hello hello() const;
    std::vector<uint8_t> metadata() const;
    const auth::Key &key() const { return key_; }
    void set_param(sg_param_t p, uint64_t v);
    uint64_t peer_timeout_ns() const { return peer_timeout_ns_; }
    // SG_TRANSFER_VERIFY=1 at creation: ask for (decode) and send (prefill) blocks' content CRCs.
    bool verify_transfers() const { return verify_transfers_; }
    uint64_t get_param(sg_param_t p) const;

    // The counters, with the registrations the transports hold now. Takes mu.
    sg_context_stats_t stats();
    std::string metrics_text();  // the statistics in Prometheus's text format (metrics.cpp)
    // Counts (and logs) a session that bootstrap refused for authentication (session_auth.cpp).
    void count_refused_session(const Error &e);

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
    // Sessions and transfers run their own steps; what those steps share with the rest of the
    // context (the transports and their EAGAIN state, the operation cookies, the event queue, the
    // staging copy queues, the budgets, the waits) they reach through `ctx`.
    friend class Session;
    friend class Transfer;
    friend struct TransferPath;
    // CompletionSink, called with mu held.
    void on_complete(void *cookie, int status, const char *error_text) override;
    void on_message(std::span<const uint8_t> bytes) override;
    // The effects of an operation's completion, without returning its cookie.
    void settle(OpCookie *c, int status, const char *error_text);
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
    // Staged chunks (staging.hpp), copied with mu let go by run_copies.
    std::vector<UnpackJob> unpacks_;  // guarded by mu
    bool unpacking_ = false;       // a thread is copying a batch (one at a time)
    // With mu held through `lock`: copies the queued chunks with mu let go, then counts them.
    void run_unpacks(std::unique_lock<std::mutex> &lock);
    void finish_unpack(UnpackJob &u);
    std::deque<PackJob> packs_;  // guarded by mu
    bool packing_ = false;    // a thread is copying a batch (one at a time)
    // With mu held through `lock`: packs and posts the reserved chunks, then unpacks received ones.
    void run_copies(std::unique_lock<std::mutex> &lock);
    void run_packs(std::unique_lock<std::mutex> &lock);
    // Hands a packed chunk to the provider; false when it is full (the chunk stays queued).
    bool post_pack(PackJob &p);
    // Gives back what a chunk reserved when it will never be posted (its transfer or session ended).
    void drop_pack(PackJob &p);
    void check_timers_locked();
    OpCookie *take_cookie();
    void give_cookie(OpCookie *c);
    void wake();

    sg_context_options_t opt_{};
    auth::Key key_;
    uint64_t staging_threshold_ = 256 * 1024;
    uint64_t staging_policy_ = SG_STAGING_AUTO;
    uint64_t max_op_bytes_ = 16ull << 20;
    uint32_t spin_us_ = defaults::kProgressSpinUs;
    uint64_t peer_timeout_ns_ = defaults::kPeerTimeoutMs * 1000000ull;
    bool verify_transfers_ = false;
    uint64_t next_timer_check_ns_ = 0;
    plan::InflightBudget budget_;  // the scheduler's in-flight bounds (plan/schedule.hpp)
    uint32_t max_transfers_per_session_ = defaults::kMaxTransfersPerSession;
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
    struct Event {
        std::shared_ptr<Transfer> t;
        sg_event_kind_t kind;
        uint32_t layer;
        sg_status_t status;
        std::vector<uint32_t> blocks;
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
        std::shared_ptr<StreamEvent> written;  // wait for it first (the engine's stream)
        bool select = true;                    // false: full path, only mark the layer written
        const float *device_queries = nullptr; // on the pool's device: staged out once `written` passed
    };
    void queue_job(SelectJob job);
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

}  // namespace sg::core
