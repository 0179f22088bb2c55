// The core on the fake fabric, scenario by scenario: matching in either order, cancel before and
// after the match on each side, quiesce, release, deadlines and leases on the test clock, the
// scheduler's priority order and in-flight bounds as the fabric's write log shows them, EAGAIN,
// a broken connection, and a local_only peer that dies. No sockets, threads or sleeps: every test
// is one seed's schedule and replays exactly.
#include "fake_pair.hpp"
#include "support/scoped_env.hpp"

#include "select/select.hpp"

#include <gtest/gtest.h>

#include <cstdlib>
#include <set>

namespace {

using namespace sg;
using namespace sg::testing;

// Writes straight into the decode pool, none packed through staging slots, so the fabric's write
// log names the blocks (SG_STAGING_THRESHOLD is read when a context is created).
struct NoStaging {
    NoStaging() { ::setenv("SG_STAGING_THRESHOLD", "0", 1); }
    ~NoStaging() { ::unsetenv("SG_STAGING_THRESHOLD"); }
};

TEST(Schedule, ExpectBeforePostMovesEveryByte) {
    FakePair p(1);
    Request r(p, 3, 16, 61);
    r.do_expect();
    p.run_until([&] { return false; }, 20);  // the Expect reaches the prefill side first
    r.do_post();
    ASSERT_TRUE(r.run_to_quiesce());
    EXPECT_EQ(r.post->status, SG_OK);
    EXPECT_EQ(r.expect->status, SG_OK);
    EXPECT_TRUE(r.exact());
    EXPECT_EQ(r.expect->wait(-1, 0), SG_OK);
    r.finish();
}

TEST(Schedule, PostBeforeExpectMovesEveryByte) {
    FakePair p(2);
    Request r(p, 3, 16, 64);
    r.do_post();
    p.run_until([&] { return false; }, 20);
    r.do_expect();
    ASSERT_TRUE(r.run_to_quiesce());
    EXPECT_EQ(r.post->status, SG_OK);
    EXPECT_EQ(r.expect->status, SG_OK);
    EXPECT_TRUE(r.exact());
    r.finish();
}

// Cancel on either side, before or after the match: both sides end (the other with an error, not
// SG_OK) and quiesce, and the decode side is quiesced only once the prefill side confirmed.
struct CancelCase {
    bool prefill_cancels;
    bool after_match;
};

class CancelSchedule : public ::testing::TestWithParam<CancelCase> {};

TEST_P(CancelSchedule, BothSidesEndAndQuiesce) {
    const CancelCase c = GetParam();
    fake::Knobs k;
    k.delay = 0.3;  // writes still under way when the cancel comes
    FakePair p(3, {k});
    Request r(p, 4, 32, 128);
    core::Context &canceler = c.prefill_cancels ? *p.prefill : *p.decode;
    if (c.after_match) {
        r.do_expect();
        r.do_post();
        ASSERT_TRUE(p.run_until([&] { return !p.fabric.writes().empty(); }));
        std::shared_ptr<core::Transfer> &mine = c.prefill_cancels ? r.post : r.expect;
        mine->cancel(SG_ERR_CANCELED, "canceled by the test");
        EXPECT_EQ(mine->status, SG_ERR_CANCELED);
        if (!c.prefill_cancels) EXPECT_FALSE(quiesced(*p.decode, *r.expect));  // the prefill side has not confirmed
    } else if (c.prefill_cancels) {
        r.do_post();
        r.post->cancel(SG_ERR_CANCELED, "canceled by the test");
        p.run_until([&] { return false; }, 20);
        r.do_expect();
    } else {
        r.do_expect();
        r.expect->cancel(SG_ERR_CANCELED, "canceled by the test");
        p.run_until([&] { return false; }, 20);
        sg_transfer_options_t o = transfer_options();
        o.deadline_ns = 50 * kMs;  // nothing will ask for this post again
        r.do_post(o);
    }
    ASSERT_TRUE(r.run_to_quiesce()) << "prefill " << r.post->status << " decode " << r.expect->status;
    EXPECT_NE(r.post->status, SG_OK);
    EXPECT_NE(r.expect->status, SG_OK);
    EXPECT_EQ((c.prefill_cancels ? r.post : r.expect)->status, SG_ERR_CANCELED);
    r.finish();
}

INSTANTIATE_TEST_SUITE_P(Sides, CancelSchedule,
                         ::testing::Values(CancelCase{true, false}, CancelCase{false, false}, CancelCase{true, true},
                                           CancelCase{false, true}),
                         [](const auto &info) {
                             return std::string(info.param.prefill_cancels ? "Prefill" : "Decode") +
                                    (info.param.after_match ? "AfterMatch" : "BeforeMatch");
                         });

// A selective transfer the decode side releases before it holds every block: release waits for the
// prefill side's confirmation (here: its progress runs while release polls), and both sides count
// it completed.
TEST(Schedule, ReleaseEndsASelectiveTransferEarly) {
    FakePair p(4);
    Request r(p, 2, 32, 128);
    r.do_expect();
    r.do_post(transfer_options(SG_PATH_PROACTIVE | SG_PATH_ON_DEMAND));
    ASSERT_TRUE(p.run_until([&] { return r.expect->residency.count(1) > 0; }));
    EXPECT_FALSE(r.expect->finished());
    p.blocking(*p.decode, [&] { r.expect->release(); });
    EXPECT_TRUE(r.expect->is_quiesced());
    ASSERT_TRUE(p.run_until([&] { return quiesced(*p.prefill, *r.post); }));
    EXPECT_EQ(r.post->status, SG_OK);
    EXPECT_EQ(r.expect->status, SG_OK);
    r.expect.reset();
    r.finish();
    EXPECT_EQ(p.prefill->stats().transfers_completed, 1u);
    EXPECT_EQ(p.decode->stats().transfers_completed, 1u);
}

// A transfer's path is a table of steps chosen once from its SG_PATH_* bits (transfer_path.hpp):
// on the prefill side at post, on the decode side when the peer's Selective message names them
// (the whole cache until then). Both tables are complete.
TEST(TransferPath, IsChosenOnceFromThePathBitsOnEachSide) {
    using core::TransferPath;
    EXPECT_EQ(&TransferPath::of(0), &TransferPath::kFull);
    EXPECT_EQ(&TransferPath::of(SG_PATH_FULL), &TransferPath::kFull);
    for (uint32_t bits = 1; bits < 8; ++bits) {
        const uint32_t paths = (bits & 1 ? SG_PATH_PROACTIVE : 0u) | (bits & 2 ? SG_PATH_ON_DEMAND : 0u) |
                               (bits & 4 ? SG_PATH_SPECULATIVE : 0u);
        EXPECT_EQ(&TransferPath::of(paths), &TransferPath::kSelective) << paths;
    }
    for (const TransferPath *path : {&TransferPath::kFull, &TransferPath::kSelective}) {
        SCOPED_TRACE(path->name);
        EXPECT_TRUE(path->prepare && path->commit_written && path->check_peer && path->pump && path->layer_written &&
                    path->begin_decode && path->chunk_landed && path->release_unfinished);
    }
    EXPECT_TRUE(TransferPath::kFull.whole);
    EXPECT_FALSE(TransferPath::kSelective.whole);

    for (const uint32_t paths : {uint32_t(SG_PATH_FULL), SG_PATH_PROACTIVE | SG_PATH_ON_DEMAND | SG_PATH_SPECULATIVE}) {
        SCOPED_TRACE(paths);
        FakePair p(6);
        Request r(p, 2, 32, 128);
        r.do_expect();
        EXPECT_EQ(&r.expect->path(), &TransferPath::kFull);  // not named by the peer yet
        r.do_post(transfer_options(paths));
        EXPECT_EQ(&r.post->path(), &TransferPath::of(paths));
        ASSERT_TRUE(r.run_to_quiesce());
        EXPECT_EQ(r.expect->paths(), paths);
        EXPECT_EQ(&r.expect->path(), &TransferPath::of(paths));
        ASSERT_EQ(r.post->status, SG_OK) << r.post->error;
        EXPECT_TRUE(r.exact());
        const sg_transfer_stats_t st = r.post->stats_snapshot();
        EXPECT_GT(st.bytes, 0u);
        EXPECT_EQ(st.bytes_full, paths == SG_PATH_FULL ? st.bytes : 0u);
        r.finish();
    }
}

TEST(Schedule, ADeadlineEndsATransferWhenTheClockPassesIt) {
    FakePair p(5);
    Request r(p, 2, 8, 32);
    sg_transfer_options_t o = transfer_options();
    o.deadline_ns = 5 * kMs;
    r.do_expect(o);
    p.run_until([&] { return false; }, 100);  // 2 ms of test time: not yet
    EXPECT_FALSE(r.expect->finished());
    p.clock.advance(10 * kMs);
    ASSERT_TRUE(p.run_until([&] { return r.expect->finished(); }, 1000));
    EXPECT_EQ(r.expect->status, SG_ERR_DEADLINE);
    EXPECT_TRUE(r.run_to_quiesce());
    r.finish();
    EXPECT_EQ(p.decode->stats().deadlines_hit, 1u);
}

// On-demand without the speculative path: the blocks stay leased for lease_ns after the last layer
// was written, then the transfer ends with SG_ERR_LEASE_EXPIRED on the prefill side.
TEST(Schedule, ALeaseExpiresWhenTheDecodeSideNeverTakesTheRest) {
    FakePair p(6);
    Request r(p, 2, 32, 128);
    r.do_expect();
    sg_transfer_options_t o = transfer_options(SG_PATH_PROACTIVE | SG_PATH_ON_DEMAND);
    o.lease_ns = 30 * kMs;
    r.do_post(o);
    ASSERT_TRUE(p.run_until([&] { return r.expect->residency.count(0) > 0 && r.expect->residency.count(1) > 0; }));
    p.run_until([&] { return false; }, 200);  // 4 ms: the lease holds
    EXPECT_FALSE(r.post->finished());
    p.clock.advance(40 * kMs);
    ASSERT_TRUE(r.run_to_quiesce());
    EXPECT_EQ(r.post->status, SG_ERR_LEASE_EXPIRED);
    EXPECT_NE(r.expect->status, SG_OK);
    r.finish();
}

// Three layers of one KV head, 4-token blocks: sinks and recent window of two blocks each, so a
// 64-block request's proactive blocks are 0, 1, 62 and 63.
select::Profile sinks_and_recent_profile() {
    return select::parse_profile(
        R"({"version": 1, "model": "t", "num_layers": 3, "num_kv_heads": 1, "block_tokens": 4,
            "defaults": {"policy": "sinks_recent", "budget": {"tokens": 16}, "sinks": 8, "recent": 8}})");
}

