// Lane failover (transport/lanes.cpp) over libfabric's tcp provider on loopback: a write that
// breaks a lane is moved to another once; a write the target refuses breaks every connection it is
// sent on (the tcp provider drops a connection whose write names a key it does not know), so moving
// it again and again lost every lane and the peer with it.
#include "transport/transport.hpp"

#include <gtest/gtest.h>

#include <chrono>
#include <cstring>
#include <thread>
#include <vector>

namespace {

using namespace sg::transport;

struct Completions : CompletionSink {
    std::vector<std::pair<void *, int>> done;
    void on_complete(void *cookie, int status, const char *) override { done.emplace_back(cookie, status); }
    void on_message(std::span<const uint8_t>) override {}
    int status_of(void *cookie) const {
        for (auto &[c, st] : done)
            if (c == cookie) return st;
        return 1;  // not yet
    }
};

OpenOptions tcp_lanes(uint32_t lanes) {
    OpenOptions o;
    o.provider = canonical_provider("tcp");
    o.lanes = lanes;
    o.lane_threads = false;  // poll() drives every lane: the test decides when anything moves
    o.delivery_complete = true;
    o.lane_small_write_bytes = 4096;  // the test's writes go on the bulk lanes
    return o;
}

alignas(16) uint8_t cookies[4][kCookieBytes];

TEST(LaneFailover, AWriteTheTargetRefusesCostsOneLaneNotThePeer) {
    std::unique_ptr<Transport> a, b;
    try {
        a = open(tcp_lanes(3));
        b = open(tcp_lanes(3));
    } catch (const std::exception &e) {
        GTEST_SKIP() << "no tcp provider with three lanes here: " << e.what();
    }
    const PeerAddr a_to_b = a->insert_peer_lanes(b->lane_addresses(), Transport::LaneProtocol::Fencing);
    (void)b->insert_peer_lanes(a->lane_addresses(), Transport::LaneProtocol::Fencing);
    std::vector<uint8_t> target(1 << 20, 0), source(256 * 1024, 0x5a);
    Registration reg = b->register_memory(target.data(), target.size(), 0x7e57);
    Registration src = a->register_memory(source.data(), source.size(), 0x50c);
    const LocalIov iov{source.data(), source.size(), src.desc};
    Completions at_a, at_b;
    auto run_until = [&](void *cookie) {
        const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
        while (at_a.status_of(cookie) == 1 && std::chrono::steady_clock::now() < deadline) {
            a->poll(at_a);
            b->poll(at_b);
            std::this_thread::sleep_for(std::chrono::microseconds(200));
        }
        return at_a.status_of(cookie);
    };

    // A key B never gave out.
    ASSERT_EQ(a->post_write(a_to_b, {&iov, 1}, reg.remote_base, reg.key ^ 0xdead0000ull, cookies[0]), 0);
    const int refused = run_until(cookies[0]);
    ASSERT_NE(refused, 1) << "the refused write never completed";
    EXPECT_NE(refused, 0) << "a write with a key the target never gave out completed";
    EXPECT_FALSE(sg::is_connection_error(refused)) << "the refused write's status would lose the session above";
    EXPECT_LE(a->lane_stats().lanes_lost, 1u) << "the refused write took more than the lane it first broke";

    // The peer is still there: a good write completes and lands.
    ASSERT_EQ(a->post_write(a_to_b, {&iov, 1}, reg.remote_base, reg.key, cookies[1]), 0);
    EXPECT_EQ(run_until(cookies[1]), 0);
    EXPECT_EQ(std::memcmp(target.data(), source.data(), source.size()), 0);
    a->deregister(src);
    b->deregister(reg);
}

}  // namespace
