// The core against an authenticated but hostile peer, and against its own faults: frames injected as
// if they came from the peer (Context::inject_frame), a transport that throws on the progress
// thread, and the deadline sweep. Each test failed before its fix (out-of-bounds read, process
// ended by std::terminate, use-after-free under ASan).
#include "support/host_pool.hpp"
#include "core/core.hpp"

#include "../test_key.h"

#include <gtest/gtest.h>

#include <atomic>
#include <cstdlib>
#include <utility>
#include <cstring>
#include <numeric>
#include <thread>
#include <vector>

namespace {

using namespace sg;
constexpr uint64_t kSecond = 1000000000ull;

sg_context_options_t options(bool progress_thread) {
    sg_context_options_t o{};
    o.struct_size = sizeof o;
    o.provider = "tcp";
    o.manual_progress = progress_thread ? 0 : 1;
    o.log_level = SG_LOG_OFF;
    SG_TEST_USE_KEY(o);
    return o;
}

// A small fp16 pool: 2 layers, 1 head of 64, 4-token blocks, 8 blocks.
struct Pool : sgtest::HostPool {
    explicit Pool(uint32_t layers = 2) : HostPool({layers, 1, 64, 4, 8}) {}
};

sg_transfer_options_t transfer_options() {
    sg_transfer_options_t o{};
    o.struct_size = sizeof o;
    return o;
}

std::vector<uint32_t> table(size_t n) {
    std::vector<uint32_t> t(n);
    std::iota(t.begin(), t.end(), 0u);
    return t;
}

// Two contexts with a session each way (as after a successful bootstrap).
struct Pair {
    core::Context prefill, decode;
    std::shared_ptr<core::Session> at_prefill, at_decode;
    Pool pool;  // what a test's requests move
    // Hands m to `to` as a frame from the other side (inject_frame takes the context's mutex).
    template <class M, class... Type>  // Type: the MsgType of a TransferError
    void inject(core::Context &to, const M &m, Type... type) {
        std::vector<uint8_t> frame;
        wire::encode(frame, (&to == &decode ? prefill : decode).id, m, type...);
        to.inject_frame(frame);
    }
    // The decode side lost its session for breaking the protocol, saying `why`.
    ::testing::AssertionResult decode_lost_for(const std::string &why) {
        std::lock_guard lock(decode.mu);
        if (at_decode->error == SG_ERR_PROTOCOL && at_decode->error_message.find(why) != std::string::npos)
            return ::testing::AssertionSuccess();
        return ::testing::AssertionFailure() << "session error " << at_decode->error << " '" << at_decode->error_message
                                             << "', expected SG_ERR_PROTOCOL naming '" << why << "'";
    }
    // The pool registered with one side and exported on its session (sg_session_export_kv).
    std::shared_ptr<core::KvPool> export_pool(core::Context &side) {
        auto kv = std::make_shared<core::KvPool>(&side, pool.layout);
        (&side == &prefill ? at_prefill : at_decode)->export_kv(*kv);
        return kv;
    }
    // A decode-side transfer of 32 tokens into an exported pool, blocks 0..7.
    std::shared_ptr<core::Transfer> expect_on_decode(const sg_transfer_options_t &o = transfer_options()) {
        return decode.expect(at_decode, "req", export_pool(decode), table(8), 32, o);
    }
    explicit Pair(bool progress_thread = false) : prefill(options(progress_thread)), decode(options(progress_thread)) {
        sg_session_options_t so{};
        so.struct_size = sizeof so;
        at_prefill = prefill.open_session(decode.hello(), so, true);
        at_decode = decode.open_session(prefill.hello(), so, true);
    }
    // As a host does: close the sessions, then release what was on them (a transfer and its session
    // hold each other until the transfer is released).
    ~Pair() {
        for (auto [ctx, s] : {std::pair{&prefill, at_prefill}, std::pair{&decode, at_decode}}) {
            s->close();
            std::vector<std::shared_ptr<core::Transfer>> ts;
            {
                std::lock_guard lock(ctx->mu);
                ts = s->matchbook.transfers();
            }
            for (auto &t : ts) t->release();
        }
    }
};


TEST(HostilePeer, AStagedChunkWhoseSlotOffsetWrapsFailsTheSessionAndTouchesNoMemory) {
    Pair p;
    auto t = p.expect_on_decode();
    // slot_offset + length wraps past 2^64 to a small number: a check written as
    // `pos + len > slot_bytes` passes and the unpack reads far outside the staging slot.
    wire::StagedChunk m;
    m.decode_xfer_id = t->id;
    m.layer = 0;
    m.slot = 0;
    m.slot_offset = UINT64_MAX - 63;
    m.segments.push_back({0, 0, 128});
    p.inject(p.decode, m);
    std::lock_guard lock(p.decode.mu);
    EXPECT_TRUE(p.at_decode->closed());
    EXPECT_EQ(p.at_decode->error, SG_ERR_PROTOCOL) << p.at_decode->error_message;
    EXPECT_EQ(t->status, SG_ERR_PROTOCOL);
    for (uint16_t x : p.pool.k[0]) ASSERT_EQ(x, 0u);
}

// A slot's generation only grows (wire 1.7): the same notice twice names bytes we already
// unpacked and whose slot the peer may be writing again.
TEST(HostilePeer, AStagedChunkWhoseGenerationDidNotGrowFailsTheSession) {
    Pair p;
    auto t = p.expect_on_decode();
    wire::StagedChunk m;
    m.decode_xfer_id = t->id;
    m.segments.push_back({0, 0, 128});
    m.generation = 5;
    const std::vector<uint8_t> zeros(128, 0);  // what an unwritten slot holds
    m.crc32c = crc32c(0, zeros.data(), zeros.size());
    p.inject(p.decode, m);
    {
        std::lock_guard lock(p.decode.mu);
        ASSERT_FALSE(p.at_decode->closed()) << p.at_decode->error_message;
    }
    p.inject(p.decode, m);
    EXPECT_TRUE(p.decode_lost_for("with generation 5 after generation 5"));
}

TEST(HostilePeer, AnOutOfRangeSegmentOffsetFailsTheSession) {
    Pair p;
    auto t = p.expect_on_decode();
    wire::StagedChunk m;
    m.decode_xfer_id = t->id;
    m.segments.push_back({0, UINT64_MAX - 8, 64});  // offset + length wraps inside the region check
    p.inject(p.decode, m);
    std::lock_guard lock(p.decode.mu);
    EXPECT_EQ(p.at_decode->error, SG_ERR_PROTOCOL);
}

// Quantized chunks (wire_quant): one for a transfer that did not consent to quantization, and one
// whose segment is not whole head rows, each fail the session before any byte is decoded.
TEST(HostilePeer, AQuantizedChunkTheTransferDidNotAgreeToFailsTheSession) {
    Pair p;
    auto t = p.expect_on_decode();  // wire_quant 0
    wire::StagedChunk m;
    m.decode_xfer_id = t->id;
    m.wire_quant = SG_WIRE_QUANT_INT8;
    m.segments.push_back({0, 0, 128});
    p.inject(p.decode, m);
    EXPECT_TRUE(p.decode_lost_for("quantized as int8"));
    for (uint16_t x : p.pool.k[0]) ASSERT_EQ(x, 0u);
}

TEST(HostilePeer, AQuantizedSegmentThatCutsARowFailsTheSession) {
    Pair p;
    auto kv = p.export_pool(p.decode);
    const auto tbl = table(8);
    sg_transfer_options_t o = transfer_options();
    o.wire_quant = SG_WIRE_QUANT_INT8;
    auto t = p.decode.expect(p.at_decode, "req", kv, tbl, 32, o);
    wire::StagedChunk m;
    m.decode_xfer_id = t->id;
    m.wire_quant = SG_WIRE_QUANT_INT8;
    m.segments.push_back({0, 2, 64});  // starts inside a row
    p.inject(p.decode, m);
    EXPECT_TRUE(p.decode_lost_for("whole head rows"));
    for (uint16_t x : p.pool.k[0]) ASSERT_EQ(x, 0u);
}

// A BlocksReady must name one of the selective paths (UnitPath::of); any other value used to be
// counted as speculative bytes.
TEST(HostilePeer, ABlocksReadyOfNoSelectivePathFailsTheSession) {
    for (const uint32_t path : {uint32_t(SG_PATH_FULL), 0u, SG_PATH_PROACTIVE | SG_PATH_ON_DEMAND, 0x40u}) {
        SCOPED_TRACE(path);
        Pair p;
        auto t = p.expect_on_decode();
        wire::BlocksReady m;
        m.decode_xfer_id = t->id;
        m.layer = 0;
        m.path = path;
        m.blocks = {0};
        p.inject(p.decode, m);
        EXPECT_TRUE(p.decode_lost_for("is not one of the selective paths"));
        std::lock_guard lock(p.decode.mu);
        EXPECT_EQ(t->stats.bytes, 0u);
        EXPECT_FALSE(t->residency.test(0, 0));
    }
}

TEST(HostilePeer, AMessageThatDoesNotDecodeFailsTheSession) {
    Pair p;
    wire::LayerReady m;
    std::vector<uint8_t> frame;
    wire::encode(frame, p.prefill.id, m);
    frame.resize(frame.size() - 3);  // cut inside the last field
    frame[20] = uint8_t(frame.size() - wire::kFrameHeaderBytes);
    p.decode.inject_frame(frame);
    std::lock_guard lock(p.decode.mu);
    EXPECT_EQ(p.at_decode->error, SG_ERR_PROTOCOL) << p.at_decode->error_message;
}

// Two posts whose deadlines pass before any Expect: the sweep used to range-iterate the unmatched
// posts while failing one erased it from that map (use-after-free, seen by ASan).
// The range checks of what a peer sends lose the session wherever they fail (STYLE 25); a
// LayerReady for a layer that does not exist used to be ignored and a bad Fetch failed only its
// transfer (docs/protocol.md review).
TEST(HostilePeer, ALayerReadyForALayerThatDoesNotExistFailsTheSession) {
    Pair p;
    auto t = p.expect_on_decode();
    wire::LayerReady m;
    m.decode_xfer_id = t->id;
    m.layer = 7;
    p.inject(p.decode, m);
    std::lock_guard lock(p.decode.mu);
    EXPECT_TRUE(p.at_decode->closed());
    EXPECT_EQ(p.at_decode->error, SG_ERR_PROTOCOL) << p.at_decode->error_message;
    EXPECT_EQ(t->status, SG_ERR_PROTOCOL);
}

// An AuthResult means something only on a session that runs the fabric challenge (made from a
// blob); on a session its bootstrap handshake proved, a rejection from the peer is noise.
TEST(HostilePeer, AnAuthResultOnABootstrappedSessionIsIgnored) {
    Pair p;
    p.inject(p.decode, wire::AuthResult{0});
    std::lock_guard lock(p.decode.mu);
    EXPECT_FALSE(p.at_decode->closed()) << p.at_decode->error_message;
    EXPECT_EQ(p.decode.counters.auth_failures, 0u);
}

// Expects waiting for a post are bounded like the context's other per-id tables.
TEST(HostilePeer, ExpectsWithoutPostsAreBounded) {
    Pair p;
    wire::Expect m;
    m.handle_id = 1;
    m.num_tokens = 4;
    m.block_ids = {0};
    std::vector<uint8_t> frame;
    for (uint32_t i = 0; i <= 65536; ++i) {
        m.request_id = "r" + std::to_string(i);
        m.decode_xfer_id = i + 1;
        frame.clear();
        wire::encode(frame, p.decode.id, m);
        p.prefill.inject_frame(frame);
    }
    std::lock_guard lock(p.prefill.mu);
    EXPECT_TRUE(p.at_prefill->closed());
    EXPECT_EQ(p.at_prefill->error, SG_ERR_PROTOCOL) << p.at_prefill->error_message;
    EXPECT_LE(p.at_prefill->matchbook.held_expects(), core::Matchbook::kMaxRemembered);
}

// A post whose match fails when the Expect arrives (here: the Expect names a pool the decode side
// never exported) stays filed as that request's post until it is released: the id stays taken
// (SG_ERR_DUPLICATE), and the decode side's cancel of that Expect is about it, not remembered for
// the id's next post.
TEST(Matchbook, APostThatFailsAtItsMatchKeepsItsIdUntilReleased) {
    Pair p;
    auto kv = p.export_pool(p.prefill);
    const auto tbl = table(8);
    auto post = p.prefill.post(p.at_prefill, "x", kv, tbl, 32, transfer_options());
    wire::Expect e;
    e.request_id = "x";
    e.decode_xfer_id = 77;
    e.handle_id = 12345;  // never exported
    e.num_tokens = 32;
    e.block_ids.assign(tbl.begin(), tbl.end());
    p.inject(p.prefill, e);
    {
        std::lock_guard lock(p.prefill.mu);
        ASSERT_TRUE(post->finished());
        EXPECT_EQ(post->status, SG_ERR_PROTOCOL) << post->error;
        EXPECT_FALSE(p.at_prefill->closed()) << "the failed match ends this transfer only";
        EXPECT_EQ(p.at_prefill->matchbook.matched_post("x"), post.get());
    }
    try {
        (void)p.prefill.post(p.at_prefill, "x", kv, tbl, 32, transfer_options());
        ADD_FAILURE() << "a second post of the id was taken while the failed one is filed";
    } catch (const Error &err) {
        EXPECT_EQ(err.status(), SG_ERR_DUPLICATE) << err.message();
    }
    wire::TransferError cancel;
    cancel.request_id = "x";
    cancel.decode_xfer_id = 77;
    cancel.status = SG_ERR_CANCELED;
    cancel.message = "withdrawn";
    cancel.from_post_side = 0;
    p.inject(p.prefill, cancel, wire::MsgType::Cancel);
    post->release();
    // The id is free again, and the cancel above was not kept for it.
    auto again = p.prefill.post(p.at_prefill, "x", kv, tbl, 32, transfer_options());
    std::lock_guard lock(p.prefill.mu);
    EXPECT_FALSE(again->finished()) << again->error;
    EXPECT_TRUE(p.at_prefill->matchbook.posted("x"));
}

// The session's machine: only the diagram's transitions (docs/protocol.md 5.2) are legal, and an
// illegal one is refused with SG_ERR_INTERNAL instead of silently taken.
TEST(SessionStateMachine, OnlyTheDiagramsTransitionsAreLegal) {
    using S = core::SessionState;
    const S all[] = {S::Authenticating, S::Open, S::Draining, S::Closed};
    int legal = 0;
    for (S a : all)
        for (S b : all) legal += core::legal_transition(a, b);
    EXPECT_EQ(legal, 6);  // Authenticating -> Open, Draining, Closed; Open -> Draining, Closed; Draining -> Closed
    EXPECT_TRUE(core::legal_transition(S::Draining, S::Closed));
    EXPECT_FALSE(core::legal_transition(S::Closed, S::Open));
    EXPECT_FALSE(core::legal_transition(S::Open, S::Authenticating));
    Pair p;
    std::lock_guard lock(p.decode.mu);
    EXPECT_EQ(p.at_decode->state(), S::Open);
    try {
        p.at_decode->advance(S::Authenticating);
        ADD_FAILURE() << "Open -> Authenticating was taken";
    } catch (const Error &e) {
        EXPECT_EQ(e.status(), SG_ERR_INTERNAL);
    }
    EXPECT_EQ(p.at_decode->state(), S::Open);
}

// The close handshake goes None -> ByeSent -> Answered, one step at a time; any other step is
// refused with SG_ERR_INTERNAL. A second Bye from the peer after its answer changes nothing.
TEST(SessionStateMachine, TheCloseHandshakeTakesItsStepsOnceAndInOrder) {
    using B = core::ByeExchange;
    Pair p;
    std::unique_lock lock(p.decode.mu);
    core::Session &s = *p.at_decode;
    EXPECT_EQ(s.bye(), B::None);
    auto refused = [&](B to) {
        try {
            s.advance_bye(to);
            return false;
        } catch (const Error &e) {
            return e.status() == SG_ERR_INTERNAL;
        }
    };
    EXPECT_TRUE(refused(B::Answered)) << "an answer to a Bye never sent";
    EXPECT_TRUE(refused(B::None));
    s.advance_bye(B::ByeSent);
    EXPECT_TRUE(refused(B::ByeSent)) << "a second Bye";
    s.advance_bye(B::Answered);
    EXPECT_TRUE(refused(B::Answered));
    EXPECT_EQ(s.bye(), B::Answered);
    // The peer's Bye after the exchange ended: taken without a step and without losing the session.
    std::vector<uint8_t> frame;
    wire::Bye again;
    again.reply = 1;
    wire::encode(frame, p.prefill.id, again);
    lock.unlock();  // inject_frame takes the mutex
    p.decode.inject_frame(frame);
    lock.lock();
    EXPECT_EQ(s.bye(), B::Answered);
}

// A prefill layer goes Unwritten -> Written -> Posted -> Noticed and a send unit Claimed ->
// Compiled -> Noticed, one step at a time; skipping a step or taking one twice is refused with
// SG_ERR_INTERNAL and changes nothing.
template <class Part, class Step>
void expect_steps_in_order(Part &part, std::initializer_list<Step> steps) {
    auto refused = [&](Step to) {
        const Step before = part.step();
        try {
            part.advance(to);
            return false;
        } catch (const Error &e) {
            return e.status() == SG_ERR_INTERNAL && part.step() == before;
        }
    };
    const std::vector<Step> order(steps);
    EXPECT_EQ(part.step(), order[0]);
    for (size_t i = 1; i < order.size(); ++i) {
        for (size_t j = 0; j < order.size(); ++j)
            if (j != i) EXPECT_TRUE(refused(order[j])) << "from step " << i - 1 << " to " << j;
        part.advance(order[i]);
        EXPECT_EQ(part.step(), order[i]);
    }
    for (const Step to : order) EXPECT_TRUE(refused(to)) << "after the last step";
}

TEST(TransferSteps, ALayerAndASendUnitTakeTheirStepsOnceAndInOrder) {
    using LS = core::Transfer::LayerStep;
    core::Transfer::Layer layer;
    EXPECT_FALSE(layer.out.written());
    expect_steps_in_order(layer.out, {LS::Unwritten, LS::Written, LS::Posted, LS::Noticed});
    EXPECT_TRUE(layer.out.written());
    using US = core::SendUnit::Step;
    core::SendUnit unit;
    EXPECT_FALSE(unit.fully_posted());
    expect_steps_in_order(unit, {US::Claimed, US::Compiled, US::Noticed});
    EXPECT_TRUE(unit.fully_posted());  // no ops: compiled is all of it
}

TEST(Deadlines, PostsWhoseDeadlinePassesBeforeTheirExpectFailCleanly) {
    Pair p;
    auto kv = p.export_pool(p.prefill);
    const auto tbl = table(8);
    sg_transfer_options_t o = transfer_options();
    o.deadline_ns = 20'000'000;
    std::vector<std::shared_ptr<core::Transfer>> posts;
    for (const char *rid : {"a", "b", "c"}) posts.push_back(p.prefill.post(p.at_prefill, rid, kv, tbl, 32, o));
    const uint64_t until = now_ns() + 5 * kSecond;
    auto all_failed = [&] {
        std::lock_guard lock(p.prefill.mu);
        for (auto &t : posts)
            if (!t->finished()) return false;
        return true;
    };
    while (!all_failed() && now_ns() < until) p.prefill.progress_once();
    for (auto &t : posts) EXPECT_EQ(t->status, SG_ERR_DEADLINE);
}

TEST(Deadlines, ADeadlineOfUint64MaxNeverFires) {
    Pair p;
    auto kv = p.export_pool(p.prefill);
    const auto tbl = table(8);
    sg_transfer_options_t o = transfer_options();
    o.deadline_ns = UINT64_MAX;  // "now + deadline" wrapped to the past before
    auto t = p.prefill.post(p.at_prefill, "forever", kv, tbl, 32, o);
    const uint64_t until = now_ns() + kSecond / 2;
    while (now_ns() < until) p.prefill.progress_once();
    std::lock_guard lock(p.prefill.mu);
    EXPECT_EQ(t->status, SG_IN_PROGRESS);
}

// A transport that forwards to the real one and throws from poll() once armed, as fi_cq_read's
// error path does.
class ThrowingTransport : public transport::Transport {
  public:
    explicit ThrowingTransport(std::shared_ptr<transport::Transport> inner) : inner_(std::move(inner)) {}
    std::atomic<bool> armed{false};
    const transport::Capabilities &caps() const override { return inner_->caps(); }
    std::vector<uint8_t> local_address() override { return inner_->local_address(); }
    transport::PeerAddr insert_peer(std::span<const uint8_t> a) override { return inner_->insert_peer(a); }
    void remove_peer(transport::PeerAddr p) override { inner_->remove_peer(p); }
    transport::Registration register_memory(void *addr, uint64_t len, uint64_t key) override {
        return inner_->register_memory(addr, len, key);
    }
    void deregister(transport::Registration &r) noexcept override { inner_->deregister(r); }
    int post_write(transport::PeerAddr p, std::span<const transport::LocalIov> l, uint64_t ra, uint64_t key,
                   void *cookie) override {
        return inner_->post_write(p, l, ra, key, cookie);
    }
    int post_send(transport::PeerAddr p, const void *buf, uint64_t len, void *desc, void *cookie) override {
        return inner_->post_send(p, buf, len, desc, cookie);
    }
    size_t poll(transport::CompletionSink &sink) override {
        if (armed.exchange(false)) fail(SG_ERR_TRANSPORT, "fi_cq_read: injected failure");
        return inner_->poll(sink);
    }
    int wait_fd() const override { return inner_->wait_fd(); }
    bool prepare_wait() override { return inner_->prepare_wait(); }
    uint64_t live_registrations() const override { return inner_->live_registrations(); }