// The scheduler's order, seen in what the prefill side posts: every proactive block before any
// speculative one, and a fetch's blocks before anything posted after the fetch arrived.
TEST(Schedule, OnDemandGoesBeforeProactiveBeforeSpeculative) {
    PairConfig cfg;
    cfg.max_ops_in_flight = 2;  // so that work queues behind the bounds
    NoStaging direct;
    FakePair p(7, cfg);
    const uint32_t layers = 3, blocks = 64, tpb = 4;
    Request r(p, layers, blocks, uint64_t(blocks) * tpb);
    r.dt = iota_table(blocks);  // decode block i holds request block i
    // Sinks and recent window of two blocks each: the proactive blocks are 0, 1, 62 and 63.
    const select::Profile profile = sinks_and_recent_profile();
    r.do_expect();
    r.do_post(transfer_options(SG_PATH_PROACTIVE | SG_PATH_ON_DEMAND | SG_PATH_SPECULATIVE), &profile);
    auto proactive = [&](uint32_t b) { return b < 2 || b >= blocks - 2; };
    // The blocks a write covers (coalesced writes cover several).
    struct Span {
        uint32_t layer, first, count;
    };
    auto span_of = [&](const fake::WriteRecord &w) {
        Span sp{};
        EXPECT_TRUE(r.dst.locate(w.target_addr, sp.layer, sp.first)) << "a write outside the decode pool";
        sp.count = uint32_t(w.len / (r.dst.block_elems() * 2));
        return sp;
    };
    // Until the first speculative write, let it run; then fetch blocks of the last layer that no
    // write has touched yet.
    ASSERT_TRUE(p.run_until([&] {
        for (auto &w : p.fabric.writes())
            if (!proactive(span_of(w).first)) return true;
        return false;
    }));
    const std::vector<uint32_t> wanted = {40, 41, 50};
    r.expect->fetch(layers - 1, wanted);
    // The fetch leaves with the decode side's next progress and arrives at the prefill side's.
    p.decode->progress_once();
    const size_t fetch_arrives = p.fabric.writes().size();
    p.prefill->progress_once();
    ASSERT_TRUE(r.run_to_quiesce());
    EXPECT_EQ(r.post->status, SG_OK);
    EXPECT_TRUE(r.exact());

    const auto log = p.fabric.writes();
    size_t last_proactive = 0, first_speculative = log.size();
    for (size_t i = 0; i < fetch_arrives; ++i) {
        const Span sp = span_of(log[i]);
        if (proactive(sp.first) && proactive(sp.first + sp.count - 1)) last_proactive = i;
        else if (first_speculative == log.size()) first_speculative = i;
    }
    EXPECT_LT(last_proactive, first_speculative) << "a speculative write went before a proactive one";
    // Once the fetch arrived, its blocks go before anything else.
    uint32_t fetched_left = uint32_t(wanted.size());
    for (size_t i = fetch_arrives; i < log.size() && fetched_left; ++i) {
        const Span sp = span_of(log[i]);
        uint32_t covered = 0;
        for (uint32_t b : wanted) covered += sp.layer == layers - 1 && b >= sp.first && b < sp.first + sp.count;
        ASSERT_GT(covered, 0u) << "write " << i << " (layer " << sp.layer << " block " << sp.first
                               << ") went before the fetched blocks";
        fetched_left -= std::min(covered, fetched_left);
    }
    EXPECT_EQ(fetched_left, 0u);
    r.finish();
}

