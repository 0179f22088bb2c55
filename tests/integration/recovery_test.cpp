// A context stays usable after any peer dies. Over shm a decode process SIGKILLed while the prefill
// side's writes were in flight used to leave them "in flight until the context is destroyed": the
// transfer never quiesced, and the context's operation budget stayed taken, so a new peer's transfer
// on the same pool stayed SG_IN_PROGRESS for 30 s and more (every run). Over tcp it recovered.
#include "support/pair_harness.hpp"
#include "support/test_time.hpp"
#include "support/host_pool.hpp"

#include <atomic>
#include <chrono>
#include <csignal>
#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

namespace {

using sgtest::kSecond;

constexpr uint32_t kLayers = 4, kHeads = 8, kDim = 128, kTpb = 16;
constexpr uint64_t kBlocks = 64;  // 4 MiB a layer

struct Pool : sgtest::HostPool {
    explicit Pool(uint16_t fill) : HostPool({kLayers, kHeads, kDim, kTpb, kBlocks}, fill, uint16_t(fill + 1)) {}
};

std::vector<uint32_t> all_blocks() {
    std::vector<uint32_t> t(kBlocks);
    for (uint32_t i = 0; i < kBlocks; ++i) t[i] = i;
    return t;
}

// The decode process: expects; dies by SIGKILL once the first layer is in place (die = true), or
// checks every byte of a whole transfer.
int decode_peer(const char *provider, uint16_t port, bool die) {
    sg_context_t ctx = sgtest::make_context(provider);
    CHILD_CHECK(ctx, "context");
    Pool pool(0);
    sg_kv_handle_t kv = nullptr;
    CHILD_CHECK(sg_kv_register(ctx, &pool.layout, &kv, nullptr) == SG_OK, "register");
    sg_session_t s = nullptr;
    CHILD_CHECK(sg_session_connect(ctx, "127.0.0.1", port, nullptr, sgtest::wait_ns(10 * kSecond), &s, nullptr) == SG_OK, "connect");
    CHILD_CHECK(sg_session_export_kv(s, kv) == SG_OK, "export");
    const auto table = all_blocks();
    sg_transfer_t t = nullptr;
    CHILD_CHECK(sg_transfer_expect(s, "kv", kv, table.data(), table.size(), kBlocks * kTpb, nullptr, &t, nullptr) == SG_OK,
                "expect");
    if (die) {
        CHILD_CHECK(sg_transfer_wait_layer(t, 0, sgtest::wait_ns(20 * kSecond)) == SG_OK, "layer 0");
        kill(getpid(), SIGKILL);
    }
    CHILD_CHECK(sg_transfer_wait(t, sgtest::wait_ns(20 * kSecond)) == SG_OK, "wait");
    for (uint32_t l = 0; l < kLayers; ++l)
        for (size_t i = 0; i < pool.k[l].size(); ++i) CHILD_CHECK(pool.k[l][i] == 7 && pool.v[l][i] == 8, "byte %zu", i);
    sg_transfer_release(t);
    sg_session_close(s, 5 * kSecond);
    sg_session_destroy(s);
    sg_context_destroy(ctx);
    return 0;
}

void survive_a_killed_decode_side(const char *provider) {
    sg_context_t ctx = sgtest::make_context(provider);
    ASSERT_NE(ctx, nullptr);
    Pool pool(7);
    sg_kv_handle_t kv = nullptr;
    ASSERT_EQ(sg_kv_register(ctx, &pool.layout, &kv, nullptr), SG_OK);
    for (int round = 0; round < 2; ++round) {
        const bool die = round == 0;
        sg_listener_t l = nullptr;
        const int rc = sgtest::run_pair(
            [&](uint16_t port) { return decode_peer(provider, port, die); },
            [&](uint16_t *port) {
                ASSERT_EQ(sg_listener_create(ctx, "127.0.0.1", 0, &l, nullptr), SG_OK);
                sg_listener_port(l, port);
            },
            [&] {
                sg_session_t s = nullptr;
                ASSERT_EQ(sg_session_accept(l, nullptr, sgtest::wait_ns(10 * kSecond), &s, nullptr), SG_OK) << sg_last_error_message();
                ASSERT_EQ(sg_session_export_kv(s, kv), SG_OK);
                const auto table = all_blocks();
                sg_transfer_t t = nullptr;
                ASSERT_EQ(sg_transfer_post(s, "kv", kv, table.data(), table.size(), kBlocks * kTpb, nullptr, &t, nullptr),
                          SG_OK);
                ASSERT_EQ(sg_transfer_layer_written(t, 0, nullptr), SG_OK);
                if (die) {
                    // Give the peer time to see layer 0 and die, then write into a dead process.
                    std::this_thread::sleep_for(std::chrono::milliseconds(300));
                }
                for (uint32_t layer = 1; layer < kLayers; ++layer) ASSERT_EQ(sg_transfer_layer_written(t, layer, nullptr), SG_OK);
                const auto start = std::chrono::steady_clock::now();
                const sg_status_t st = sg_transfer_wait(t, sgtest::wait_ns(20 * kSecond));
                if (die) {
                    EXPECT_EQ(st, SG_ERR_PEER_LOST) << sg_status_str(st);
                    EXPECT_EQ(sg_transfer_wait_quiesced(t, 10 * kSecond), SG_OK)
                        << "the transfer to a killed peer never quiesced: " << sg_last_error_message();
                    EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(10));
                } else {
                    EXPECT_EQ(st, SG_OK) << "a new peer's transfer on the same pool: " << sg_status_str(st);
                    if (st != SG_OK) {
                        std::vector<char> text(1 << 16);
                        size_t len = 0;
                        sg_context_metrics_text(ctx, text.data(), text.size(), &len);
                        ADD_FAILURE() << text.data();
                    }
                }
                EXPECT_EQ(sg_transfer_release(t), SG_OK);
                sg_session_destroy(s);
            });
        EXPECT_EQ(rc, die ? 128 + SIGKILL : 0) << provider << " round " << round;
        sg_listener_destroy(l);
        if (::testing::Test::HasFailure()) break;
    }
    sg_kv_deregister(kv);
    sg_context_destroy(ctx);
}

