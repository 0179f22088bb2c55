// Two-process harness for integration tests: forks a peer before any SmartGen call (a context never
// crosses fork), hands it the listener port over a pipe, and collects its verdict.
#pragma once

#include <smartgen/smartgen.h>

#include "../test_key.h"

#include <gtest/gtest.h>

#include <csignal>
#include <cstdlib>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <string>
#include <sys/wait.h>
#include <unistd.h>

namespace sgtest {

// Throws-free check used inside the child process, where gtest assertions cannot report.
#define CHILD_CHECK(cond, ...)                                          \
    do {                                                                \
        if (!(cond)) {                                                  \
            std::fprintf(stderr, "[peer] check failed: %s: ", #cond);   \
            std::fprintf(stderr, __VA_ARGS__);                          \
            std::fprintf(stderr, " (%s)\n", sg_last_error_message());   \
            std::fflush(stderr);                                        \
            _exit(1);                                                   \
        }                                                               \
    } while (0)

constexpr uint64_t kSecond = 1000000000ull;

// peer_timeout_ms: 0 is the library's default (2 s, or SG_PEER_TIMEOUT_MS, which scripts/test.sh
// raises under ThreadSanitizer); tests that time peer-loss detection pass their own.
inline sg_context_t make_context(const char *provider, uint32_t lanes = 0, uint32_t peer_timeout_ms = 0) {
    sg_context_options_t o;
    sg_context_options_init(&o);
    o.provider = provider;
    o.lanes = lanes;
    o.peer_timeout_ms = peer_timeout_ms;
    SG_TEST_USE_KEY(o);
    sg_context_t ctx = nullptr;
    sg_error_info_t err;
    sg_error_info_init(&err);
    if (sg_context_create(&o, &ctx, &err) != SG_OK) {
        std::fprintf(stderr, "context on %s: %s\n", provider ? provider : "auto", err.message);
        return nullptr;
    }
    return ctx;
}

// Runs `peer(port)` in a forked child that must connect to the parent's listener, and
// `self(listener)` in this process. Returns the child's exit status (0 = its checks passed).
inline int run_pair(const std::function<int(uint16_t port)> &peer, const std::function<void(uint16_t *port_out)> &self_listen,
                    const std::function<void()> &self_run) {
    int fds[2];
    if (pipe(fds)) return -1;
    pid_t pid = fork();
    if (pid == 0) {
        close(fds[1]);
        alarm(120);  // a hung peer must not hang the suite
        uint16_t port = 0;
        if (read(fds[0], &port, sizeof port) != sizeof port) _exit(3);
        _exit(peer(port));
    }
    close(fds[0]);
    uint16_t port = 0;
    self_listen(&port);
    (void)!write(fds[1], &port, sizeof port);
    close(fds[1]);
    self_run();
    int status = 0;
    if (::testing::Test::HasFatalFailure()) kill(pid, SIGKILL);
    waitpid(pid, &status, 0);
    if (WIFSIGNALED(status)) return 128 + WTERMSIG(status);
    return WEXITSTATUS(status);
}

}  // namespace sgtest
