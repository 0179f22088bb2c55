// The bootstrap listener under hostile and slow connections, and both sides agreeing on a session's
// outcome. Before handshakes ran concurrently, the listener served them one at a time with the whole
// accept timeout each: 200 held sockets delayed a legitimate peer by 65 s, and a peer whose sends
// were each delayed by 100 ms failed every time against an accept called in 250 ms slices.
#include <smartgen/smartgen.h>
#include "support/test_time.hpp"

#include "../test_key.h"
#include "support/test_context.hpp"

#include <gtest/gtest.h>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

namespace {

constexpr uint64_t kSecond = 1000000000ull;
using Clock = std::chrono::steady_clock;

sg_context_t make(const char *provider = "tcp") { return make_test_context(provider); }

// A tcp context whose peer timeout is short, so the listener's drop deadlines come soon.
sg_context_t make_with_peer_timeout(uint32_t ms) { return make_test_context("tcp", ms); }

int connect_to(uint16_t port) {
    const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_port = htons(port);
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    EXPECT_EQ(::connect(fd, reinterpret_cast<sockaddr *>(&a), sizeof a), 0);
    return fd;
}

uint64_t open_sessions(sg_context_t c) {
    sg_context_stats_t s;
    sg_context_stats_init(&s);
    EXPECT_EQ(sg_context_stats(c, &s), SG_OK);
    return s.sessions_open;
}

TEST(Bootstrap, SilentAndSlowConnectionsDoNotDelayALegitimatePeer) {
    sg_context_t a = make(), b = make();
    sg_listener_t l = nullptr;
    ASSERT_EQ(sg_listener_create(a, "127.0.0.1", 0, &l, nullptr), SG_OK);
    uint16_t port = 0;
    sg_listener_port(l, &port);
    // The host's accept loop, with a generous timeout, as a server's would be.
    sg_session_t sa = nullptr, sb = nullptr;
    std::atomic<sg_status_t> accepted{SG_IN_PROGRESS};
    std::thread host([&] {
        const auto until = Clock::now() + std::chrono::seconds(15);
        sg_status_t st = SG_IN_PROGRESS;
        while (st != SG_OK && Clock::now() < until) st = sg_session_accept(l, nullptr, sgtest::wait_ns(10 * kSecond), &sa, nullptr);
        accepted = st;
    });
    // 150 sockets that connect and say nothing, and 20 that send a byte of a header now and then.
    std::vector<int> held;
    for (int i = 0; i < 150; ++i) held.push_back(connect_to(port));
    std::vector<int> slow;
    for (int i = 0; i < 20; ++i) slow.push_back(connect_to(port));
    std::atomic<bool> stop{false};
    std::thread drip([&] {
        for (int round = 0; !stop && round < 100; ++round) {
            for (int fd : slow) (void)!::send(fd, "S", 1, MSG_NOSIGNAL);
            std::this_thread::sleep_for(std::chrono::milliseconds(50));
        }
    });
    std::this_thread::sleep_for(std::chrono::milliseconds(200));  // all of them are the listener's now
    const auto start = Clock::now();
    const sg_status_t connected = sg_session_connect(b, "127.0.0.1", port, nullptr, sgtest::wait_ns(10 * kSecond), &sb, nullptr);
    const auto took = Clock::now() - start;
    host.join();
    stop = true;
    drip.join();
    EXPECT_EQ(accepted, SG_OK) << sg_last_error_message();
    EXPECT_EQ(connected, SG_OK);
    EXPECT_LT(took, std::chrono::seconds(2)) << "a legitimate peer waited behind silent sockets";
    for (int fd : held) ::close(fd);
    for (int fd : slow) ::close(fd);
    sg_session_destroy(sa);
    sg_session_destroy(sb);
    sg_listener_destroy(l);
    sg_context_destroy(a);
    sg_context_destroy(b);
}

// A relay that passes bytes both ways, holding each chunk back `delay` first: a slow network. With
// `to_connector` given, chunks towards the connecting side wait that long instead. Each direction
// has its own thread, so a chunk held back one way does not hold up the other; an end that closes
// is passed on as a half-close once what it sent before has been delivered.
struct SlowRelay {
    int listen_fd = -1;
    uint16_t port = 0;
    std::thread th;
    std::atomic<bool> stop{false};
    SlowRelay(uint16_t target, std::chrono::milliseconds delay, std::chrono::milliseconds to_connector = std::chrono::milliseconds(-1)) {
        if (to_connector.count() < 0) to_connector = delay;
        listen_fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
        sockaddr_in a{};
        a.sin_family = AF_INET;
        a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
        socklen_t len = sizeof a;
        EXPECT_EQ(::bind(listen_fd, reinterpret_cast<sockaddr *>(&a), sizeof a), 0);
        EXPECT_EQ(::listen(listen_fd, 4), 0);
        ::getsockname(listen_fd, reinterpret_cast<sockaddr *>(&a), &len);
        port = ntohs(a.sin_port);
        th = std::thread([this, target, delay, to_connector] {
            const int in = ::accept(listen_fd, nullptr, nullptr);
            const int out = connect_to(target);
            auto pump = [this](int from, int to, std::chrono::milliseconds wait) {
                std::vector<uint8_t> buf(65536);
                while (!stop) {
                    pollfd p{from, POLLIN, 0};
                    if (::poll(&p, 1, 50) <= 0) continue;
                    const ssize_t n = ::recv(from, buf.data(), buf.size(), 0);
                    if (n <= 0) break;
                    std::this_thread::sleep_for(wait);
                    (void)!::send(to, buf.data(), size_t(n), MSG_NOSIGNAL);
                }
                ::shutdown(to, SHUT_WR);
            };
            std::thread back(pump, out, in, to_connector);
            pump(in, out, delay);
            back.join();
            ::close(in);
            ::close(out);
        });
    }
    ~SlowRelay() {
        stop = true;
        th.join();
        ::close(listen_fd);
    }
};

TEST(Bootstrap, AnAcceptTimeoutDoesNotAbortAHandshakeUnderWay) {
    sg_context_t a = make(), b = make();
    sg_listener_t l = nullptr;
    ASSERT_EQ(sg_listener_create(a, "127.0.0.1", 0, &l, nullptr), SG_OK);
    uint16_t port = 0;
    sg_listener_port(l, &port);
    SlowRelay relay(port, std::chrono::milliseconds(150));
    sg_session_t sa = nullptr, sb = nullptr;
    sg_status_t connected = SG_IN_PROGRESS;
    std::thread peer([&] { connected = sg_session_connect(b, "127.0.0.1", relay.port, nullptr, sgtest::wait_ns(20 * kSecond), &sb, nullptr); });
    // Accept in 100 ms slices, as a host that also watches something else does: every exchange
    // step takes longer than a slice.
    sg_status_t accepted = SG_ERR_TIMEOUT;
    int slices = 0;
    const auto start = Clock::now();
    while (accepted == SG_ERR_TIMEOUT && Clock::now() - start < std::chrono::seconds(15)) {
        accepted = sg_session_accept(l, nullptr, 100000000ull, &sa, nullptr);
        ++slices;
    }
    peer.join();
    EXPECT_EQ(accepted, SG_OK) << sg_last_error_message();
    EXPECT_EQ(connected, SG_OK);
    EXPECT_GT(slices, 3);
    sg_session_destroy(sa);
    sg_session_destroy(sb);
    sg_listener_destroy(l);
    sg_context_destroy(a);
    sg_context_destroy(b);
}

// A connector that stalls mid-handshake (here: the listener's frames reach it 2 s late) is dropped
// by the listener after four peer timeouts without progress. Both sides say so: the listener's accept
// fails with SG_ERR_TIMEOUT naming the stall (it used to log it and go on waiting), and the connector
// gets the listener's reason, SG_ERR_TIMEOUT, instead of "bootstrap send: Broken pipe" as
// SG_ERR_PEER_LOST.
TEST(Bootstrap, AStalledHandshakeIsReportedAsATimeoutOnBothSides) {
    sg_context_t a = make_with_peer_timeout(300);
    ASSERT_NE(a, nullptr);
    sg_context_t b = make();
    sg_listener_t l = nullptr;
    ASSERT_EQ(sg_listener_create(a, "127.0.0.1", 0, &l, nullptr), SG_OK);
    uint16_t port = 0;
    sg_listener_port(l, &port);
    SlowRelay relay(port, std::chrono::milliseconds(0), std::chrono::milliseconds(2000));
    sg_session_t sa = nullptr, sb = nullptr;
    sg_status_t connected = SG_IN_PROGRESS;
    std::string connect_error;
    std::thread peer([&] {
        connected = sg_session_connect(b, "127.0.0.1", relay.port, nullptr, sgtest::wait_ns(20 * kSecond), &sb, nullptr);
        connect_error = sg_last_error_message();
    });
    const auto start = Clock::now();
    const sg_status_t accepted = sg_session_accept(l, nullptr, sgtest::wait_ns(15 * kSecond), &sa, nullptr);
    const auto took = Clock::now() - start;
    const std::string accept_error = sg_last_error_message();
    peer.join();
    EXPECT_EQ(accepted, SG_ERR_TIMEOUT) << accept_error;
    EXPECT_NE(accept_error.find("stalled"), std::string::npos) << accept_error;
    EXPECT_GE(took, std::chrono::milliseconds(4 * 300));
    EXPECT_LT(took, std::chrono::seconds(10)) << "the accept call waited for its own timeout instead";
    EXPECT_EQ(connected, SG_ERR_TIMEOUT) << connect_error;
    EXPECT_NE(connect_error.find("gave up the bootstrap handshake"), std::string::npos) << connect_error;
    EXPECT_EQ(sa, nullptr);
    EXPECT_EQ(sb, nullptr);
    EXPECT_EQ(open_sessions(a), 0u);
    EXPECT_EQ(open_sessions(b), 0u);
    sg_listener_destroy(l);
    sg_context_destroy(a);
    sg_context_destroy(b);
}

// A connection that never says a word is dropped after four peer timeouts without progress, told
// why (a live connector that was only descheduled reports SG_ERR_TIMEOUT when it wakes), and is
// nobody's failed bootstrap: the accept call goes on waiting and ends on its own timeout.
TEST(Bootstrap, ASilentConnectionIsToldWhyItIsDroppedAndTheAcceptGoesOn) {
    sg_context_t a = make_with_peer_timeout(200);
    ASSERT_NE(a, nullptr);
    sg_listener_t l = nullptr;
    ASSERT_EQ(sg_listener_create(a, "127.0.0.1", 0, &l, nullptr), SG_OK);
    uint16_t port = 0;
    sg_listener_port(l, &port);
    const int silent = connect_to(port);
    std::string got;
    std::thread reader([&] {
        char buf[4096];
        for (ssize_t n; (n = ::recv(silent, buf, sizeof buf, 0)) > 0;) got.append(buf, size_t(n));
    });
    sg_session_t s = nullptr;
    const auto start = Clock::now();
    EXPECT_EQ(sg_session_accept(l, nullptr, 3 * kSecond, &s, nullptr), SG_ERR_TIMEOUT);
    EXPECT_NE(std::string(sg_last_error_message()).find("waiting for a peer"), std::string::npos) << sg_last_error_message();
    EXPECT_GE(Clock::now() - start, std::chrono::seconds(3));
    reader.join();  // the listener closed it
    EXPECT_NE(got.find("the listener dropped it"), std::string::npos) << "no reason among " << got.size() << " bytes";
    ::close(silent);
    sg_listener_destroy(l);
    sg_context_destroy(a);
}

// The connecting side asks for shm; the accepting context has only tcp. Before both sides reported
// their outcome, the connector failed with SG_ERR_NO_PROVIDER while the acceptor got SG_OK and a
// half-open session.
TEST(Bootstrap, AProviderMismatchFailsBothSidesAndLeavesNoSession) {
    sg_context_t a = make("tcp"), b = make(nullptr);
    sg_listener_t l = nullptr;
    ASSERT_EQ(sg_listener_create(a, "127.0.0.1", 0, &l, nullptr), SG_OK);
    uint16_t port = 0;
    sg_listener_port(l, &port);
    sg_session_options_t so;
    sg_session_options_init(&so);
    so.provider = "shm";
    sg_session_t sa = nullptr, sb = nullptr;
    sg_status_t connected = SG_IN_PROGRESS;
    std::thread peer([&] { connected = sg_session_connect(b, "127.0.0.1", port, &so, sgtest::wait_ns(5 * kSecond), &sb, nullptr); });
    sg_error_info_t err;
    sg_error_info_init(&err);
    const sg_status_t accepted = sg_session_accept(l, nullptr, sgtest::wait_ns(5 * kSecond), &sa, &err);
    peer.join();
    EXPECT_EQ(connected, SG_ERR_NO_PROVIDER);
    EXPECT_EQ(accepted, SG_ERR_NO_PROVIDER) << err.message;
    EXPECT_NE(std::string(err.message).find("peer could not open"), std::string::npos) << err.message;
    EXPECT_EQ(sa, nullptr);
    EXPECT_EQ(sb, nullptr);
    EXPECT_EQ(open_sessions(a), 0u);
    EXPECT_EQ(open_sessions(b), 0u);
    // And the two can still make a session that works.
    std::thread again([&] { connected = sg_session_connect(b, "127.0.0.1", port, nullptr, sgtest::wait_ns(5 * kSecond), &sb, nullptr); });
    EXPECT_EQ(sg_session_accept(l, nullptr, sgtest::wait_ns(5 * kSecond), &sa, nullptr), SG_OK) << sg_last_error_message();
    again.join();
    EXPECT_EQ(connected, SG_OK);
    sg_session_destroy(sa);
    sg_session_destroy(sb);
    sg_listener_destroy(l);
    sg_context_destroy(a);
    sg_context_destroy(b);
}

}  // namespace