TEST(Recovery, AContextStaysUsableAfterItsDecodePeerIsKilledMidTransferShm) { survive_a_killed_decode_side("shm"); }

TEST(Recovery, AContextStaysUsableAfterItsDecodePeerIsKilledMidTransferTcp) { survive_a_killed_decode_side("tcp"); }

}  // namespace

namespace {

std::atomic<int> g_sigterm_seen{0};
void on_sigterm(int) { g_sigterm_seen = 1; }

// A process that expects a transfer nobody posts and waits on it; `handler`: installs its own
// SIGTERM handler first. Another thread sends SIGTERM to the process during the wait.
[[noreturn]] void wait_and_get_sigterm(bool handler) {
    alarm(30);
    if (handler) std::signal(SIGTERM, on_sigterm);
    sg_context_t a = sgtest::make_context("tcp"), b = sgtest::make_context("tcp");
    CHILD_CHECK(a && b, "contexts");
    size_t la = 0, lb = 0;
    sg_context_get_metadata(a, nullptr, 0, &la);
    sg_context_get_metadata(b, nullptr, 0, &lb);
    std::vector<uint8_t> ma(la), mb(lb);
    sg_context_get_metadata(a, ma.data(), la, &la);
    sg_context_get_metadata(b, mb.data(), lb, &lb);
    sg_session_t sa = nullptr, sb = nullptr;
    CHILD_CHECK(sg_session_from_metadata(a, mb.data(), lb, nullptr, &sa, nullptr) == SG_OK, "session a");
    CHILD_CHECK(sg_session_from_metadata(b, ma.data(), la, nullptr, &sb, nullptr) == SG_OK, "session b");
    Pool pool(0);
    sg_kv_handle_t kv = nullptr;
    CHILD_CHECK(sg_kv_register(b, &pool.layout, &kv, nullptr) == SG_OK, "register");
    CHILD_CHECK(sg_session_wait_ready(sb, sgtest::wait_ns(5 * kSecond)) == SG_OK, "ready");
    CHILD_CHECK(sg_session_export_kv(sb, kv) == SG_OK, "export");
    const auto table = all_blocks();
    sg_transfer_t t = nullptr;
    CHILD_CHECK(sg_transfer_expect(sb, "never", kv, table.data(), table.size(), kBlocks * kTpb, nullptr, &t, nullptr) == SG_OK,
                "expect");
    std::thread killer([] {
        std::this_thread::sleep_for(std::chrono::milliseconds(200));
        kill(getpid(), SIGTERM);
    });
    for (int i = 0; i < 40 && !g_sigterm_seen; ++i) sg_transfer_wait(t, 50000000ull);
    killer.join();
    _exit(g_sigterm_seen ? 42 : 1);
}

int run_in_child(bool handler, const std::string &dir) {
    const pid_t pid = fork();
    if (pid == 0) {
        if (chdir(dir.c_str()) != 0) _exit(3);
        wait_and_get_sigterm(handler);
    }
    int status = 0;
    waitpid(pid, &status, 0);
    return status;
}

bool dir_has_btr_files(const std::string &dir) {
    const std::string cmd = "ls " + dir + "/*.btr >/dev/null 2>&1";
    return std::system(cmd.c_str()) == 0;
}

// Debian's libfabric loads psm's libinfinipath, whose constructor installed its own SIGTERM,
// SIGINT, SIGSEGV, ... handlers in every host: SIGTERM during sg_transfer_wait wrote .btr files
// and ended in SIGSEGV inside libfabric in 3 of 6 processes.
TEST(Signals, TheHostsSignalDispositionsAreItsOwn) {
    char tmpl[] = "/tmp/sg-signals-XXXXXX";
    ASSERT_NE(mkdtemp(tmpl), nullptr);
    const std::string dir = tmpl;
    const int with_handler = run_in_child(true, dir);
    EXPECT_TRUE(WIFEXITED(with_handler) && WEXITSTATUS(with_handler) == 42) << "status " << with_handler;
    const int without = run_in_child(false, dir);
    EXPECT_TRUE(WIFSIGNALED(without) && WTERMSIG(without) == SIGTERM)
        << "a host without a handler must die of SIGTERM; status " << without;
    EXPECT_FALSE(dir_has_btr_files(dir));
    const std::string rm = "rm -rf " + dir;
    (void)!std::system(rm.c_str());
}

}  // namespace