// The in-flight bounds, as the fabric counted them: never more writes or bytes outstanding than
// the context allows, however the completions are held back.
TEST(Schedule, OutstandingWritesStayWithinTheContextsBounds) {
    PairConfig cfg;
    cfg.knobs.hold = 0.5;
    cfg.knobs.max_hold_polls = 16;
    cfg.max_ops_in_flight = 3;
    cfg.max_bytes_in_flight = 2048;  // two of the 1 KiB writes: the byte bound binds before the op bound
    cfg.max_session_bytes_in_flight = 2048;
    NoStaging direct;  // a staged chunk packs up to a 4 MiB slot and goes alone past the byte bound
    FakePair p(8, cfg);
    Request r(p, 4, 64, 256, 128);  // 1 KiB per block and plane; the reversed table writes block by block
    r.do_expect();
    r.do_post();
    ASSERT_TRUE(r.run_to_quiesce());
    EXPECT_EQ(r.expect->status, SG_OK);
    EXPECT_TRUE(r.exact());
    const fake::Flow f = p.fabric.flow(p.prefill_ep);
    EXPECT_LE(f.max_ops, 3u);
    EXPECT_LE(f.max_bytes, 2048u);
    EXPECT_EQ(f.max_bytes, 2048u) << "the bound was never reached: the test proves nothing";
    EXPECT_GT(p.prefill->stats().stalls, 0u);
    r.finish();
}

