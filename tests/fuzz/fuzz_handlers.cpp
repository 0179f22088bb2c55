// Fuzzer: a context's message handlers (runtime/core), fed frames from an authenticated but hostile
// peer — any field, any order, any session state.
//
// Two contexts live in this process over the in-memory fake fabric (runtime/transport/fake.hpp,
// one seed, no injected faults: what is fuzzed is the frames, not the schedule) with no progress
// thread: A, the peer the fuzzer
// plays, and B, the target. Both hold the tests' key; their sessions are opened as a bootstrap
// leaves them (authenticated) or, on request, as metadata blobs leave them (the fabric
// challenge-response still to run, so frames are held and auth frames are live). Each side exports
// a small KV pool, and B holds transfers in several states:
//   ef  expect, full path        (decode side: LayerReady, StagedChunk, TransferDone, Cancel, ...)
//   es  expect                   (becomes selective when a Selective frame names it: Digests,
//                                 BlocksReady, B's own fetches)
//   pf  post, all layers written (unmatched until an Expect names it; then B writes into A's pool)
//   ps  post, proactive + on-demand + speculative, all layers written (Fetch)
//   pw  post, full path, layers written by the harness's host actions
// Every frame is injected into B with Context::inject_frame, named as sent by A; between frames the
// harness may run progress on both contexts (B's answers reach the real A, B's RMA writes land in
// A's pool) or act as B's host (cancel, layer_written, fetch, notify, release, new expects/posts).
//
// Input: byte 0 is the mode. Bit 0: 0 = raw frames, 1 = structured. 0xF4/0xF5 rebuild the sessions
// first (fresh state); 0xFC/0xFD rebuild them unauthenticated, as metadata blobs leave them.
//   raw:        records of u16 little-endian length + that many bytes, each a frame whose sender id
//               (bytes 12..19) the harness overwrites with A's id; a zero length runs progress.
//   structured: FuzzedDataProvider ops: build a message of any type with wire::encode from fuzzer
//               choices (ids, request ids and handles drawn mostly from the fixture's real ones),
//               optionally damage it, inject it; run progress; or do a host action on B.
// State persists between inputs, as a long-lived session does; the fixture is rebuilt when a
// session closed (a protocol error, Bye, failed authentication) or grew past small bounds, and
// transfers that finished are replaced. sg::Error from a host action is a clean refusal; anything
// else escaping, and any sanitizer report, is a finding.
#include "fuzz_common.hpp"

#include "kernels.hpp"
#include "transport/fake.hpp"

#include <fuzzer/FuzzedDataProvider.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <span>
#include <string>
#include <thread>
#include <tuple>