  private:
    std::shared_ptr<transport::Transport> inner_;
};

TEST(ExceptionBarrier, ATransportErrorOnTheProgressThreadFailsTheSessionsNotTheProcess) {
    core::Context a(options(true)), b(options(false));
    ThrowingTransport *thrower = nullptr;
    {
        std::lock_guard lock(a.mu);
        auto w = std::make_unique<ThrowingTransport>(std::move(a.transports[0]));
        thrower = w.get();
        a.transports[0] = std::move(w);
    }
    sg_session_options_t so{};
    so.struct_size = sizeof so;
    auto s = a.open_session(b.hello(), so, true);
    thrower->armed = true;
    const uint64_t until = now_ns() + 5 * kSecond;
    for (;;) {
        {
            std::lock_guard lock(a.mu);
            if (s->closed() || now_ns() > until) break;
        }
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    std::lock_guard lock(a.mu);
    EXPECT_TRUE(s->closed());
    EXPECT_EQ(s->error, SG_ERR_INTERNAL);
    EXPECT_NE(s->error_message.find("injected failure"), std::string::npos) << s->error_message;
}


// A big frame: an Expect with 60000 block ids (~240 KB).
std::vector<uint8_t> big_frame(uint64_t sender) {
    wire::Expect e;
    e.request_id = "flood";
    e.block_ids.assign(60000, 7);
    std::vector<uint8_t> frame;
    wire::encode(frame, sender, e);
    return frame;
}

// Frames from senders the context has no session with are kept (their session may be opened in a
// moment), but within a budget: before, 4096 frames per (forged) sender id, without bound overall.
TEST(Unauthenticated, FramesFromUnknownSendersStayWithinTheContextsBudget) {
    core::Context c(options(false));
    for (uint64_t i = 0; i < 200; ++i) c.inject_frame(big_frame(0x1000 + i));  // ~48 MB from 200 ids
    EXPECT_LE(c.unauthenticated_bytes(), core::Context::kUnauthenticatedBytes);
    EXPECT_GT(c.unauthenticated_bytes(), 0u);
    core::Context d(options(false));
    for (int i = 0; i < 100; ++i) d.inject_frame(big_frame(0x42));  // ~24 MB from one id
    EXPECT_LE(d.unauthenticated_bytes(), core::Context::kUnauthenticatedShare);
}

TEST(Unauthenticated, APeerThatSendsTooMuchBeforeProvingItsKeyIsDropped) {
    core::Context a(options(false)), b(options(false));
    sg_session_options_t so{};
    so.struct_size = sizeof so;
    auto s = a.open_session(b.hello(), so, false);  // from a blob: must prove itself over the fabric
    for (int i = 0; i < 100; ++i) a.inject_frame(big_frame(b.id));
    {
        std::lock_guard lock(a.mu);
        EXPECT_TRUE(s->closed());
        EXPECT_EQ(s->error, SG_ERR_PROTOCOL) << s->error_message;
    }
    EXPECT_EQ(a.unauthenticated_bytes(), 0u);
}


// One killed peer logged 17-65 identical lines, and every refused blob one more: repeats within a
// second are counted, not written.
TEST(Logging, IdenticalLinesWithinASecondAreCountedNotRepeated) {
    struct Sink {
        std::vector<std::string> lines;
        static void write(void *user, sg_log_level_t, const char *msg) { static_cast<Sink *>(user)->lines.push_back(msg); }
    } sink;
    Logger log(SG_LOG_INFO, &Sink::write, &sink);
    for (int i = 0; i < 50; ++i) log.log(SG_LOG_ERROR, "session with peer 7 lost: connection reset");
    log.log(SG_LOG_ERROR, "another line");
    ASSERT_EQ(sink.lines.size(), 2u);
    EXPECT_EQ(sink.lines[0], "session with peer 7 lost: connection reset");
    std::this_thread::sleep_for(std::chrono::nanoseconds(Logger::kRepeatWindowNs + 10000000));
    log.log(SG_LOG_ERROR, "session with peer 7 lost: connection reset");
    ASSERT_EQ(sink.lines.size(), 3u);
    EXPECT_NE(sink.lines[2].find("and 49 more like it"), std::string::npos) << sink.lines[2];
}


// Found by the handler fuzzer: a peer's status is any int32; one this version does not know is
// SG_ERR_REMOTE, never a value outside sg_status_t (undefined behaviour, then handed to the host).
TEST(HostilePeer, AStatusOutsideTheEnumBecomesRemote) {
    Pair p;
    auto t = p.expect_on_decode();
    wire::TransferError m;
    m.request_id = "req";
    m.decode_xfer_id = t->id;
    m.status = -1221118153;
    m.message = "?";
    m.from_post_side = 1;
    p.inject(p.decode, m, wire::MsgType::Cancel);
    std::lock_guard lock(p.decode.mu);
    EXPECT_EQ(t->status, SG_ERR_REMOTE);
    EXPECT_EQ(peer_error_status(SG_ERR_DEADLINE), SG_ERR_DEADLINE);
    EXPECT_EQ(peer_error_status(5), SG_ERR_REMOTE);
}

// Found by the metadata and handshake fuzzers: an endpoint name of the wrong length (empty) reached
// fi_av_insert, which read the provider's name length from address 0.
TEST(HostilePeer, AnEndpointNameOfTheWrongLengthIsRefused) {
    core::Context a(options(false)), b(options(false));
    wire::Hello h = b.hello();
    ASSERT_FALSE(h.endpoints.empty());
    sg_session_options_t so{};
    so.struct_size = sizeof so;
    for (size_t len : {size_t(0), size_t(2), h.endpoints[0].address.size() + 1}) {
        wire::Hello bad = h;
        for (auto &e : bad.endpoints) e.address.resize(len, 0);
        try {
            a.open_session(bad, so, true);
            ADD_FAILURE() << "a " << len << "-byte endpoint name was taken";
        } catch (const Error &e) {
            EXPECT_EQ(e.status(), SG_ERR_PROTOCOL) << e.message();
        }
    }
}


// SG_STAGING_THRESHOLD and SG_PROGRESS_SPIN_US were parsed with strtoull and no bounds (the setter
// enforces them): garbage or an out-of-range value now refuses the context.
TEST(Environment, TunablesFromTheEnvironmentKeepTheSettersBounds) {
    for (auto [name, value] : {std::pair{"SG_STAGING_THRESHOLD", "999999999999"}, std::pair{"SG_PROGRESS_SPIN_US", "abc"},
                               std::pair{"SG_STAGING_POLICY", "7"}, std::pair{"SG_PROGRESS_SPIN_US", "-1"}}) {
        setenv(name, value, 1);
        try {
            core::Context c(options(false));
            ADD_FAILURE() << name << "=" << value << " was taken";
        } catch (const Error &e) {
            EXPECT_EQ(e.status(), SG_ERR_INVALID_ARGUMENT) << e.message();
            EXPECT_NE(e.message().find(name), std::string::npos) << e.message();
        }
        unsetenv(name);
    }
    setenv("SG_STAGING_THRESHOLD", "4096", 1);
    core::Context ok(options(false));
    EXPECT_EQ(ok.get_param(SG_PARAM_STAGING_THRESHOLD), 4096u);
    unsetenv("SG_STAGING_THRESHOLD");
}


// Each session used to map and register 64 MiB of staging slots at once, whatever its role. Now a
// session that expects offers receive slots with its first Expect, and one that stages allocates
// its pack slots at its first staged chunk: a session that only posts holds no receive slots.
TEST(Staging, SlotsComeOnFirstUseByRole) {
    Pair p;
    {
        std::lock_guard lock(p.prefill.mu);
        EXPECT_EQ(p.at_prefill->recv_staging.base, nullptr);
        EXPECT_EQ(p.at_prefill->send_staging.base, nullptr);
    }
    Pool pool;
    auto src = std::make_shared<core::KvPool>(&p.prefill, pool.layout);
    p.at_prefill->export_kv(*src);
    const auto tbl = table(8);
    auto posted = p.prefill.post(p.at_prefill, "only-posts", src, tbl, 32, transfer_options());
    Pool pool2;
    auto dst = std::make_shared<core::KvPool>(&p.decode, pool2.layout);
    p.at_decode->export_kv(*dst);
    auto expected = p.decode.expect(p.at_decode, "expects", dst, tbl, 32, transfer_options());
    std::lock_guard lp(p.prefill.mu);
    EXPECT_EQ(p.at_prefill->recv_staging.base, nullptr) << "a session that only posts needs no receive slots";
    std::lock_guard ld(p.decode.mu);
    EXPECT_NE(p.at_decode->recv_staging.base, nullptr);
    EXPECT_EQ(p.at_decode->send_staging.base, nullptr) << "a session that only expects packs nothing";
}

}  // namespace