// Once every layer is written the decode side may start its step and fetch at any moment: what the
// prefill side has in flight then is ahead of the fetch (and of the host's messages). Proactive
// writes are held to 256 KiB in flight per session from that moment (speculative ones to 64 KiB),
// however many the operation and byte bounds would allow.
TEST(Schedule, ProactiveBytesInFlightStaySmallOnceEveryLayerIsWritten) {
    PairConfig cfg;
    cfg.knobs.hold = 0.5;
    cfg.knobs.max_hold_polls = 16;
    cfg.max_ops_in_flight = 1024;  // neither the operation bound nor the 32 MiB session bound binds
    NoStaging direct;
    FakePair p(11, cfg);
    const uint32_t layers = 4, blocks = 512, tpb = 4, head_dim = 256;  // 2 KiB per block and plane
    Request r(p, layers, blocks, uint64_t(blocks) * tpb, head_dim);
    // 256 blocks a layer are essential (128 sinks, 128 recent): 1 MiB of proactive writes per layer.
    const select::Profile profile = select::parse_profile(
        R"({"version": 1, "model": "t", "num_layers": 4, "num_kv_heads": 1, "block_tokens": 4,
            "defaults": {"policy": "sinks_recent", "budget": {"tokens": 1024}, "sinks": 512, "recent": 512}})");
    r.do_expect();
    r.do_post(transfer_options(SG_PATH_PROACTIVE | SG_PATH_SPECULATIVE), &profile);  // every layer written
    ASSERT_TRUE(r.run_to_quiesce());
    EXPECT_EQ(r.expect->status, SG_OK);
    EXPECT_TRUE(r.exact());
    const fake::Flow f = p.fabric.flow(p.prefill_ep);
    EXPECT_LE(f.max_bytes, (256u + 64u) << 10) << "proactive 256 KiB + speculative 64 KiB";
    EXPECT_GE(f.max_bytes, 192u << 10) << "the bound was never approached: the test proves nothing";
    r.finish();
}

TEST(Schedule, PostsRefusedWithEagainAreRetried) {
    PairConfig cfg;
    cfg.knobs.eagain = 0.3;
    FakePair p(9, cfg);
    Request r(p, 3, 32, 128);
    r.do_expect();
    r.do_post();
    ASSERT_TRUE(r.run_to_quiesce());
    EXPECT_EQ(r.post->status, SG_OK);
    EXPECT_EQ(r.expect->status, SG_OK);
    EXPECT_TRUE(r.exact());
    EXPECT_GT(p.fabric.eagains(), 0u);
    EXPECT_GT(p.prefill->stats().retries + p.decode->stats().retries, 0u);
    r.finish();
}

// A staged chunk checks its bytes (wire 1.7: its slot's generation and CRC32C): a chunk that lands
// with a byte changed (a torn write, a late copy of an earlier chunk) fails its transfer on both
// sides with SG_ERR_TRANSPORT instead of completing with wrong bytes; the session goes on, and the
// next request, on a clean wire, is exact.
TEST(Schedule, AStagedChunkWhoseBytesChangedOnTheWayFailsItsTransfer) {
    PairConfig cfg;
    cfg.knobs.corrupt_landing = 1.0;
    FakePair p(23, cfg);
    {
        Request r(p, 2, 16, 64);
        r.do_expect();
        r.do_post();
        ASSERT_TRUE(r.run_to_quiesce());
        EXPECT_GT(r.post->stats.staged_bytes, 0u) << "the request did not go through staging slots";
        EXPECT_EQ(r.expect->status, SG_ERR_TRANSPORT) << r.expect->error;
        EXPECT_NE(r.expect->error.find("CRC32C"), std::string::npos) << r.expect->error;
        EXPECT_NE(r.post->status, SG_OK);
        r.post->release();
        r.expect->release();
    }
    fake::Knobs clean;
    p.fabric.set_knobs(clean);
    Request r(p, 2, 16, 64);
    r.do_expect();
    r.do_post();
    ASSERT_TRUE(r.run_to_quiesce());
    EXPECT_EQ(r.expect->status, SG_OK) << r.expect->error;
    EXPECT_TRUE(r.exact());
    r.finish();
}

// End-to-end verification (SG_TRANSFER_VERIFY, wire 1.8). A direct write carries no check of its
// own: one that lands with a byte changed completes the transfer with wrong bytes. With
// verification on, the decode side finds the block whose content differs from the sender's CRC,
// and the transfer fails on both sides with SG_ERR_TRANSPORT naming layer and block; the next
// request on a clean wire is exact and every one of its blocks was checked.
TEST(Schedule, VerificationCatchesADirectWriteThatLandedWrong) {
    PairConfig cfg;
    cfg.knobs.corrupt_landing = 1.0;
    NoStaging direct;
    {
        sgtest::ScopedEnv off("SG_TRANSFER_VERIFY", "0");
        FakePair p(23, cfg);
        Request r(p, 2, 16, 64);
        r.do_expect();
        r.do_post();
        ASSERT_TRUE(r.run_to_quiesce());
        ASSERT_EQ(r.post->stats.staged_bytes, 0u) << "the request went through staging slots";
        EXPECT_EQ(r.expect->status, SG_OK) << "unverified, a corrupt direct write goes unseen";
        EXPECT_FALSE(r.exact()) << "the fabric corrupted nothing: the test proves nothing";
        EXPECT_EQ(p.decode->stats().blocks_verified, 0u);
        r.finish();
    }
    sgtest::ScopedEnv on("SG_TRANSFER_VERIFY", "1");
    FakePair p(23, cfg);
    {
        Request r(p, 2, 16, 64);
        r.do_expect();
        r.do_post();
        ASSERT_TRUE(r.run_to_quiesce());
        EXPECT_EQ(r.expect->status, SG_ERR_TRANSPORT) << r.expect->error;
        EXPECT_NE(r.expect->error.find("verification: layer"), std::string::npos) << r.expect->error;
        EXPECT_NE(r.expect->error.find("block"), std::string::npos) << r.expect->error;
        EXPECT_NE(r.post->status, SG_OK);
        EXPECT_EQ(p.decode->stats().verify_mismatches, 1u);
        r.post->release();
        r.expect->release();
    }
    p.fabric.set_knobs(fake::Knobs{});
    const uint64_t before = p.decode->stats().blocks_verified;
    Request r(p, 2, 16, 64);
    r.do_expect();
    r.do_post();
    ASSERT_TRUE(r.run_to_quiesce());
    EXPECT_EQ(r.expect->status, SG_OK) << r.expect->error;
    EXPECT_TRUE(r.exact());
    EXPECT_EQ(p.decode->stats().blocks_verified - before, 2u * 16u);
    EXPECT_EQ(p.decode->stats().verify_mismatches, 1u);
    r.finish();
}

