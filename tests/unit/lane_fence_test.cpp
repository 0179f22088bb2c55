// Lane failover's fence handshake (transport/lanes.cpp, docs/protocol.md 3.1) on a fake fabric that
// lands a write late, as TCP does: the write's link drops, its initiator sees it fail at once, and
// its bytes, already in the target's socket, still land a while later unless the target closes that
// connection first. A write moved to another lane as soon as the peer looked alive there landed
// twice: the second copy completed, the host reused the memory, and the first copy overwrote it.
// LaneHeal.*: with a 1.7 peer the lane then comes back (docs/protocol.md 3.1).
#include "transport/fake.hpp"

#include <gtest/gtest.h>

#include <chrono>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

namespace {

using namespace sg::transport;
using LaneProtocol = Transport::LaneProtocol;

struct Sink : CompletionSink {
    std::vector<std::pair<void *, int>> done;
    std::vector<std::string> messages;
    void on_complete(void *cookie, int status, const char *) override { done.emplace_back(cookie, status); }
    void on_message(std::span<const uint8_t> bytes) override { messages.emplace_back(bytes.begin(), bytes.end()); }
    int status_of(void *cookie) const {
        for (auto &[c, st] : done)
            if (c == cookie) return st;
        return 1;  // not yet
    }
};

OpenOptions two_lanes() {
    OpenOptions o;
    o.provider = "fake";
    o.lanes = 2;
    o.lane_threads = false;  // poll() drives every lane: one schedule per run
    o.delivery_complete = true;
    return o;
}

alignas(16) uint8_t cookies[8][kCookieBytes];

constexpr uint32_t kLateByPolls = 40;
constexpr size_t kBytes = 64 * 1024;

struct Pair {
    fake::Fabric fabric;
    std::unique_ptr<Transport> a, b;
    std::vector<std::vector<uint8_t>> a_lanes, b_lanes;
    PeerAddr a_to_b = 0, b_to_a = 0;
    Sink at_a, at_b;
    std::vector<uint8_t> a_mem = std::vector<uint8_t>(kBytes, 0), b_mem = std::vector<uint8_t>(kBytes, 0);
    std::vector<uint8_t> from_a = std::vector<uint8_t>(kBytes, 0xa1);  // what A writes into b_mem
    Registration a_reg, b_reg, from_a_reg;

