// Failures: deadlines, and a peer killed with SIGKILL at five points. The survivor must learn it
// within 3 s (peer_timeout_ms defaults to 2000; a broken connection is noticed sooner) and its
// transfer and session must report SG_ERR_PEER_LOST.
#include "support/pair_harness.hpp"
#include "support/test_time.hpp"
#include "support/host_pool.hpp"

#include <arpa/inet.h>
#include <dirent.h>
#include <malloc.h>
#include <netinet/in.h>
#include <sys/socket.h>

#include <atomic>
#include <csignal>

#include <chrono>
#include <vector>

namespace {

// These tests time peer-loss detection: the default timeout, whatever the environment asks.
constexpr uint32_t kDetectMs = 2000;

using sgtest::kSecond;

// 2 KV heads of 64, 16-token blocks; layer l's K elements hold l and its V elements l + 100.
struct SmallPool : sgtest::HostPool {
    explicit SmallPool(uint32_t layers, uint64_t blocks = 64) : HostPool({layers, 2, 64, 16, blocks}) {
        for (uint32_t l = 0; l < layers; ++l) {
            std::fill(k[l].begin(), k[l].end(), uint16_t(l));
            std::fill(v[l].begin(), v[l].end(), uint16_t(l + 100));
        }
    }
};

int open_fds() {
    int n = 0;
    if (DIR *d = opendir("/proc/self/fd")) {
        while (readdir(d)) n++;
        closedir(d);
    }
    return n;
}

double seconds_since(std::chrono::steady_clock::time_point t0) {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

TEST(Failure, DeadlineFailsBothSides) {
    sg_context_t a = sgtest::make_context("tcp", 0, kDetectMs), b = sgtest::make_context("tcp", 0, kDetectMs);
    ASSERT_TRUE(a && b);
    sg_listener_t l = nullptr;
    ASSERT_EQ(sg_listener_create(a, "127.0.0.1", 0, &l, nullptr), SG_OK);
    uint16_t port = 0;
    sg_listener_port(l, &port);
    sg_session_t sa = nullptr, sb = nullptr;
    std::thread t([&] { EXPECT_EQ(sg_session_connect(b, "127.0.0.1", port, nullptr, sgtest::wait_ns(5 * kSecond), &sb, nullptr), SG_OK); });
    ASSERT_EQ(sg_session_accept(l, nullptr, sgtest::wait_ns(5 * kSecond), &sa, nullptr), SG_OK);
    t.join();
    SmallPool ps(4), pd(4);
    sg_kv_handle_t ks = nullptr, kd = nullptr;
    ASSERT_EQ(sg_kv_register(a, &ps.layout, &ks, nullptr), SG_OK);
    ASSERT_EQ(sg_kv_register(b, &pd.layout, &kd, nullptr), SG_OK);
    ASSERT_EQ(sg_session_export_kv(sa, ks), SG_OK);
    ASSERT_EQ(sg_session_export_kv(sb, kd), SG_OK);
    const uint32_t table[2] = {0, 1};
    sg_transfer_options_t o;
    sg_transfer_options_init(&o);
    o.deadline_ns = 200000000;  // 200 ms, and no layer is ever written
    sg_transfer_t x = nullptr, y = nullptr;
    ASSERT_EQ(sg_transfer_expect(sb, "late", kd, table, 2, 32, nullptr, &y, nullptr), SG_OK);
    const auto t0 = std::chrono::steady_clock::now();
    ASSERT_EQ(sg_transfer_post(sa, "late", ks, table, 2, 32, &o, &x, nullptr), SG_OK);
    EXPECT_EQ(sg_transfer_wait(x, sgtest::wait_ns(5 * kSecond)), SG_ERR_DEADLINE);
    const double took = seconds_since(t0);
    EXPECT_GE(took, 0.19);
    EXPECT_LT(took, 1.0);
    EXPECT_EQ(sg_transfer_wait(y, sgtest::wait_ns(5 * kSecond)), SG_ERR_DEADLINE);
    std::printf("[ info ] deadline 200 ms reported after %.0f ms\n", took * 1000);
    // The session itself stays healthy.
    sg_status_t st = SG_ERR_INTERNAL;
    ASSERT_EQ(sg_session_error(sa, &st, nullptr, 0), SG_OK);
    EXPECT_EQ(st, SG_OK);
    sg_transfer_release(x);
    sg_transfer_release(y);
    sg_listener_destroy(l);
    sg_context_destroy(a);
    sg_context_destroy(b);
}

// SIGKILL of either side at five points. The survivor must see SG_ERR_PEER_LOST on the session
// (and on its transfer when that was still running) within 3 s, reach the quiesced state, and after
// destroying its session and context be back at its baseline of descriptors, memory mappings and
// heap bytes in use. SIGPIPE keeps its default disposition: a send to the dead peer must not raise
// it.
enum class Point { Handshake, FirstLayer, MidTransfer, LastLayer, Release };
const char *point_name(Point p) {
    switch (p) {
    case Point::Handshake: return "handshake";
    case Point::FirstLayer: return "first layer";
    case Point::MidTransfer: return "mid-transfer";
    case Point::LastLayer: return "last layer";
    case Point::Release: return "release";
    }
    return "?";
}

struct KillCase {
    bool kill_decode;  // the victim is the decode side (else prefill)
    Point point;
};

constexpr uint32_t kLayers = 4;
// Layers the prefill side writes before the victim is killed, by point.
uint32_t layers_before(Point p) {
    switch (p) {
    case Point::Handshake: return 0;
    case Point::FirstLayer: return 1;
    case Point::MidTransfer: return 2;
    case Point::LastLayer: return kLayers;
    case Point::Release: return 2;
    }
    return 0;
}

int count_maps() {
    FILE *f = std::fopen("/proc/self/maps", "r");
    int n = 0;
    for (int c; f && (c = std::fgetc(f)) != EOF;) n += c == '\n';
    if (f) std::fclose(f);
    return n;
}

size_t heap_in_use() {
    const struct mallinfo2 m = mallinfo2();
    return m.uordblks + m.hblkhd;
}

// The victim: a whole SmartGen process of the given role, or at the handshake point a process that
// dies halfway through the bootstrap exchange. Signals `ready` at its point, then waits for the kill.
[[noreturn]] void run_victim(const KillCase &c, int port_fd, int ready_fd) {
    alarm(60);
    const char one = 1;
    if (c.point == Point::Handshake) {
        // Half a frame header of the bootstrap, then death: the survivor is mid-exchange.
        const int fd = socket(AF_INET, SOCK_STREAM, 0);
        sockaddr_in sa{};
        sa.sin_family = AF_INET;
        sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
        if (c.kill_decode) {  // the decode side connects to the survivor's listener
            uint16_t port = 0;
            if (read(port_fd, &port, sizeof port) != sizeof port) _exit(3);
            sa.sin_port = htons(port);
            CHILD_CHECK(connect(fd, reinterpret_cast<sockaddr *>(&sa), sizeof sa) == 0, "connect");
            CHILD_CHECK(write(fd, "SGW1\1\0\0\0", 8) == 8, "write");
        } else {  // the prefill side listens and the survivor connects
            socklen_t len = sizeof sa;
            CHILD_CHECK(bind(fd, reinterpret_cast<sockaddr *>(&sa), sizeof sa) == 0 && listen(fd, 1) == 0 &&
                            getsockname(fd, reinterpret_cast<sockaddr *>(&sa), &len) == 0,
                        "listen");
            const uint16_t port = ntohs(sa.sin_port);
            CHILD_CHECK(write(port_fd, &port, sizeof port) == sizeof port, "port");
            const int c2 = accept(fd, nullptr, nullptr);
            char buf[8];
            CHILD_CHECK(c2 >= 0 && read(c2, buf, sizeof buf) > 0, "accept");
        }
        (void)!write(ready_fd, &one, 1);
        pause();
        _exit(0);
    }
    uint16_t port = 0;
    if (read(port_fd, &port, sizeof port) != sizeof port) _exit(3);
    sg_context_t ctx = sgtest::make_context("tcp", 0, kDetectMs);
    CHILD_CHECK(ctx, "context");
    sg_session_t s = nullptr;
    CHILD_CHECK(sg_session_connect(ctx, "127.0.0.1", port, nullptr, sgtest::wait_ns(5 * kSecond), &s, nullptr) == SG_OK, "connect");
    SmallPool pool(kLayers);
    sg_kv_handle_t kv = nullptr;
    CHILD_CHECK(sg_kv_register(ctx, &pool.layout, &kv, nullptr) == SG_OK, "register");
    CHILD_CHECK(sg_session_export_kv(s, kv) == SG_OK, "export");
    const uint32_t table[4] = {3, 2, 1, 0};
    sg_transfer_t x = nullptr;
    const uint32_t upto = layers_before(c.point);
    if (c.kill_decode) {
        CHILD_CHECK(sg_transfer_expect(s, "doomed", kv, table, 4, 64, nullptr, &x, nullptr) == SG_OK, "expect");
        CHILD_CHECK(sg_transfer_wait_layer(x, upto - 1, sgtest::wait_ns(5 * kSecond)) == SG_OK, "layer %u", upto - 1);
    } else {
        CHILD_CHECK(sg_transfer_post(s, "doomed", kv, table, 4, 64, nullptr, &x, nullptr) == SG_OK, "post");
        for (uint32_t l = 0; l < upto; ++l) CHILD_CHECK(sg_transfer_layer_written(x, l, nullptr) == SG_OK, "write %u", l);
        CHILD_CHECK(sg_transfer_wait_layer(x, upto - 1, sgtest::wait_ns(5 * kSecond)) == SG_OK, "layer %u sent", upto - 1);
    }
    if (c.point == Point::Release) {
        CHILD_CHECK(sg_transfer_cancel(x) == SG_OK, "cancel");
        (void)!write(ready_fd, &one, 1);
        sg_transfer_release(x);  // killed in here or just after
        pause();
    }
    (void)!write(ready_fd, &one, 1);
    pause();
    _exit(0);
}

void warm_up() {
    sg_context_t a = sgtest::make_context("tcp", 0, kDetectMs), b = sgtest::make_context("tcp", 0, kDetectMs);
    size_t la = 0, lb = 0;
    sg_context_get_metadata(a, nullptr, 0, &la);
    sg_context_get_metadata(b, nullptr, 0, &lb);
    std::vector<uint8_t> ma(la), mb(lb);
    sg_context_get_metadata(a, ma.data(), la, &la);
    sg_context_get_metadata(b, mb.data(), lb, &lb);
    sg_session_t sa = nullptr, sb = nullptr;
    sg_session_from_metadata(a, mb.data(), lb, nullptr, &sa, nullptr);
    sg_session_from_metadata(b, ma.data(), la, nullptr, &sb, nullptr);
    {
        SmallPool src(kLayers), dst(kLayers);
        sg_kv_handle_t ks = nullptr, kd = nullptr;
        sg_kv_register(a, &src.layout, &ks, nullptr);
        sg_kv_register(b, &dst.layout, &kd, nullptr);
        sg_session_export_kv(sa, ks);
        sg_session_export_kv(sb, kd);
        const uint32_t table[4] = {0, 1, 2, 3};
        sg_transfer_options_t all;
        sg_transfer_options_init(&all);
        all.flags = SG_TRANSFER_ALL_LAYERS_WRITTEN;
        sg_transfer_t x = nullptr, y = nullptr;
        sg_transfer_expect(sb, "warm", kd, table, 4, 64, nullptr, &y, nullptr);
        sg_transfer_post(sa, "warm", ks, table, 4, 64, &all, &x, nullptr);
        EXPECT_EQ(sg_transfer_wait(y, sgtest::wait_ns(5 * kSecond)), SG_OK);
        sg_transfer_release(x);
        sg_transfer_release(y);
        sg_session_destroy(sa);
        sg_session_destroy(sb);
        sg_kv_deregister(ks);
        sg_kv_deregister(kd);
    }
    sg_context_destroy(a);
    sg_context_destroy(b);
}

class KillAt : public ::testing::TestWithParam<KillCase> {};

TEST_P(KillAt, SurvivorSeesPeerLostWithin3sAndReturnsToBaseline) {
    const KillCase c = GetParam();
    ASSERT_EQ(signal(SIGPIPE, SIG_DFL), SIG_DFL) << "the test must run with SIGPIPE's default disposition";
    int port_pipe[2], ready_pipe[2];
    ASSERT_EQ(pipe(port_pipe), 0);
    ASSERT_EQ(pipe(ready_pipe), 0);
    // Fork before this process makes any SmartGen call.
    const pid_t victim = fork();
    if (victim == 0) {
        run_victim(c, c.point == Point::Handshake && !c.kill_decode ? port_pipe[1] : port_pipe[0], ready_pipe[1]);
    }
    // A throwaway session with one transfer, in this process, pays for what libfabric, the
    // allocators and the runtime set up once per process; the baseline is taken after it.
    warm_up();
    const int fds_before = open_fds(), maps_before = count_maps();
    const size_t heap_before = heap_in_use();
    std::chrono::steady_clock::time_point killed_at;
    std::atomic<bool> killed{false};
    std::thread killer([&] {
        char one;
        if (read(ready_pipe[0], &one, 1) == 1) {
            kill(victim, SIGKILL);
            waitpid(victim, nullptr, 0);
            killed_at = std::chrono::steady_clock::now();
            killed = true;
        }
    });
    sg_context_t ctx = sgtest::make_context("tcp", 0, kDetectMs);
    ASSERT_TRUE(ctx);
    sg_session_t s = nullptr;
    sg_error_info_t err;
    sg_error_info_init(&err);
    if (c.point == Point::Handshake) {
        sg_status_t st;
        if (c.kill_decode) {
            sg_listener_t lis = nullptr;
            ASSERT_EQ(sg_listener_create(ctx, "127.0.0.1", 0, &lis, nullptr), SG_OK);
            uint16_t port = 0;
            sg_listener_port(lis, &port);
            ASSERT_EQ(write(port_pipe[1], &port, sizeof port), ssize_t(sizeof port));
            st = sg_session_accept(lis, nullptr, sgtest::wait_ns(5 * kSecond), &s, &err);
            sg_listener_destroy(lis);
        } else {
            uint16_t port = 0;
            ASSERT_EQ(read(port_pipe[0], &port, sizeof port), ssize_t(sizeof port));
            st = sg_session_connect(ctx, "127.0.0.1", port, nullptr, sgtest::wait_ns(5 * kSecond), &s, &err);
        }
        killer.join();
        ASSERT_TRUE(killed);
        const double took = seconds_since(killed_at);
        EXPECT_EQ(st, SG_ERR_PEER_LOST) << err.message;
        EXPECT_LT(took, 3.0);
        std::printf("[ info ] %s killed at the handshake: the bootstrap failed %.0f ms later (%s)\n",
                    c.kill_decode ? "decode" : "prefill", took * 1000, err.message);
    } else {
        sg_listener_t lis = nullptr;
        ASSERT_EQ(sg_listener_create(ctx, "127.0.0.1", 0, &lis, nullptr), SG_OK);
        uint16_t port = 0;
        sg_listener_port(lis, &port);
        ASSERT_EQ(write(port_pipe[1], &port, sizeof port), ssize_t(sizeof port));
        ASSERT_EQ(sg_session_accept(lis, nullptr, sgtest::wait_ns(5 * kSecond), &s, &err), SG_OK) << err.message;
        sg_listener_destroy(lis);
        SmallPool pool(kLayers);
        sg_kv_handle_t kv = nullptr;
        ASSERT_EQ(sg_kv_register(ctx, &pool.layout, &kv, nullptr), SG_OK);
        ASSERT_EQ(sg_session_export_kv(s, kv), SG_OK);
        const uint32_t table[4] = {0, 1, 2, 3};
        sg_transfer_t x = nullptr;
        const uint32_t upto = layers_before(c.point);
        if (c.kill_decode) {
            ASSERT_EQ(sg_transfer_post(s, "doomed", kv, table, 4, 64, nullptr, &x, nullptr), SG_OK);
            for (uint32_t l = 0; l < upto; ++l) ASSERT_EQ(sg_transfer_layer_written(x, l, nullptr), SG_OK);
        } else {
            ASSERT_EQ(sg_transfer_expect(s, "doomed", kv, table, 4, 64, nullptr, &x, nullptr), SG_OK);
        }
        killer.join();
        ASSERT_TRUE(killed);
        // More work toward the dead peer, where there is any left.
        if (c.kill_decode)
            for (uint32_t l = upto; l < kLayers; ++l) EXPECT_EQ(sg_transfer_layer_written(x, l, nullptr), SG_OK);
        sg_status_t st = SG_OK;
        char msg[256] = "";
        while (seconds_since(killed_at) < 5.0) {
            ASSERT_EQ(sg_session_error(s, &st, msg, sizeof msg), SG_OK);
            if (st != SG_OK) break;
            std::this_thread::sleep_for(std::chrono::milliseconds(2));
        }
        const double took = seconds_since(killed_at);
        EXPECT_EQ(st, SG_ERR_PEER_LOST) << msg;
        EXPECT_LT(took, 3.0);
        const sg_status_t xs = sg_transfer_wait(x, sgtest::wait_ns(5 * kSecond));
        if (c.point == Point::LastLayer)
            EXPECT_TRUE(xs == SG_OK || xs == SG_ERR_PEER_LOST) << sg_status_str(xs);
        else if (c.point == Point::Release)
            EXPECT_TRUE(xs == SG_ERR_CANCELED || xs == SG_ERR_PEER_LOST) << sg_status_str(xs);
        else
            EXPECT_EQ(xs, SG_ERR_PEER_LOST);
        EXPECT_EQ(sg_transfer_wait_quiesced(x, kSecond), SG_OK);
        std::printf("[ info ] %s killed at %s: session lost %.0f ms later (%s); transfer %s\n",
                    c.kill_decode ? "decode" : "prefill", point_name(c.point), took * 1000, msg, sg_status_str(xs));
        EXPECT_EQ(sg_transfer_release(x), SG_OK);
        EXPECT_EQ(sg_session_destroy(s), SG_OK);
        EXPECT_EQ(sg_kv_deregister(kv), SG_OK);
    }
    EXPECT_EQ(sg_context_destroy(ctx), SG_OK);
    for (int fd : {port_pipe[0], port_pipe[1], ready_pipe[0], ready_pipe[1]}) close(fd);
    EXPECT_EQ(open_fds(), fds_before - 4) << "descriptors left open after the session and context were destroyed";
#if !defined(__SANITIZE_ADDRESS__) && !defined(__SANITIZE_THREAD__)
    // A sanitizer's allocator maps and keeps memory its own way (LeakSanitizer checks leaks there).
    EXPECT_EQ(count_maps(), maps_before) << "memory mappings left after the session and context were destroyed";
    const size_t heap_after = heap_in_use();
    EXPECT_LT(heap_after, heap_before + (256u << 10)) << "heap in use grew from " << heap_before << " to " << heap_after;
#else
    (void)maps_before;
    (void)heap_before;
#endif
}

std::vector<KillCase> all_kill_cases() {
    std::vector<KillCase> v;
    for (bool d : {true, false})
        for (Point p : {Point::Handshake, Point::FirstLayer, Point::MidTransfer, Point::LastLayer, Point::Release})
            v.push_back({d, p});
    return v;
}

std::string kill_case_name(const ::testing::TestParamInfo<KillCase> &info) {
    std::string n = std::string(info.param.kill_decode ? "Decode" : "Prefill") + "_" + point_name(info.param.point);
    for (char &ch : n)
        if (ch == ' ' || ch == '-') ch = '_';
    return n;
}

INSTANTIATE_TEST_SUITE_P(Failure, KillAt, ::testing::ValuesIn(all_kill_cases()), kill_case_name);

}  // namespace