// The selective paths check each block as its notice makes it resident (proactive first, the rest
// streamed behind): every block of every layer once, none twice; and a staged request is checked
// after its chunks' own CRCs too.
TEST(Schedule, VerificationChecksEveryBlockOnceOnTheSelectivePathsAndTheStagedOne) {
    sgtest::ScopedEnv on("SG_TRANSFER_VERIFY", "1");
    FakePair p(29);
    {
        Request r(p, 4, 32, 128);
        const select::Profile profile = select::parse_profile(
            R"({"version": 1, "model": "t", "num_layers": 4, "num_kv_heads": 1, "block_tokens": 4,
                "defaults": {"policy": "sinks_recent", "budget": {"tokens": 32}, "sinks": 16, "recent": 16}})");
        r.do_expect();
        r.do_post(transfer_options(SG_PATH_PROACTIVE | SG_PATH_SPECULATIVE), &profile);
        ASSERT_TRUE(r.run_to_quiesce());
        EXPECT_EQ(r.expect->status, SG_OK) << r.expect->error;
        EXPECT_TRUE(r.exact());
        EXPECT_GT(r.expect->stats.bytes_proactive, 0u);
        EXPECT_GT(r.expect->stats.bytes_speculative, 0u);
        EXPECT_EQ(p.decode->stats().blocks_verified, 4u * 32u);
        r.post->release();
        r.expect->release();
    }
    const uint64_t before = p.decode->stats().blocks_verified;
    Request r(p, 2, 16, 64);
    r.do_expect();
    r.do_post();
    ASSERT_TRUE(r.run_to_quiesce());
    EXPECT_GT(r.post->stats.staged_bytes, 0u) << "the request did not go through staging slots";
    EXPECT_EQ(r.expect->status, SG_OK) << r.expect->error;
    EXPECT_EQ(p.decode->stats().blocks_verified - before, 2u * 16u);
    EXPECT_EQ(p.decode->stats().verify_mismatches, 0u);
    r.finish();
}

// Every key a session gave its peer closes under the context's lock when the session closes (its
// staging slots' too), not in ~Session, which runs on whatever thread drops the last reference and
// only unmaps memory no key reaches any more. Before, the staging slots stayed registered until
// the last reference went.
TEST(Schedule, AClosedSessionHoldsNoRegistrationWhileItsObjectLives) {
    FakePair p(31);
    Request r(p, 2, 16, 64);
    r.do_expect();
    r.do_post();
    ASSERT_TRUE(r.run_to_quiesce());
    ASSERT_GT(r.post->stats.staged_bytes, 0u) << "the request did not go through staging slots";
    ASSERT_TRUE(r.exact());
    r.post->release();
    r.expect->release();
    // Held here: both Session objects outlive the checks below.
    const std::shared_ptr<core::Session> decode_side = p.at_decode, prefill_side = p.at_prefill;
    p.blocking(*p.prefill, [&] { p.at_prefill->close(); });
    p.blocking(*p.decode, [&] { p.at_decode->close(); });
    EXPECT_EQ(p.prefill->stats().registrations, 0u);
    EXPECT_EQ(p.decode->stats().registrations, 0u);
    r.post.reset();
    r.expect.reset();
}

TEST(Schedule, ABrokenConnectionFailsBothSidesWithPeerLostAndStillQuiesces) {
    fake::Knobs k;
    k.delay = 0.3;
    FakePair p(10, {k});
    Request r(p, 4, 32, 128);
    r.do_expect();
    r.do_post();
    ASSERT_TRUE(p.run_until([&] { return !p.fabric.writes().empty(); }));
    p.fabric.drop_link(p.prefill_ep, p.decode_ep);
    ASSERT_TRUE(r.run_to_quiesce());
    EXPECT_EQ(r.post->status, SG_ERR_PEER_LOST);
    EXPECT_EQ(r.expect->status, SG_ERR_PEER_LOST);
    r.finish();
}

// shm-like: nothing tells the prefill side that its peer died; the peer timeout does (on the test
// clock), and the writes the dead peer will never complete are abandoned so the transfer quiesces.
TEST(Schedule, ALocalOnlyPeerThatDiesIsLostAfterThePeerTimeout) {
    PairConfig cfg;
    cfg.knobs.local_only = true;
    cfg.peer_timeout_ms = 100;
    FakePair p(11, cfg);
    Request r(p, 4, 32, 128);
    r.do_expect();
    r.do_post();
    ASSERT_TRUE(p.run_until([&] { return !p.fabric.writes().empty(); }));
    p.fabric.kill(p.decode_ep);
    // Only the prefill side runs from now on.
    for (int i = 0; i < 20; ++i) p.prefill->progress_once();
    EXPECT_FALSE(r.post->finished());
    for (int i = 0; i < 400 && !quiesced(*p.prefill, *r.post); ++i) {
        p.clock.advance(kMs);
        p.prefill->progress_once();
    }
    EXPECT_EQ(r.post->status, SG_ERR_PEER_LOST);
    EXPECT_TRUE(quiesced(*p.prefill, *r.post));
    EXPECT_GT(p.fabric.stuck(), 0u);
    // The dead side is torn down without its peer: its session closes at once.
    p.at_decode->close(p.clock.now);
    EXPECT_TRUE(quiesced(*p.decode, *r.expect));
    r.finish();
}

