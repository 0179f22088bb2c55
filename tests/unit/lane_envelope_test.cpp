// The lane envelope's acks (transport/lanes.cpp, docs/protocol.md 3.1) between striped transports
// on the fake fabric, their lanes driven by poll(): an ack erases the messages a sender keeps to
// send again when its control lane breaks, so only the peer whose stream it names may give one,
// and only for messages that were sent.
#include "transport/fake.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cstring>
#include <string>
#include <vector>

namespace {

using namespace sg::transport;

struct Messages : CompletionSink {
    std::vector<std::string> got;
    void on_complete(void *, int, const char *) override {}
    void on_message(std::span<const uint8_t> bytes) override { got.emplace_back(bytes.begin(), bytes.end()); }
};

OpenOptions options(uint32_t lanes) {
    OpenOptions o;
    o.provider = "fake";
    o.lanes = lanes;
    o.lane_threads = false;
    o.delivery_complete = true;
    return o;
}

void put_le(uint8_t *p, uint64_t v, int bytes) {
    for (int i = 0; i < bytes; ++i) p[i] = uint8_t(v >> (8 * i));
}
uint64_t get_le(const uint8_t *p, int bytes) {
    uint64_t v = 0;
    for (int i = 0; i < bytes; ++i) v |= uint64_t(p[i]) << (8 * i);
    return v;
}

// An Ack as protocol.md 3.1 lays it out: 'SGL1' | kind 2 | lane | 0 | stream | 0 | origin | nonce | seq.
std::vector<uint8_t> ack(uint32_t stream, uint64_t origin, uint64_t nonce, uint64_t seq) {
    std::vector<uint8_t> e(40, 0);
    put_le(&e[0], 0x314C4753u, 4);
    e[4] = 2;
    put_le(&e[8], stream, 4);
    put_le(&e[16], origin, 8);
    put_le(&e[24], nonce, 8);
    put_le(&e[32], seq, 8);
    return e;
}

uint64_t fnv1a(std::span<const uint8_t> bytes) {
    uint64_t h = 0xcbf29ce484222325ull;
    for (uint8_t b : bytes) h = (h ^ b) * 0x100000001b3ull;
    return h;
}

alignas(16) uint8_t cookies[16][kCookieBytes];

// A (two lanes) sends three messages to B (two lanes) that B has not read yet; C, a third peer of
// A's, sends A an ack naming A's stream to B. Then A's control lane to B breaks: A must still hold
// the three messages and send them again on its other lane.
void forged_ack_changes_nothing(bool own_origin, uint64_t seq) {
    fake::Fabric fabric(7, fake::Knobs{});
    // C is two plain endpoints that A takes for a framing peer's two lanes: it sees A's envelopes
    // and writes its own.
    auto a = open(options(2)), b = open(options(2)), c = open(options(1)), c_lane1 = open(options(1));
    const auto a_lanes = a->lane_addresses(), b_lanes = b->lane_addresses();
    const PeerAddr a_to_b = a->insert_peer_lanes(b_lanes, Transport::LaneProtocol::Fencing);
    (void)b->insert_peer_lanes(a_lanes, Transport::LaneProtocol::Fencing);
    const std::vector<std::vector<uint8_t>> c_lanes = {c->local_address(), c_lane1->local_address()};
    const PeerAddr a_to_c = a->insert_peer_lanes(c_lanes, Transport::LaneProtocol::Fencing);
    const PeerAddr c_to_a = c->insert_peer(a_lanes[0]);
    Messages at_a, at_b, at_c;

    const std::vector<std::string> sent = {"first", "second", "third"};
    for (size_t i = 0; i < sent.size(); ++i)
        ASSERT_EQ(a->post_send(a_to_b, sent[i].data(), sent[i].size(), nullptr, cookies[i]), 0);
    const std::string hi = "hello c";
    ASSERT_EQ(a->post_send(a_to_c, hi.data(), hi.size(), nullptr, cookies[8]), 0);
    for (int i = 0; i < 4 && at_c.got.empty(); ++i) {
        a->poll(at_a);
        c->poll(at_c);
    }
    ASSERT_EQ(at_c.got.size(), 1u);
    const auto &framed = at_c.got[0];
    ASSERT_GE(framed.size(), 40u) << "A frames its messages to C";
    const uint64_t a_nonce = get_le(reinterpret_cast<const uint8_t *>(framed.data()) + 24, 8);

    // A's stream to B is its first peer entry (0). The ack says it comes from C (its origin), or
    // from B but for more messages than A ever sent B.
    const uint64_t origin = own_origin ? fnv1a(c_lanes[0]) : fnv1a(b_lanes[0]);
    const auto forged = ack(0, origin, a_nonce, seq);
    ASSERT_EQ(c->post_send(c_to_a, forged.data(), forged.size(), nullptr, cookies[9]), 0);
    for (int i = 0; i < 4; ++i) {
        c->poll(at_c);
        a->poll(at_a);
    }

    fabric.drop_link(fake::Fabric::endpoint_id(a_lanes[0]), fake::Fabric::endpoint_id(b_lanes[0]));
    for (int i = 0; i < 200 && at_b.got.size() < sent.size(); ++i) {
        a->poll(at_a);
        b->poll(at_b);
    }
    EXPECT_EQ(at_b.got, sent) << "B got every message once, in order, over A's other lane";
}

TEST(LaneEnvelope, AnAckFromAnotherPeerIsIgnored) { forged_ack_changes_nothing(true, 3); }

TEST(LaneEnvelope, AnAckForMessagesNeverSentIsIgnored) { forged_ack_changes_nothing(false, 1000); }

// A second session with the same peer while the first ends (a reconnect): both sides hold two
// entries for each other. Removing B's old entry for A must leave the stream of A's new session
// alone; it erased every stream from A's address, so the new session's next messages waited for
// ones B had already delivered and never came up.
TEST(LaneEnvelope, RemovingAnOldEntryForAPeerKeepsTheNewSessionsStream) {
    fake::Fabric fabric(11, fake::Knobs{});
    auto a = open(options(2)), b = open(options(2));
    const auto a_lanes = a->lane_addresses(), b_lanes = b->lane_addresses();
    (void)a->insert_peer_lanes(b_lanes, Transport::LaneProtocol::Fencing);
    const PeerAddr b_to_a_old = b->insert_peer_lanes(a_lanes, Transport::LaneProtocol::Fencing);
    const PeerAddr a_to_b_new = a->insert_peer_lanes(b_lanes, Transport::LaneProtocol::Fencing);
    (void)b->insert_peer_lanes(a_lanes, Transport::LaneProtocol::Fencing);
    Messages at_a, at_b;
    const std::vector<std::string> before = {"one", "two"}, after = {"three", "four"};
    size_t cookie = 0;
    auto send_and_read = [&](const std::vector<std::string> &batch, size_t want) {
        for (const auto &m : batch) ASSERT_EQ(a->post_send(a_to_b_new, m.data(), m.size(), nullptr, cookies[cookie++]), 0);
        for (int i = 0; i < 50 && at_b.got.size() < want; ++i) {
            a->poll(at_a);
            b->poll(at_b);
        }
    };
    send_and_read(before, 2);
    ASSERT_EQ(at_b.got, before);
    b->remove_peer(b_to_a_old);
    send_and_read(after, 4);
    EXPECT_EQ(at_b.got, (std::vector<std::string>{"one", "two", "three", "four"}));
}

// A sender keeps at most 64 MiB of unacked messages for a peer; past that the oldest copies go,
// and until they are acked a broken control lane cannot send everything again, so it loses the
// peer. Once the peer has acked past every dropped copy, nothing is missing any more: a control
// lane that breaks later must move the messages as before. The mark was never cleared, so one
// burst past 64 MiB made every later control-lane failure lose the session.
TEST(LaneEnvelope, OnceDroppedCopiesAreAckedAControlLaneBreakLosesNothing) {
    fake::Fabric fabric(13, fake::Knobs{});
    auto a = open(options(2)), b = open(options(2));
    const auto a_lanes = a->lane_addresses(), b_lanes = b->lane_addresses();
    const PeerAddr a_to_b = a->insert_peer_lanes(b_lanes, Transport::LaneProtocol::Fencing);
    (void)b->insert_peer_lanes(a_lanes, Transport::LaneProtocol::Fencing);
    Messages at_a, at_b;
    // 340 messages of 200 KiB: 68 MiB posted before B reads any (the oldest copies are dropped).
    const size_t burst = 340;
    const std::string big(200 * 1024, 'x');
    static std::vector<std::array<uint8_t, kCookieBytes>> burst_cookies(burst + 8);
    for (size_t i = 0; i < burst; ++i)
        ASSERT_EQ(a->post_send(a_to_b, big.data(), big.size(), nullptr, burst_cookies[i].data()), 0);
    for (int i = 0; i < 5000 && at_b.got.size() < burst; ++i) {
        a->poll(at_a);
        b->poll(at_b);
    }
    ASSERT_EQ(at_b.got.size(), burst);
    // B acks every 16 messages it delivers (the last ack covers 336, past every dropped copy);
    // A takes the acks.
    for (int i = 0; i < 20; ++i) {
        b->poll(at_b);
        a->poll(at_a);
    }
    at_b.got.clear();

    fabric.drop_link(fake::Fabric::endpoint_id(a_lanes[0]), fake::Fabric::endpoint_id(b_lanes[0]));
    const std::vector<std::string> after = {"after-1", "after-2", "after-3"};
    for (size_t i = 0; i < after.size(); ++i)
        ASSERT_EQ(a->post_send(a_to_b, after[i].data(), after[i].size(), nullptr, burst_cookies[burst + i].data()), 0);
    for (int i = 0; i < 200 && at_b.got.size() < after.size(); ++i) {
        a->poll(at_a);
        b->poll(at_b);
    }
    EXPECT_EQ(at_b.got, after) << "the messages sent after lane 0 broke did not move to lane 1";
}

// Anyone who reaches an endpoint can send envelopes, and an origin is a hash of a public address. A
// forger that names a known peer's origin with fresh nonces, each message early (seq 2, so it
// waits for a seq 1 that never comes), made the receiver keep a stream and up to 16 MiB for each
// nonce without bound. Now streams past 1024 must be the peer's own life, and early messages of
// every stream together are held to 64 MiB; the real peer's messages still arrive once.
TEST(LaneEnvelope, ForgedStreamsUnderAKnownOriginHoldBoundedMemory) {
    fake::Fabric fabric(17, fake::Knobs{});
    auto v = open(options(2)), p = open(options(2)), forger = open(options(1));
    const auto v_lanes = v->lane_addresses(), p_lanes = p->lane_addresses();
    const PeerAddr p_to_v = p->insert_peer_lanes(v_lanes, Transport::LaneProtocol::Fencing);
    (void)v->insert_peer_lanes(p_lanes, Transport::LaneProtocol::Fencing);
    const PeerAddr forger_to_v = forger->insert_peer(v_lanes[0]);
    Messages at_v, at_p, at_forger;
    auto pump = [&] {
        for (int i = 0; i < 4; ++i) {
            p->poll(at_p);
            forger->poll(at_forger);
            v->poll(at_v);
        }
    };
    const std::string first = "first";
    ASSERT_EQ(p->post_send(p_to_v, first.data(), first.size(), nullptr, cookies[0]), 0);
    pump();
    ASSERT_EQ(at_v.got, std::vector<std::string>{first});

    const uint64_t p_origin = fnv1a(p_lanes[0]);
    std::vector<uint8_t> frame(40 + 60 * 1024, 0xee);
    put_le(&frame[0], 0x314C4753u, 4);
    frame[4] = 1;  // Data
    put_le(&frame[16], p_origin, 8);
    put_le(&frame[32], 2, 8);  // early: seq 1 of this "stream" never comes
    const int forged = 3000;   // 176 MiB if each were kept
    for (int i = 0; i < forged; ++i) {
        put_le(&frame[24], 0x5eed0000ull + uint64_t(i), 8);  // a fresh nonce each time
        ASSERT_EQ(forger->post_send(forger_to_v, frame.data(), frame.size(), nullptr, cookies[1 + i % 8]), 0);
        if (i % 64 == 63) pump();
    }
    pump();
    const auto stats = v->lane_stats();
    EXPECT_LE(stats.streams, 1025u) << "forged streams got state past the bound";
    EXPECT_LE(stats.early_bytes, uint64_t(64) << 20) << "forged early messages held past 64 MiB";

    const std::string second = "second";
    ASSERT_EQ(p->post_send(p_to_v, second.data(), second.size(), nullptr, cookies[9]), 0);
    for (int i = 0; i < 50 && std::count(at_v.got.begin(), at_v.got.end(), second) == 0; ++i) pump();
    EXPECT_EQ(std::count(at_v.got.begin(), at_v.got.end(), second), 1) << "the real peer's message did not arrive once";
}

}  // namespace