    Pair(uint64_t seed, LaneProtocol protocol) : fabric(seed, knobs()) {
        a = open(two_lanes());
        b = open(two_lanes());
        a_lanes = a->lane_addresses();
        b_lanes = b->lane_addresses();
        a_to_b = a->insert_peer_lanes(b_lanes, protocol);
        b_to_a = b->insert_peer_lanes(a_lanes, protocol);
        a_reg = a->register_memory(a_mem.data(), a_mem.size(), 0xa);
        b_reg = b->register_memory(b_mem.data(), b_mem.size(), 0xb);
        from_a_reg = a->register_memory(from_a.data(), from_a.size(), 0x1a);
        // A numbered message each way first: a lane-loss notice is taken only from a peer whose
        // messages this side has seen (its nonce).
        const std::string hi = "hello";
        EXPECT_EQ(a->post_send(a_to_b, hi.data(), hi.size(), nullptr, cookies[6]), 0);
        EXPECT_EQ(b->post_send(b_to_a, hi.data(), hi.size(), nullptr, cookies[7]), 0);
        for (int i = 0; i < 20 && (at_a.messages.empty() || at_b.messages.empty()); ++i) poll();
        EXPECT_EQ(at_b.messages.size(), 1u);
        EXPECT_EQ(at_a.messages.size(), 1u);
    }
    ~Pair() {
        a->deregister(from_a_reg);
        a->deregister(a_reg);
        b->deregister(b_reg);
    }
    static fake::Knobs knobs() {
        fake::Knobs k;
        k.late_landing_polls = kLateByPolls;
        return k;
    }
    void poll() {
        a->poll(at_a);
        b->poll(at_b);
    }
    // Polls until the cookie completes at `sink` (or 4000 rounds); its status, 1 if it never did.
    int run_until(const Sink &sink, void *cookie) {
        for (int i = 0; i < 4000 && sink.status_of(cookie) == 1; ++i) poll();
        return sink.status_of(cookie);
    }
    // A writes from_a over b_mem as bulk (lane 1).
    void a_writes_b(void *cookie) {
        const LocalIov iov{from_a.data(), from_a.size(), from_a_reg.desc};
        EXPECT_EQ(a->post_write_as(WriteClass::Bulk, a_to_b, {&iov, 1}, b_reg.remote_base, b_reg.key, cookie), 0);
    }
    void drop_lane(size_t lane) {
        fabric.drop_link(fake::Fabric::endpoint_id(a_lanes[lane]), fake::Fabric::endpoint_id(b_lanes[lane]));
    }
};

bool all(const std::vector<uint8_t> &mem, uint8_t v) {
    for (uint8_t x : mem)
        if (x != v) return false;
    return true;
}

// Both sides write to each other on lane 1 when its link drops under both writes. Each write is
// moved once, after the peer has closed its own connection on lane 1, and lands; the memory the
// host then reuses is never written again (the first copies are past their landing time).
void crossed_writes_move_once_and_never_land_late(Pair &p) {
    std::vector<uint8_t> from_b(kBytes, 0xb2);
    Registration src_b = p.b->register_memory(from_b.data(), from_b.size(), 0x1b);
    const LocalIov iov_b{from_b.data(), from_b.size(), src_b.desc};
    p.a_writes_b(cookies[0]);
    EXPECT_EQ(p.b->post_write_as(WriteClass::Bulk, p.b_to_a, {&iov_b, 1}, p.a_reg.remote_base, p.a_reg.key, cookies[1]), 0);
    p.drop_lane(1);  // before either target polled: both writes are in flight, and late

    EXPECT_EQ(p.run_until(p.at_a, cookies[0]), 0) << "A's write was not moved to lane 0";
    EXPECT_EQ(p.run_until(p.at_b, cookies[1]), 0) << "B's write was not moved to lane 0";
    EXPECT_TRUE(all(p.b_mem, 0xa1));
    EXPECT_TRUE(all(p.a_mem, 0xb2));
    EXPECT_EQ(p.a->lane_stats().failovers, 1u);
    EXPECT_EQ(p.b->lane_stats().failovers, 1u);

    // The host reuses both buffers; anything that lands from now on is a stale copy.
    std::memset(p.a_mem.data(), 0x55, kBytes);
    std::memset(p.b_mem.data(), 0x55, kBytes);
    for (uint32_t i = 0; i < 3 * kLateByPolls; ++i) p.poll();
    EXPECT_TRUE(all(p.b_mem, 0x55)) << "A's first copy landed in B's memory after the moved copy completed";
    EXPECT_TRUE(all(p.a_mem, 0x55)) << "B's first copy landed in A's memory after the moved copy completed";
    p.b->deregister(src_b);
}

TEST(LaneFence, AWriteThatBrokeItsLaneMovesOnlyOnceThePeerFencedIt) {
    Pair p(3, LaneProtocol::Fencing);
    crossed_writes_move_once_and_never_land_late(p);
    // Lane 0 still carries both ways.
    const std::string after = "after";
    ASSERT_EQ(p.a->post_send(p.a_to_b, after.data(), after.size(), nullptr, cookies[2]), 0);
    for (int i = 0; i < 50 && p.at_b.messages.size() < 2; ++i) p.poll();
    ASSERT_EQ(p.at_b.messages.size(), 2u);
    EXPECT_EQ(p.at_b.messages[1], after);
}

// A 1.5 peer cannot say when its connection on the lane is closed: the write fails instead of
// being sent again, the session's messages go on, and the first copy never lands either (the
// side that gave the lane up closed its own connection on it).
TEST(LaneFence, WithAPeerThatCannotFenceTheWriteFailsAndNothingLandsLate) {
    Pair p(5, LaneProtocol::Framed);
    p.a_writes_b(cookies[0]);
    p.drop_lane(1);
    const int st = p.run_until(p.at_a, cookies[0]);
    ASSERT_NE(st, 1) << "the write never completed";
    EXPECT_NE(st, 0) << "a write whose first copy may still land was sent again to a peer that cannot fence";
    EXPECT_FALSE(sg::is_connection_error(st)) << "a write given up for its lane alone would lose the session above";
    EXPECT_EQ(p.a->lane_stats().failovers, 0u);

    std::memset(p.b_mem.data(), 0x55, kBytes);
    for (uint32_t i = 0; i < 3 * kLateByPolls; ++i) p.poll();
    EXPECT_TRUE(all(p.b_mem, 0x55)) << "the failed write's first copy landed after the host reused the memory";

    const std::string after = "after";
    ASSERT_EQ(p.a->post_send(p.a_to_b, after.data(), after.size(), nullptr, cookies[2]), 0);
    for (int i = 0; i < 50 && p.at_b.messages.size() < 2; ++i) p.poll();
    ASSERT_EQ(p.at_b.messages.size(), 2u) << "the session's messages did not survive the lane";
    EXPECT_EQ(p.at_b.messages[1], after);
}

// A peer that never answers (a fencing peer whose answer is lost, or one that stopped progressing
// but is not yet timed out): the write fails after kFenceWaitNs (5 s) rather than wait forever or
// move unfenced. B is not polled at all after the drop, so no LaneFenced can come.
TEST(LaneFence, AWriteWhoseLaneThePeerNeverConfirmsFencedFailsInTime) {
    Pair p(7, LaneProtocol::Fencing);
    p.a_writes_b(cookies[0]);
    p.drop_lane(1);
    const auto start = std::chrono::steady_clock::now();
    while (p.at_a.status_of(cookies[0]) == 1 && std::chrono::steady_clock::now() - start < std::chrono::seconds(20)) {
        p.a->poll(p.at_a);
        std::this_thread::sleep_for(std::chrono::milliseconds(2));
    }
    const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    const int st = p.at_a.status_of(cookies[0]);
    ASSERT_NE(st, 1) << "a write held for a fence that never came was never settled";
    EXPECT_NE(st, 0);
    EXPECT_FALSE(sg::is_connection_error(st)) << "a write given up for its lane alone would lose the session above";
    EXPECT_GE(waited, 4.5) << "it failed before the peer had its time to answer";
    EXPECT_EQ(p.a->lane_stats().failovers, 0u);
}

// ---- Lanes that heal (1.7) ----
// With a 1.7 peer a lane given up is closed twice on both sides (a first fence each, then, once the
// peer's first is heard, a closing fence that also closes whatever connection the peer opened in
// between) and then inserted again: the session gets the lane back.

uint64_t healed(const Pair &p, bool at_a) { return (at_a ? p.a : p.b)->lane_stats().lanes_healed; }

// Polls until both sides have healed `n` lanes (or 4000 rounds).
bool run_until_healed(Pair &p, uint64_t n) {
    for (int i = 0; i < 4000 && (healed(p, true) < n || healed(p, false) < n); ++i) p.poll();
    return healed(p, true) >= n && healed(p, false) >= n;
}

// The fence test above with a 1.7 peer: both writes move once both sides closed lane 1 twice, the
// memory reused after them is never written, and lane 1 then carries writes again.
TEST(LaneHeal, AWriteThatBrokeItsLaneMovesOnceBothSidesClosedItAndTheLaneComesBack) {
    Pair p(3, LaneProtocol::Healing);
    crossed_writes_move_once_and_never_land_late(p);
    ASSERT_TRUE(run_until_healed(p, 1)) << "lane 1 never came back (healed: A " << healed(p, true) << ", B "
                                        << healed(p, false) << ")";
    const uint64_t lane1_before = p.a->lane_stats().bytes_per_lane[1];
    std::memset(p.from_a.data(), 0xc3, kBytes);
    p.a_writes_b(cookies[2]);
    EXPECT_EQ(p.run_until(p.at_a, cookies[2]), 0);
    EXPECT_TRUE(all(p.b_mem, 0xc3));
    EXPECT_GT(p.a->lane_stats().bytes_per_lane[1], lane1_before) << "the healed lane carried nothing";
    EXPECT_EQ(p.a->lane_stats().failovers, 1u);
}

// Lane resets at five different times over one session's life, one lane down at a time (lane 1,
// then lane 0, which carries the messages, and so on): each time a write in flight on the broken
// lane moves once or lands, every message arrives once and in order, nothing lands late in memory
// the host reused, and the lane comes back. Without healing the second reset left no lane.
TEST(LaneHeal, ASessionSurvivesFiveLaneResetsOneLaneDownAtATime) {
    Pair p(11, LaneProtocol::Healing);
    size_t messages = p.at_b.messages.size();
    for (int round = 0; round < 5; ++round) {
        SCOPED_TRACE("reset " + std::to_string(round + 1));
        const size_t lane = round % 2 == 0 ? 1 : 0;
        const uint8_t v = uint8_t(0x10 + round);
        std::memset(p.from_a.data(), v, kBytes);
        p.a_writes_b(cookies[0]);
        const std::string m = "round " + std::to_string(round);
        ASSERT_EQ(p.a->post_send(p.a_to_b, m.data(), m.size(), nullptr, cookies[1]), 0);
        p.drop_lane(lane);
        EXPECT_EQ(p.run_until(p.at_a, cookies[0]), 0) << "the write on the reset lane failed";
        EXPECT_TRUE(all(p.b_mem, v));
        ASSERT_TRUE(run_until_healed(p, uint64_t(round + 1))) << "lane " << lane << " never came back";
        for (int i = 0; i < 200 && p.at_b.messages.size() < messages + 1; ++i) p.poll();
        ASSERT_EQ(p.at_b.messages.size(), messages + 1) << "a message was lost or duplicated";
        EXPECT_EQ(p.at_b.messages.back(), m);
        messages = p.at_b.messages.size();
        std::memset(p.b_mem.data(), 0x55, kBytes);
        for (uint32_t i = 0; i < 3 * kLateByPolls; ++i) p.poll();
        EXPECT_TRUE(all(p.b_mem, 0x55)) << "a first copy landed after the host reused the memory";
        p.at_a.done.clear();
    }
    EXPECT_EQ(p.a->lane_stats().lanes_lost, 5u);
    EXPECT_EQ(p.b->lane_stats().lanes_lost, 5u);
    EXPECT_EQ(p.a->lane_stats().lanes_healed, 5u);
    EXPECT_EQ(p.b->lane_stats().lanes_healed, 5u);
}

// A 1.6 peer cannot heal: its lanes stay down as before, and the session goes on the others.
TEST(LaneHeal, WithA16PeerALaneGivenUpStaysDown) {
    Pair p(13, LaneProtocol::Fencing);
    p.a_writes_b(cookies[0]);
    p.drop_lane(1);
    EXPECT_EQ(p.run_until(p.at_a, cookies[0]), 0);
    for (int i = 0; i < 500; ++i) p.poll();
    EXPECT_EQ(healed(p, true), 0u);
    EXPECT_EQ(healed(p, false), 0u);
}

}  // namespace