// Found by the random schedules (SG_SCHEDULE_SEED=1205 and 1537): a send the provider refuses by
// throwing loses the session, and the frame stayed at the head of the session's outbox, counted in
// its transfer's in-flight operations, so the transfer (SG_ERR_PEER_LOST) never quiesced. Losing a
// session now drops its transfers' unsent frames (Context::drop_unsent).
TEST(Schedule, ASendRefusedOnABrokenLinkDoesNotKeepItsTransferFromQuiescing) {
    fake::Knobs k;
    k.send_after_write = false;  // the layer's notice waits for its writes' completions
    k.broken_posts_throw = 1;
    FakePair p(12, {k});
    Request r(p, 1, 8, 32);
    r.do_expect();
    p.run_until([&] { return false; }, 20);  // the Expect is at the prefill side
    r.do_post();
    p.prefill->progress_once();  // the layer's writes go
    p.decode->progress_once();   // and land
    ASSERT_FALSE(p.fabric.writes().empty());
    p.fabric.drop_link(p.prefill_ep, p.decode_ep);
    p.prefill->progress_once();  // the writes complete; the notice's post throws: the session is lost
    EXPECT_EQ(r.post->status, SG_ERR_PEER_LOST);
    // (ASSERT: release of a transfer that does not quiesce would wait on the test clock for good.)
    ASSERT_TRUE(p.run_until([&] { return quiesced(*p.prefill, *r.post); }, 20000))
        << "the prefill transfer of a lost session never quiesces";
    r.finish();
}


// ---- lanes: one session striped over several endpoints (transport/lanes.cpp) ----

// Every layer the decode side calls ready holds its bytes, at every step: with lanes, a notice on
// lane 0 cannot be ordered after writes on another lane, so the writes ask for delivery completion
// and the notice waits for them. The fabric completes writes early where it may (early_completion:
// a write completing before it lands) and delays and holds the rest, so lanes finish out of order.
class LaneSchedule : public ::testing::TestWithParam<uint32_t> {};

// The pools here have small blocks; without this every write would stay on lane 0.
struct EveryWriteStriped {
    EveryWriteStriped() { ::setenv("SG_LANE_SMALL_WRITE_BYTES", "0", 1); }
    ~EveryWriteStriped() { ::unsetenv("SG_LANE_SMALL_WRITE_BYTES"); }
};

TEST_P(LaneSchedule, NoLayerIsReadyBeforeItsBytesOnAnyLane) {
    const NoStaging direct;
    const EveryWriteStriped striped;
    PairConfig cfg;
    cfg.lanes = GetParam();
    cfg.knobs.delay = 0.4;
    cfg.knobs.hold = 0.4;
    cfg.knobs.early_completion = 0.5;
    cfg.max_ops_in_flight = 16;
    for (uint64_t seed = 1; seed <= 12; ++seed) {
        FakePair p(0x1a4e0 + seed, cfg);
        Request r(p, 6, 48, 190);
        r.do_expect();
        r.do_post();
        size_t ready_seen = 0;
        std::string overtaken;
        ASSERT_TRUE(p.run_until([&] {
            for (uint32_t l = 0; l < r.src.layers; ++l) {
                if (!r.expect->layers[l].ready) continue;
                ++ready_seen;
                for (size_t i = 0; i < r.st.size(); ++i)
                    if (!same_tokens(r.src, r.st, r.dst, r.dt, r.tokens, l, i)) {
                        overtaken = "layer " + std::to_string(l) + " ready before block " + std::to_string(i) + " landed";
                        return true;
                    }
            }
            return r.both_quiesced();
        })) << "seed " << seed;
        ASSERT_EQ(overtaken, "") << "seed " << seed;
        EXPECT_EQ(r.post->status, SG_OK);
        EXPECT_EQ(r.expect->status, SG_OK);
        EXPECT_TRUE(r.exact());
        EXPECT_GT(ready_seen, 0u);
        // The writes really were spread: every lane's endpoint wrote some.
        std::set<uint32_t> writers;
        for (const auto &w : p.fabric.writes()) writers.insert(w.from);
        EXPECT_EQ(writers.size(), size_t(GetParam())) << "seed " << seed;
        EXPECT_EQ(p.prefill->stats().lanes, GetParam());
        r.finish();
    }
}

INSTANTIATE_TEST_SUITE_P(Lanes, LaneSchedule, ::testing::Values(2u, 4u),
                         [](const auto &info) { return std::to_string(info.param) + "lanes"; });

// A lane whose link breaks mid-transfer: its writes move to the other lanes, the transfer completes
// byte-exact, and the statistics count the move.
TEST(Lanes, AWriteOnABrokenLaneMovesToAnotherAndTheTransferStaysExact) {
    const NoStaging direct;
    const EveryWriteStriped striped;
    for (double throws : {0.0, 1.0}) {  // a broken link's posts fail at completion, or throw at once
        PairConfig cfg;
        cfg.lanes = 3;
        cfg.knobs.delay = 0.3;
        cfg.knobs.broken_posts_throw = throws;
        cfg.max_ops_in_flight = 8;
        FakePair p(0x1a4f0 + uint64_t(throws), cfg);
        Request r(p, 8, 64, 256);
        r.do_expect();
        r.do_post();
        ASSERT_TRUE(p.run_until([&] { return p.fabric.writes().size() >= 6; }));
        // Lane 1 of each side: the endpoints named second in each Hello.
        const auto hp = core::parse_metadata(*p.decode, p.prefill->metadata());
        const auto hd = core::parse_metadata(*p.prefill, p.decode->metadata());
        ASSERT_EQ(hp.endpoints.size(), 3u);
        p.fabric.drop_link(fake::Fabric::endpoint_id(hp.endpoints[1].address),
                           fake::Fabric::endpoint_id(hd.endpoints[1].address));
        ASSERT_TRUE(r.run_to_quiesce());
        EXPECT_EQ(r.post->status, SG_OK) << "broken_posts_throw " << throws;
        EXPECT_EQ(r.expect->status, SG_OK);
        EXPECT_TRUE(r.exact());
        const auto s = p.prefill->stats();
        EXPECT_EQ(s.lanes_lost, 1u);
        EXPECT_EQ(s.peers_lost, 0u);
        r.finish();
    }
}

