// runtime/common: what every runtime folder shares — the error type that carries a status and its
// message from where a failure is understood up to the ABI, the internal allocator (mimalloc when
// built with SMARTGEN_MIMALLOC, counted so tests can prove a path does not allocate per block), the
// monotonic clock and the logger. Depends on nothing but the public header for sg_status_t.
#pragma once

#include <smartgen/smartgen.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <memory>
#include <string>
#include <vector>

namespace sg {

// Thrown inside the runtime; the ABI layer turns it into a status plus message, once.
class Error : public std::exception {
  public:
    Error(sg_status_t status, std::string message) : status_(status), message_(std::move(message)) {}
    sg_status_t status() const noexcept { return status_; }
    const char *what() const noexcept override { return message_.c_str(); }
    const std::string &message() const noexcept { return message_; }

  private:
    sg_status_t status_;
    std::string message_;
};

[[noreturn]] void fail(sg_status_t status, std::string message);

// ---- option defaults ----
// What a field left 0 in an options struct means (docs/abi.md), in one table: the ABI's _init
// functions write these, and the layers that apply the options start from the same values.
namespace defaults {
inline constexpr uint32_t kProgressSpinUs = 50;            // sg_context_options_t.progress_spin_us
inline constexpr uint32_t kMaxOpsInFlight = 64;            // .max_ops_in_flight
inline constexpr uint32_t kMaxOpsInFlightLimit = 4096;     //   (its largest allowed value)
inline constexpr uint64_t kMaxBytesInFlight = 64ull << 20;          // .max_bytes_in_flight
inline constexpr uint64_t kMaxSessionBytesInFlight = 32ull << 20;   // .max_session_bytes_in_flight
inline constexpr uint32_t kMaxTransfersPerSession = 1024;  // .max_transfers_per_session
inline constexpr uint64_t kPeerTimeoutMs = 2000;           // .peer_timeout_ms (0; SG_PEER_TIMEOUT_MS overrides)
inline constexpr uint32_t kLeaseTtlMs = 5000;              // sg_directory_options_t.lease_ttl_ms
inline constexpr uint32_t kRequestTimeoutMs = 1000;        // sg_directory_options_t.request_timeout_ms
}  // namespace defaults

// ---- executable invariants ----
// SG_ASSERT(cond, what): in debug and sanitizer builds (SMARTGEN_ASSERTS, set by CMake for the
// Debug build type and every SMARTGEN_SANITIZE build) a false cond prints file, line, the condition
// and `what` (a std::string expression, evaluated only then) and aborts: an invariant the runtime
// relies on is broken, and going on would corrupt a transfer. Compiled out of release builds.
[[noreturn]] void assert_failed(const char *condition, const std::string &what, const char *file, int line) noexcept;
#if defined(SMARTGEN_ASSERTS)
#define SG_ASSERT(cond, what) ((cond) ? (void)0 : ::sg::assert_failed(#cond, (what), __FILE__, __LINE__))
#else
#define SG_ASSERT(cond, what) ((void)0)
#endif

inline void check(bool ok, sg_status_t status, const char *message) {
    if (!ok) fail(status, message);
}

// ---- values a peer or a caller chooses ----
// Whether [offset, offset + len) lies inside [0, size), computed so that nothing can wrap: every
// offset, length, count and index a peer sends goes through this before it touches memory.
constexpr bool in_bounds(uint64_t offset, uint64_t len, uint64_t size) noexcept {
    return offset <= size && len <= size - offset;
}
// a + b, or UINT64_MAX when that does not fit (deadlines and leases of "forever").
constexpr uint64_t saturating_add(uint64_t a, uint64_t b) noexcept { return a + b < a ? UINT64_MAX : a + b; }
// a * b, or UINT64_MAX when that does not fit.
constexpr uint64_t saturating_mul(uint64_t a, uint64_t b) noexcept {
    return b != 0 && a > UINT64_MAX / b ? UINT64_MAX : a * b;
}

// A status a peer sent (any int32): itself when it is an error this version knows, else
// SG_ERR_REMOTE; never a value outside sg_status_t's range.
sg_status_t peer_error_status(int32_t wire_status) noexcept;

// ---- internal allocation ----
void *mem_alloc(size_t bytes);
void mem_free(void *p) noexcept;
// Allocations made through mem_alloc since the process started (tests use the difference).
uint64_t mem_allocation_count() noexcept;
bool mem_uses_mimalloc() noexcept;

template <class T>
struct Allocator {
    using value_type = T;
    Allocator() noexcept = default;
    template <class U>
    Allocator(const Allocator<U> &) noexcept {}
    T *allocate(size_t n) { return static_cast<T *>(mem_alloc(n * sizeof(T))); }
    void deallocate(T *p, size_t) noexcept { mem_free(p); }
    template <class U>
    bool operator==(const Allocator<U> &) const noexcept { return true; }
};

template <class T>
using Vec = std::vector<T, Allocator<T>>;

// ---- checksums ----
// CRC32C (Castagnoli), zlib-style: crc32c(0, a) then crc32c(that, b) is the CRC of a then b.
// "123456789" gives 0xE3069283. Uses the CPU's crc32 instruction where it has one (checked at
// run time). crc32c_copy copies len bytes from src to dst and returns the CRC of them, reading
// each byte once; crc32c_portable is the table code every CPU runs, for tests of the other.
uint32_t crc32c(uint32_t crc, const void *data, size_t len) noexcept;
uint32_t crc32c_copy(uint32_t crc, void *dst, const void *src, size_t len) noexcept;
uint32_t crc32c_portable(uint32_t crc, const void *data, size_t len) noexcept;

// ---- time ----
// Whether a completion status (a negative errno) is one providers report for operations on a
// connection that went away (rxm fails what was queued on it with EIO or ECANCELED when the peer
// dies): the peer is lost, not the operation alone.
bool is_connection_error(int status) noexcept;
uint64_t now_ns() noexcept;  // CLOCK_MONOTONIC, or the test clock while one is set
// The test clock (tests only; transport/fake.hpp's schedules): from now on now_ns() returns `ns`,
// so deadlines, leases, peer timeouts and keep-alives move only when a test moves them; 0 goes
// back to CLOCK_MONOTONIC. Costs now_ns() one relaxed atomic load. Set it before creating the
// contexts it should drive: times they took from the other clock do not mix with it.
void set_test_clock_ns(uint64_t ns) noexcept;

// ---- logging ----
// Repeats are rate-limited: a line identical to one written less than kRepeatWindowNs ago is
// counted, not written, and the next time it is written it says how many were left out. (A killed
// peer, a flood of refused blobs or a failing link would otherwise print the same line by the
// dozen.) Debug lines are never held back.
class Logger {
  public:
    static constexpr uint64_t kRepeatWindowNs = 1000000000ull;
    Logger() = default;
    Logger(sg_log_level_t level, sg_log_fn fn, void *user);
    bool enabled(sg_log_level_t level) const noexcept { return level != SG_LOG_OFF && level <= level_; }
    void log(sg_log_level_t level, const std::string &message) const noexcept;

  private:
    struct Repeats;
    sg_log_level_t level_ = SG_LOG_WARN;
    sg_log_fn fn_ = nullptr;
    void *user_ = nullptr;
    std::shared_ptr<Repeats> repeats_;
};

// Parses "error|warn|info|debug|off" (or a digit); returns fallback for anything else.
sg_log_level_t parse_log_level(const char *text, sg_log_level_t fallback) noexcept;

}  // namespace sg
