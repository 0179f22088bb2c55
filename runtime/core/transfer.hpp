// Internal to core/ (core.hpp is the folder's header): a registered KV pool, and a transfer — one
// request's KV on one side — with its state, its per-layer progress and its role-specific parts
// (prefill, decode, the selective paths' send units).
#pragma once

#include "core/selection.hpp"
#include "core/session.hpp"
#include "core/transfer_path.hpp"
#include "plan/plan.hpp"
#include "plan/schedule.hpp"
#include "plan/transfer_state.hpp"

namespace sg::core {

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

// Selective paths, prefill side: blocks of one layer that go under one path and end with one
// BlocksReady notice. Units of the on-demand path go before everything else, speculative ones last.
struct SendUnit {
    uint32_t layer = 0;
    const UnitPath *path = nullptr;  // which of the selective paths it goes under
    std::vector<uint32_t> blocks;  // logical indices, ascending
    Vec<plan::Op> ops;
    // Its way, one step after the other (advance() refuses any other move): its blocks claimed,
    // compiled into ops (posted from next_op on), its BlocksReady notices sent.
    enum class Step : uint8_t { Claimed, Compiled, Noticed };
    Step step() const { return step_; }
    void advance(Step to);
    size_t next_op = 0;
    uint32_t outstanding = 0;      // writes posted and not completed (staged ones from their reservation)
    uint32_t packs_pending = 0;    // staged chunks reserved and not yet handed to the provider
    uint32_t digest_chunks = 0;    // proactive: Digests messages sent ahead of the notice
    uint64_t bytes = 0;
    bool staged = false;           // small ops: packed into staging slots
    bool urgent = false;           // speculative, under way, holds blocks a fetch asked for
    bool fully_posted() const { return step_ >= Step::Compiled && next_op == ops.size(); }

  private:
    Step step_ = Step::Claimed;
};

// What a unit's writes are to the transport: a fetch's reply (or a speculative unit a fetch now waits
// for) is urgent; the speculative path is background bulk, kept apart from the fetches; the proactive
// path goes as the full path does. Proactive writes are scattered blocks, small, and a lane apart must
// ask for delivery completion (lanes.cpp), which halved their rate (a layer's essential blocks took
// 11-14 ms to post against a layer written every 10 ms on loopback, 4-7 layers queued behind them);
// they are sent while prefill runs, before decode fetches anything, and their bound shrinks once it
// may (paths_prefill.cpp).
inline transport::WriteClass write_class(const SendUnit *u) {
    if (!u) return transport::WriteClass::Default;
    if (u->path->urgent || u->urgent) return transport::WriteClass::Urgent;
    if (u->path->bulk) return transport::WriteClass::Bulk;
    return transport::WriteClass::Default;
}

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
    uint32_t num_layers() const { return uint32_t(layers.size()); }  // fixed at construction
    // No operation of it is in flight and the peer can no longer write into the decode side's
    // blocks for it: its blocks may be reused.
    bool is_quiesced() const { return state() >= plan::TransferState::Quiesced; }
    // What moves a Finished transfer to Quiesced (Transfer::note_quiesced makes the move).
    bool quiesce_condition() const;
    // The counters quiesce depends on, checked against each other (with the context's mutex held):
    // "" when they agree, else the first disagreement. SG_ASSERTed at every state change; the fake
    // fabric's random schedules call it after every step in every build.
    std::string invariant_violation() const;
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
            // The layer's way through the prefill side, one step after the other (advance()
            // refuses any other move): the engine wrote it (sg_transfer_layer_written), every op of
            // the whole layer was posted, LayerReady was sent. A selective layer stays Written:
            // its send units carry their own notices.
            enum class Step : uint8_t { Unwritten, Written, Posted, Noticed };
            Step step() const { return step_; }
            bool written() const { return step_ >= Step::Written; }
            void advance(Step to);
            uint64_t written_ns = 0;
            uint32_t outstanding = 0;    // ops of this layer not yet completed (staged ones from their reservation)
            uint32_t packs_pending = 0;  // staged chunks reserved and not yet handed to the provider
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
            bool crcs_sent = false;           // verification: BlockCrcs went before its first notice