namespace {

using namespace sg;
using namespace sg::core;
using fuzz::HostPool;

constexpr uint64_t kSlotBytes = StagingArea::kSlotBytes;
constexpr uint64_t kLostUnauthDrainNs = 2000000;  // see close_pair

struct Fixture {
    std::unique_ptr<Context> a, b;  // a: the peer the fuzzer speaks for; b: the target
    std::unique_ptr<HostPool> pa, pb;
    std::shared_ptr<Session> sa, sb;
    std::shared_ptr<Transfer> ef, es, pf, ps, pw;  // b's, see the header
    std::vector<std::shared_ptr<Transfer>> extra;  // made by host actions
    std::array<uint64_t, 4> fuzz_handles{};        // ids of pools the fuzzer exported lately
    size_t next_handle = 0;
};
Fixture *F = nullptr;

// SG_FUZZ_STATS=1: how often the fixture was rebuilt, why, and what that cost, printed at exit.
// SG_FUZZ_TRACE=1: also every slow close and every pair that had to be opened again.
struct Stats {
    uint64_t inputs = 0, rebuilds = 0, rebuild_ns = 0, close_ns = 0, closed = 0, fresh = 0, reopens = 0;
    ~Stats() {
        if (!std::getenv("SG_FUZZ_STATS")) return;
        const double n = rebuilds ? double(rebuilds) : 1.0;
        std::fprintf(stderr,
                     "fuzz_handlers: %llu inputs, %llu rebuilds (%llu after a session closed, %llu asked for), "
                     "%.2f ms each (closing %.2f ms), %llu pairs opened again\n",
                     (unsigned long long)inputs, (unsigned long long)rebuilds, (unsigned long long)closed,
                     (unsigned long long)fresh, rebuild_ns / 1e6 / n, close_ns / 1e6 / n, (unsigned long long)reopens);
    }
} stats;

const uint32_t kTableEf[] = {0, 1, 2, 3};  // 16 tokens
const uint32_t kTableEs[] = {4, 5, 6, 7};  // 13 tokens
const uint32_t kTablePw[] = {1, 3};        // 8 tokens
const char *const kRids[] = {"ef", "es", "pf", "ps", "pw", "x0", "x1"};

void pump(int rounds) {
    for (int i = 0; i < rounds; ++i) {
        F->b->progress_once();
        F->a->progress_once();
    }
}

// Runs progress on both sides until pred() holds or timeout_ms passed. A healthy pair answers in
// microseconds; the bound is wall time because a loaded machine may delay a connection setup.
template <class P> bool settle(P pred, int timeout_ms) {
    const uint64_t deadline = now_ns() + uint64_t(timeout_ms) * 1000000;
    while (!pred()) {
        if (now_ns() > deadline) return false;
        pump(1);
    }
    return true;
}

template <class Fn> void host(Fn &&fn) {
    try {
        fn();
    } catch (const Error &) {
        // A refusal with a status: what the ABI would return.
    }
}

// ---- fixture -------------------------------------------------------------------------------------

std::shared_ptr<Transfer> expect(const char *rid, std::span<const uint32_t> table, uint64_t tokens) {
    std::shared_ptr<Transfer> t;
    host([&] { t = F->b->expect(F->sb, rid, F->pb->pool, table, tokens, fuzz::transfer_options()); });
    return t;
}

std::shared_ptr<Transfer> post(const char *rid, std::span<const uint32_t> table, uint64_t tokens, uint32_t paths,
                               uint32_t flags) {
    std::shared_ptr<Transfer> t;
    host([&] { t = F->b->post(F->sb, rid, F->pb->pool, table, tokens, fuzz::transfer_options(paths, flags)); });
    return t;
}

constexpr uint32_t kSelectivePaths = SG_PATH_PROACTIVE | SG_PATH_ON_DEMAND | SG_PATH_SPECULATIVE;

// A finished post whose operations all completed can be released at once; an expect is released
// only after the peer confirms its writes stopped, so finished expects stay in the session (the
// fixture is rebuilt when they pile up) and a new one takes the name.
void refresh_transfers() {
    auto renew_post = [&](std::shared_ptr<Transfer> &t, auto make) {
        if (t && !t->finished()) return;
        if (t) {
            if (!t->is_quiesced()) return;
            host([&] { t->release(); });
            t.reset();
        }
        t = make();
    };
    if (!F->ef || F->ef->finished()) F->ef = expect("ef", kTableEf, 16);
    if (!F->es || F->es->finished()) F->es = expect("es", kTableEs, 13);
    renew_post(F->pf, [] { return post("pf", kTableEf, 16, SG_PATH_FULL, SG_TRANSFER_ALL_LAYERS_WRITTEN); });
    renew_post(F->ps, [] { return post("ps", kTableEs, 13, kSelectivePaths, SG_TRANSFER_ALL_LAYERS_WRITTEN); });
    renew_post(F->pw, [] { return post("pw", kTablePw, 8, SG_PATH_FULL, 0); });
}

// Both pools exported. Staging slots are offered with a session's first Expect (the fixture's
// expects then bring B's to A), so they are not waited for here.
bool exports_arrived() {
    std::scoped_lock lock(F->a->mu, F->b->mu);
    return F->sb->remote_pools.count(F->pa->pool->id) && F->sa->remote_pools.count(F->pb->pool->id);
}

void close_pair();

bool try_open_pair(bool authenticated) {
    const sg_session_options_t so = fuzz::session_options();
    try {
        F->sb = F->b->open_session(F->a->hello(), so, authenticated);
        F->sa = F->a->open_session(F->b->hello(), so, authenticated);
        F->sb->export_kv(*F->pb->pool);
        F->sa->export_kv(*F->pa->pool);
    } catch (const Error &e) {
        std::fprintf(stderr, "fuzz_handlers: cannot open the session pair: %s\n", e.message().c_str());
        std::abort();
    }
    F->next_handle = 0;
    F->fuzz_handles = {};
    // Frames of the previous pair that arrived after it closed wait as orphans and are delivered to
    // the new sessions; a late Bye closes one at once (see docs/fuzzing.md). Then the pair is
    // opened again, the orphans being spent.
    if (F->sb->closed() || F->sa->closed()) return false;
    if (!authenticated || settle(exports_arrived, 1000)) return true;
    if (std::getenv("SG_FUZZ_TRACE"))
        for (Session *s : {F->sb.get(), F->sa.get()})
            std::fprintf(stderr, "stuck open (%s): auth %d may_send %d outbox %zu remote_pools %zu staging %d\n",
                         s == F->sb.get() ? "b" : "a", s->proven, s->may_send, s->outbox.size(), s->remote_pools.size(),
                         s->have_peer_staging);
    return false;
}

void open_pair(bool authenticated) {
    for (int attempt = 0; !try_open_pair(authenticated); ++attempt) {
        if (attempt == 3) {
            auto show = [](const char *who, const Session &s) {
                std::fprintf(stderr,
                             "  %s: closed %d (%s) authenticated %d may_send %d remote_pools %zu staging %d outbox %zu\n",
                             who, s.closed(), s.error_message.c_str(), s.proven, s.may_send, s.remote_pools.size(),
                             s.have_peer_staging, s.outbox.size());
            };
            std::fprintf(stderr, "fuzz_handlers: cannot bring up a session pair with both pools exported\n");
            show("b", *F->sb);
            show("a", *F->sa);
            std::abort();
        }
        stats.reopens++;
        close_pair();
    }
    refresh_transfers();
}

uint32_t inflight_posts() {
    uint32_t n = 0;
    for (auto *t : {&F->pf, &F->ps, &F->pw})
        if (*t) n += (*t)->inflight;
    for (auto &t : F->extra) n += t->inflight;
    return n;
}

// Both sides hear a Bye first, so neither waits for the other's answer when it closes.
void close_pair() {
    pump(4);  // sends already handed to the provider complete
    // A session still proving its key would hold the Bye below instead of closing: finish its proof
    // with the answer the real peer would give (the harness holds the key).
    for (auto [ctx, s, peer] : {std::tuple{F->b.get(), F->sb.get(), F->a.get()}, std::tuple{F->a.get(), F->sa.get(), F->b.get()}}) {
        if (s->closed() || s->proven || s->auth_nonce.empty()) continue;
        std::vector<uint8_t> proof;
        wire::encode(proof, peer->id, wire::AuthProof{auth::fabric_proof(fuzz::test_key(), peer->id, ctx->id, s->auth_nonce)});
        ctx->inject_frame(proof);
    }
    // Writes under way finish and the proofs land.
    settle([] { return inflight_posts() == 0 && (F->sb->closed() || F->sa->closed() || (F->sb->proven && F->sa->proven)); }, 100);
    std::vector<uint8_t> bye;
    wire::encode(bye, F->a->id, wire::Bye{});
    F->b->inject_frame(bye);
    bye.clear();
    wire::encode(bye, F->b->id, wire::Bye{});
    F->a->inject_frame(bye);
    // Each side closes while the other makes progress (the peer's answers and completions must
    // flow), within the drain time sg_session_destroy allows; then the session object goes away,
    // as it does when a host destroys its handle.
    auto close_with_peer_progress = [](Context &closing, Session &s, Context &other) {
        std::atomic<bool> stop{false};
        std::thread helper([&] {
            while (!stop.load(std::memory_order_relaxed)) other.progress_once();
        });
        const bool trace = std::getenv("SG_FUZZ_TRACE");
        char before[256];
        if (trace) std::snprintf(before, sizeof before, "closed %d auth %d may_send %d outbox %zu/%zu/%zu bye %d minor %d",
                                 s.closed(), s.proven, s.may_send, s.outbox.size(), s.bulk_outbox.size(), s.auth_outbox.size(),
                                 int(s.bye()), s.peer_minor);
        const uint64_t t0 = now_ns();
        // A session lost before it was authenticated holds sends in its outbox that were never
        // handed to the provider and never will be; close_session would wait its whole drain time
        // (200 ms) for them. The auth messages it did hand over completed meanwhile (the peer
        // makes progress), so a short drain loses nothing there.
        if (s.closed() && !s.proven)
            s.close(now_ns() + kLostUnauthDrainNs);
        else
            s.close();
        if (trace && now_ns() - t0 > 50000000) std::fprintf(stderr, "slow close (%s): %s\n", &closing == F->b.get() ? "b" : "a", before);
        stop = true;
        helper.join();
    };
    close_with_peer_progress(*F->b, *F->sb, *F->a);
    close_with_peer_progress(*F->a, *F->sa, *F->b);
    // A transfer holds its session and the session its transfers until the host releases them, as
    // a host of the C API does; on a closed session a quiesced transfer is released at once.
    for (Session *s : {F->sb.get(), F->sa.get()}) {
        Context &ctx = s == F->sb.get() ? *F->b : *F->a;
        std::vector<std::shared_ptr<Transfer>> all;
        {
            std::scoped_lock lock(ctx.mu);
            all = s->matchbook.transfers();
        }
        for (auto &t : all)
            if (settle([&] { return t->is_quiesced(); }, 100)) host([&] { t->release(); });
    }
    F->ef.reset(), F->es.reset(), F->pf.reset(), F->ps.reset(), F->pw.reset();
    F->extra.clear();
    F->sa.reset();
    F->sb.reset();
    pump(2);  // the engines drop the finished transfers they still hold
}

// Anything a hostile peer can grow by sending, bounded here so that millions of inputs stay small.
bool needs_rebuild() {
    std::scoped_lock lock(F->a->mu, F->b->mu);
    const Session &s = *F->sb;
    return s.closed() || F->sa->closed() || s.matchbook.expects().size() > 32 ||
           s.matchbook.matched_posts().size() > 16 || s.matchbook.held_expects() > 64 || s.remote_pools.size() > 64 ||
           s.matchbook.largest_remembered() > 64 || s.held_frames.size() > 256 ||
           s.outbox.size() > 1024 || s.bulk_outbox.size() > 1024 || F->sa->held_frames.size() > 256 ||
           F->sa->outbox.size() > 1024;
}

void ensure_fixture(bool fresh, bool authenticated) {
    if (!F) {
        // The fake fabric moves bytes and messages only when polled, so an input sees the same
        // schedule every time, and needs no sockets. Measured over 40 s from the seed corpus
        // (ASan): 159 inputs/s and 9009 edges, against 157/s and 8118 over tcp.
        // SG_FUZZ_PROVIDER=tcp runs the pair over real sockets instead.
        static transport::fake::Fabric *fabric = new transport::fake::Fabric(1, transport::fake::Knobs{});
        (void)fabric;
        F = new Fixture;
        const char *prov = std::getenv("SG_FUZZ_PROVIDER") ? std::getenv("SG_FUZZ_PROVIDER") : "fake";
        F->a = fuzz::make_context(true, prov);
        F->b = fuzz::make_context(true, prov);
        F->pa = std::make_unique<HostPool>(*F->a);
        F->pb = std::make_unique<HostPool>(*F->b);
        open_pair(true);
    }
    if (!fresh && !(F->sb->proven && F->sa->proven))
        settle([] { return F->sb->proven && F->sa->proven; }, 100);
    if (fresh || needs_rebuild() || !F->sb->proven || !F->sa->proven) {
        const uint64_t t0 = now_ns();
        stats.closed += F->sb->closed() || F->sa->closed();
        stats.fresh += fresh;
        close_pair();
        const uint64_t t1 = now_ns();
        open_pair(authenticated);
        stats.rebuilds++;
        stats.close_ns += t1 - t0;
        stats.rebuild_ns += now_ns() - t0;
    }
    stats.inputs++;
    {
        std::scoped_lock lock(F->a->mu, F->b->mu);
        F->sb->notifications.clear();  // the host takes them
        F->sa->notifications.clear();
    }
    if (F->extra.size() > 8) F->extra.erase(F->extra.begin(), F->extra.begin() + 4);
    refresh_transfers();
}

// ---- choices ---------------------------------------------------------------------------------------

uint64_t id_of(const std::shared_ptr<Transfer> &t) { return t ? t->id : 0; }

uint64_t pick_xfer(FuzzedDataProvider &p) {
    switch (p.ConsumeIntegralInRange<int>(0, 9)) {
        case 0: return id_of(F->ef);
        case 1: return id_of(F->es);
        case 2: return id_of(F->pf);
        case 3: return id_of(F->ps);
        case 4: return id_of(F->pw);
        case 5: return F->extra.empty() ? 0 : id_of(F->extra[p.ConsumeIntegralInRange<size_t>(0, F->extra.size() - 1)]);
        case 6: return 0;
        case 7: return p.ConsumeIntegralInRange<uint64_t>(1, 64);
        default: return p.ConsumeIntegral<uint64_t>();
    }
}

std::string pick_rid(FuzzedDataProvider &p) {
    const size_t n = std::size(kRids);
    const size_t i = p.ConsumeIntegralInRange<size_t>(0, n + 1);
    if (i < n) return kRids[i];
    if (i == n) return std::string(p.ConsumeIntegralInRange<size_t>(250, 300), 'r');  // around the 255 limit
    return p.ConsumeRandomLengthString(32);
}

uint64_t pick_handle(FuzzedDataProvider &p) {
    switch (p.ConsumeIntegralInRange<int>(0, 5)) {
        case 0: return F->pa->pool->id;
        case 1: return 0;  // the staging area's
        case 2: return F->pb->pool->id;
        case 3: return F->fuzz_handles[p.ConsumeIntegralInRange<size_t>(0, F->fuzz_handles.size() - 1)];
        default: return p.ConsumeIntegral<uint64_t>();
    }
}

uint32_t pick_small(FuzzedDataProvider &p, uint32_t typical_max) {
    if (p.ConsumeIntegralInRange<int>(0, 7)) return p.ConsumeIntegralInRange<uint32_t>(0, typical_max);
    return p.ConsumeIntegral<uint32_t>();
}

uint64_t pick_u64(FuzzedDataProvider &p, uint64_t typical_max) {
    switch (p.ConsumeIntegralInRange<int>(0, 7)) {
        case 0: return p.ConsumeIntegral<uint64_t>();
        case 1: return UINT64_MAX - p.ConsumeIntegralInRange<uint64_t>(0, 4096);
        default: return p.ConsumeIntegralInRange<uint64_t>(0, typical_max);
    }
}

std::vector<uint32_t> pick_blocks(FuzzedDataProvider &p, uint32_t typical_max) {
    std::vector<uint32_t> v(p.ConsumeIntegralInRange<size_t>(0, 12));
    for (auto &x : v) x = pick_small(p, typical_max);
    if (p.ConsumeBool()) std::sort(v.begin(), v.end());
    return v;
}

std::vector<uint8_t> pick_bytes(FuzzedDataProvider &p, size_t typical, size_t max) {
    const size_t n = p.ConsumeBool() ? typical : p.ConsumeIntegralInRange<size_t>(0, max);
    std::vector<uint8_t> v = p.ConsumeBytes<uint8_t>(n);
    v.resize(n);
    return v;
}

uint32_t pick_paths(FuzzedDataProvider &p) {
    static const uint32_t kPaths[] = {SG_PATH_FULL, kSelectivePaths, SG_PATH_PROACTIVE | SG_PATH_ON_DEMAND,
                                      SG_PATH_ON_DEMAND, SG_PATH_SPECULATIVE, 0};
    const size_t i = p.ConsumeIntegralInRange<size_t>(0, std::size(kPaths));
    return i < std::size(kPaths) ? kPaths[i] : p.ConsumeIntegral<uint32_t>();
}

// ---- messages --------------------------------------------------------------------------------------

wire::HandleExport handle_export(FuzzedDataProvider &p) {
    wire::HandleExport m;
    m.handle_id = pick_handle(p);
    if (p.ConsumeBool()) {
        // A's real pool: layout and the keys of its registrations, then maybe one field changed.
        m.layout = F->pa->pool->layout.to_desc();
        m.regions_per_layer = F->pa->pool->layout.regions_per_layer();
        std::scoped_lock lock(F->a->mu);
        if (auto it = F->sa->local_regs.find(F->pa->pool->id); it != F->sa->local_regs.end())
            for (auto &r : it->second.regions) m.regions.push_back({r.key, r.remote_base, F->pa->pool->layout.region_bytes()});
    } else {
        m.layout.num_layers = pick_small(p, 3);
        m.layout.num_kv_heads = pick_small(p, 3);
        m.layout.head_dim = pick_small(p, 32);
        m.layout.tokens_per_block = pick_small(p, 8);
        m.layout.num_blocks = pick_u64(p, 16);
        m.layout.dtype = pick_small(p, 5);
        m.layout.packing = pick_small(p, 2);
        m.layout.block_order = pick_small(p, 2);
        m.layout.mem_kind = pick_small(p, 2);
        m.layout.block_stride_bytes = pick_u64(p, 8192);
        m.regions_per_layer = pick_small(p, 2);
        m.regions.resize(p.ConsumeIntegralInRange<size_t>(0, 8));
        for (auto &r : m.regions) r = {p.ConsumeIntegral<uint64_t>(), pick_u64(p, 1 << 20), pick_u64(p, 1 << 20)};
    }
    switch (p.ConsumeIntegralInRange<int>(0, 7)) {
        case 0: m.layout.num_blocks = pick_u64(p, 64); break;
        case 1: m.layout.block_stride_bytes = pick_u64(p, 8192); break;
        case 2:
            if (!m.regions.empty()) m.regions[p.ConsumeIntegralInRange<size_t>(0, m.regions.size() - 1)].length = pick_u64(p, 1 << 16);
            break;
        case 3: m.layout.tokens_per_block = pick_small(p, 16); break;
        default: break;
    }
    if (m.handle_id != F->pa->pool->id && m.handle_id != 0) F->fuzz_handles[F->next_handle++ % F->fuzz_handles.size()] = m.handle_id;
    return m;
}

wire::Digests digests(FuzzedDataProvider &p) {
    wire::Digests m;
    m.decode_xfer_id = pick_xfer(p);
    m.layer = pick_small(p, 2);
    m.first_block = pick_small(p, 4);
    m.count = pick_small(p, 4);
    m.elem_bytes = p.ConsumeBool() ? 2 : 4;
    const uint64_t per_block = kernels::digest_floats(1, HostPool::kHeads, HostPool::kDim) * m.elem_bytes;
    const uint64_t want = uint64_t(std::min<uint32_t>(m.count, 64)) * per_block;
    m.data = pick_bytes(p, size_t(want), size_t(want) + 8);
    return m;
}

// Builds one message of any type and appends its frame (sender: A) to out.
void build_message(FuzzedDataProvider &p, std::vector<uint8_t> &out) {
    const uint64_t from = F->a->id;
    const auto type = static_cast<wire::MsgType>(
        p.ConsumeIntegralInRange<uint16_t>(uint16_t(wire::MsgType::Hello), uint16_t(wire::kLastMsgType)));
    switch (type) {
        case wire::MsgType::Hello: {
            wire::Hello m = F->a->hello();
            if (p.ConsumeBool()) m.ctx_id = p.ConsumeIntegral<uint64_t>();
            if (p.ConsumeBool()) m.endpoints.clear();
            wire::encode(out, from, m);
            return;
        }
        case wire::MsgType::HandleExport: wire::encode(out, from, handle_export(p)); return;
        case wire::MsgType::Expect: {
            wire::Expect m;
            m.request_id = pick_rid(p);
            m.decode_xfer_id = pick_xfer(p);
            m.handle_id = pick_handle(p);
            static const uint64_t kTokens[] = {16, 13, 8, 1};
            const size_t ti = p.ConsumeIntegralInRange<size_t>(0, std::size(kTokens));
            m.num_tokens = ti < std::size(kTokens) ? kTokens[ti] : pick_u64(p, 64);
            switch (p.ConsumeIntegralInRange<int>(0, 3)) {
                case 0: m.block_ids.assign(std::begin(kTableEf), std::end(kTableEf)); break;
                case 1: m.block_ids.assign(std::begin(kTableEs), std::end(kTableEs)); break;
                case 2: m.block_ids.assign(std::begin(kTablePw), std::end(kTablePw)); break;
                default: m.block_ids = pick_blocks(p, 9); break;
            }
            wire::encode(out, from, m);
            return;
        }
        case wire::MsgType::LayerReady: {
            wire::LayerReady m;
            m.decode_xfer_id = pick_xfer(p);
            m.layer = pick_small(p, 2);
            m.bytes = pick_u64(p, 1 << 16);
            m.staged_chunks = pick_small(p, 3);
            wire::encode(out, from, m);
            return;
        }
        case wire::MsgType::StagedChunk: {
            wire::StagedChunk m;
            m.decode_xfer_id = pick_xfer(p);
            m.layer = pick_small(p, 2);
            m.slot = pick_small(p, StagingArea::kSlots);
            m.slot_offset = p.ConsumeBool() ? pick_u64(p, 4096) : kSlotBytes - p.ConsumeIntegralInRange<uint64_t>(0, 4096);
            m.segments.resize(p.ConsumeIntegralInRange<size_t>(0, 6));
            for (auto &s : m.segments) {
                s.region = pick_small(p, 5);
                s.offset = p.ConsumeBool() ? pick_u64(p, 2048) : UINT64_MAX - p.ConsumeIntegralInRange<uint64_t>(0, 4096);
                s.length = pick_u64(p, 2048);
            }
            wire::encode(out, from, m);
            return;
        }
        case wire::MsgType::StagingCredit: wire::encode(out, from, wire::StagingCredit{pick_small(p, 9)}); return;
        case wire::MsgType::TransferDone: {
            wire::TransferDone m;
            m.decode_xfer_id = pick_xfer(p);
            m.bytes = pick_u64(p, 1 << 16);
            wire::encode(out, from, m);
            return;
        }
        case wire::MsgType::Cancel:
        case wire::MsgType::Error: {
            wire::TransferError m;
            m.request_id = pick_rid(p);
            m.decode_xfer_id = pick_xfer(p);
            static const int32_t kStatus[] = {0, SG_ERR_CANCELED, SG_ERR_LEASE_EXPIRED, SG_ERR_DEADLINE, SG_ERR_PROTOCOL, 1};
            const size_t si = p.ConsumeIntegralInRange<size_t>(0, std::size(kStatus));
            m.status = si < std::size(kStatus) ? kStatus[si] : p.ConsumeIntegral<int32_t>();
            m.message = p.ConsumeRandomLengthString(64);
            m.from_post_side = p.ConsumeBool() ? 1 : 0;
            wire::encode(out, from, m, type);
            return;
        }
        case wire::MsgType::Bye: {
            wire::Bye m;
            m.status = p.ConsumeIntegral<int32_t>();
            m.reply = p.ConsumeBool() ? 1 : 0;
            wire::encode(out, from, m);
            return;
        }
        case wire::MsgType::Ping: wire::encode(out, from, wire::Ping{p.ConsumeIntegral<uint64_t>()}); return;
        case wire::MsgType::Notify: {
            wire::Notify m;
            m.payload = pick_bytes(p, 16, wire::kMaxNotifyBytes + 8);
            wire::encode(out, from, m);
            return;
        }
        case wire::MsgType::AuthChallenge:
            wire::encode(out, from, wire::AuthChallenge{pick_bytes(p, wire::kNonceBytes, 64)});
            return;
        case wire::MsgType::AuthProof: {
            wire::AuthProof m;
            if (p.ConsumeBool()) {
                // The proof the real A would send: lets an input authenticate B's blob session itself.
                std::scoped_lock lock(F->b->mu);
                m.mac = auth::fabric_proof(fuzz::test_key(), F->a->id, F->b->id, F->sb->auth_nonce);
            } else {
                m.mac = pick_bytes(p, wire::kMacBytes, 64);
            }
            wire::encode(out, from, m);
            return;
        }
        case wire::MsgType::AuthResult: {
            wire::AuthResult m;
            m.accepted = p.ConsumeIntegralInRange<uint32_t>(0, 2);
            if (p.ConsumeBool()) m.mac = pick_bytes(p, wire::kMacBytes, 64);
            wire::encode(out, from, m);
            return;
        }
        case wire::MsgType::Quiesced: wire::encode(out, from, wire::Quiesced{pick_xfer(p)}); return;
        case wire::MsgType::CancelAck: {
            wire::CancelAck m;
            m.request_id = pick_rid(p);
            m.recorded = p.ConsumeIntegralInRange<uint32_t>(0, 2);
            wire::encode(out, from, m);
            return;
        }
        case wire::MsgType::Reposted: wire::encode(out, from, wire::Reposted{pick_rid(p)}); return;
        case wire::MsgType::Selective: {
            wire::Selective m;
            m.decode_xfer_id = pick_xfer(p);
            m.paths = pick_paths(p);
            wire::encode(out, from, m);
            return;
        }
        case wire::MsgType::Digests: wire::encode(out, from, digests(p)); return;
        case wire::MsgType::BlocksReady: {
            wire::BlocksReady m;
            m.decode_xfer_id = pick_xfer(p);
            m.layer = pick_small(p, 2);
            m.path = pick_paths(p);
            m.bytes = pick_u64(p, 1 << 16);
            m.digest_chunks = pick_small(p, 3);
            m.blocks = pick_blocks(p, 4);
            m.essential = p.ConsumeIntegralInRange<uint32_t>(0, 2);
            m.staged_chunks = pick_small(p, 3);
            wire::encode(out, from, m);
            return;
        }
        case wire::MsgType::Fetch: {
            wire::Fetch m;
            m.request_id = pick_rid(p);
            m.decode_xfer_id = pick_xfer(p);
            m.layer = pick_small(p, 2);
            m.blocks = pick_blocks(p, 4);
            wire::encode(out, from, m);
            return;
        }
        case wire::MsgType::TransferAck: wire::encode(out, from, wire::TransferAck{pick_xfer(p)}); return;
        case wire::MsgType::Opened: {  // a bootstrap message: a session must ignore it
            wire::Opened m;
            m.status = p.ConsumeIntegral<int32_t>();
            m.message = p.ConsumeRandomLengthString(64);
            wire::encode(out, from, m);
            return;
        }
        default: break;
    }
    // A type this harness does not build yet (a newer minor): an empty body.
    const size_t start = out.size();
    wire::encode(out, from, wire::Ping{});
    out[start + 8] = uint8_t(type);
    out[start + 9] = uint8_t(uint16_t(type) >> 8);
}

// What a careless or hostile sender does to a well-formed frame.
void damage(FuzzedDataProvider &p, std::vector<uint8_t> &frame) {
    switch (p.ConsumeIntegralInRange<int>(0, 15)) {
        case 0: frame.resize(p.ConsumeIntegralInRange<size_t>(0, frame.size())); break;
        case 1:
            if (!frame.empty()) frame[p.ConsumeIntegralInRange<size_t>(0, frame.size() - 1)] ^= p.ConsumeIntegralInRange<uint8_t>(1, 255);
            break;
        case 2: {
            const auto v = pick_bytes(p, 8, 64);
            wire::append_raw_field(frame, 0, uint16_t(wire::kOptionalBit | p.ConsumeIntegral<uint8_t>()), v);
            break;
        }
        case 3: {
            const auto v = pick_bytes(p, 8, 64);
            wire::append_raw_field(frame, 0, p.ConsumeIntegralInRange<uint16_t>(1, 16), v);  // a repeated or unknown required tag
            break;
        }
        default: break;
    }
}

// ---- host actions on B ----------------------------------------------------------------------------------

std::shared_ptr<Transfer> pick_transfer(FuzzedDataProvider &p) {
    switch (p.ConsumeIntegralInRange<int>(0, 5)) {
        case 0: return F->ef;
        case 1: return F->es;
        case 2: return F->pf;
        case 3: return F->ps;
        case 4: return F->pw;
        default: return F->extra.empty() ? nullptr : F->extra[p.ConsumeIntegralInRange<size_t>(0, F->extra.size() - 1)];
    }
}

void host_action(FuzzedDataProvider &p) {
    Context &b = *F->b;
    switch (p.ConsumeIntegralInRange<int>(0, 7)) {
        case 0:
            if (auto t = pick_transfer(p)) host([&] { t->cancel(SG_ERR_CANCELED, "canceled by the fuzz host"); });
            return;
        case 1:
            if (F->pw) host([&] { F->pw->layer_written(pick_small(p, 2)); });
            return;
        case 2:
            if (F->es) {
                const uint32_t layer = pick_small(p, 2);
                const auto blocks = pick_blocks(p, 4);
                host([&] { F->es->fetch(layer, blocks); });
            }
            return;
        case 3: {
            const auto payload = pick_bytes(p, 8, wire::kMaxNotifyBytes + 8);
            host([&] { F->sb->notify(payload); });
            return;
        }
        case 4:
            if (auto t = pick_transfer(p)) {
                // The caller's buffer: any size a host could really pass, not the 16 GiB an
                // arbitrary 32-bit count of floats would take (that exhausted the fuzzer's memory).
                std::vector<float> out(std::min<uint32_t>(pick_small(p, 4096), 1u << 20));
                size_t floats = 0;
                const uint32_t layer = pick_small(p, 2);
                if (layer < t->layers.size()) host([&] { (void)t->digests(layer, out, floats); });
            }
            return;
        case 5:
            // Releasing blocks until the transfer is quiesced; only a quiesced one is released here.
            if (auto t = pick_transfer(p); t && t->is_quiesced()) {
                host([&] { t->release(); });
                if (t == F->ef) F->ef.reset();
                if (t == F->es) F->es.reset();
                if (t == F->pf) F->pf.reset();
                if (t == F->ps) F->ps.reset();
                if (t == F->pw) F->pw.reset();
            }
            return;
        case 6: {
            // A new expect or post under a name the fuzzer may already have used in its frames.
            const std::string rid = pick_rid(p);
            const uint32_t which = p.ConsumeIntegralInRange<uint32_t>(0, 3);
            std::span<const uint32_t> table = which == 0 ? std::span<const uint32_t>(kTableEf)
                                              : which == 1 ? std::span<const uint32_t>(kTableEs)
                                                           : std::span<const uint32_t>(kTablePw);
            const uint64_t tokens = which == 0 ? 16 : which == 1 ? 13 : 8;
            std::shared_ptr<Transfer> t;
            if (p.ConsumeBool()) {
                host([&] { t = b.expect(F->sb, rid.c_str(), F->pb->pool, table, tokens, fuzz::transfer_options()); });
            } else {
                const bool selective = p.ConsumeBool();
                host([&] {
                    t = b.post(F->sb, rid.c_str(), F->pb->pool, table, tokens,
                               fuzz::transfer_options(selective ? kSelectivePaths : SG_PATH_FULL,
                                                      selective || p.ConsumeBool() ? SG_TRANSFER_ALL_LAYERS_WRITTEN : 0));
                });
            }
            if (t) F->extra.push_back(std::move(t));
            return;
        }
        default: pump(p.ConsumeIntegralInRange<int>(1, 16)); return;
    }
}

// ---- the two input forms --------------------------------------------------------------------------------

void run_raw(std::span<const uint8_t> in) {
    std::vector<uint8_t> frame;
    while (in.size() >= 2) {
        size_t len = size_t(in[0]) | size_t(in[1]) << 8;
        in = in.subspan(2);
        if (len == 0) {
            pump(1);
            continue;
        }
        len = std::min(len, in.size());
        frame.assign(in.begin(), in.begin() + len);
        in = in.subspan(len);
        if (frame.size() >= 20)
            for (int i = 0; i < 8; ++i) frame[12 + i] = uint8_t(F->a->id >> (8 * i));
        F->b->inject_frame(frame);
    }
}

void run_structured(std::span<const uint8_t> in) {
    FuzzedDataProvider p(in.data(), in.size());
    std::vector<uint8_t> frame;
    for (int ops = 0; ops < 64 && p.remaining_bytes(); ++ops) {
        const int op = p.ConsumeIntegralInRange<int>(0, 15);
        if (op < 12) {
            frame.clear();
            build_message(p, frame);
            damage(p, frame);
            F->b->inject_frame(frame);
        } else if (op < 14) {
            pump(p.ConsumeIntegralInRange<int>(1, 4));
        } else {
            host_action(p);
        }
    }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size == 0) return 0;
    const uint8_t mode = data[0];
    const bool fresh = (mode & 0xF6) == 0xF4;  // 0xF4/0xF5: authenticated, 0xFC/0xFD: from blobs
    ensure_fixture(fresh, !(fresh && (mode & 0x8)));
    const std::span<const uint8_t> rest(data + 1, size - 1);
    if (mode & 1)
        run_structured(rest);
    else
        run_raw(rest);
    pump(2);
    return 0;
}