// Lane 0 carries the session's messages; when its link breaks mid-transfer they move to a live
// lane with every unacked one sent again, the peer is told at once, and nothing is lost or
// delivered twice: the transfer completes byte-exact on both sides and neither loses the session.
TEST(Lanes, LaneZeroBreakingMovesTheMessagesAndLosesNothing) {
    const NoStaging direct;
    for (double throws : {0.0, 1.0}) {
        for (uint64_t seed = 0; seed < 6; ++seed) {
            SCOPED_TRACE("broken_posts_throw " + std::to_string(throws) + " seed " + std::to_string(seed));
            PairConfig cfg;
            cfg.lanes = 3;
            cfg.knobs.delay = 0.3;
            cfg.knobs.hold = 0.3;
            cfg.knobs.broken_posts_throw = throws;
            cfg.max_ops_in_flight = 8;
            FakePair p(0x1a5a0 + seed + uint64_t(throws * 100), cfg);
            Request r(p, 8, 64, 256);
            r.do_expect();
            r.do_post();
            // Break it while messages (layer notices) and small writes are in flight on it.
            ASSERT_TRUE(p.run_until([&] { return p.fabric.writes().size() >= 4 + seed * 3; }));
            const auto hp = core::parse_metadata(*p.decode, p.prefill->metadata());
            const auto hd = core::parse_metadata(*p.prefill, p.decode->metadata());
            ASSERT_EQ(hp.endpoints.size(), 3u);
            p.fabric.drop_link(fake::Fabric::endpoint_id(hp.endpoints[0].address),
                               fake::Fabric::endpoint_id(hd.endpoints[0].address));
            ASSERT_TRUE(r.run_to_quiesce());
            EXPECT_EQ(r.post->status, SG_OK);
            EXPECT_EQ(r.expect->status, SG_OK);
            EXPECT_TRUE(r.exact());
            const auto sp = p.prefill->stats(), sd = p.decode->stats();
            EXPECT_EQ(sp.peers_lost, 0u);
            EXPECT_EQ(sd.peers_lost, 0u);
            // Each side gave lane 0 up once, by its own error or by the other's notice.
            EXPECT_EQ(sp.lanes_lost, 1u);
            EXPECT_EQ(sd.lanes_lost, 1u);
            r.post->release();
            r.expect->release();
            r.post.reset();
            r.expect.reset();
            // The session still carries a second transfer whole.
            Request again(p, 8, 64, 256);
            again.do_expect();
            again.do_post();
            ASSERT_TRUE(again.run_to_quiesce());
            EXPECT_EQ(again.post->status, SG_OK);
            EXPECT_TRUE(again.exact());
            again.finish();
        }
    }
}

// A striped context and a one-lane peer, either way round: the session uses lane 0 alone and moves
// every byte.
TEST(Lanes, AStripedContextWorksWithAOneLanePeer) {
    const NoStaging direct;
    const EveryWriteStriped striped;
    for (uint32_t prefill_lanes : {1u, 4u}) {
        PairConfig cfg;
        cfg.knobs.delay = 0.2;
        cfg.lanes = prefill_lanes;
        cfg.decode_lanes = prefill_lanes == 1 ? 4 : 1;
        FakePair p(0x1a500 + prefill_lanes, cfg);
        Request r(p, 4, 32, 128);
        r.do_expect();
        r.do_post();
        ASSERT_TRUE(r.run_to_quiesce());
        EXPECT_EQ(r.post->status, SG_OK);
        EXPECT_TRUE(r.exact());
        std::set<uint32_t> writers;
        for (const auto &w : p.fabric.writes()) writers.insert(w.from);
        EXPECT_EQ(writers.size(), 1u);
        r.finish();
    }
}

// By default small writes stay on lane 0, posted in the call like a plain endpoint's; only writes of
// at least lane_small_write_bytes (256 KiB) are striped.
TEST(Lanes, SmallWritesStayOnLaneZeroAndLargeOnesAreStriped) {
    const NoStaging direct;
    for (uint32_t head_dim : {64u, 8192u}) {  // 4-token blocks of 512 B, or of 64 KiB coalesced past 256 KiB
        PairConfig cfg;
        cfg.lanes = 2;
        cfg.knobs.max_msg_size = 1 << 20;
        FakePair p(0x1a510 + head_dim, cfg);
        Request r(p, 2, 32, 128, head_dim);
        r.st = iota_table(r.st.size());
        r.dt = iota_table(r.dt.size());  // contiguous on both sides: runs coalesce
        r.do_expect();
        r.do_post();
        ASSERT_TRUE(r.run_to_quiesce());
        EXPECT_TRUE(r.exact());
        std::set<uint32_t> writers;
        uint64_t largest = 0;
        for (const auto &w : p.fabric.writes()) {
            writers.insert(w.from);
            largest = std::max(largest, w.len);
        }
        if (largest < 256 * 1024)
            EXPECT_EQ(writers.size(), 1u) << "writes of at most " << largest << " bytes";
        else
            EXPECT_EQ(writers.size(), 2u) << "writes of up to " << largest << " bytes";
        r.finish();
    }
}

}  // namespace

