// The directory at fleet scale, against a real three-member etcd: P prefill and P decode contexts in
// several processes publish themselves, every decode context looks every prefill name up, each
// decode context opens a session to one prefill context by name and waits until it is
// authenticated; then one in eight prefill engines is killed (its process, SIGKILL) and the parent
// watches their entries vanish. Reports lookups per second and the time from kill to disappearance.
//
// Short form (every CI run): P = 16, in 4 + 2 processes. SG_DIRECTORY_SCALE=64 runs the issue's
// 64 + 64 (8 prefill processes of 8, 4 decode processes of 16).
#include "support/etcd_cluster.hpp"
#include "support/test_time.hpp"
#include "support/pair_harness.hpp"

#include <sys/prctl.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <string>
#include <vector>

namespace {

using sgtest::EtcdCluster;
using sgtest::kSecond;

// The library's default lease: with up to 128 contexts and three etcd members on two cores, a
// keep-alive can be late by more than a second, and a 2 s lease would end under a live engine.
constexpr uint32_t kTtlMs = 5000;
// Up to 2 x 64 contexts, three etcd members and their progress threads share this machine's two
// cores: sessions get a peer timeout that such a crowd cannot miss by starvation alone.
constexpr uint32_t kPeerTimeoutMs = 15000;

uint64_t mono_ns() {
    return uint64_t(std::chrono::duration_cast<std::chrono::nanoseconds>(
                        std::chrono::steady_clock::now().time_since_epoch())
                        .count());
}

sg_directory_t open_dir(const std::string &endpoints, sg_context_t ctx) {
    sg_directory_options_t o;
    sg_directory_options_init(&o);
    o.endpoints = endpoints.c_str();
    o.lease_ttl_ms = kTtlMs;
    o.request_timeout_ms = 2000;
    sg_directory_t d = nullptr;
    for (int attempt = 0; attempt < 100; ++attempt) {
        if (sg_directory_open(ctx, &o, &d, nullptr) == SG_OK) return d;
        usleep(100 * 1000);
    }
    return nullptr;
}

void say(int fd, const std::string &line) { (void)!write(fd, (line + "\n").data(), line.size() + 1); }

// Blocks until the parent closes its end (then the child cleans up and exits).
void wait_for_parent(int fd) {
    char c;
    while (read(fd, &c, 1) > 0) {
    }
}

struct Child {
    pid_t pid = -1;
    int from = -1;  // the child's reports
    int to = -1;    // closed by the parent to let it finish
    std::string buffer;
    // The next line the child wrote (waiting up to the deadline); "" at EOF or timeout.
    std::string line(uint64_t deadline) {
        for (;;) {
            const size_t nl = buffer.find('\n');
            if (nl != std::string::npos) {
                std::string l = buffer.substr(0, nl);
                buffer.erase(0, nl + 1);
                return l;
            }
            if (mono_ns() > deadline) return "";
            fd_set set;
            FD_ZERO(&set);
            FD_SET(from, &set);
            timeval tv{0, 100000};
            if (select(from + 1, &set, nullptr, nullptr, &tv) <= 0) continue;
            char buf[4096];
            const ssize_t n = read(from, buf, sizeof buf);
            if (n <= 0) return "";
            buffer.append(buf, size_t(n));
        }
    }
};

template <class Body>
Child spawn(Body body) {
    int up[2], down[2];
    if (pipe(up) || pipe(down)) return {};
    Child c;
    c.pid = fork();
    if (c.pid == 0) {
        prctl(PR_SET_PDEATHSIG, SIGKILL);  // never outlive a test killed by its timeout
        // Only its own two pipe ends: a sibling's write end held open here would keep that
        // sibling from ever seeing the parent close it.
        for (int fd = 3; fd < 1024; ++fd)
            if (fd != up[1] && fd != down[0]) close(fd);
        body(up[1], down[0]);
        _exit(0);
    }
    close(up[1]);
    close(down[0]);
    c.from = up[0];
    c.to = down[1];
    return c;
}

std::string numbered(const char *role, uint32_t i) {
    std::string name = role;
    name += '/';
    name += std::to_string(i);
    return name;
}
std::string prefill_name(uint32_t i) { return numbered("prefill", i); }

// Contexts role/first .. role/first+count-1, each with its directory handle, published; reports
// "published <seconds inside sg_directory_publish>" (false after reporting an error).
bool publish_engines(const std::string &endpoints, const char *role, uint32_t first, uint32_t count,
                     std::vector<sg_context_t> &ctxs, std::vector<sg_directory_t> &dirs, int out) {
    double publish_s = 0;
    for (uint32_t i = 0; i < count; ++i) {
        ctxs.push_back(sgtest::make_context("tcp", 0, kPeerTimeoutMs));
        dirs.push_back(ctxs.back() ? open_dir(endpoints, ctxs.back()) : nullptr);
        const uint64_t t0 = mono_ns();
        if (!dirs.back() || sg_directory_publish(dirs.back(), numbered(role, first + i).c_str(), 10 * kSecond) != SG_OK) {
            say(out, std::string("error publish ") + sg_last_error_message());
            return false;
        }
        publish_s += double(mono_ns() - t0) / 1e9;
    }
    say(out, "published " + std::to_string(publish_s));
    return true;
}

// Prefill: contexts [first, first + count) publish, then each accepts its one session.
void prefill_process(const std::string &endpoints, uint32_t first, uint32_t count, int out, int in) {
    std::vector<sg_context_t> ctxs;
    std::vector<sg_directory_t> dirs;
    if (!publish_engines(endpoints, "prefill", first, count, ctxs, dirs, out)) return;
    for (uint32_t i = 0; i < count; ++i) {
        sg_session_t s = nullptr;
        if (sg_directory_accept(dirs[i], 60 * kSecond, &s, nullptr) != SG_OK ||
            sg_session_wait_ready(s, sgtest::wait_ns(30 * kSecond)) != SG_OK) {
            say(out, std::string("error accept ") + sg_last_error_message());
            return;
        }
    }
    say(out, "sessions");
    wait_for_parent(in);
    // The process just ends (as the killed one did): closing a fleet's sessions one context at a
    // time, each waiting for a peer that is closing too, would take longer than the test.
}

// Decode: contexts [first, first + count) publish (so the fleet is 2P names), wait for the parent's
// word that every prefill engine is there, look every prefill name up (timed), then each opens a
// session to the prefill context of its own index.
void decode_process(const std::string &endpoints, uint32_t first, uint32_t count, uint32_t prefills, int out, int in) {
    std::vector<sg_context_t> ctxs;
    std::vector<sg_directory_t> dirs;
    if (!publish_engines(endpoints, "decode", first, count, ctxs, dirs, out)) return;
    char go;
    if (read(in, &go, 1) != 1) return;
    std::vector<uint8_t> blob(4096);
    uint64_t lookups = 0;
    const uint64_t t0 = mono_ns();
    for (uint32_t i = 0; i < count; ++i)
        for (uint32_t p = 0; p < prefills; ++p) {
            size_t len = 0;
            if (sg_directory_lookup(dirs[i], prefill_name(p).c_str(), 10 * kSecond, blob.data(), blob.size(), &len) !=
                SG_OK) {
                say(out, "error lookup " + prefill_name(p) + ": " + sg_last_error_message());
                return;
            }
            lookups++;
        }
    const double seconds = double(mono_ns() - t0) / 1e9;
    say(out, "lookups " + std::to_string(lookups) + " " + std::to_string(seconds));
    const uint64_t t1 = mono_ns();
    std::vector<sg_session_t> sessions;
    for (uint32_t i = 0; i < count; ++i) {
        sg_session_t s = nullptr;
        if (sg_directory_connect(dirs[i], prefill_name(first + i).c_str(), nullptr, 10 * kSecond, &s, nullptr) != SG_OK) {
            say(out, std::string("error connect ") + sg_last_error_message());
            return;
        }
        sessions.push_back(s);
    }
    for (auto s : sessions)
        if (sg_session_wait_ready(s, sgtest::wait_ns(30 * kSecond)) != SG_OK) {
            say(out, std::string("error ready ") + sg_last_error_message());
            return;
        }
    say(out, "sessions " + std::to_string(double(mono_ns() - t1) / 1e9));
    wait_for_parent(in);
}

uint32_t fleet_size() {
    const char *env = std::getenv("SG_DIRECTORY_SCALE");
    const long n = env ? std::strtol(env, nullptr, 10) : 16;
    return n >= 8 && n <= 256 ? uint32_t(n / 8 * 8) : 16;
}

TEST(DirectoryScale, AFleetPublishesLooksUpConnectsAndLosesAnEighthOfItsPrefillEngines) {
    if (EtcdCluster::binary().empty()) GTEST_SKIP() << "needs etcd (Debian's etcd-server)";
    EtcdCluster cluster(3);
    const std::string endpoints = cluster.endpoints();
    const uint32_t n = fleet_size();
    const uint32_t prefill_procs = 8, per_prefill = n / prefill_procs;  // one process = an eighth
    const uint32_t decode_procs = n >= 64 ? 4 : 2, per_decode = n / decode_procs;
    std::vector<Child> prefill, decode;
    const uint64_t t_start = mono_ns();
    for (uint32_t p = 0; p < prefill_procs; ++p)
        prefill.push_back(spawn([&](int out, int in) { prefill_process(endpoints, p * per_prefill, per_prefill, out, in); }));
    for (uint32_t p = 0; p < decode_procs; ++p)
        decode.push_back(spawn([&](int out, int in) { decode_process(endpoints, p * per_decode, per_decode, n, out, in); }));
    const uint64_t deadline = mono_ns() + (60 + 2 * uint64_t(n)) * kSecond;
    double publish_total_s = 0;  // inside sg_directory_publish, summed over the fleet
    for (auto *group : {&prefill, &decode})
        for (Child &c : *group) {
            const std::string l = c.line(deadline);
            ASSERT_EQ(l.rfind("published ", 0), 0u) << l << cluster.log(0);
            publish_total_s += std::atof(l.c_str() + 10);
        }
    const double ready_s = double(mono_ns() - t_start) / 1e9;
    for (Child &c : decode) ASSERT_EQ(write(c.to, "g", 1), 1);

    uint64_t lookups = 0;
    double slowest = 0;
    for (Child &c : decode) {
        const std::string l = c.line(deadline);
        ASSERT_EQ(l.rfind("lookups ", 0), 0u) << l;
        unsigned long long k = 0;
        double s = 0;
        ASSERT_EQ(std::sscanf(l.c_str(), "lookups %llu %lf", &k, &s), 2) << l;
        lookups += k;
        slowest = std::max(slowest, s);
    }
    double connect_s = 0;
    for (Child &c : decode) {
        const std::string l = c.line(deadline);
        ASSERT_EQ(l.rfind("sessions ", 0), 0u) << l;
        connect_s = std::max(connect_s, std::atof(l.c_str() + 9));
    }
    for (Child &c : prefill) ASSERT_EQ(c.line(deadline), "sessions");

    // Every name is there: 2n engines.
    sg_directory_t watcher = open_dir(endpoints, nullptr);
    ASSERT_TRUE(watcher);
    size_t len = 0, count = 0;
    ASSERT_EQ(sg_directory_list(watcher, nullptr, 10 * kSecond, nullptr, 0, &len, &count), SG_OK);
    EXPECT_EQ(count, size_t(2 * n));

    // An eighth of the prefill engines die at once.
    Child &victim = prefill[3];
    kill(victim.pid, SIGKILL);
    waitpid(victim.pid, nullptr, 0);
    const uint64_t killed = mono_ns();
    std::vector<double> gone_ms(per_prefill, -1);
    uint32_t remaining = per_prefill;
    while (remaining && mono_ns() - killed < 15 * kSecond) {
        for (uint32_t i = 0; i < per_prefill; ++i) {
            if (gone_ms[i] >= 0) continue;
            size_t l = 0;
            if (sg_directory_lookup(watcher, prefill_name(3 * per_prefill + i).c_str(), kSecond, nullptr, 0, &l) ==
                SG_ERR_NOT_FOUND) {
                gone_ms[i] = double(mono_ns() - killed) / 1e6;
                remaining--;
            }
        }
        usleep(20 * 1000);
    }
    EXPECT_EQ(remaining, 0u) << "entries of killed engines still there 15 s after the kill";
    std::sort(gone_ms.begin(), gone_ms.end());
    ASSERT_EQ(sg_directory_list(watcher, "prefill/", 10 * kSecond, nullptr, 0, &len, &count), SG_OK);
    EXPECT_EQ(count, size_t(n - per_prefill)) << "the survivors stay published";
    for (const double g : gone_ms) EXPECT_LE(g, kTtlMs + 1500.0) << "gone later than the TTL and a lease checkpoint";

    std::printf("[ figures ] fleet %u prefill + %u decode contexts in %u + %u processes: all created and "
                "published after %.2f s (a publish took %.1f ms on average); "
                "%llu lookups at %.0f per second (all decode processes at once; slowest process %.2f s); "
                "%u sessions by name, authenticated, in %.2f s; %u prefill engines SIGKILLed: entries gone after "
                "%.0f ms (first) / %.0f ms (median) / %.0f ms (last), TTL %u ms\n",
                n, n, prefill_procs, decode_procs, ready_s, publish_total_s * 1000 / (2 * n),
                static_cast<unsigned long long>(lookups),
                double(lookups) / slowest, slowest, n, connect_s, per_prefill, gone_ms.front(),
                gone_ms[gone_ms.size() / 2], gone_ms.back(), kTtlMs);
    std::fflush(stdout);
    sg_directory_destroy(watcher);
    for (auto *group : {&prefill, &decode})
        for (Child &c : *group) {
            close(c.to);
            if (&c != &victim) {
                int st = 0;
                waitpid(c.pid, &st, 0);
                EXPECT_TRUE(WIFEXITED(st) && WEXITSTATUS(st) == 0);
            }
            close(c.from);
        }
}

}  // namespace
