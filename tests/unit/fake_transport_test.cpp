// The fake fabric on its own (transport/fake.hpp), before the core runs on it: writes land and
// messages arrive only when the target polls, keys and bounds are checked as a provider checks
// them, the ordering the capabilities promise holds under every delay, connections break, dead
// peers of a local_only fabric never answer, and one seed replays one schedule.
#include "transport/fake.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <string>
#include <vector>

namespace {

using namespace sg::transport;

struct Event {
    bool message;
    void *cookie;
    int status;
    std::vector<uint8_t> bytes;
};

struct Recorder : CompletionSink {
    std::vector<Event> events;
    void on_complete(void *cookie, int status, const char *) override { events.push_back({false, cookie, status, {}}); }
    void on_message(std::span<const uint8_t> bytes) override {
        events.push_back({true, nullptr, 0, std::vector<uint8_t>(bytes.begin(), bytes.end())});
    }
};

OpenOptions fake_options() {
    OpenOptions o;
    o.provider = "fake";
    return o;
}

// Two endpoints that know each other.
struct Link {
    std::unique_ptr<Transport> a = open(fake_options()), b = open(fake_options());
    PeerAddr a_to_b = a->insert_peer(b->local_address());
    PeerAddr b_to_a = b->insert_peer(a->local_address());
    uint32_t a_id = fake::Fabric::endpoint_id(a->local_address());
    uint32_t b_id = fake::Fabric::endpoint_id(b->local_address());
};

alignas(16) uint8_t cookies[8][kCookieBytes];

TEST(FakeTransport, OpensOnlyWhileAFabricIsInstalled) {
    try {
        (void)open(fake_options());
        FAIL() << "opened without a fabric";
    } catch (const sg::Error &e) {
        EXPECT_EQ(e.status(), SG_ERR_NO_PROVIDER);
    }
    fake::Fabric fabric(1, {});
    EXPECT_EQ(open(fake_options())->caps().provider, "fake");
    EXPECT_THROW(fake::Fabric(2, {}), sg::Error);  // one at a time
}

TEST(FakeTransport, AWriteLandsWhenTheTargetPollsAndCompletesWhenTheInitiatorDoes) {
    fake::Fabric fabric(1, {});
    Link l;
    std::vector<uint8_t> src(256), dst(1024, 0);
    for (size_t i = 0; i < src.size(); ++i) src[i] = uint8_t(i);
    Registration r = l.b->register_memory(dst.data(), dst.size(), 0x1234);
    EXPECT_EQ(r.key, 0x1234u);
    EXPECT_EQ(l.b->live_registrations(), 1u);
    LocalIov iov{src.data(), src.size(), nullptr};
    ASSERT_EQ(l.a->post_write(l.a_to_b, {&iov, 1}, 512, r.key, cookies[0]), 0);
    Recorder ra, rb;
    EXPECT_EQ(l.a->poll(ra), 0u);  // nothing lands before the target polls
    EXPECT_EQ(dst[512], 0);
    EXPECT_EQ(l.b->poll(rb), 0u);  // writes raise no event at the target
    EXPECT_EQ(std::memcmp(dst.data() + 512, src.data(), src.size()), 0);
    ASSERT_EQ(l.a->poll(ra), 1u);
    EXPECT_EQ(ra.events[0].cookie, cookies[0]);
    EXPECT_EQ(ra.events[0].status, 0);
    const auto log = fabric.writes();
    ASSERT_EQ(log.size(), 1u);
    EXPECT_EQ(log[0].offset, 512u);
    EXPECT_EQ(log[0].len, 256u);
    EXPECT_EQ(log[0].target_addr, reinterpret_cast<uint64_t>(dst.data() + 512));
    EXPECT_EQ(fabric.flow(l.a_id).max_ops, 1u);
    EXPECT_EQ(fabric.flow(l.a_id).max_bytes, 256u);
    EXPECT_EQ(fabric.flow(l.a_id).ops, 0u);
    l.b->deregister(r);
    EXPECT_EQ(l.b->live_registrations(), 0u);
}

TEST(FakeTransport, ABadKeyOrRangeCompletesWithAnErrorAndTouchesNothing) {
    fake::Fabric fabric(1, {});
    Link l;
    std::vector<uint8_t> src(64, 7), dst(128, 0);
    Registration r = l.b->register_memory(dst.data(), dst.size(), 99);
    LocalIov iov{src.data(), src.size(), nullptr};
    ASSERT_EQ(l.a->post_write(l.a_to_b, {&iov, 1}, 0, 98, cookies[0]), 0);               // wrong key
    ASSERT_EQ(l.a->post_write(l.a_to_b, {&iov, 1}, 100, 99, cookies[1]), 0);             // past the end
    ASSERT_EQ(l.a->post_write(l.a_to_b, {&iov, 1}, UINT64_MAX - 8, 99, cookies[2]), 0);  // wraps
    Recorder ra, rb;
    l.b->poll(rb);
    ASSERT_EQ(l.a->poll(ra), 3u);
    for (auto &e : ra.events) EXPECT_EQ(e.status, -EACCES);
    for (uint8_t x : dst) ASSERT_EQ(x, 0);
    l.b->deregister(r);
}

TEST(FakeTransport, ProviderKeysAndVirtualAddressesFollowTheKnobs) {
    fake::Knobs k;
    k.provider_keys = true;
    k.virt_addr = true;
    k.needs_local_desc = true;
    fake::Fabric fabric(5, k);
    Link l;
    std::vector<uint8_t> src(64, 3), dst(128, 0);
    Registration rd = l.b->register_memory(dst.data(), dst.size(), 42);
    Registration rs = l.a->register_memory(src.data(), src.size(), 42);
    EXPECT_NE(rd.key, 42u);  // the fabric chose
    EXPECT_EQ(rd.remote_base, reinterpret_cast<uint64_t>(dst.data()));
    LocalIov good{src.data(), 64, rs.desc}, bare{src.data(), 64, nullptr};
    ASSERT_EQ(l.a->post_write(l.a_to_b, {&good, 1}, rd.remote_base + 64, rd.key, cookies[0]), 0);
    ASSERT_EQ(l.a->post_write(l.a_to_b, {&bare, 1}, rd.remote_base, rd.key, cookies[1]), 0);
    ASSERT_EQ(l.a->post_write(l.a_to_b, {&good, 1}, 64, rd.key, cookies[2]), 0);  // an offset, not an address
    Recorder ra, rb;
    l.b->poll(rb);
    l.a->poll(ra);
    ASSERT_EQ(ra.events.size(), 3u);
    std::vector<int> status(3);
    for (auto &e : ra.events) status[size_t((static_cast<uint8_t(*)[kCookieBytes]>(e.cookie)) - cookies)] = e.status;
    EXPECT_EQ(status[0], 0);
    EXPECT_EQ(status[1], -EACCES);  // FI_MR_LOCAL: a local buffer needs its descriptor
    EXPECT_EQ(status[2], -EACCES);
    EXPECT_EQ(dst[64], 3);
    EXPECT_EQ(dst[0], 0);
    l.a->deregister(rs);
    l.b->deregister(rd);
}

// With send_after_write, however late a write lands, a send posted after it arrives after it; sends
// keep their order; without it, a send may overtake.
TEST(FakeTransport, DelaysNeverBreakTheOrderingTheCapabilitiesPromise) {
    for (bool saw : {true, false}) {
        bool overtaken = false;
        for (uint64_t seed = 1; seed <= 200; ++seed) {
            fake::Knobs k;
            k.send_after_write = saw;
            k.delay = 0.5;
            k.hold = 0.5;
            fake::Fabric fabric(seed, k);
            Link l;
            std::vector<uint8_t> dst(64, 0), src(64, 1);
            Registration r = l.b->register_memory(dst.data(), dst.size(), 1);
            Recorder ra;
            struct Checker : CompletionSink {
                std::vector<uint8_t> *dst;
                std::vector<uint8_t> seen;
                bool landed_before_message = true;
                void on_complete(void *, int, const char *) override {}
                void on_message(std::span<const uint8_t> b) override {
                    seen.push_back(b[0]);
                    landed_before_message = landed_before_message && (*dst)[b[0]] == 1;
                }
            } rb;
            rb.dst = &dst;
            for (uint8_t i = 0; i < 8; ++i) {
                LocalIov iov{src.data(), 1, nullptr};
                ASSERT_EQ(l.a->post_write(l.a_to_b, {&iov, 1}, i, 1, cookies[0]), 0);
                ASSERT_EQ(l.a->post_send(l.a_to_b, &i, 1, nullptr, cookies[1]), 0);
            }
            for (int p = 0; p < 64; ++p) {
                l.b->poll(rb);
                l.a->poll(ra);
            }
            ASSERT_EQ(rb.seen.size(), 8u);
            for (uint8_t i = 0; i < 8; ++i) ASSERT_EQ(rb.seen[i], i) << "seed " << seed;
            if (saw) ASSERT_TRUE(rb.landed_before_message) << "seed " << seed;
            overtaken = overtaken || !rb.landed_before_message;
            EXPECT_EQ(fabric.pending(), 0u);
            l.b->deregister(r);
        }
        EXPECT_EQ(overtaken, !saw) << "send_after_write " << saw;
    }
}

TEST(FakeTransport, ADroppedLinkFailsWhatIsPendingAndWhatIsPostedLater) {
    fake::Fabric fabric(3, {});
    Link l;
    uint8_t byte = 1;
    ASSERT_EQ(l.a->post_send(l.a_to_b, &byte, 1, nullptr, cookies[0]), 0);
    fabric.drop_link(l.a_id, l.b_id);
    Recorder ra, rb;
    EXPECT_EQ(l.b->poll(rb), 0u);
    ASSERT_EQ(l.a->poll(ra), 1u);
    EXPECT_EQ(ra.events[0].status, -ECONNRESET);
    // Later posts either throw or fail at completion, as the seed decided for this link.
    size_t failed = 0;
    for (int i = 0; i < 4; ++i) {
        try {
            if (l.b->post_send(l.b_to_a, &byte, 1, nullptr, cookies[1]) == 0) {
                Recorder r;
                l.b->poll(r);
                failed += r.events.size() == 1 && r.events[0].status == -ECONNRESET;
            }
        } catch (const sg::Error &e) {
            EXPECT_EQ(e.status(), SG_ERR_TRANSPORT);
            failed++;
        }
    }
    EXPECT_EQ(failed, 4u);
    EXPECT_EQ(fabric.pending(), 0u);
}

// TCP's receiver checks a write's key when its header arrives and copies the payload as it comes:
// a write whose link drops lands a prefix at once and the rest later at the same address, even
// after the key was closed. Only a fence of the initiator stops the rest.
TEST(FakeTransport, APartialLandingFinishesWhateverBecameOfTheKeyUnlessTheTargetFences) {
    fake::Knobs k;
    k.late_landing_polls = 3;
    k.partial_landing = 1.0;
    for (bool fence : {false, true}) {
        fake::Fabric fabric(5, k);
        Link l;
        std::vector<uint8_t> src(4096, 0xab), dst(8192, 0);
        Registration r = l.b->register_memory(dst.data(), dst.size(), 0x77);
        LocalIov iov{src.data(), src.size(), nullptr};
        ASSERT_EQ(l.a->post_write(l.a_to_b, {&iov, 1}, 1024, r.key, cookies[0]), 0);
        fabric.drop_link(l.a_id, l.b_id);
        auto landed = [&] { return size_t(std::count(dst.begin(), dst.end(), uint8_t(0xab))); };
        const size_t prefix = landed();
        EXPECT_GT(prefix, 0u) << "no prefix landed when the link dropped";
        EXPECT_LT(prefix, src.size());
        EXPECT_EQ(dst[1024], 0xab);  // a prefix: from the write's first byte on
        Recorder ra, rb;
        ASSERT_EQ(l.a->poll(ra), 1u);
        EXPECT_EQ(ra.events[0].status, -ECONNRESET);  // the initiator sees it fail at once
        l.b->deregister(r);  // the key is closed: it was checked at the first byte
        if (fence) EXPECT_TRUE(l.b->fence(l.b_to_a));
        for (int i = 0; i < 6; ++i) l.b->poll(rb);
        EXPECT_EQ(landed(), fence ? prefix : src.size()) << (fence ? "fenced" : "not fenced");
        EXPECT_EQ(fabric.pending(), 0u);
    }
}

// A late write's bytes have left their initiator: its removing the peer, fencing it or closing
// its endpoint does not take them back (TCP delivers what was sent before a close). Only the
// target's fence does.
TEST(FakeTransport, ALateWriteOutlivesItsInitiatorsRemoveFenceAndCloseButNotTheTargetsFence) {
    fake::Knobs k;
    k.late_landing_polls = 3;
    for (int initiator_step = 0; initiator_step < 3; ++initiator_step)
        for (bool target_fences : {false, true}) {
            fake::Fabric fabric(7, k);
            Link l;
            std::vector<uint8_t> src(4096, 0xcd), dst(4096, 0);
            Registration r = l.b->register_memory(dst.data(), dst.size(), 0x78);
            LocalIov iov{src.data(), src.size(), nullptr};
            ASSERT_EQ(l.a->post_write(l.a_to_b, {&iov, 1}, 0, r.key, cookies[0]), 0);
            fabric.drop_link(l.a_id, l.b_id);
            Recorder ra, rb;
            ASSERT_EQ(l.a->poll(ra), 1u);
            EXPECT_EQ(ra.events[0].status, -ECONNRESET);
            if (initiator_step == 0) l.a->remove_peer(l.a_to_b);
            if (initiator_step == 1) l.a->fence(l.a_to_b);
            if (initiator_step == 2) l.a.reset();
            if (target_fences) EXPECT_TRUE(l.b->fence(l.b_to_a));
            for (int i = 0; i < 6; ++i) l.b->poll(rb);
            const size_t landed = size_t(std::count(dst.begin(), dst.end(), uint8_t(0xcd)));
            EXPECT_EQ(landed, target_fences ? 0u : src.size())
                << "initiator step " << initiator_step << (target_fences ? ", target fenced" : ", target did not fence");
            l.b->deregister(r);
        }
}

TEST(FakeTransport, ALocalOnlyFabricNeverCompletesOperationsToADeadPeer) {
    fake::Knobs k;
    k.local_only = true;
    fake::Fabric fabric(3, k);
    Link l;
    EXPECT_TRUE(l.a->caps().local_only);
    fabric.kill(l.b_id);
    uint8_t byte = 1;
    ASSERT_EQ(l.a->post_send(l.a_to_b, &byte, 1, nullptr, cookies[0]), 0);
    Recorder ra, rb;
    for (int p = 0; p < 16; ++p) {
        l.a->poll(ra);
        l.b->poll(rb);
    }
    EXPECT_TRUE(ra.events.empty());
    EXPECT_TRUE(rb.events.empty());
    EXPECT_EQ(fabric.stuck(), 1u);
    EXPECT_EQ(fabric.pending(), 0u);
    // The initiator's own removal of the peer settles it (fi_av_remove cancels).
    l.a->remove_peer(l.a_to_b);
    l.a->poll(ra);
    ASSERT_EQ(ra.events.size(), 1u);
    EXPECT_EQ(ra.events[0].status, -ECANCELED);
}

// Everything the fabric decides comes from its seed: the same posts and polls give the same events.
TEST(FakeTransport, OneSeedReplaysOneSchedule) {
    auto run = [](uint64_t seed) {
        fake::Knobs k;
        k.delay = 0.3;
        k.hold = 0.3;
        k.eagain = 0.2;
        k.early_completion = 0.3;
        fake::Fabric fabric(seed, k);
        Link l;
        std::vector<uint8_t> dst(256, 0), src(256, 9);
        Registration r = l.b->register_memory(dst.data(), dst.size(), 5);
        std::string trace;
        Recorder ra, rb;
        for (int i = 0; i < 32; ++i) {
            LocalIov iov{src.data(), 8, nullptr};
            trace += char('0' - l.a->post_write(l.a_to_b, {&iov, 1}, uint64_t(i) * 8, 5, cookies[i % 8]));
            trace += char('0' + l.b->poll(rb));
            trace += char('0' + l.a->poll(ra));
        }
        l.b->deregister(r);
        return trace + std::to_string(fabric.eagains());
    };
    EXPECT_EQ(run(11), run(11));
    EXPECT_NE(run(11), run(12));
}

}  // namespace
