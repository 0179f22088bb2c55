// The directory's two threads (runtime/directory: Inbox, KeepAlive) with the cluster replaced by
// functions: what a request or a keep-alive round throws never leaves the thread (which would end
// the host process); it is counted and the thread goes on.
#include "directory/directory.hpp"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <new>
#include <stdexcept>
#include <thread>

namespace {

using sg::directory::Inbox;
using sg::directory::KeepAlive;
using sg::directory::InboxEntry;
using sg::directory::Worker;

// Waits up to 10 s for pred.
template <class P>
bool eventually(P pred) {
    for (int i = 0; i < 1000; ++i) {
        if (pred()) return true;
        std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    return pred();
}

TEST(DirectoryInbox, AnOutOfMemoryWhileAnsweringIsCountedAndTheNextRequestIsAnswered) {
    std::atomic<int> taken{0}, answered{0};
    Inbox inbox([&](const std::string &name, uint64_t) -> std::optional<InboxEntry> {
                    EXPECT_EQ(name, "prefill/0");
                    std::this_thread::sleep_for(std::chrono::milliseconds(5));
                    return InboxEntry{"peer-" + std::to_string(taken++), {1, 2, 3}};
                },
                [] {},
                [&](const InboxEntry &req) {
                    if (req.from == "peer-0") throw std::bad_alloc();
                    if (req.from == "peer-1") throw std::runtime_error("another library's exception");
                    answered++;
                });
    EXPECT_FALSE(inbox.serving());
    ASSERT_TRUE(inbox.serve("prefill/0"));
    EXPECT_FALSE(inbox.serve("prefill/1")) << "an inbox serves one name";
    ASSERT_TRUE(eventually([&] { return answered.load() >= 2; }))
        << "the thread stopped after " << inbox.failures() << " failures";
    EXPECT_EQ(inbox.failures(), 2u);
    EXPECT_TRUE(inbox.serving());
    inbox.stop();
    EXPECT_FALSE(inbox.serving());
}

TEST(DirectoryInbox, AFailingClusterIsBackedOffFromAndStopEndsAWaitAtOnce) {
    std::atomic<int> takes{0};
    std::atomic<bool> interrupted{false};
    Inbox inbox(
        [&](const std::string &, uint64_t) -> std::optional<InboxEntry> {
            if (++takes <= 2) throw std::bad_alloc();  // then a watch that waits until interrupted
            while (!interrupted.load()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
            return std::nullopt;
        },
        [&] { interrupted = true; }, [](const InboxEntry &) { FAIL() << "nothing was requested"; });
    const auto t0 = std::chrono::steady_clock::now();
    ASSERT_TRUE(inbox.serve("decode/0"));
    ASSERT_TRUE(eventually([&] { return takes.load() >= 3; }));
    // Two failures, each followed by 500 ms without a take: not a spin against a dead cluster.
    EXPECT_GE(std::chrono::steady_clock::now() - t0, std::chrono::milliseconds(900));
    EXPECT_EQ(inbox.failures(), 2u);
    const auto t1 = std::chrono::steady_clock::now();
    inbox.stop();
    EXPECT_LT(std::chrono::steady_clock::now() - t1, std::chrono::seconds(2));
    EXPECT_TRUE(interrupted.load());
}

TEST(DirectoryKeepAlive, AnOutOfMemoryInARoundIsCountedAndTheNextPeriodRenewsAgain) {
    std::atomic<int> calls{0};
    std::atomic<uint64_t> budget_seen{0};
    KeepAlive keepalive(std::chrono::milliseconds(20), std::chrono::milliseconds(400), [&](uint64_t deadline_ns) {
        budget_seen = deadline_ns - sg::now_ns();
        const int n = calls++;
        if (n == 0) throw std::bad_alloc();
        if (n == 1) throw std::runtime_error("another library's exception");
        if (n == 2) sg::fail(SG_ERR_CONNECT, "no etcd member answered");
    });
    keepalive.start();
    keepalive.start();  // one thread
    ASSERT_TRUE(eventually([&] { return keepalive.rounds() >= 2; }))
        << "the thread stopped after " << keepalive.failures() << " failures";
    EXPECT_EQ(keepalive.failures(), 3u);
    EXPECT_GT(budget_seen.load(), 300u * 1000000) << "each round gets its budget from its start";
    EXPECT_LE(budget_seen.load(), 400u * 1000000);
    keepalive.stop();
    const int after_stop = calls.load();
    std::this_thread::sleep_for(std::chrono::milliseconds(60));
    EXPECT_EQ(calls.load(), after_stop) << "no round after stop";
}

TEST(DirectoryKeepAlive, StopEndsTheWaitForTheNextPeriodAtOnceAndStartAfterStopRunsNothing) {
    std::atomic<int> calls{0};
    KeepAlive keepalive(std::chrono::hours(1), std::chrono::seconds(1), [&](uint64_t) { calls++; });
    keepalive.start();
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    const auto t0 = std::chrono::steady_clock::now();
    keepalive.stop();
    EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(1));
    keepalive.start();
    keepalive.stop();
    EXPECT_EQ(calls.load(), 0);
    EXPECT_EQ(keepalive.rounds(), 0u);
}

// The worker both threads are: started once, a failing round backed off from (rounds that do not
// throw run back to back), and stop() calls the interrupt that ends a round blocked in the cluster.
TEST(DirectoryWorker, StartsOnceBacksOffAfterAFailureAndStopInterruptsARound) {
    std::atomic<int> calls{0};
    std::atomic<bool> interrupted{false};
    Worker worker(std::chrono::milliseconds(0), std::chrono::hours(1),
                  [&] {
                      if (calls++ < 3) return;  // three quick rounds
                      throw std::bad_alloc();   // then a failure: backed off from for an hour
                  },
                  [&] { interrupted = true; });
    EXPECT_FALSE(worker.running());
    ASSERT_TRUE(worker.start());
    EXPECT_FALSE(worker.start()) << "a second thread";
    ASSERT_TRUE(eventually([&] { return worker.failures() == 1; }));
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    EXPECT_EQ(calls.load(), 4) << "a round ran during the back-off";
    EXPECT_EQ(worker.rounds(), 3u);
    EXPECT_TRUE(worker.running());
    const auto t0 = std::chrono::steady_clock::now();
    worker.stop();
    EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(1)) << "stop waited out the back-off";
    EXPECT_TRUE(interrupted.load());
    EXPECT_FALSE(worker.running());
    EXPECT_FALSE(worker.start()) << "started after stop";
}

// Two stops at once (a host's teardown racing the handle's destructor): each returns only once the
// round under way has finished and the thread is gone.
TEST(DirectoryWorker, EveryStopReturnsOnlyOnceTheThreadIsGone) {
    std::atomic<bool> in_round{false};
    Worker worker(std::chrono::milliseconds(0), std::chrono::milliseconds(0), [&] {
        in_round = true;
        std::this_thread::sleep_for(std::chrono::milliseconds(200));
        in_round = false;
    });
    ASSERT_TRUE(worker.start());
    ASSERT_TRUE(eventually([&] { return in_round.load(); }));
    std::atomic<int> returned_in_round{0};
    auto stopper = [&] {
        worker.stop();
        if (in_round) returned_in_round++;
    };
    std::thread a(stopper), b(stopper);
    while (worker.running()) std::this_thread::yield();  // running() is safe beside stop()
    a.join();
    b.join();
    EXPECT_EQ(returned_in_round.load(), 0);
    EXPECT_FALSE(worker.running());
}

}  // namespace
