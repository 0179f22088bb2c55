// Authentication through the public API: the pre-shared key, both bootstrap paths, refusals with
// their own statuses on both sides, the key file, and the counters.
#include <smartgen/smartgen.h>
#include "support/test_time.hpp"

#include "../test_key.h"

#include <gtest/gtest.h>

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

namespace {

constexpr uint64_t kSecond = 1000000000ull;

struct Options {
    sg_context_options_t o;
    Options() {
        sg_context_options_init(&o);
        o.provider = "tcp";
        o.log_level = SG_LOG_OFF;  // the refusals below are expected
    }
};

sg_context_t make(const char *key, bool allow_unauthenticated = false) {
    Options opt;
    if (key) {
        opt.o.auth_key = key;
        opt.o.auth_key_len = std::strlen(key);
    }
    opt.o.allow_unauthenticated = allow_unauthenticated;
    sg_context_t c = nullptr;
    EXPECT_EQ(sg_context_create(&opt.o, &c, nullptr), SG_OK) << sg_last_error_message();
    return c;
}

struct Outcome {
    sg_status_t accept = SG_OK, connect = SG_OK;
    std::string accept_msg, connect_msg;
};

// Bootstraps b to a over TCP and reports what each side got.
Outcome bootstrap(sg_context_t a, sg_context_t b) {
    sg_listener_t l = nullptr;
    EXPECT_EQ(sg_listener_create(a, "127.0.0.1", 0, &l, nullptr), SG_OK);
    uint16_t port = 0;
    sg_listener_port(l, &port);
    Outcome out;
    sg_session_t sa = nullptr, sb = nullptr;
    std::thread t([&] {
        sg_error_info_t err;
        sg_error_info_init(&err);
        out.connect = sg_session_connect(b, "127.0.0.1", port, nullptr, sgtest::wait_ns(5 * kSecond), &sb, &err);
        out.connect_msg = err.message;
    });
    sg_error_info_t err;
    sg_error_info_init(&err);
    out.accept = sg_session_accept(l, nullptr, sgtest::wait_ns(5 * kSecond), &sa, &err);
    out.accept_msg = err.message;
    t.join();
    sg_session_destroy(sa);
    sg_session_destroy(sb);
    sg_listener_destroy(l);
    return out;
}

uint64_t auth_failures(sg_context_t c) {
    sg_context_stats_t s;
    sg_context_stats_init(&s);
    EXPECT_EQ(sg_context_stats(c, &s), SG_OK);
    return s.auth_failures;
}

TEST(Auth, SameKeyMakesASessionOverBootstrap) {
    sg_context_t a = make(sg_test_auth_key), b = make(sg_test_auth_key);
    const Outcome r = bootstrap(a, b);
    EXPECT_EQ(r.accept, SG_OK) << r.accept_msg;
    EXPECT_EQ(r.connect, SG_OK) << r.connect_msg;
    EXPECT_EQ(auth_failures(a), 0u);
    sg_context_destroy(a);
    sg_context_destroy(b);
}

TEST(Auth, DifferentKeysAreRefusedOnBothSides) {
    sg_context_t a = make(sg_test_auth_key), b = make("a-different-key-that-is-long-enough-0123");
    const Outcome r = bootstrap(a, b);
    EXPECT_EQ(r.accept, SG_ERR_AUTH_FAILED) << r.accept_msg;
    EXPECT_EQ(r.connect, SG_ERR_AUTH_FAILED) << r.connect_msg;
    EXPECT_NE(r.accept_msg.find("different keys"), std::string::npos) << r.accept_msg;
    EXPECT_EQ(auth_failures(a), 1u);
    EXPECT_EQ(auth_failures(b), 1u);
    sg_context_destroy(a);
    sg_context_destroy(b);
}

TEST(Auth, AKeylessPeerIsRefusedOnBothSides) {
    sg_context_t keyed = make(sg_test_auth_key), open = make(nullptr, true);
    Outcome r = bootstrap(keyed, open);
    EXPECT_EQ(r.accept, SG_ERR_AUTH_REQUIRED) << r.accept_msg;
    EXPECT_EQ(r.connect, SG_ERR_AUTH_REQUIRED) << r.connect_msg;
    r = bootstrap(open, keyed);
    EXPECT_EQ(r.accept, SG_ERR_AUTH_REQUIRED) << r.accept_msg;
    EXPECT_EQ(r.connect, SG_ERR_AUTH_REQUIRED) << r.connect_msg;
    // The same holds for metadata blobs, refused when loaded.
    size_t len = 0;
    sg_context_get_metadata(open, nullptr, 0, &len);
    std::vector<uint8_t> blob(len);
    ASSERT_EQ(sg_context_get_metadata(open, blob.data(), len, &len), SG_OK);
    sg_session_t s = nullptr;
    EXPECT_EQ(sg_session_from_metadata(keyed, blob.data(), len, nullptr, &s, nullptr), SG_ERR_AUTH_REQUIRED);
    sg_context_destroy(keyed);
    sg_context_destroy(open);
}

TEST(Auth, TwoUnauthenticatedContextsWorkOnlyWhenAllowed) {
    Options opt;
    sg_context_t c = nullptr;
    sg_error_info_t err;
    sg_error_info_init(&err);
    EXPECT_EQ(sg_context_create(&opt.o, &c, &err), SG_ERR_AUTH_REQUIRED);
    EXPECT_NE(std::string(err.message).find("allow_unauthenticated"), std::string::npos) << err.message;
    sg_context_t a = make(nullptr, true), b = make(nullptr, true);
    const Outcome r = bootstrap(a, b);
    EXPECT_EQ(r.accept, SG_OK) << r.accept_msg;
    EXPECT_EQ(r.connect, SG_OK) << r.connect_msg;
    sg_context_destroy(a);
    sg_context_destroy(b);
}

TEST(Auth, MetadataSessionsProveTheKeyOverTheFabric) {
    sg_context_t a = make(sg_test_auth_key), b = make(sg_test_auth_key);
    size_t la = 0, lb = 0;
    sg_context_get_metadata(a, nullptr, 0, &la);
    sg_context_get_metadata(b, nullptr, 0, &lb);
    std::vector<uint8_t> ma(la), mb(lb);
    ASSERT_EQ(sg_context_get_metadata(a, ma.data(), la, &la), SG_OK);
    ASSERT_EQ(sg_context_get_metadata(b, mb.data(), lb, &lb), SG_OK);
    sg_session_t sa = nullptr, sb = nullptr;
    ASSERT_EQ(sg_session_from_metadata(a, mb.data(), lb, nullptr, &sa, nullptr), SG_OK);
    // Until b loads a's blob, b cannot answer a's challenge: a is not ready.
    EXPECT_EQ(sg_session_wait_ready(sa, 50'000'000), SG_ERR_TIMEOUT);
    ASSERT_EQ(sg_session_from_metadata(b, ma.data(), la, nullptr, &sb, nullptr), SG_OK);
    EXPECT_EQ(sg_session_wait_ready(sa, sgtest::wait_ns(5 * kSecond)), SG_OK) << sg_last_error_message();
    EXPECT_EQ(sg_session_wait_ready(sb, sgtest::wait_ns(5 * kSecond)), SG_OK) << sg_last_error_message();
    // A blob with one bit changed is refused.
    std::vector<uint8_t> bad = mb;
    bad[30] ^= 0x10;
    sg_context_t c = make(sg_test_auth_key);
    sg_session_t sc = nullptr;
    sg_error_info_t err;
    sg_error_info_init(&err);
    EXPECT_EQ(sg_session_from_metadata(c, bad.data(), bad.size(), nullptr, &sc, &err), SG_ERR_AUTH_FAILED) << err.message;
    // A blob cut or padded in transit is malformed, not a question of keys: SG_ERR_PROTOCOL naming
    // the bytes (0.4 answered AUTH_FAILED "carries no signature" for 1,000 trailing bytes).
    std::vector<uint8_t> padded = mb;
    padded.resize(mb.size() + 1000, 0xAB);
    sg_error_info_init(&err);
    EXPECT_EQ(sg_session_from_metadata(c, padded.data(), padded.size(), nullptr, &sc, &err), SG_ERR_PROTOCOL);
    EXPECT_NE(std::string(err.message).find("1000 trailing"), std::string::npos) << err.message;
    std::vector<uint8_t> cut(mb.begin(), mb.end() - 5);
    sg_error_info_init(&err);
    EXPECT_EQ(sg_session_from_metadata(c, cut.data(), cut.size(), nullptr, &sc, &err), SG_ERR_PROTOCOL);
    EXPECT_NE(std::string(err.message).find("cut short"), std::string::npos) << err.message;
    EXPECT_EQ(sc, nullptr);
    sg_session_destroy(sa);
    sg_session_destroy(sb);
    sg_context_destroy(a);
    sg_context_destroy(b);
    sg_context_destroy(c);
}

// SG_AUTH_KEY_FILE names the key when the options give none.
TEST(Auth, KeyFileFromTheEnvironment) {
    char path[] = "/tmp/smartgen-key-XXXXXX";
    const int fd = mkstemp(path);
    ASSERT_GE(fd, 0);
    const std::string key = std::string(sg_test_auth_key) + "\n";  // the newline is not part of it
    ASSERT_EQ(write(fd, key.data(), key.size()), ssize_t(key.size()));
    close(fd);
    ASSERT_EQ(setenv("SG_AUTH_KEY_FILE", path, 1), 0);
    Options opt;
    sg_context_t from_file = nullptr;
    ASSERT_EQ(sg_context_create(&opt.o, &from_file, nullptr), SG_OK) << sg_last_error_message();
    unsetenv("SG_AUTH_KEY_FILE");
    sg_context_t from_option = make(sg_test_auth_key);
    const Outcome r = bootstrap(from_file, from_option);
    EXPECT_EQ(r.accept, SG_OK) << r.accept_msg;
    EXPECT_EQ(r.connect, SG_OK) << r.connect_msg;
    sg_context_destroy(from_file);
    sg_context_destroy(from_option);

    // A key shorter than 32 bytes, or a file that cannot be read, is refused at creation.
    const int fd2 = open(path, O_WRONLY | O_TRUNC);
    ASSERT_EQ(write(fd2, "short", 5), 5);
    close(fd2);
    setenv("SG_AUTH_KEY_FILE", path, 1);
    sg_context_t c = nullptr;
    sg_error_info_t err;
    sg_error_info_init(&err);
    EXPECT_EQ(sg_context_create(&opt.o, &c, &err), SG_ERR_INVALID_ARGUMENT);
    EXPECT_NE(std::string(err.message).find("32"), std::string::npos) << err.message;
    unlink(path);
    EXPECT_EQ(sg_context_create(&opt.o, &c, &err), SG_ERR_INVALID_ARGUMENT);
    EXPECT_NE(std::string(err.message).find(path), std::string::npos) << err.message;
    unsetenv("SG_AUTH_KEY_FILE");
}


// A keyless relay between two listeners that hold the same key (two engines of one cluster): it
// opens a connection to each and copies bytes between them. Before proofs named the prover's role,
// each listener's proof passed at the other and both accepts returned a session nobody asked for.
int connect_loopback(uint16_t port) {
    const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_port = htons(port);
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    EXPECT_EQ(::connect(fd, reinterpret_cast<sockaddr *>(&a), sizeof a), 0);
    return fd;
}

TEST(Auth, ARelayBetweenTwoListenersWithTheSameKeyJoinsNothing) {
    const char *key = "cluster-wide-key-0123456789abcdef-0123";
    sg_context_t a = make(key), b = make(key);
    sg_listener_t la = nullptr, lb = nullptr;
    ASSERT_EQ(sg_listener_create(a, "127.0.0.1", 0, &la, nullptr), SG_OK);
    ASSERT_EQ(sg_listener_create(b, "127.0.0.1", 0, &lb, nullptr), SG_OK);
    uint16_t pa = 0, pb = 0;
    sg_listener_port(la, &pa);
    sg_listener_port(lb, &pb);
    sg_status_t sta = SG_IN_PROGRESS, stb = SG_IN_PROGRESS;
    sg_session_t sa = nullptr, sb = nullptr;
    std::thread ta([&] { sta = sg_session_accept(la, nullptr, sgtest::wait_ns(5 * kSecond), &sa, nullptr); });
    std::thread tb([&] { stb = sg_session_accept(lb, nullptr, sgtest::wait_ns(5 * kSecond), &sb, nullptr); });
    const int fa = connect_loopback(pa), fb = connect_loopback(pb);
    // Relay until either side hangs up (each accept ends by then) or 6 s pass.
    std::vector<uint8_t> buf(65536);
    const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(6);
    for (bool open = true; open && std::chrono::steady_clock::now() < until;) {
        pollfd p[2] = {{fa, POLLIN, 0}, {fb, POLLIN, 0}};
        if (::poll(p, 2, 100) <= 0) continue;
        for (int i = 0; i < 2 && open; ++i) {
            if (!(p[i].revents & (POLLIN | POLLHUP | POLLERR))) continue;
            const ssize_t n = ::recv(p[i].fd, buf.data(), buf.size(), 0);
            if (n <= 0) {
                open = false;
                break;
            }
            (void)!::send(p[1 - i].fd, buf.data(), size_t(n), MSG_NOSIGNAL);
        }
    }
    ta.join();
    tb.join();
    ::close(fa);
    ::close(fb);
    EXPECT_EQ(sta, SG_ERR_AUTH_FAILED);
    EXPECT_EQ(stb, SG_ERR_AUTH_FAILED);
    EXPECT_EQ(sa, nullptr);
    EXPECT_EQ(sb, nullptr);
    sg_session_destroy(sa);
    sg_session_destroy(sb);
    sg_listener_destroy(la);
    sg_listener_destroy(lb);
    sg_context_destroy(a);
    sg_context_destroy(b);
}

}  // namespace