namespace {

double cpu_seconds() {
    timespec ts{};
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
    return double(ts.tv_sec) + double(ts.tv_nsec) * 1e-9;
}

// With the default provider choice a context also opens shm, whose wait object never fires for a
// peer's writes, so the progress thread napped 1 ms at a time even with no session at all: ~800
// wake-ups a second, ~7% of a core, for nothing.
TEST(Idle, AContextWithNoSessionsCostsAlmostNoCpu) {
    sg_context_t c = make(nullptr);
    ASSERT_NE(c, nullptr);
    std::this_thread::sleep_for(std::chrono::milliseconds(300));  // start-up work done
    const double before = cpu_seconds();
    std::this_thread::sleep_for(std::chrono::seconds(3));
    const double used = cpu_seconds() - before;
    std::printf("[ info ] idle context: %.1f ms of CPU in 3 s (%.2f%% of a core)\n", used * 1000, used / 3 * 100);
    EXPECT_LT(used, 0.06) << "more than 2% of a core while idle";
    sg_context_destroy(c);
}

}  // namespace

namespace {

uint64_t peers_lost(sg_context_t c) {
    sg_context_stats_t s;
    sg_context_stats_init(&s);
    EXPECT_EQ(sg_context_stats(c, &s), SG_OK);
    return s.peers_lost;
}

// Two contexts that close their session and make a new one, again and again. Frames of the old
// session (its Bye above all) used to land on the new one: it started out "peer closed the session"
// in 1-8 rounds of 10, and with metadata blobs the new session failed with PEER_LOST and then
// SG_ERR_DUPLICATE for ~3 s.
void reconnect_rounds(bool blobs) {
    sg_context_t a = make(), b = make();
    sg_listener_t l = nullptr;
    uint16_t port = 0;
    if (!blobs) {
        ASSERT_EQ(sg_listener_create(a, "127.0.0.1", 0, &l, nullptr), SG_OK);
        sg_listener_port(l, &port);
    }
    for (int round = 0; round < 10; ++round) {
        SCOPED_TRACE(round);
        sg_session_t sa = nullptr, sb = nullptr;
        if (blobs) {
            size_t la = 0, lb = 0;
            sg_context_get_metadata(a, nullptr, 0, &la);
            sg_context_get_metadata(b, nullptr, 0, &lb);
            std::vector<uint8_t> ma(la), mb(lb);
            ASSERT_EQ(sg_context_get_metadata(a, ma.data(), la, &la), SG_OK);
            ASSERT_EQ(sg_context_get_metadata(b, mb.data(), lb, &lb), SG_OK);
            ASSERT_EQ(sg_session_from_metadata(a, mb.data(), lb, nullptr, &sa, nullptr), SG_OK) << sg_last_error_message();
            ASSERT_EQ(sg_session_from_metadata(b, ma.data(), la, nullptr, &sb, nullptr), SG_OK) << sg_last_error_message();
            ASSERT_EQ(sg_session_wait_ready(sa, sgtest::wait_ns(5 * kSecond)), SG_OK) << sg_last_error_message();
            ASSERT_EQ(sg_session_wait_ready(sb, sgtest::wait_ns(5 * kSecond)), SG_OK) << sg_last_error_message();
        } else {
            std::thread t([&] { EXPECT_EQ(sg_session_connect(b, "127.0.0.1", port, nullptr, sgtest::wait_ns(5 * kSecond), &sb, nullptr), SG_OK); });
            ASSERT_EQ(sg_session_accept(l, nullptr, sgtest::wait_ns(5 * kSecond), &sa, nullptr), SG_OK) << sg_last_error_message();
            t.join();
        }
        // The new session is healthy: a notification goes both ways, and neither side sees its peer gone.
        const char hi[] = "hi";
        for (sg_session_t s : {sa, sb}) {
            const sg_status_t st = sg_session_notify(s, hi, sizeof hi);
            sg_status_t why = SG_OK;
            char msg[256] = "";
            sg_session_error(s, &why, msg, sizeof msg);
            ASSERT_EQ(st, SG_OK) << (s == sa ? "accepting" : "connecting") << " side: " << msg;
        }
        std::this_thread::sleep_for(std::chrono::milliseconds(50));
        for (sg_session_t s : {sa, sb}) {
            sg_status_t st = SG_OK;
            char msg[256] = "";
            ASSERT_EQ(sg_session_error(s, &st, msg, sizeof msg), SG_OK);
            EXPECT_EQ(st, SG_OK) << msg;
        }
        // Both close at once, as two engines restarting their link would.
        std::thread ca([&] { sg_session_destroy(sa); });
        sg_session_destroy(sb);
        ca.join();
    }
    EXPECT_EQ(peers_lost(a), 0u);
    EXPECT_EQ(peers_lost(b), 0u);
    sg_listener_destroy(l);
    sg_context_destroy(a);
    sg_context_destroy(b);
}

// Both sides rebuild their session from metadata blobs while the other still tears the old one
// down: one side destroys and rebuilds at once, the other 0-45 ms later. The new session comes up
// on both sides or fails on both, and one that came up stays up past a peer timeout (0.4: in 2 of
// 20 runs ready on one side and given up on the other). Not yet: that it always comes up. When the
// side that speaks first rebuilds first, its challenge reaches the other's closed old session and
// is dropped, and the new session fails on both sides after a peer timeout (8 and 9 of 20 rounds in two runs);
// docs/sessions.md tells hosts to destroy on both sides before rebuilding, or to retry.
// SG_RECONNECT_ROUNDS sets the rounds (6).
TEST(Reconnect, BlobSessionsRebuiltDuringTheOldOnesTeardownAgreeOnBothSides) {
    const char *env = std::getenv("SG_RECONNECT_ROUNDS");
    const int rounds = env && *env ? std::atoi(env) : 6;
    sg_context_t a = make(), b = make();
    auto blob = [](sg_context_t c) {
        size_t n = 0;
        sg_context_get_metadata(c, nullptr, 0, &n);
        std::vector<uint8_t> m(n);
        EXPECT_EQ(sg_context_get_metadata(c, m.data(), n, &n), SG_OK);
        return m;
    };
    const std::vector<uint8_t> ma = blob(a), mb = blob(b);
    sg_session_t sa = nullptr, sb = nullptr;
    ASSERT_EQ(sg_session_from_metadata(a, mb.data(), mb.size(), nullptr, &sa, nullptr), SG_OK);
    ASSERT_EQ(sg_session_from_metadata(b, ma.data(), ma.size(), nullptr, &sb, nullptr), SG_OK);
    ASSERT_EQ(sg_session_wait_ready(sa, sgtest::wait_ns(5 * kSecond)), SG_OK) << sg_last_error_message();
    ASSERT_EQ(sg_session_wait_ready(sb, sgtest::wait_ns(5 * kSecond)), SG_OK) << sg_last_error_message();
    int agreed_up = 0;
    for (int round = 0; round < rounds; ++round) {
        SCOPED_TRACE(round);
        // Which side goes first, and how far behind the other is, change from round to round.
        const bool a_first = round % 2 == 0;
        sg_context_t first = a_first ? a : b, second = a_first ? b : a;
        sg_session_t &s_first = a_first ? sa : sb, &s_second = a_first ? sb : sa;
        const std::vector<uint8_t> &to_second = a_first ? mb : ma, &to_first = a_first ? ma : mb;
        ASSERT_EQ(sg_session_destroy(s_first), SG_OK);
        ASSERT_EQ(sg_session_from_metadata(first, to_second.data(), to_second.size(), nullptr, &s_first, nullptr), SG_OK)
            << sg_last_error_message();
        std::this_thread::sleep_for(std::chrono::milliseconds(15 * (round % 4)));
        ASSERT_EQ(sg_session_destroy(s_second), SG_OK);
        ASSERT_EQ(sg_session_from_metadata(second, to_first.data(), to_first.size(), nullptr, &s_second, nullptr), SG_OK)
            << sg_last_error_message();
        const sg_status_t ready_a = sg_session_wait_ready(sa, sgtest::wait_ns(5 * kSecond));
        const sg_status_t ready_b = sg_session_wait_ready(sb, sgtest::wait_ns(5 * kSecond));
        // Past a peer timeout (2 s): a session one side gave up would be lost on the other by now.
        std::this_thread::sleep_for(std::chrono::milliseconds(2300));
        sg_status_t err_a = SG_OK, err_b = SG_OK;
        char msg_a[256] = "", msg_b[256] = "";
        sg_session_error(sa, &err_a, msg_a, sizeof msg_a);
        sg_session_error(sb, &err_b, msg_b, sizeof msg_b);
        const bool up_a = ready_a == SG_OK && err_a == SG_OK, up_b = ready_b == SG_OK && err_b == SG_OK;
        EXPECT_EQ(up_a, up_b) << "a: ready " << sg_status_str(ready_a) << ", now " << msg_a << "; b: ready "
                              << sg_status_str(ready_b) << ", now " << msg_b;
        agreed_up += up_a && up_b;
    }
    std::printf("[ info ] %d of %d rebuilt sessions up on both sides, the rest failed on both\n", agreed_up, rounds);
    // The rounds where the side that does not speak first rebuilds first come up.
    EXPECT_GT(agreed_up, 0);
    sg_session_destroy(sa);
    sg_session_destroy(sb);
    sg_context_destroy(a);
    sg_context_destroy(b);
}

TEST(Reconnect, TenRoundsOverTheListener) { reconnect_rounds(false); }
TEST(Reconnect, TenRoundsWithMetadataBlobs) { reconnect_rounds(true); }

}  // namespace