          private:
            Step step_ = Step::Unwritten;
        } out;
        // Decode side.
        struct In {
            bool notice_received = false;  // LayerReady arrived
            uint32_t chunks_announced = 0; // staged_chunks from LayerReady
            // Selective paths.
            std::vector<uint32_t> proactive_blocks;  // blocks the proactive notices named (digested here)
            // Every block came proactive (a layer streamed whole): its digests are computed only if
            // someone asks for them (sg_transfer_digests), since no selection needs them.
            bool digests_deferred = false;
            uint32_t resident_count = 0;
            std::vector<uint8_t> requested;   // fetched and not yet resident
            bool essential_notice = false;    // the proactive BlocksReady arrived
            uint32_t digest_chunks_announced = 0, digest_chunks_received = 0;
            // BlocksReady notices whose staged chunks (counted per layer) are not all unpacked yet
            std::vector<wire::BlocksReady> held_notices;
            // Verification: the sender's content CRC of each block (BlockCrcs), and which arrived.
            std::vector<uint32_t> expected_crcs;
            std::vector<uint8_t> crc_known;
        } in;
    };
    using LayerStep = Layer::Out::Step;
    std::vector<Layer> layers;
    kv::Residency residency;
    sg_transfer_stats_t stats{};
    uint32_t inflight = 0;  // ops and sends of this transfer not yet completed

    // Paths (SG_PATH_*): prefill, from the options; decode, from the peer's Selective message (0
    // until then). set_paths chooses the path's steps with them, once.
    uint32_t paths() const { return paths_; }
    const TransferPath &path() const { return *path_; }
    void set_paths(uint32_t paths);

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
        // How the end of the sending goes, each step once and in this order: Sending; DoneSent
        // (TransferDone went: every layer's bytes and notices are out); Confirmed (the decode side
        // said every byte is in place, TransferAck, peers of 1.1 and newer). Only then is a
        // prefill transfer complete, so a prefill process that exits after its wait and a graceful
        // close loses nothing. An acknowledgement before our TransferDone confirms nothing.
        enum class End : uint8_t { Sending, DoneSent, Confirmed };
        End end = End::Sending;
        bool done_sent() const { return end != End::Sending; }
        bool quiesce_sent = false;  // Quiesced sent after a failure or a release
        bool stalled = false;       // waiting for the in-flight bounds (counted once per episode)
        bool peer_released = false; // the decode side released a selective transfer
        bool send_crcs = false;     // verification: BlockCrcs before each layer's first notice
        uint64_t lease_deadline_ns = 0;  // set when the last layer is written and lease_ns > 0
    };
    // A transfer holds its own side's part only: prefill() and sel() on the posting side, decode()
    // on the expecting side. Asking for the other side's is a bug in the runtime: SG_ERR_INTERNAL
    // (the session it happens on is lost, the process is not).
    Prefill &prefill() { return part(prefill_, "prefill"); }
    const Prefill &prefill() const { return part(prefill_, "prefill"); }
    bool matched() const { return post_side && prefill_->dst != nullptr; }
    // Prefill side, once matched: every op goes through the staging slots, never as a plain write
    // (quantized on the wire, or a pool in device memory that the provider cannot reach).
    bool staged_only() const { return options.wire_quant || !rma_reaches_both_pools(); }
    bool device_side() const {
        return pool->layout.mem_kind == SG_MEM_CUDA ||
               (post_side && prefill_->dst && prefill_->dst->layout.mem_kind == SG_MEM_CUDA);
    }
    // Host memory, or device memory registered with the provider (FI_HMEM), on both sides.
    bool rma_reaches_both_pools() const {
        const Prefill &p = prefill();
        const bool src = pool->layout.mem_kind != SG_MEM_CUDA || (p.src_reg && p.src_reg->device_direct);
        const bool dst = !p.dst || p.dst->layout.mem_kind != SG_MEM_CUDA || p.dst->device_direct;
        return src && dst;
    }

    // Prefill side, selective paths: the profile applied to this request (selection runs on the
    // thread that marks a layer written, serialized by select_mu) and the send units by path.
    struct Selective {
        std::unique_ptr<LayerSelector> selector;
        std::mutex select_mu;
        std::deque<std::unique_ptr<SendUnit>> demand_queue, proactive_queue, speculative_queue;
        std::vector<std::unique_ptr<SendUnit>> posted_units;  // posted; notice or completions pending
        uint32_t layers_written = 0;
        uint32_t spec_order_pos = 0;  // first entry of `order` the speculative path has not exhausted
        uint64_t last_written_ns = 0;  // when the last layer was written (the layer interval)
        uint32_t layers_whole = 0;     // layers whose proactive unit took every block (stream_whole)
    };
    Selective &sel() { return part(sel_, "selective paths' prefill"); }
    const Selective &sel() const { return part(sel_, "selective paths' prefill"); }

    // Decode side.
    struct Decode {
        bool done_received = false;
        // The peer confirmed that no write for this transfer will come any more (TransferDone or
        // Quiesced), or it never learned of it.
        bool peer_quiesced = false;
        // Staged chunks checked and waiting for their copy into the pool (done outside the
        // context's mutex, Context::run_unpacks): the transfer is not quiesced before they land.
        uint32_t unpacks_pending = 0;
        std::deque<uint32_t> noticed;  // layers whose LayerReady came, in that order, not yet ready
        struct PendingFetch {
            uint32_t layer;
            std::vector<uint32_t> blocks;
        };
        std::vector<PendingFetch> fetches;  // BLOCKS_READY goes when all of one are resident
    };
    Decode &decode() { return part(decode_, "decode"); }
    const Decode &decode() const { return part(decode_, "decode"); }

    // The C handle, for event callbacks: set once the ABI has registered the transfer; events
    // wait until then and are dropped once the host released it.
    std::atomic<void *> api_handle{nullptr};
    // Events emitted and not yet delivered (or dropped): the waits return only once it is 0, so
    // every event before a wait's condition has run its callback when the wait returns.
    std::atomic<uint32_t> events_queued{0};
    // Once released and quiesced: the pool no longer counts it (idempotent; the destructor too).
    void let_go_of_pool();

    // ---- The host's verbs (transfer_host.cpp): the ABI's calls, each taking the context's mutex
    // itself; the engine's steps that move the bytes are below, private. ----
    // Prefill side. cuda_stream (a device pool's layer written by kernels on the engine's stream):
    // the layer counts as written once an event recorded on that stream now has completed, polled
    // on the selection worker. device_queries: queries is memory of the pool's device, read
    // (staged out) once the stream has passed the event.
    void layer_written(uint32_t layer, const float *queries = nullptr, uint32_t num_queries = 0,
                       uint32_t num_q_heads = 0, void *cuda_stream = nullptr, bool device_queries = false);
    // Decode side, selective paths: asks for blocks of a layer (SG_EVENT_BLOCKS_READY when all are
    // resident), and the layer's digests as fp32 into out when it holds them all (floats: how many
    // there are); false while the layer is not essential.
    void fetch(uint32_t layer, std::span<const uint32_t> blocks);
    bool digests(uint32_t layer, std::span<float> out, size_t &floats);
    // Waits until pred() (evaluated with the mutex held) or the transfer finished; SG_ERR_TIMEOUT
    // on timeout. Every event emitted before it returns has been delivered.
    sg_status_t wait_for(uint64_t timeout_ns, const std::function<bool()> &pred);
    sg_status_t wait(int64_t layer, uint64_t timeout_ns);  // layer -1: the whole transfer
    sg_status_t wait_layer_state(uint32_t layer, uint32_t bits, uint64_t timeout_ns);
    sg_status_t wait_blocks(uint32_t layer, std::span<const uint32_t> blocks, uint64_t timeout_ns);
    // Until quiesced; throws SG_ERR_TIMEOUT when timeout_ns passes first.
    void wait_quiesced(uint64_t timeout_ns);
    void cancel(sg_status_t why, const std::string &message);
    // Ends it (a selective decode transfer: done early, not a failure) and waits until it is
    // quiesced; its events are dropped from the call on.
    void release();
    void set_api_handle(void *handle);
    // What the host reads: snapshots.
    Outcome outcome() const;
    uint32_t layer_state(uint32_t layer) const;  // SG_LAYER_* bits
    uint64_t layer_time(uint32_t layer) const;   // written (or start) to ready, ns
    // The layer's residency bitmap into bitmap (NULL: only its size); num_bits gets the number of
    // bits, also when cap is too small (SG_ERR_BUFFER_TOO_SMALL).
    void residency_bitmap(uint32_t layer, uint8_t *bitmap, size_t cap, size_t &num_bits) const;
    sg_transfer_stats_t stats_snapshot() const;


  private:
    // ---- The engine's steps: what the context's progress does to a transfer, always with the
    // context's mutex held. The context drives them and a session's handlers call them; the host
    // reaches a transfer only through the verbs above. ----
    friend class Context;
    friend class Session;
    friend struct TransferPath;
    // Completion (transfer.cpp, completions.cpp): events, the end, quiescing.
    // blocks: for SG_EVENT_BLOCKS_READY, the logical blocks of the fetch that completed (copied only
    // when the host has a callback).
    void emit(sg_event_kind_t kind, uint32_t layer, sg_status_t status,
              std::span<const uint32_t> blocks = {});
    // With mu held through `lock`: until every event t emitted so far has been delivered (or the
    // deadline passes). Without a progress thread it delivers them here, on the waiting thread.
    void drain_events(std::unique_lock<std::mutex> &lock, uint64_t deadline);
    void mark_ready(uint32_t layer);  // the layer's bytes are all in place (or delivered)
    // Verification (SG_TRANSFER_VERIFY): the prefill side sends a layer's block CRCs once, before
    // its first notice; the decode side checks blocks whose bytes are now in place against them
    // and fails the transfer on a mismatch (false then).
    void send_block_crcs(uint32_t layer);
    bool verify_blocks(uint32_t layer, std::span<const uint32_t> blocks);
    bool verify_layer(uint32_t layer);
    void layers_ready_in_order();
    void complete_if_done();
    void send_done();                   // TransferDone, once
    void finish(sg_status_t status, const std::string &message);
    void fail_with(sg_status_t status, const std::string &message, bool tell_peer);
    void end_by_release();
    void note_quiesced();
    void maybe_send_quiesced();
    void mark_written(uint32_t layer);
    void record_layer_rate(Transfer::Layer &L);
    // The prefill side's sending (scheduler.cpp, staging.cpp).
    bool pump(uint32_t quota);
    bool start_next_layer();
    bool post_write_op(uint32_t layer, const Vec<plan::Op> &ops, size_t &next_op, SendUnit *unit);
    bool post_staged_chunk(uint32_t layer, const Vec<plan::Op> &ops, size_t &next_op, SendUnit *unit);
    void maybe_send_notices();
    // wire_len: bytes in flight on the session; payload_len: the pool bytes they carry (less when
    // quantized), for the per-path statistics.
    void count_unit_bytes(const SendUnit &u, uint64_t wire_len, uint64_t payload_len);
    // Selective paths, prefill side (paths_prefill.cpp, paths_prefill_units.cpp).
    void check_selection_inputs(uint32_t layer, const float *queries, uint32_t num_queries,
                                uint32_t num_q_heads);
    PreparedLayer prepare_layer(uint32_t layer, const float *queries, uint32_t num_queries,
                                uint32_t num_q_heads);
    void commit_layer(uint32_t layer, PreparedLayer &&prep);
    bool stream_whole(uint64_t interval_ns) const;
    bool commit_whole_layer(uint32_t layer);
    void queue_whole_layer(uint32_t layer);
    void release_unposted_speculative(uint32_t layer, std::span<const uint32_t> wanted);
    void digest_proactive_blocks(uint32_t layer);
    std::unique_ptr<SendUnit> claim(uint32_t layer, const UnitPath &path, std::span<const uint32_t> want);
    bool pump_selective(int pass, uint32_t quota);
    SendUnit *next_unit(int pass);
    void compile_unit(SendUnit &u);
    void selective_notices();
    // Selective paths, decode side (paths_decode.cpp).
    void announce_paths();
    void apply_held_notices(uint32_t layer);
    void apply_blocks_ready(const wire::BlocksReady &m);
    void decode_block_resident(uint32_t layer, std::span<const uint32_t> blocks, const UnitPath &path,
                               uint64_t bytes);
    void maybe_essential(uint32_t layer);
    void check_fetches(uint32_t layer);

  private:
    template <class Part>
    static Part &part(const std::unique_ptr<Part> &p, const char *which) {
        if (!p) [[unlikely]]
            fail(SG_ERR_INTERNAL, std::string("the ") + which + " side's part of a transfer of the other side");
        return *p;
    }
    // One side's parts, made by the constructor: the other side's stay null.
    std::unique_ptr<Prefill> prefill_;
    std::unique_ptr<Selective> sel_;
    std::unique_ptr<Decode> decode_;
    uint32_t paths_ = 0;
    const TransferPath *path_ = &TransferPath::kFull;
    std::atomic<bool> holds_pool_{true};
    std::atomic<plan::TransferState> state_{plan::TransferState::Unmatched};
};

}  // namespace sg::core
