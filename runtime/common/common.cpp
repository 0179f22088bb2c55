#include "common/common.hpp"

#include <cerrno>
#include <cstdio>
#include <map>
#include <mutex>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <new>

#ifdef SMARTGEN_WITH_MIMALLOC
#include <mimalloc.h>
#endif

namespace sg {

void fail(sg_status_t status, std::string message) { throw Error(status, std::move(message)); }

void assert_failed(const char *condition, const std::string &what, const char *file, int line) noexcept {
    std::fprintf(stderr, "smartgen: invariant broken at %s:%d: %s (%s)\n", file, line, condition, what.c_str());
    std::fflush(stderr);
    std::abort();
}

namespace {
std::atomic<uint64_t> g_allocations{0};
}

void *mem_alloc(size_t bytes) {
    g_allocations.fetch_add(1, std::memory_order_relaxed);
#ifdef SMARTGEN_WITH_MIMALLOC
    void *p = mi_malloc(bytes);
#else
    void *p = std::malloc(bytes);
#endif
    if (!p && bytes) throw std::bad_alloc();
    return p;
}

void mem_free(void *p) noexcept {
#ifdef SMARTGEN_WITH_MIMALLOC
    mi_free(p);
#else
    std::free(p);
#endif
}

uint64_t mem_allocation_count() noexcept { return g_allocations.load(std::memory_order_relaxed); }

bool mem_uses_mimalloc() noexcept {
#ifdef SMARTGEN_WITH_MIMALLOC
    return true;
#else
    return false;
#endif
}

namespace {
// 0: no test clock. A process-wide value, not the context's, because a test drives several
// contexts (and the fake fabric) on one timeline.
std::atomic<uint64_t> g_test_clock_ns{0};
}  // namespace

void set_test_clock_ns(uint64_t ns) noexcept { g_test_clock_ns.store(ns, std::memory_order_relaxed); }

uint64_t now_ns() noexcept {
    if (const uint64_t t = g_test_clock_ns.load(std::memory_order_relaxed)) return t;
    timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return uint64_t(ts.tv_sec) * 1000000000ull + uint64_t(ts.tv_nsec);
}

struct Logger::Repeats {
    struct Seen {
        uint64_t last_ns = 0;
        uint64_t held_back = 0;
    };
    std::mutex mu;
    std::map<std::string, Seen> lines;
    // Distinct lines remembered; past this the oldest are forgotten (they only lose their count).
    static constexpr size_t kMaxLines = 256;
};

Logger::Logger(sg_log_level_t level, sg_log_fn fn, void *user)
    : level_(level), fn_(fn), user_(user), repeats_(std::make_shared<Repeats>()) {}

void Logger::log(sg_log_level_t level, const std::string &message) const noexcept {
    if (!enabled(level)) return;
    try {
        std::string text = message;
        if (repeats_ && level != SG_LOG_DEBUG) {
            std::lock_guard lock(repeats_->mu);
            const uint64_t now = now_ns();
            auto &lines = repeats_->lines;
            auto it = lines.find(message);
            if (it != lines.end() && now - it->second.last_ns < kRepeatWindowNs) {
                it->second.held_back++;
                return;
            }
            if (it != lines.end() && it->second.held_back)
                text += " (and " + std::to_string(it->second.held_back) + " more like it in the last second)";
            if (it == lines.end()) {
                if (lines.size() >= Repeats::kMaxLines) {
                    auto oldest = lines.begin();
                    for (auto j = lines.begin(); j != lines.end(); ++j)
                        if (j->second.last_ns < oldest->second.last_ns) oldest = j;
                    lines.erase(oldest);
                }
                it = lines.emplace(message, Repeats::Seen{}).first;
            }
            it->second.last_ns = now;
            it->second.held_back = 0;
        }
        if (fn_) {
            fn_(user_, level, text.c_str());
            return;
        }
        static const char *names[] = {"off", "error", "warn", "info", "debug"};
        std::fprintf(stderr, "smartgen[%s]: %s\n", names[level], text.c_str());
    } catch (...) {
        // Logging never throws; a line lost to an allocation failure is the least of the problems then.
    }
}

sg_status_t peer_error_status(int32_t wire_status) noexcept {
    switch (wire_status) {
        case SG_ERR_INVALID_ARGUMENT: case SG_ERR_INVALID_HANDLE: case SG_ERR_INVALID_LAYOUT:
        case SG_ERR_LAYOUT_MISMATCH: case SG_ERR_OUT_OF_RANGE: case SG_ERR_BUFFER_TOO_SMALL:
        case SG_ERR_INVALID_STATE: case SG_ERR_DUPLICATE: case SG_ERR_VERSION_MISMATCH: case SG_ERR_NOT_FOUND:
        case SG_ERR_NO_MEMORY: case SG_ERR_AGAIN: case SG_ERR_TIMEOUT: case SG_ERR_CANCELED:
        case SG_ERR_TRANSPORT: case SG_ERR_PEER_LOST: case SG_ERR_PROTOCOL: case SG_ERR_DEADLINE:
        case SG_ERR_CONNECT: case SG_ERR_REMOTE: case SG_ERR_AUTH_FAILED: case SG_ERR_AUTH_REQUIRED:
        case SG_ERR_LEASE_EXPIRED: case SG_ERR_UNSUPPORTED: case SG_ERR_NO_PROVIDER: case SG_ERR_INTERNAL:
            return static_cast<sg_status_t>(wire_status);
        default: return SG_ERR_REMOTE;
    }
}

sg_log_level_t parse_log_level(const char *text, sg_log_level_t fallback) noexcept {
    if (!text || !*text) return fallback;
    if (!std::strcmp(text, "off") || !std::strcmp(text, "0")) return SG_LOG_OFF;
    if (!std::strcmp(text, "error") || !std::strcmp(text, "1")) return SG_LOG_ERROR;
    if (!std::strcmp(text, "warn") || !std::strcmp(text, "2")) return SG_LOG_WARN;
    if (!std::strcmp(text, "info") || !std::strcmp(text, "3")) return SG_LOG_INFO;
    if (!std::strcmp(text, "debug") || !std::strcmp(text, "4")) return SG_LOG_DEBUG;
    return fallback;
}

bool is_connection_error(int status) noexcept {
    switch (-status) {
        case ECONNRESET: case EPIPE: case ENOTCONN: case ECONNABORTED: case ECONNREFUSED: case EHOSTUNREACH:
        case ETIMEDOUT: case EIO: case ECANCELED: case ESHUTDOWN: case ENETDOWN: case ENETUNREACH: case EHOSTDOWN:
            return true;
        default:
            return false;
    }
}

}  // namespace sg
