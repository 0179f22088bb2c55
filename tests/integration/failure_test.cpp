// Failures: deadlines, and a peer killed with SIGKILL mid-transfer. The survivor must learn it
// within 3 s (peer_timeout_ms defaults to 2000; a broken connection is noticed sooner) and its
// transfer and session must report SG_ERR_PEER_LOST.
#include "pair_harness.hpp"

#include <dirent.h>

#include <chrono>
#include <vector>

namespace {

using sgtest::kSecond;

struct SmallPool {
    std::vector<std::vector<uint16_t>> k, v;
    std::vector<void *> kp, vp;
    sg_kv_layout_t layout;
    explicit SmallPool(uint32_t layers = 4, uint64_t blocks = 64) {
        for (uint32_t l = 0; l < layers; ++l) {
            k.emplace_back(size_t(blocks) * 16 * 2 * 64, uint16_t(l));
            v.emplace_back(size_t(blocks) * 16 * 2 * 64, uint16_t(l + 100));
        }
        for (uint32_t l = 0; l < layers; ++l) {
            kp.push_back(k[l].data());
            vp.push_back(v[l].data());
        }
        sg_kv_layout_init(&layout);
        layout.num_layers = layers;
        layout.num_kv_heads = 2;
        layout.head_dim = 64;
        layout.tokens_per_block = 16;
        layout.num_blocks = blocks;
        layout.layer_k_base = kp.data();
        layout.layer_v_base = vp.data();
        layout.layer_base_count = layers;
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
    sg_context_t a = sgtest::make_context("tcp"), b = sgtest::make_context("tcp");
    ASSERT_TRUE(a && b);
    sg_listener_t l = nullptr;
    ASSERT_EQ(sg_listener_create(a, "127.0.0.1", 0, &l, nullptr), SG_OK);
    uint16_t port = 0;
    sg_listener_port(l, &port);
    sg_session_t sa = nullptr, sb = nullptr;
    std::thread t([&] { EXPECT_EQ(sg_session_connect(b, "127.0.0.1", port, nullptr, 5 * kSecond, &sb, nullptr), SG_OK); });
    ASSERT_EQ(sg_session_accept(l, nullptr, 5 * kSecond, &sa, nullptr), SG_OK);
    t.join();
    SmallPool ps, pd;
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
    EXPECT_EQ(sg_transfer_wait(x, 5 * kSecond), SG_ERR_DEADLINE);
    const double took = seconds_since(t0);
    EXPECT_GE(took, 0.19);
    EXPECT_LT(took, 1.0);
    EXPECT_EQ(sg_transfer_wait(y, 5 * kSecond), SG_ERR_DEADLINE);
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

// The decode process is killed after the first layer arrived; prefill is the survivor.
TEST(Failure, PrefillSurvivesDecodeKilledMidTransfer) {
    // Fork before this process makes any SmartGen call, so the child inherits no library threads
    // or locks.
    int ready_pipe[2];
    ASSERT_EQ(pipe(ready_pipe), 0);
    int fds[2];
    ASSERT_EQ(pipe(fds), 0);
    const pid_t child_pid = fork();
    if (child_pid == 0) {
        close(fds[1]);
        alarm(60);
        uint16_t port = 0;
        if (read(fds[0], &port, sizeof port) != sizeof port) _exit(3);
        sg_context_t c = sgtest::make_context("tcp");
        CHILD_CHECK(c, "context");
        sg_session_t s = nullptr;
        CHILD_CHECK(sg_session_connect(c, "127.0.0.1", port, nullptr, 5 * kSecond, &s, nullptr) == SG_OK, "connect");
        SmallPool dst;
        sg_kv_handle_t kv = nullptr;
        CHILD_CHECK(sg_kv_register(c, &dst.layout, &kv, nullptr) == SG_OK, "register");
        CHILD_CHECK(sg_session_export_kv(s, kv) == SG_OK, "export");
        const uint32_t table[4] = {3, 2, 1, 0};
        sg_transfer_t x = nullptr;
        CHILD_CHECK(sg_transfer_expect(s, "doomed", kv, table, 4, 64, nullptr, &x, nullptr) == SG_OK, "expect");
        CHILD_CHECK(sg_transfer_wait_layer(x, 0, 5 * kSecond) == SG_OK, "layer 0");
        char one = 1;
        (void)!write(ready_pipe[1], &one, 1);
        pause();  // killed here
        _exit(0);
    }
    close(fds[0]);
    // libfabric opens a few process-wide descriptors once; a throwaway context pays for them so
    // the baseline measures what a session's lifetime leaves behind. It counts fds[1] and both
    // ends of ready_pipe, which the test closes itself.
    sg_context_destroy(sgtest::make_context("tcp"));
    const int fds_before = open_fds();
    sg_context_t ctx = sgtest::make_context("tcp");
    ASSERT_TRUE(ctx);
    sg_listener_t lis = nullptr;
    SmallPool pool;
    ASSERT_EQ(sg_listener_create(ctx, "127.0.0.1", 0, &lis, nullptr), SG_OK);
    uint16_t port = 0;
    sg_listener_port(lis, &port);
    (void)!write(fds[1], &port, sizeof port);
    close(fds[1]);
    sg_session_t s = nullptr;
    ASSERT_EQ(sg_session_accept(lis, nullptr, 5 * kSecond, &s, nullptr), SG_OK);
    sg_kv_handle_t kv = nullptr;
    ASSERT_EQ(sg_kv_register(ctx, &pool.layout, &kv, nullptr), SG_OK);
    ASSERT_EQ(sg_session_export_kv(s, kv), SG_OK);
    const uint32_t table[4] = {0, 1, 2, 3};
    sg_transfer_t x = nullptr;
    ASSERT_EQ(sg_transfer_post(s, "doomed", kv, table, 4, 64, nullptr, &x, nullptr), SG_OK);
    ASSERT_EQ(sg_transfer_layer_written(x, 0, nullptr), SG_OK);
    char one;
    ASSERT_EQ(read(ready_pipe[0], &one, 1), 1);  // decode holds layer 0
    kill(child_pid, SIGKILL);
    waitpid(child_pid, nullptr, 0);
    const auto t0 = std::chrono::steady_clock::now();
    ASSERT_EQ(sg_transfer_layer_written(x, 1, nullptr), SG_OK);  // more work toward a dead peer
    EXPECT_EQ(sg_transfer_wait(x, 5 * kSecond), SG_ERR_PEER_LOST) << sg_last_error_message();
    const double took = seconds_since(t0);
    EXPECT_LT(took, 3.0);
    std::printf("[ info ] prefill detected the killed decode process after %.0f ms\n", took * 1000);
    sg_status_t st = SG_OK;
    char msg[256];
    ASSERT_EQ(sg_session_error(s, &st, msg, sizeof msg), SG_OK);
    EXPECT_EQ(st, SG_ERR_PEER_LOST) << msg;
    EXPECT_EQ(sg_transfer_release(x), SG_OK);
    EXPECT_EQ(sg_session_destroy(s), SG_OK);
    sg_kv_deregister(kv);
    sg_listener_destroy(lis);
    EXPECT_EQ(sg_context_destroy(ctx), SG_OK);
    close(ready_pipe[0]);
    close(ready_pipe[1]);
    EXPECT_EQ(open_fds(), fds_before - 3) << "descriptors left open after the session and context were destroyed";
}

// The prefill process is killed between layers; decode is the survivor, waiting for data.
TEST(Failure, DecodeSurvivesPrefillKilledBetweenLayers) {
    // Fork before this process makes any SmartGen call, so the child inherits no library threads
    // or locks; it learns the port through a pipe.
    int fds[2];
    ASSERT_EQ(pipe(fds), 0);
    pid_t child_pid = fork();
    if (child_pid == 0) {
        close(fds[1]);
        alarm(60);
        uint16_t port = 0;
        if (read(fds[0], &port, sizeof port) != sizeof port) _exit(3);
        sg_context_t c = sgtest::make_context("tcp");
        CHILD_CHECK(c, "context");
        sg_session_t s = nullptr;
        CHILD_CHECK(sg_session_connect(c, "127.0.0.1", port, nullptr, 5 * kSecond, &s, nullptr) == SG_OK, "connect");
        SmallPool src;
        sg_kv_handle_t kv = nullptr;
        CHILD_CHECK(sg_kv_register(c, &src.layout, &kv, nullptr) == SG_OK, "register");
        CHILD_CHECK(sg_session_export_kv(s, kv) == SG_OK, "export");
        const uint32_t table[4] = {0, 1, 2, 3};
        sg_transfer_t x = nullptr;
        CHILD_CHECK(sg_transfer_post(s, "orphan", kv, table, 4, 64, nullptr, &x, nullptr) == SG_OK, "post");
        CHILD_CHECK(sg_transfer_layer_written(x, 0, nullptr) == SG_OK, "layer 0");
        pause();  // killed before layer 1
        _exit(0);
    }
    close(fds[0]);
    sg_context_t ctx = sgtest::make_context("tcp");
    ASSERT_TRUE(ctx);
    sg_listener_t lis = nullptr;
    ASSERT_EQ(sg_listener_create(ctx, "127.0.0.1", 0, &lis, nullptr), SG_OK);
    uint16_t port = 0;
    sg_listener_port(lis, &port);
    (void)!write(fds[1], &port, sizeof port);
    close(fds[1]);
    sg_session_t s = nullptr;
    ASSERT_EQ(sg_session_accept(lis, nullptr, 5 * kSecond, &s, nullptr), SG_OK);
    SmallPool pool;
    sg_kv_handle_t kv = nullptr;
    ASSERT_EQ(sg_kv_register(ctx, &pool.layout, &kv, nullptr), SG_OK);
    ASSERT_EQ(sg_session_export_kv(s, kv), SG_OK);
    const uint32_t table[4] = {7, 5, 3, 1};
    sg_transfer_t x = nullptr;
    ASSERT_EQ(sg_transfer_expect(s, "orphan", kv, table, 4, 64, nullptr, &x, nullptr), SG_OK);
    ASSERT_EQ(sg_transfer_wait_layer(x, 0, 5 * kSecond), SG_OK);
    kill(child_pid, SIGKILL);
    waitpid(child_pid, nullptr, 0);
    const auto t0 = std::chrono::steady_clock::now();
    EXPECT_EQ(sg_transfer_wait(x, 5 * kSecond), SG_ERR_PEER_LOST) << sg_last_error_message();
    const double took = seconds_since(t0);
    EXPECT_LT(took, 3.0);
    std::printf("[ info ] decode detected the killed prefill process after %.0f ms\n", took * 1000);
    // Layer 0 stays resident: the engine may keep what arrived.
    uint8_t bits = 0;
    size_t n = 0;
    ASSERT_EQ(sg_transfer_residency(x, 0, &bits, 1, &n), SG_OK);
    EXPECT_EQ(bits, 0x0f);
    sg_transfer_release(x);
    sg_session_destroy(s);
    sg_kv_deregister(kv);
    sg_listener_destroy(lis);
    EXPECT_EQ(sg_context_destroy(ctx), SG_OK);
}

}  // namespace
