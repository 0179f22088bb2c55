// Deadlines for "this should have happened by now" in tests, scaled to the build and the host.
// Sanitizer builds run 3-10x slower than release, and CI runs two test processes at once on two
// cores, sometimes beside other work: a wait that is an upper bound on something that will happen
// (a connect, a transfer, a cluster answering) gets the scale; a duration a test asserts as a
// property of the runtime (a deadline that must fire, a bound on how fast a peer is told) does not.
//   SG_TEST_TIME_SCALE=N  overrides the scale (e.g. 20 for a debugger or valgrind).
#pragma once

#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <functional>
#include <thread>

namespace sgtest {

#if defined(__SANITIZE_THREAD__)
inline constexpr uint64_t kBuildTimeScale = 10;
#elif defined(__SANITIZE_ADDRESS__)
inline constexpr uint64_t kBuildTimeScale = 4;
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
inline constexpr uint64_t kBuildTimeScale = 10;
#elif __has_feature(address_sanitizer)
inline constexpr uint64_t kBuildTimeScale = 4;
#else
inline constexpr uint64_t kBuildTimeScale = 2;
#endif
#else
inline constexpr uint64_t kBuildTimeScale = 2;  // release under load
#endif

inline uint64_t time_scale() {
    static const uint64_t scale = [] {
        if (const char *e = std::getenv("SG_TEST_TIME_SCALE"); e && *e) {
            const long v = std::strtol(e, nullptr, 10);
            if (v >= 1 && v <= 1000) return uint64_t(v);
        }
        return kBuildTimeScale;
    }();
    return scale;
}

// An upper bound on a wait, in nanoseconds (the unit of the C API's timeouts).
inline uint64_t wait_ns(uint64_t nominal_ns) { return nominal_ns * time_scale(); }

// Polls pred every `every` until it holds or the scaled bound passes; pred's last answer.
inline bool eventually(const std::function<bool()> &pred, uint64_t nominal_ns,
                       std::chrono::milliseconds every = std::chrono::milliseconds(20)) {
    const auto until = std::chrono::steady_clock::now() + std::chrono::nanoseconds(wait_ns(nominal_ns));
    while (!pred()) {
        if (std::chrono::steady_clock::now() > until) return pred();
        std::this_thread::sleep_for(every);
    }
    return true;
}

}  // namespace sgtest