namespace {

// With lanes, the speculative path's bulk travels apart from the fetches (ARCHITECTURE: on-demand
// traffic never queues behind bulk in a socket buffer): every speculative write leaves from a lane
// other than lane 0, and a fetch's reply from lane 0, with the session's messages, whatever its size.
TEST(Lanes, SpeculativeBulkTravelsApartFromFetchReplies) {
    NoStaging direct;
    PairConfig cfg;
    cfg.lanes = 2;
    cfg.max_ops_in_flight = 2;  // so that the speculative path has not reached the fetched blocks
    FakePair p(0x1a520, cfg);
    const uint32_t layers = 3, blocks = 64, tpb = 4;
    Request r(p, layers, blocks, uint64_t(blocks) * tpb);
    r.dt = iota_table(blocks);
    const select::Profile profile = sinks_and_recent_profile();
    r.do_expect();
    r.do_post(transfer_options(SG_PATH_PROACTIVE | SG_PATH_ON_DEMAND | SG_PATH_SPECULATIVE), &profile);
    auto proactive = [&](uint32_t b) { return b < 2 || b >= blocks - 2; };
    const std::vector<uint32_t> wanted = {40, 41, 50};
    auto fetched = [&](uint32_t layer, uint32_t b) {
        return layer == layers - 1 && std::find(wanted.begin(), wanted.end(), b) != wanted.end();
    };
    // The fetch goes as soon as the decode side may ask (the last layer's essential blocks are here).
    ASSERT_TRUE(p.run_until([&] { return r.expect->layers[layers - 1].essential; }));
    r.expect->fetch(layers - 1, wanted);
    p.decode->progress_once();  // the fetch leaves; writes logged from here on were posted after it
    const size_t fetch_arrives = p.fabric.writes().size();
    ASSERT_TRUE(r.run_to_quiesce());
    EXPECT_EQ(r.post->status, SG_OK);
    EXPECT_TRUE(r.exact());
    const uint32_t lane0 = p.prefill_ep;  // the endpoint of lane 0 (the metadata's first)
    size_t speculative = 0, replies = 0;
    const auto log = p.fabric.writes();
    for (size_t i = 0; i < log.size(); ++i) {
        const auto &w = log[i];
        uint32_t layer = 0, first = 0;
        ASSERT_TRUE(r.dst.locate(w.target_addr, layer, first));
        const uint32_t count = uint32_t(w.len / (r.dst.block_elems() * 2));
        if (proactive(first) && proactive(first + count - 1)) continue;
        bool any_fetched = false;
        for (uint32_t b = first; b < first + count; ++b) any_fetched = any_fetched || fetched(layer, b);
        // (A speculative write posted before the fetch arrived may hold fetched blocks: it stays bulk.)
        if (any_fetched && i >= fetch_arrives) {
            EXPECT_EQ(w.from, lane0) << "a fetch's reply (layer " << layer << " block " << first << ") left from lane "
                                     << w.from - lane0;
            ++replies;
        } else {
            EXPECT_NE(w.from, lane0) << "speculative bulk (layer " << layer << " block " << first << ") on lane 0";
            ++speculative;
        }
    }
    EXPECT_GT(speculative, 0u);
    EXPECT_GT(replies, 0u) << "the fetch found every block already sent: the test proves nothing";
    r.finish();
}

}  // namespace

namespace {

// Where streaming cannot be beaten (a provider for peers on this host), a selective transfer with the
// speculative path sends every layer whole as it is written: one proactive unit of every block, no
// selection, no digests, and the decode side holds each layer whole with its essential blocks.
// Without the speculative path the host asked for the essential blocks alone, and gets them.
TEST(Schedule, OnALocalProviderSelectiveLayersGoWholeWithTheSpeculativePathOn) {
    NoStaging direct;
    const select::Profile profile = sinks_and_recent_profile();
    for (const bool speculative : {true, false}) {
        PairConfig cfg;
        cfg.knobs.local_only = true;
        FakePair p(0x1a530 + speculative, cfg);
        const uint32_t layers = 3, blocks = 64, tpb = 4;
        Request r(p, layers, blocks, uint64_t(blocks) * tpb);
        r.do_expect();
        const uint32_t paths = SG_PATH_PROACTIVE | SG_PATH_ON_DEMAND | (speculative ? SG_PATH_SPECULATIVE : 0u);
        r.do_post(transfer_options(paths), &profile);
        ASSERT_TRUE(p.run_until([&] { return r.expect->layers[layers - 1].essential; }));
        for (uint32_t l = 0; l < layers; ++l)
            EXPECT_EQ(r.expect->layers[l].ready, speculative) << "layer " << l << (speculative ? " not" : "")
                                                               << " whole at its essential notice";
        EXPECT_EQ(r.post->sel().layers_whole, speculative ? layers : 0u);
        EXPECT_EQ(r.post->stats.digest_bytes > 0, !speculative) << "digests go only for blocks left behind";
        if (speculative) {
            EXPECT_EQ(r.post->stats.bytes_proactive, r.post->stats.bytes) << "every byte proactive";
            ASSERT_TRUE(r.run_to_quiesce());
            EXPECT_TRUE(r.exact());
        }
        r.finish();
    }
}

}  // namespace
