// PeerLiveness (runtime/core/liveness.hpp): when a silent peer is lost. Pure arithmetic on given
// clocks, so every case is exact.
#include "core/liveness.hpp"

#include <gtest/gtest.h>

using sg::core::PeerLiveness;

namespace {
constexpr uint64_t kMs = 1000000;
constexpr uint64_t kTimeout = 2000 * kMs;

// Timer passes every `step` from `from` to `to` (exclusive of `from`).
void passes(PeerLiveness &l, uint64_t from, uint64_t to, uint64_t step) {
    for (uint64_t t = from + step; t <= to; t += step) l.watch(t);
}
}  // namespace

TEST(PeerLiveness, ADeadPeerWatchedOnTimeIsLostAfterTheTimeout) {
    PeerLiveness l;
    l.start(0);
    passes(l, 0, 1990 * kMs, 10 * kMs);
    EXPECT_FALSE(l.lost(kTimeout));
    passes(l, 1990 * kMs, 2010 * kMs, 10 * kMs);
    EXPECT_TRUE(l.lost(kTimeout));
}

TEST(PeerLiveness, OurOwnStallIsNotThePeersSilence) {
    PeerLiveness l;
    l.start(0);
    passes(l, 0, 500 * kMs, 10 * kMs);
    l.watch(3500 * kMs);  // our thread was off the CPU for 3 s: credited 250 ms
    EXPECT_EQ(l.silence_ns(), 750 * kMs);
    EXPECT_FALSE(l.lost(kTimeout));
    l.heard(3510 * kMs);  // the keep-alive that waited in the queue
    EXPECT_EQ(l.silence_ns(), 0u);
    // The 760 ms it was watched silent is a gap it has shown: three of it, 2280 ms, is allowed now.
    EXPECT_EQ(l.timeout_ns(kTimeout), 2280 * kMs);
    // A peer that then dies is still found once we watch it for that long.
    passes(l, 3510 * kMs, 3510 * kMs + 2270 * kMs, 10 * kMs);
    EXPECT_FALSE(l.lost(kTimeout));
    passes(l, 3510 * kMs + 2270 * kMs, 3510 * kMs + 2300 * kMs, 10 * kMs);
    EXPECT_TRUE(l.lost(kTimeout));
}

TEST(PeerLiveness, QuietKeepAlivesLeaveTheTimeoutAsConfigured) {
    PeerLiveness l;
    l.start(0);
    uint64_t t = 0;
    for (int i = 0; i < 40; ++i) {  // keep-alives every 250 ms, passes every 10 ms
        passes(l, t, t + 250 * kMs, 10 * kMs);
        t += 250 * kMs;
        l.heard(t);
    }
    EXPECT_EQ(l.largest_gap_ns(), 250 * kMs);
    EXPECT_EQ(l.timeout_ns(kTimeout), kTimeout);
}

TEST(PeerLiveness, APeerThatHasShownLongGapsGetsLongerBoundedAndFading) {
    PeerLiveness l;
    l.start(0);
    passes(l, 0, 1500 * kMs, 10 * kMs);
    l.heard(1500 * kMs);  // a 1.5 s gap: a descheduled peer
    EXPECT_EQ(l.timeout_ns(kTimeout), 4500 * kMs);
    passes(l, 1500 * kMs, 1500 * kMs + 4000 * kMs, 10 * kMs);
    EXPECT_FALSE(l.lost(kTimeout)) << "4 s of silence after a 1.5 s gap is within 3 gaps";
    passes(l, 5500 * kMs, 6020 * kMs, 10 * kMs);
    EXPECT_TRUE(l.lost(kTimeout));

    PeerLiveness huge;
    huge.start(0);
    passes(huge, 0, 7000 * kMs, 10 * kMs);  // a 7 s gap, heard in the end
    huge.heard(7000 * kMs);
    EXPECT_EQ(huge.timeout_ns(kTimeout), 4 * kTimeout) << "never more than four timeouts";

    // Thirty seconds later the gap counts half; after ten half-lives it no longer stretches anything.
    huge.heard(37000 * kMs);
    EXPECT_EQ(huge.largest_gap_ns(), 3500 * kMs);
    uint64_t t = 37000 * kMs;
    for (int i = 0; i < 1300; ++i) {
        passes(huge, t, t + 250 * kMs, 10 * kMs);
        t += 250 * kMs;
        huge.heard(t);
    }
    EXPECT_EQ(huge.timeout_ns(kTimeout), kTimeout);
}
