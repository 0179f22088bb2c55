// The C ABI: every entry point is extern "C" and noexcept, checks its arguments, looks handles up in
// their registries, and funnels every exception through guard(), which keeps the message for
// sg_last_error_message and the optional sg_error_info_t.
#include "core/core.hpp"
#include "core/registry.hpp"
#include "core/selection.hpp"
#ifdef SMARTGEN_WITH_DIRECTORY
#include "directory/directory.hpp"
#endif

#include <smartgen/smartgen.h>

#include <arpa/inet.h>
#include <netdb.h>

#include <algorithm>
#include <atomic>
#include <cfloat>
#include <cmath>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <cstdio>
#include <cstring>
#include <thread>
#include <chrono>
#include <new>
#include <stdexcept>
#include <string_view>

using sg::Error;
using sg::fail;
namespace core = sg::core;

namespace {

thread_local std::string t_last_error;

// Keeps prefix + detail as this thread's last error and in *err. Never throws and, when memory has
// run out, never allocates: the thread's message is then cut to the buffer it already holds.
sg_status_t record(sg_status_t status, std::string_view prefix, std::string_view detail,
                   sg_error_info_t *err) noexcept {
    try {
        t_last_error.assign(prefix).append(detail);
    } catch (...) {
        t_last_error.clear();  // keeps its capacity: the appends below fit in it and cannot throw
        const size_t room = t_last_error.capacity();
        t_last_error.append(prefix.substr(0, room));
        t_last_error.append(detail.substr(0, room - t_last_error.size()));
    }
    if (err && err->struct_size >= offsetof(sg_error_info_t, message) + 1) {
        err->status = status;
        const size_t cap = std::min(sizeof err->message, err->struct_size - offsetof(sg_error_info_t, message));
        const size_t np = std::min(prefix.size(), cap - 1);
        const size_t nd = std::min(detail.size(), cap - 1 - np);
        std::memcpy(err->message, prefix.data(), np);
        std::memcpy(err->message + np, detail.data(), nd);
        err->message[np + nd] = '\0';
    }
    return status;
}

sg_status_t record(sg_status_t status, std::string_view message, sg_error_info_t *err) noexcept {
    return record(status, {}, message, err);
}

template <class F>
sg_status_t guard(sg_error_info_t *err, F &&fn) noexcept {
    try {
        return fn();
    } catch (const Error &e) {
        return record(e.status(), e.message(), err);
    } catch (const std::bad_alloc &) {  // also under an address-space limit (ulimit -v)
        return record(SG_ERR_NO_MEMORY, "out of memory", err);
    } catch (const std::length_error &e) {  // a container asked for more than it can ever hold
        return record(SG_ERR_NO_MEMORY, "out of memory: ", e.what(), err);
    } catch (const std::exception &e) {
        return record(SG_ERR_INTERNAL, "internal error: ", e.what(), err);
    } catch (...) {
        return record(SG_ERR_INTERNAL, "internal error: unknown exception", err);
    }
}

// Registries: one per kind, so a handle of one kind is never accepted as another.
core::Registry<core::Context> &contexts() {
    static core::Registry<core::Context> r(1);
    return r;
}
core::Registry<core::KvPool> &pools() {
    static core::Registry<core::KvPool> r(2);
    return r;
}
core::Registry<core::Listener> &listeners() {
    static core::Registry<core::Listener> r(3);
    return r;
}
core::Registry<core::Session> &sessions() {
    static core::Registry<core::Session> r(4);
    return r;
}
core::Registry<sg::select::Profile> &profiles() {
    static core::Registry<sg::select::Profile> r(6);
    return r;
}

// A selector: the profile applied to one request, with the shape it was made for.
struct SelectorObj {
    sg::kv::Layout layout;
    uint64_t num_tokens;
    core::LayerSelector sel;
    sg::select::LayerSelection out;
};
core::Registry<SelectorObj> &selectors() {
    static core::Registry<SelectorObj> r(7);
    return r;
}

core::Registry<core::Transfer> &transfers() {
    static core::Registry<core::Transfer> r(5);
    return r;
}

template <class H>
uint64_t raw(H h) {
    return uint64_t(reinterpret_cast<uintptr_t>(h));
}
template <class H>
H wrap(uint64_t v) {
    return reinterpret_cast<H>(uintptr_t(v));
}

template <class T>
std::shared_ptr<T> lookup(core::Registry<T> &r, uint64_t h, const char *what) {
    auto p = r.get(h);
    if (!p) fail(SG_ERR_INVALID_HANDLE, std::string(what) + " handle is not live (destroyed, or never created)");
    return p;
}

// Copies a caller's size-prefixed struct over defaults: reads min(caller's size, ours).
template <class T>
T read_sized(const T *in, const T &defaults, const char *what) {
    T out = defaults;
    if (!in) return out;
    if (in->struct_size < sizeof(size_t))
        fail(SG_ERR_INVALID_ARGUMENT, std::string(what) + ".struct_size is not set (call its _init function)");
    std::memcpy(static_cast<void *>(&out), in, std::min(in->struct_size, sizeof(T)));
    out.struct_size = sizeof(T);
    return out;
}

// sg_X_init_sized: the caller's `size` bytes are zeroed, the defaults its struct has room for copied in,
// and its size recorded, so no _init writes past what the caller compiled (older or newer header).
template <class T>
void init_sized(T *p, size_t size, const T &defaults) {
    if (!p || size < sizeof(size_t)) return;
    std::memset(static_cast<void *>(p), 0, size);
    std::memcpy(static_cast<void *>(p), &defaults, std::min(size, sizeof(T)));
    p->struct_size = size;
}

// The plain sg_X_init functions (for programs built against headers before 0.5) write their struct's
// first layout in this SONAME and never more, or a vendored older header would be overrun. These are
// the structs' sizes now; one that grows trips its assert, and its plain function must then pass its
// old size (sg_directory_stats_init in 0.5) — under a new default version only if a released version
// already wrote more (sg_transfer_options_init). docs/abi.md, "Growing a struct".
static_assert(sizeof(sg_error_info_t) == 528 && sizeof(sg_context_options_t) == 144 &&
                  sizeof(sg_context_stats_t) == 160 && sizeof(sg_kv_layout_t) == 88 &&
                  sizeof(sg_session_options_t) == 16 && sizeof(sg_selector_input_t) == 64 &&
                  sizeof(sg_directory_options_t) == 32 && sizeof(sg_directory_stats_t) == 72 &&
                  sizeof(sg_layer_written_t) == 40,
              "a struct with a plain _init grew: freeze that _init's size (docs/abi.md, Growing a struct)");

template <class T>
T zeroed_with_size() {
    T t;
    std::memset(static_cast<void *>(&t), 0, sizeof t);
    t.struct_size = sizeof t;
    return t;
}

// A blocking call inside a transfer event callback would stall the progress thread it runs on.
void not_in_callback(const char *fn) {
    if (core::in_event_callback())
        fail(SG_ERR_INVALID_STATE, std::string(fn) + " may not be called from a transfer event callback (it blocks)");
}

// The bits each flags field knows. A bit outside them is refused, never ignored: a caller compiled
// against a newer header must learn that this library does not do what the bit asks.
constexpr uint32_t kTransferFlags = SG_TRANSFER_ALL_LAYERS_WRITTEN;
constexpr uint32_t kTransferPaths = SG_PATH_FULL | SG_PATH_PROACTIVE | SG_PATH_ON_DEMAND | SG_PATH_SPECULATIVE;
constexpr uint32_t kLayerBits = SG_LAYER_WRITTEN | SG_LAYER_READY | SG_LAYER_ESSENTIAL;

void check_bits(uint32_t value, uint32_t known, const char *field, const char *family) {
    if (value & ~known) {
        char hex[16];
        std::snprintf(hex, sizeof hex, "0x%x", value & ~known);
        fail(SG_ERR_INVALID_ARGUMENT, std::string(field) + " holds bits " + hex + " that are not " + family +
                                          " (unknown bits are refused)");
    }
}

void need(const void *p, const char *name) {
    if (!p) fail(SG_ERR_INVALID_ARGUMENT, std::string(name) + " is NULL");
}

// The one rule for a caller buffer that comes with a size out-parameter (the header's "Caller
// buffers"): NULL with capacity 0 asks for the size, NULL with a capacity is refused. Checked before
// anything is computed or written; true for a size query.
bool size_query(const void *buf, size_t cap, const char *name) {
    if (!buf && cap)
        fail(SG_ERR_INVALID_ARGUMENT, std::string(name) + " is NULL with a capacity of " + std::to_string(cap) +
                                          " (NULL with capacity 0 asks for the size)");
    return !buf;
}

// An optional error-detail string, cut to fit (as in sg_error_info_t): msg NULL with cap 0 skips it.
void check_detail_buffer(const char *msg, size_t cap) {
    if (!msg && cap) fail(SG_ERR_INVALID_ARGUMENT, "msg is NULL with a capacity of " + std::to_string(cap));
}
void copy_detail(const std::string &s, char *msg, size_t cap) {
    if (!msg || !cap) return;
    const size_t n = std::min(cap - 1, s.size());
    std::memcpy(msg, s.data(), n);
    msg[n] = '\0';
}

void copy_string(const std::string &s, char *buf, size_t cap) {
    need(buf, "buf");
    if (s.size() + 1 > cap) fail(SG_ERR_BUFFER_TOO_SMALL, "buffer needs " + std::to_string(s.size() + 1) + " bytes");
    std::memcpy(buf, s.c_str(), s.size() + 1);
}

// An IPv4 literal in dotted-quad form or an IPv6 literal (a scope, "fe80::1%eth0", allowed): what
// the header promises local_addr is. Host names and the short IPv4 forms ("127.1") are refused,
// rather than resolved into an address the caller did not name.
void check_ip_literal(const char *addr, const char *field) {
    in_addr v4;
    if (inet_pton(AF_INET, addr, &v4) == 1) return;
    addrinfo hints{};
    hints.ai_family = AF_INET6;
    hints.ai_flags = AI_NUMERICHOST;
    addrinfo *res = nullptr;
    if (std::strchr(addr, ':') && getaddrinfo(addr, nullptr, &hints, &res) == 0) {
        freeaddrinfo(res);
        return;
    }
    fail(SG_ERR_INVALID_ARGUMENT, std::string(field) + " \"" + addr +
                                      "\" is not an IPv4 or IPv6 address literal (NULL means 127.0.0.1)");
}

// Defaults of the context options that are not left to the runtime (docs/abi.md: a field left 0
// means its default).
constexpr uint32_t kDefaultSpinUs = 50;
constexpr uint32_t kDefaultMaxOpsInFlight = 64;
constexpr uint32_t kMaxOpsInFlightLimit = 4096;

// Replaces the fields left 0 by their defaults (and SG_PROGRESS_SPIN_NONE by the runtime's 0 µs)
// and refuses values outside a field's domain, naming the field.
void resolve_option_defaults(sg_context_options_t &o) {
    if (o.manual_progress > 1) fail(SG_ERR_INVALID_ARGUMENT, "options.manual_progress must be 0 or 1");
    if (o.allow_unauthenticated > 1) fail(SG_ERR_INVALID_ARGUMENT, "options.allow_unauthenticated must be 0 or 1");
    if (o.log_level > SG_LOG_DEBUG) fail(SG_ERR_INVALID_ARGUMENT, "options.log_level is out of range");
    if (o.log_level == SG_LOG_DEFAULT) o.log_level = SG_LOG_WARN;
    if (o.progress_spin_us == 0)
        o.progress_spin_us = kDefaultSpinUs;
    else if (o.progress_spin_us == SG_PROGRESS_SPIN_NONE)
        o.progress_spin_us = 0;
    if (o.max_ops_in_flight == 0) o.max_ops_in_flight = kDefaultMaxOpsInFlight;
    if (o.max_ops_in_flight > kMaxOpsInFlightLimit)
        fail(SG_ERR_INVALID_ARGUMENT, "options.max_ops_in_flight must be <= " + std::to_string(kMaxOpsInFlightLimit));
}

sg_context_options_t default_context_options() {
    sg_context_options_t o{};
    o.struct_size = sizeof o;
    o.header_version = SG_VERSION_NUMBER;
    o.progress_spin_us = kDefaultSpinUs;
    o.max_ops_in_flight = kDefaultMaxOpsInFlight;
    o.log_level = SG_LOG_WARN;
    o.peer_timeout_ms = 0;  // the core's default: 2000 ms, or SG_PEER_TIMEOUT_MS
    o.max_bytes_in_flight = 64ull << 20;
    o.max_session_bytes_in_flight = 32ull << 20;
    o.max_transfers_per_session = 1024;
    return o;
}

sg_transfer_options_t default_transfer_options() {
    sg_transfer_options_t o{};
    o.struct_size = sizeof o;
    o.paths = SG_PATH_FULL;
    return o;
}

sg_session_options_t default_session_options() {
    sg_session_options_t o{};
    o.struct_size = sizeof o;
    return o;
}

core::ParamBounds bounds_of(sg_param_t p) { return core::param_bounds(p); }

}  // namespace

extern "C" {

SG_API uint32_t sg_version_number(void) { return SG_VERSION_NUMBER; }
SG_API const char *sg_version_string(void) {
#define SG_STR2(x) #x
#define SG_STR(x) SG_STR2(x)
    return SG_STR(SG_VERSION_MAJOR) "." SG_STR(SG_VERSION_MINOR) "." SG_STR(SG_VERSION_PATCH);
}
SG_API uint32_t sg_abi_version(void) { return SG_ABI_VERSION; }

SG_API const char *sg_status_str(sg_status_t s) {
    switch (s) {
#define SG_CASE(x) \
    case x: return #x;
        SG_CASE(SG_OK)
        SG_CASE(SG_IN_PROGRESS)
        SG_CASE(SG_ERR_INVALID_ARGUMENT)
        SG_CASE(SG_ERR_INVALID_HANDLE)
        SG_CASE(SG_ERR_INVALID_LAYOUT)
        SG_CASE(SG_ERR_LAYOUT_MISMATCH)
        SG_CASE(SG_ERR_OUT_OF_RANGE)
        SG_CASE(SG_ERR_BUFFER_TOO_SMALL)
        SG_CASE(SG_ERR_INVALID_STATE)
        SG_CASE(SG_ERR_DUPLICATE)
        SG_CASE(SG_ERR_VERSION_MISMATCH)
        SG_CASE(SG_ERR_NOT_FOUND)
        SG_CASE(SG_ERR_NO_MEMORY)
        SG_CASE(SG_ERR_AGAIN)
        SG_CASE(SG_ERR_TIMEOUT)
        SG_CASE(SG_ERR_CANCELED)
        SG_CASE(SG_ERR_TRANSPORT)
        SG_CASE(SG_ERR_PEER_LOST)
        SG_CASE(SG_ERR_PROTOCOL)
        SG_CASE(SG_ERR_DEADLINE)
        SG_CASE(SG_ERR_AUTH_FAILED)
        SG_CASE(SG_ERR_AUTH_REQUIRED)
        SG_CASE(SG_ERR_LEASE_EXPIRED)
        SG_CASE(SG_ERR_CONNECT)
        SG_CASE(SG_ERR_REMOTE)
        SG_CASE(SG_ERR_UNSUPPORTED)
        SG_CASE(SG_ERR_NO_PROVIDER)
        SG_CASE(SG_ERR_INTERNAL)
#undef SG_CASE
    }
    return "SG_STATUS_UNKNOWN";
}

SG_API const char *sg_last_error_message(void) { return t_last_error.c_str(); }

SG_API void(sg_error_info_init)(sg_error_info_t *err) { sg_error_info_init_sized(err, sizeof *err); }
SG_API void sg_error_info_init_sized(sg_error_info_t *err, size_t size) {
    init_sized(err, size, zeroed_with_size<sg_error_info_t>());
}

SG_API size_t sg_dtype_size(sg_dtype_t d) { return size_t(sg::kv::dtype_bytes(d)); }

// ---- context ----
SG_API void(sg_context_options_init)(sg_context_options_t *o) { sg_context_options_init_sized(o, sizeof *o); }
SG_API void sg_context_options_init_sized(sg_context_options_t *o, size_t size) {
    init_sized(o, size, default_context_options());
}

SG_API sg_status_t sg_context_create(const sg_context_options_t *options, sg_context_t *out, sg_error_info_t *err) {
    return guard(err, [&] {
        need(out, "out");
        sg_context_options_t o = read_sized(options, default_context_options(), "options");
        if (o.header_version / 10000 != SG_VERSION_MAJOR)
            fail(SG_ERR_VERSION_MISMATCH, "caller was compiled against SmartGen " + std::to_string(o.header_version) +
                                              ", this library is " + sg_version_string() + " (major differs)");
        resolve_option_defaults(o);
        if (o.provider && !*o.provider)
            fail(SG_ERR_INVALID_ARGUMENT, "options.provider is \"\": pass NULL or \"auto\" to choose automatically");
        if (o.local_addr) {
            const std::string list(o.local_addr);
            for (size_t start = 0;;) {
                const size_t comma = list.find(',', start);
                check_ip_literal(list.substr(start, comma - start).c_str(), "options.local_addr");
                if (comma == std::string::npos) break;
                start = comma + 1;
            }
        }
        if (o.lanes > 16) fail(SG_ERR_INVALID_ARGUMENT, "options.lanes must be <= 16");
        auto ctx = std::make_shared<core::Context>(o);
        *out = wrap<sg_context_t>(contexts().add(std::move(ctx)));
        return SG_OK;
    });
}

namespace {
void destroy_directories_of(uint64_t ctx_handle);
}

SG_API sg_status_t sg_context_destroy(sg_context_t h) {
    return guard(nullptr, [&] {
        not_in_callback("sg_context_destroy");
        if (!h) return SG_OK;
        auto ctx = contexts().remove(raw(h));
        if (!ctx) fail(SG_ERR_INVALID_HANDLE, "context handle is not live");
        // Its names first: an entry left published would send peers to a context that is gone.
        destroy_directories_of(raw(h));
        core::Context *c = ctx.get();
        for (auto &t : transfers().remove_if([c](const core::Transfer &t) { return t.ctx == c; })) c->release(*t);
        for (auto &s : sessions().remove_if([c](const core::Session &s) { return s.ctx == c; })) c->close_session(*s);
        listeners().remove_if([c](const core::Listener &l) { return l.ctx == c; });
        pools().remove_if([c](const core::KvPool &p) { return p.ctx == c; });
        return SG_OK;
    });
}

SG_API sg_status_t sg_context_event_fd(sg_context_t h, int *fd) {
    return guard(nullptr, [&] {
        auto ctx = lookup(contexts(), raw(h), "context");
        need(fd, "fd");
        *fd = ctx->event_fd();
        return SG_OK;
    });
}

SG_API sg_status_t sg_context_progress(sg_context_t h) {
    return guard(nullptr, [&] {
        lookup(contexts(), raw(h), "context")->progress_once(true);
        return SG_OK;
    });
}

SG_API sg_status_t sg_context_provider(sg_context_t h, char *buf, size_t cap) {
    return guard(nullptr, [&] {
        copy_string(lookup(contexts(), raw(h), "context")->primary_provider, buf, cap);
        return SG_OK;
    });
}

SG_API sg_status_t sg_param_bounds(sg_param_t p, uint64_t *lo, uint64_t *hi) {
    return guard(nullptr, [&] {
        const core::ParamBounds b = bounds_of(p);
        need(lo, "min_value");
        need(hi, "max_value");
        *lo = b.lo;
        *hi = b.hi;
        return SG_OK;
    });
}

SG_API sg_status_t sg_context_set_param(sg_context_t h, sg_param_t p, uint64_t v) {
    return guard(nullptr, [&] {
        auto ctx = lookup(contexts(), raw(h), "context");
        const core::ParamBounds b = bounds_of(p);
        if (v < b.lo || v > b.hi)
            fail(SG_ERR_OUT_OF_RANGE, "value " + std::to_string(v) + " outside [" + std::to_string(b.lo) + ", " +
                                          std::to_string(b.hi) + "]");
        ctx->set_param(p, v);
        return SG_OK;
    });
}

SG_API sg_status_t sg_context_get_param(sg_context_t h, sg_param_t p, uint64_t *v) {
    return guard(nullptr, [&] {
        auto ctx = lookup(contexts(), raw(h), "context");
        bounds_of(p);
        need(v, "value");
        *v = ctx->get_param(p);
        return SG_OK;
    });
}

SG_API void(sg_context_stats_init)(sg_context_stats_t *s) { sg_context_stats_init_sized(s, sizeof *s); }
SG_API void sg_context_stats_init_sized(sg_context_stats_t *s, size_t size) {
    init_sized(s, size, zeroed_with_size<sg_context_stats_t>());
}

namespace {
sg_context_stats_t snapshot(core::Context &ctx) {
    sg_context_stats_t s = ctx.stats();
    s.struct_size = sizeof s;
    return s;
}
}  // namespace

SG_API sg_status_t sg_context_stats(sg_context_t h, sg_context_stats_t *out) {
    return guard(nullptr, [&] {
        auto ctx = lookup(contexts(), raw(h), "context");
        need(out, "out");
        if (out->struct_size < sizeof(size_t)) fail(SG_ERR_INVALID_ARGUMENT, "out->struct_size is not set");
        sg_context_stats_t s = snapshot(*ctx);
        const size_t n = std::min(out->struct_size, sizeof s);
        s.struct_size = n;
        std::memcpy(static_cast<void *>(out), &s, n);
        return SG_OK;
    });
}

SG_API sg_status_t sg_context_metrics_text(sg_context_t h, char *buf, size_t cap, size_t *len) {
    return guard(nullptr, [&] {
        auto ctx = lookup(contexts(), raw(h), "context");
        need(len, "len");
        const bool query = size_query(buf, cap, "buf");
        const sg_context_stats_t s = snapshot(*ctx);
        struct Metric {
            const char *name, *type, *help;
            uint64_t value;
        };
        const Metric metrics[] = {
            {"smartgen_bytes_total{path=\"direct\"}", "counter", "Payload bytes sent, by path.", s.bytes_direct},
            {"smartgen_bytes_total{path=\"staged\"}", nullptr, nullptr, s.bytes_staged},
            {"smartgen_rma_ops_total", "counter", "RMA operations posted.", s.rma_ops},
            {"smartgen_staging_copies_total", "counter", "memcpy calls made by staging pack and unpack.", s.staging_copies},
            {"smartgen_messages_total{direction=\"sent\"}", "counter", "Control messages.", s.messages_sent},
            {"smartgen_messages_total{direction=\"received\"}", nullptr, nullptr, s.messages_received},
            {"smartgen_retries_total", "counter", "Posts the provider refused for now and that were retried.", s.retries},
            {"smartgen_transfers_total{result=\"completed\"}", "counter", "Transfers finished, by result.",
             s.transfers_completed},
            {"smartgen_transfers_total{result=\"failed\"}", nullptr, nullptr, s.transfers_failed},
            {"smartgen_transfers_canceled_total", "counter", "Transfers canceled.", s.transfers_canceled},
            {"smartgen_deadlines_hit_total", "counter", "Transfers that missed their deadline.", s.deadlines_hit},
            {"smartgen_peers_lost_total", "counter", "Sessions whose peer was lost.", s.peers_lost},
            {"smartgen_sessions_open", "gauge", "Sessions currently open.", s.sessions_open},
            {"smartgen_auth_failures_total", "counter", "Sessions refused by authentication.", s.auth_failures},
            {"smartgen_stalls_total", "counter", "Times a transfer with work waited for the in-flight bounds.", s.stalls},
            {"smartgen_registrations", "gauge", "Memory registrations held now.", s.registrations},
            {"smartgen_lanes", "gauge", "Lanes the context stripes writes over.", s.lanes},
            {"smartgen_lane_failovers_total", "counter", "Writes moved off a failed lane.", s.lane_failovers},
            {"smartgen_lanes_lost_total", "counter", "(peer, lane) pairs given up after an error.", s.lanes_lost},
        };
        std::string text;
        for (const Metric &m : metrics) {
            if (m.type) {
                std::string base(m.name);
                base = base.substr(0, base.find('{'));
                text += "# HELP " + base + " " + m.help + "\n# TYPE " + base + " " + m.type + "\n";
            }
            text += std::string(m.name) + " " + std::to_string(m.value) + "\n";
        }
        *len = text.size();
        if (query) return SG_OK;
        if (cap <= text.size())
            fail(SG_ERR_BUFFER_TOO_SMALL, "metrics text needs " + std::to_string(text.size() + 1) + " bytes");
        std::memcpy(buf, text.c_str(), text.size() + 1);
        return SG_OK;
    });
}

// ---- providers ----
SG_API sg_status_t sg_provider_query(const char *local_addr, sg_provider_info_t *out, size_t capacity, size_t *count) {
    return guard(nullptr, [&] {
        need(count, "count");
        const bool query = size_query(out, capacity, "out");
        auto ranked = sg::transport::rank_candidates(sg::transport::discover(local_addr));
        const int remote = sg::transport::choose_remote(ranked), local = sg::transport::choose_local(ranked);
        for (size_t i = 0; i < ranked.size() && i < capacity; ++i)
            if (out[i].struct_size < sizeof(size_t))
                fail(SG_ERR_INVALID_ARGUMENT, "out[" + std::to_string(i) + "].struct_size is not set");
        *count = ranked.size();
        if (query) return SG_OK;
        if (ranked.size() > capacity)
            fail(SG_ERR_BUFFER_TOO_SMALL, std::to_string(ranked.size()) + " providers, capacity " + std::to_string(capacity));
        for (size_t i = 0; i < ranked.size(); ++i) {
            sg_provider_info_t info{};
            const auto &c = ranked[i];
            auto put = [](char *dst, size_t cap, const std::string &s) {
                std::strncpy(dst, s.c_str(), cap - 1);
                dst[cap - 1] = '\0';
            };
            put(info.name, sizeof info.name, c.caps.provider);
            put(info.fabric, sizeof info.fabric, c.caps.fabric);
            put(info.domain, sizeof info.domain, c.caps.domain);
            put(info.reason, sizeof info.reason, c.reason);
            info.caps = c.caps.caps;
            info.mr_mode = c.caps.mr_mode;
            info.msg_order = c.caps.msg_order;
            info.max_msg_size = c.caps.max_msg_size;
            info.rma_iov_limit = c.caps.rma_iov_limit;
            info.inject_size = c.caps.inject_size;
            info.usable = c.usable ? 1 : 0;
            info.rank = c.rank;
            info.chosen_remote = int(i) == remote;
            info.chosen_local = int(i) == local;
            const size_t n = std::min(out[i].struct_size, sizeof info);
            info.struct_size = n;
            std::memcpy(static_cast<void *>(&out[i]), &info, n);
        }
        return SG_OK;
    });
}

// ---- KV ----
namespace {
sg_kv_layout_t default_kv_layout() {
    auto l = zeroed_with_size<sg_kv_layout_t>();
    l.dtype = SG_DTYPE_FP16;
    l.packing = SG_KV_SEPARATE;
    l.block_order = SG_BLOCK_TOKEN_MAJOR;
    l.mem_kind = SG_MEM_HOST;
    return l;
}
}  // namespace

SG_API void(sg_kv_layout_init)(sg_kv_layout_t *l) { sg_kv_layout_init_sized(l, sizeof *l); }
SG_API void sg_kv_layout_init_sized(sg_kv_layout_t *l, size_t size) { init_sized(l, size, default_kv_layout()); }

namespace {
sg_kv_layout_t read_layout(const sg_kv_layout_t *in) {
    need(in, "layout");
    return read_sized(in, default_kv_layout(), "layout");
}
}  // namespace

SG_API sg_status_t sg_kv_layout_validate(const sg_kv_layout_t *layout, sg_error_info_t *err) {
    return guard(err, [&] {
        sg::kv::make_layout(read_layout(layout));
        return SG_OK;
    });
}

SG_API sg_status_t sg_kv_layout_plane_bytes(const sg_kv_layout_t *layout, uint64_t *bytes) {
    return guard(nullptr, [&] {
        need(bytes, "bytes");
        *bytes = sg::kv::make_layout_shape(read_layout(layout)).plane_bytes;
        return SG_OK;
    });
}

SG_API sg_status_t sg_kv_layout_region_bytes(const sg_kv_layout_t *layout, uint64_t *bytes) {
    return guard(nullptr, [&] {
        need(bytes, "bytes");
        *bytes = sg::kv::make_layout_shape(read_layout(layout)).region_bytes();
        return SG_OK;
    });
}

SG_API sg_status_t sg_kv_register(sg_context_t h, const sg_kv_layout_t *layout, sg_kv_handle_t *out, sg_error_info_t *err) {
    return guard(err, [&] {
        auto ctx = lookup(contexts(), raw(h), "context");
        need(out, "out");
        auto pool = std::make_shared<core::KvPool>(ctx.get(), read_layout(layout));
        *out = wrap<sg_kv_handle_t>(pools().add(std::move(pool)));
        return SG_OK;
    });
}

SG_API sg_status_t sg_kv_deregister(sg_kv_handle_t h) {
    return guard(nullptr, [&] {
        if (!h) return SG_OK;
        auto pool = lookup(pools(), raw(h), "KV");
        if (pool->transfers_using.load())
            fail(SG_ERR_INVALID_STATE, "the pool is used by " + std::to_string(pool->transfers_using.load()) +
                                           " unreleased transfer(s)");
        pools().remove(raw(h));
        return SG_OK;
    });
}

// ---- sessions ----
SG_API void(sg_session_options_init)(sg_session_options_t *o) { sg_session_options_init_sized(o, sizeof *o); }
SG_API void sg_session_options_init_sized(sg_session_options_t *o, size_t size) {
    init_sized(o, size, default_session_options());
}

SG_API sg_status_t sg_listener_create(sg_context_t h, const char *addr, uint16_t port, sg_listener_t *out,
                                      sg_error_info_t *err) {
    return guard(err, [&] {
        auto ctx = lookup(contexts(), raw(h), "context");
        need(out, "out");
        need(addr, "addr");
        std::shared_ptr<core::Listener> l = core::listen_on(ctx.get(), addr, port);
        *out = wrap<sg_listener_t>(listeners().add(std::move(l)));
        return SG_OK;
    });
}

SG_API sg_status_t sg_listener_port(sg_listener_t h, uint16_t *port) {
    return guard(nullptr, [&] {
        auto l = lookup(listeners(), raw(h), "listener");
        need(port, "port");
        *port = l->port;
        return SG_OK;
    });
}

SG_API sg_status_t sg_listener_destroy(sg_listener_t h) {
    return guard(nullptr, [&] {
        if (!h) return SG_OK;
        if (!listeners().remove(raw(h))) fail(SG_ERR_INVALID_HANDLE, "listener handle is not live");
        return SG_OK;
    });
}

namespace {
sg_session_t add_session(core::Context &ctx, const sg::wire::Hello &peer, const sg_session_options_t *options,
                         bool authenticated) {
    sg_session_options_t o = read_sized(options, default_session_options(), "options");
    auto s = ctx.open_session(peer, o, authenticated);
    return wrap<sg_session_t>(sessions().add(std::move(s)));
}

extern "C++" template <class F> auto counting_auth_failures(core::Context &ctx, F &&bootstrap) {
    try {
        return bootstrap();
    } catch (const sg::Error &e) {
        ctx.count_refused_session(e);
        throw;
    }
}
}  // namespace

SG_API sg_status_t sg_session_accept(sg_listener_t h, const sg_session_options_t *options, uint64_t timeout_ns,
                                     sg_session_t *out, sg_error_info_t *err) {
    return guard(err, [&] {
        not_in_callback("sg_session_accept");
        auto l = lookup(listeners(), raw(h), "listener");
        need(out, "out");
        core::Context &ctx = *l->ctx;  // a listener never outlives its context (context_destroy closes it)
        const sg_session_options_t o = read_sized(options, default_session_options(), "options");
        auto s = counting_auth_failures(ctx, [&] { return core::accept_session(*l, ctx, o, timeout_ns); });
        *out = wrap<sg_session_t>(sessions().add(std::move(s)));
        return SG_OK;
    });
}

SG_API sg_status_t sg_session_connect(sg_context_t h, const char *addr, uint16_t port, const sg_session_options_t *options,
                                      uint64_t timeout_ns, sg_session_t *out, sg_error_info_t *err) {
    return guard(err, [&] {
        not_in_callback("sg_session_connect");
        auto ctx = lookup(contexts(), raw(h), "context");
        need(out, "out");
        need(addr, "addr");
        const sg_session_options_t o = read_sized(options, default_session_options(), "options");
        auto s = counting_auth_failures(*ctx, [&] { return core::connect_session(addr, port, *ctx, o, timeout_ns); });
        *out = wrap<sg_session_t>(sessions().add(std::move(s)));
        return SG_OK;
    });
}

SG_API sg_status_t sg_context_get_metadata(sg_context_t h, void *buf, size_t cap, size_t *len) {
    return guard(nullptr, [&] {
        auto ctx = lookup(contexts(), raw(h), "context");
        need(len, "len");
        const bool query = size_query(buf, cap, "buf");
        std::vector<uint8_t> blob = ctx->metadata();
        *len = blob.size();
        if (query) return SG_OK;
        if (cap < blob.size())
            fail(SG_ERR_BUFFER_TOO_SMALL, "metadata needs " + std::to_string(blob.size()) + " bytes");
        std::memcpy(buf, blob.data(), blob.size());
        return SG_OK;
    });
}

SG_API sg_status_t sg_session_from_metadata(sg_context_t h, const void *blob, size_t len,
                                            const sg_session_options_t *options, sg_session_t *out, sg_error_info_t *err) {
    return guard(err, [&] {
        auto ctx = lookup(contexts(), raw(h), "context");
        need(out, "out");
        need(blob, "blob");
        sg::wire::Hello peer = counting_auth_failures(
            *ctx, [&] { return core::parse_metadata(*ctx, std::span(static_cast<const uint8_t *>(blob), len)); });
        // The blob proves who made it, not who uses it now: the fabric challenge-response decides.
        *out = add_session(*ctx, peer, options, false);
        return SG_OK;
    });
}

SG_API sg_status_t sg_session_wait_ready(sg_session_t sh, uint64_t timeout_ns) {
    return guard(nullptr, [&] {
        not_in_callback("sg_session_wait_ready");
        auto s = lookup(sessions(), raw(sh), "session");
        return s->ctx->wait_ready(*s, timeout_ns);
    });
}

SG_API sg_status_t sg_session_export_kv(sg_session_t sh, sg_kv_handle_t kh) {
    return guard(nullptr, [&] {
        auto s = lookup(sessions(), raw(sh), "session");
        auto p = lookup(pools(), raw(kh), "KV");
        if (p->ctx != s->ctx) fail(SG_ERR_INVALID_ARGUMENT, "the KV handle belongs to another context");
        s->ctx->export_kv(*s, *p);
        return SG_OK;
    });
}

SG_API sg_status_t sg_session_provider(sg_session_t sh, char *buf, size_t cap) {
    return guard(nullptr, [&] {
        copy_string(lookup(sessions(), raw(sh), "session")->provider, buf, cap);
        return SG_OK;
    });
}

SG_API sg_status_t sg_session_notify(sg_session_t sh, const void *data, size_t len) {
    return guard(nullptr, [&] {
        auto s = lookup(sessions(), raw(sh), "session");
        if (!data && len) fail(SG_ERR_INVALID_ARGUMENT, "data is NULL");
        s->ctx->notify(*s, std::span(static_cast<const uint8_t *>(data), len));
        return SG_OK;
    });
}

SG_API sg_status_t sg_session_next_notification(sg_session_t sh, void *buf, size_t cap, size_t *len) {
    return guard(nullptr, [&] {
        auto s = lookup(sessions(), raw(sh), "session");
        need(len, "len");
        const bool query = size_query(buf, cap, "buf");
        // SG_ERR_AGAIN is the normal "nothing yet", not recorded as an error.
        return s->ctx->next_notification(*s, buf, cap, query, *len);
    });
}

SG_API sg_status_t sg_session_error(sg_session_t sh, sg_status_t *status, char *msg, size_t cap) {
    return guard(nullptr, [&] {
        auto s = lookup(sessions(), raw(sh), "session");
        need(status, "status");
        check_detail_buffer(msg, cap);
        const core::Outcome o = s->ctx->session_error(*s);
        *status = o.status;
        copy_detail(o.message, msg, cap);
        return SG_OK;
    });
}

SG_API sg_status_t sg_session_close(sg_session_t sh, uint64_t timeout_ns) {
    return guard(nullptr, [&] {
        not_in_callback("sg_session_close");
        auto s = lookup(sessions(), raw(sh), "session");
        s->ctx->close_gracefully(*s, timeout_ns);
        return SG_OK;
    });
}

SG_API sg_status_t sg_session_destroy(sg_session_t sh) {
    return guard(nullptr, [&] {
        not_in_callback("sg_session_destroy");
        if (!sh) return SG_OK;
        auto s = sessions().remove(raw(sh));
        if (!s) fail(SG_ERR_INVALID_HANDLE, "session handle is not live");
        s->ctx->close_session(*s);
        return SG_OK;
    });
}

// ---- profiles and selectors ----
SG_API sg_status_t sg_profile_parse(const char *json, size_t len, sg_profile_t *out, sg_error_info_t *err) {
    return guard(err, [&] {
        need(out, "out");
        if (!json && len) fail(SG_ERR_INVALID_ARGUMENT, "json is NULL");
        auto p = std::make_shared<sg::select::Profile>(sg::select::parse_profile(std::string_view(json ? json : "", len)));
        *out = wrap<sg_profile_t>(profiles().add(std::move(p)));
        return SG_OK;
    });
}

SG_API sg_status_t sg_profile_load(const char *path, sg_profile_t *out, sg_error_info_t *err) {
    return guard(err, [&] {
        need(out, "out");
        need(path, "path");
        auto p = std::make_shared<sg::select::Profile>(sg::select::load_profile(path));
        *out = wrap<sg_profile_t>(profiles().add(std::move(p)));
        return SG_OK;
    });
}

SG_API sg_status_t sg_profile_to_json(sg_profile_t h, char *buf, size_t cap, size_t *len) {
    return guard(nullptr, [&] {
        auto p = lookup(profiles(), raw(h), "profile");
        need(len, "len");
        const bool query = size_query(buf, cap, "buf");
        const std::string text = sg::select::to_json(*p);
        *len = text.size();
        if (query) return SG_OK;
        if (cap <= text.size())
            fail(SG_ERR_BUFFER_TOO_SMALL, "the profile needs " + std::to_string(text.size() + 1) + " bytes");
        std::memcpy(buf, text.c_str(), text.size() + 1);
        return SG_OK;
    });
}

SG_API sg_status_t sg_profile_destroy(sg_profile_t h) {
    return guard(nullptr, [&] {
        if (!h) return SG_OK;
        if (!profiles().remove(raw(h))) fail(SG_ERR_INVALID_HANDLE, "profile handle is not live");
        return SG_OK;
    });
}

namespace {
// The largest request a selector holds: its logical block indices are uint32_t (sg_selector_select
// returns them), and one layer's digests are counted, as floats and as bytes, in size_t. Computed
// so that nothing wraps, for any num_tokens.
void check_selector_size(const sg::kv::Layout &kl, uint64_t num_tokens) {
    const uint64_t blocks = sg::kv::blocks_for(num_tokens, kl.tokens_per_block);
    if (blocks > UINT32_MAX)
        fail(SG_ERR_OUT_OF_RANGE, "num_tokens " + std::to_string(num_tokens) + " makes " + std::to_string(blocks) +
                                      " blocks of " + std::to_string(kl.tokens_per_block) +
                                      " tokens; a selector holds at most 2^32 - 1 blocks");
    const unsigned __int128 digest_bytes =
        (unsigned __int128)blocks * kl.num_kv_heads * 2 * kl.head_dim * sizeof(float);
    if (digest_bytes > SIZE_MAX)
        fail(SG_ERR_OUT_OF_RANGE, "num_tokens " + std::to_string(num_tokens) + ": one layer's digests (" +
                                      std::to_string(blocks) + " blocks x " + std::to_string(kl.num_kv_heads) +
                                      " KV heads x 2 x " + std::to_string(kl.head_dim) + " floats) exceed size_t");
}
}  // namespace

SG_API sg_status_t sg_selector_create(sg_profile_t ph, const sg_kv_layout_t *layout, uint64_t num_tokens,
                                      sg_selector_t *out, sg_error_info_t *err) {
    return guard(err, [&] {
        auto p = lookup(profiles(), raw(ph), "profile");
        need(out, "out");
        need(layout, "layout");
        sg::kv::Layout kl = sg::kv::make_layout_shape(read_layout(layout));
        if (num_tokens == 0) fail(SG_ERR_INVALID_ARGUMENT, "num_tokens is 0");
        check_selector_size(kl, num_tokens);
        if (p->block_tokens != kl.tokens_per_block || p->num_layers != kl.num_layers)
            fail(SG_ERR_LAYOUT_MISMATCH, "the profile is for " + std::to_string(p->num_layers) + " layers of " +
                                             std::to_string(p->block_tokens) + "-token blocks, the layout has " +
                                             std::to_string(kl.num_layers) + " of " +
                                             std::to_string(kl.tokens_per_block));
        auto obj = std::make_shared<SelectorObj>(SelectorObj{
            kl, num_tokens, core::LayerSelector(*p, kl.num_kv_heads, kl.head_dim, num_tokens, 2 * kl.row_bytes()), {}});
        *out = wrap<sg_selector_t>(selectors().add(std::move(obj)));
        return SG_OK;
    });
}

SG_API sg_status_t sg_selector_destroy(sg_selector_t h) {
    return guard(nullptr, [&] {
        if (!h) return SG_OK;
        if (!selectors().remove(raw(h))) fail(SG_ERR_INVALID_HANDLE, "selector handle is not live");
        return SG_OK;
    });
}

SG_API sg_status_t sg_selector_digest_floats(sg_selector_t h, size_t *floats) {
    return guard(nullptr, [&] {
        auto s = lookup(selectors(), raw(h), "selector");
        need(floats, "floats");
        *floats = size_t(sg::kernels::digest_floats(sg::kernels::num_blocks(s->num_tokens, s->layout.tokens_per_block),
                                                    s->layout.num_kv_heads, s->layout.head_dim));
        return SG_OK;
    });
}

namespace {
// A pool layout supplied with a selector call: its shape must be the selector's.
sg::kv::Layout checked_pool(const SelectorObj &s, const sg_kv_layout_t *layout, const uint32_t *ids, size_t n) {
    need(layout, "layout");
    need(ids, "block_ids");
    sg::kv::Layout kl = sg::kv::make_layout(read_layout(layout));
    if (kl.num_kv_heads != s.layout.num_kv_heads || kl.head_dim != s.layout.head_dim ||
        kl.tokens_per_block != s.layout.tokens_per_block || kl.dtype != s.layout.dtype)
        fail(SG_ERR_LAYOUT_MISMATCH, "the layout's shape differs from the one the selector was made for");
    sg::kv::check_block_table(kl, std::span(ids, n), s.num_tokens);
    return kl;
}
const uint8_t *k_region_of(const sg_kv_layout_t *layout, uint32_t layer) {
    if (layer >= layout->num_layers) fail(SG_ERR_OUT_OF_RANGE, "layer is beyond the layout");
    return static_cast<const uint8_t *>(layout->layer_k_base[layer]);
}
}  // namespace

SG_API sg_status_t sg_selector_digest(sg_selector_t h, const sg_kv_layout_t *layout, uint32_t layer,
                                      const uint32_t *ids, size_t n, float *out, size_t cap) {
    return guard(nullptr, [&] {
        auto s = lookup(selectors(), raw(h), "selector");
        need(out, "out");
        const sg::kv::Layout kl = checked_pool(*s, layout, ids, n);
        const uint64_t need_floats = sg::kernels::digest_floats(
            sg::kernels::num_blocks(s->num_tokens, kl.tokens_per_block), kl.num_kv_heads, kl.head_dim);
        if (cap < need_floats) fail(SG_ERR_BUFFER_TOO_SMALL, "digests need " + std::to_string(need_floats) + " floats");
        // A device pool's are computed on the device (core::layer_digest).
        core::layer_digest(kl, k_region_of(layout, layer), std::span(ids, n), s->num_tokens, out);
        return SG_OK;
    });
}

SG_API void(sg_selector_input_init)(sg_selector_input_t *in) { sg_selector_input_init_sized(in, sizeof *in); }
SG_API void sg_selector_input_init_sized(sg_selector_input_t *in, size_t size) {
    init_sized(in, size, zeroed_with_size<sg_selector_input_t>());
}

SG_API sg_status_t sg_selector_select(sg_selector_t h, uint32_t layer, const sg_selector_input_t *input, uint32_t *blocks,
                                      size_t cap, size_t *count) {
    return guard(nullptr, [&] {
        auto s = lookup(selectors(), raw(h), "selector");
        need(count, "count");
        const bool query = size_query(blocks, cap, "blocks");
        const sg_selector_input_t in = read_sized(input, zeroed_with_size<sg_selector_input_t>(), "input");
        core::ScoreInput si;
        si.queries = in.queries;
        si.num_queries = in.num_queries;
        si.num_q_heads = in.num_q_heads;
        si.digests = in.digests;
        si.accumulated = in.accumulated;
        core::HostKeys keys;
        if (in.keys_layout) {
            const sg::kv::Layout kl = checked_pool(*s, in.keys_layout, in.block_ids, in.num_block_ids);
            keys = core::host_keys(kl, k_region_of(in.keys_layout, layer), std::span(in.block_ids, in.num_block_ids));
            si.keys_layout = &keys.layout;
            si.k_region = keys.k_region;
            si.table = keys.table;
        }
        s->sel.select(layer, si, s->out);
        *count = s->out.blocks.size();
        if (query) return SG_OK;
        if (cap < s->out.blocks.size())
            fail(SG_ERR_BUFFER_TOO_SMALL, "the selection holds " + std::to_string(s->out.blocks.size()) + " blocks");
        std::copy(s->out.blocks.begin(), s->out.blocks.end(), blocks);
        return SG_OK;
    });
}

SG_API sg_status_t sg_selector_budget_blocks(sg_selector_t h, uint32_t layer, uint64_t *blocks) {
    return guard(nullptr, [&] {
        auto s = lookup(selectors(), raw(h), "selector");
        need(blocks, "blocks");
        if (layer >= s->layout.num_layers) fail(SG_ERR_OUT_OF_RANGE, "layer is beyond the profile");
        uint64_t most = 0;
        for (uint32_t k = 0; k < s->layout.num_kv_heads; ++k) most = std::max(most, s->sel.selector().budget(layer, k));
        *blocks = most;
        return SG_OK;
    });
}

// ---- attention parts ----
namespace {
// The shape both attention calls share; rows * head_dim cannot wrap (two uint32_t in a size_t).
void check_part_shape(uint32_t rows, uint32_t head_dim) {
    static_assert(sizeof(size_t) >= 8, "rows * head_dim must fit a size_t");
    if (!rows) fail(SG_ERR_INVALID_ARGUMENT, "rows is 0");
    if (!head_dim) fail(SG_ERR_INVALID_ARGUMENT, "head_dim is 0");
}

// A row of a part as merge_parts assumes it: a sum of exponentials (finite, >= 0), and a finite max
// whenever the sum says the row is not empty (exp(max - max) with an infinite max is NaN, which
// would spread into the merged row instead of being reported).
void check_part_row(const float *max, const float *sum, uint32_t r, const char *part) {
    if (!(sum[r] >= 0) || std::isinf(sum[r]))
        fail(SG_ERR_INVALID_ARGUMENT, std::string(part) + " row " + std::to_string(r) + ": sum " +
                                          std::to_string(sum[r]) + " is not a finite value >= 0");
    if (sum[r] > 0 && !std::isfinite(max[r]))
        fail(SG_ERR_INVALID_ARGUMENT, std::string(part) + " row " + std::to_string(r) + ": max " +
                                          std::to_string(max[r]) + " is not finite while sum is " +
                                          std::to_string(sum[r]));
}
// Whether the float merge of two valid rows would overflow: their sums (or accumulators) add past
// what a float holds. Decided in double, where the same sums cannot overflow.
constexpr double kMergeHeadroom = 0x1p120;  // below FLT_MAX (~2^128), with room for rounding
bool merge_overflows(float ma, float sa, const float *acc_a, float mb, float sb, const float *acc_b, uint32_t dim) {
    if (sa == 0 || sb == 0) return false;  // an empty side: the other is copied or kept
    const double m = std::max(ma, mb), ea = std::exp(double(ma) - m), eb = std::exp(double(mb) - m);
    if (double(sa) * ea + double(sb) * eb > kMergeHeadroom) return true;
    for (uint32_t i = 0; i < dim; ++i)
        if (std::fabs(double(acc_a[i]) * ea) + std::fabs(double(acc_b[i]) * eb) > kMergeHeadroom) return true;
    return false;
}

// The merge of such a row in double, rescaled into float range: a part stands for exp(max) * sum
// (and exp(max) * acc), so dividing sum and acc by 2^k and adding k ln 2 to max is the same part.
void merge_rescaled(float *max, float *sum, float *acc, float mb, float sb, const float *acc_b, uint32_t dim,
                    std::vector<double> &wide) {
    const double m = std::max(*max, mb), ea = std::exp(double(*max) - m), eb = std::exp(double(mb) - m);
    const double s = double(*sum) * ea + double(sb) * eb;
    wide.resize(dim);  // acc_b may be acc: read both before writing either
    double peak = s;
    for (uint32_t i = 0; i < dim; ++i) {
        wide[i] = double(acc[i]) * ea + double(acc_b[i]) * eb;
        peak = std::max(peak, std::fabs(wide[i]));
    }
    const int k = std::max(0, std::ilogb(peak) - 100);
    const double scale = std::ldexp(1.0, -k);
    *max = float(m + k * std::log(2.0));
    *sum = float(s * scale);
    for (uint32_t i = 0; i < dim; ++i) acc[i] = float(wide[i] * scale);
}
}  // namespace

SG_API sg_status_t sg_attention_merge(uint32_t rows, uint32_t head_dim, float *max, float *sum, float *acc,
                                      const float *max_b, const float *sum_b, const float *acc_b) {
    return guard(nullptr, [&] {
        need(max, "max");
        need(sum, "sum");
        need(acc, "acc");
        need(max_b, "max_b");
        need(sum_b, "sum_b");
        need(acc_b, "acc_b");
        check_part_shape(rows, head_dim);
        // Every row is checked before any is merged: outputs are written only on success.
        for (uint32_t r = 0; r < rows; ++r) {
            check_part_row(max, sum, r, "part a");
            check_part_row(max_b, sum_b, r, "part b");
        }
        std::vector<double> wide;
        for (uint32_t r = 0; r < rows; ++r) {
            const size_t off = size_t(r) * head_dim;
            if (!merge_overflows(max[r], sum[r], acc + off, max_b[r], sum_b[r], acc_b + off, head_dim)) {
                // b's max and sum go by value and acc is combined element by element, so b may be a.
                sg::kernels::merge_parts({max + r, sum + r, acc + off}, max_b[r], sum_b[r], acc_b + off, head_dim);
                continue;
            }
            merge_rescaled(max + r, sum + r, acc + off, max_b[r], sum_b[r], acc_b + off, head_dim, wide);
        }
        return SG_OK;
    });
}

SG_API sg_status_t sg_attention_finish(uint32_t rows, uint32_t head_dim, const float *sum, const float *acc,
                                       float *out) {
    return guard(nullptr, [&] {
        need(sum, "sum");
        need(acc, "acc");
        need(out, "out");
        check_part_shape(rows, head_dim);
        for (uint32_t r = 0; r < rows; ++r) {
            if (!(sum[r] >= 0) || std::isinf(sum[r]))
                fail(SG_ERR_INVALID_ARGUMENT,
                     "row " + std::to_string(r) + ": sum " + std::to_string(sum[r]) + " is not a finite value >= 0");
            // acc / sum of a real part is a weighted mean of values and stays in float range; one
            // that does not (acc far larger than sum: a tiny or subnormal sum) is refused, never Inf.
            if (sum[r] == 0) continue;
            const size_t off = size_t(r) * head_dim;
            for (uint32_t i = 0; i < head_dim; ++i)
                if (!(std::fabs(double(acc[off + i]) / double(sum[r])) <= double(FLT_MAX)))
                    fail(SG_ERR_OUT_OF_RANGE, "row " + std::to_string(r) + ": acc[" + std::to_string(i) + "] / sum = " +
                                                  std::to_string(acc[off + i]) + " / " + std::to_string(sum[r]) +
                                                  " is beyond float range (not a part: acc is at most sum * max |v|)");
        }
        for (uint32_t r = 0; r < rows; ++r) {
            const size_t off = size_t(r) * head_dim;
            if (sum[r] > 0 && !std::isfinite(1.0f / sum[r])) {
                // A sum so small its reciprocal is no float (the kernel multiplies by it): divide in
                // double; the checks above keep every quotient in float range.
                for (uint32_t i = 0; i < head_dim; ++i) out[off + i] = float(double(acc[off + i]) / double(sum[r]));
                continue;
            }
            sg::kernels::finish_part(sum[r], acc + off, head_dim, out + off);
        }
        return SG_OK;
    });
}

// ---- transfers ----
// 0.3 appended fields to sg_transfer_options_t and sg_transfer_stats_t, and their plain _init
// functions have no size to go by. The 0.1 versions write the 0.1/0.2 struct; the 0.3 versions, for
// programs linked against 0.3 and 0.4, write the whole 0.3 struct; the default (0.5) versions, which a
// program compiled against a vendored older header binds when linked today, write the 0.2 struct
// again: the smallest this SONAME shipped, so no header's struct is overrun. Programs compiled
// against this header call the _sized ones through the macros (docs/abi.md, "Growing a struct").
constexpr size_t kTransferOptionsSize01 = offsetof(sg_transfer_options_t, wire_quant);
constexpr size_t kTransferStatsSize01 = offsetof(sg_transfer_stats_t, quantized_bytes);

SG_API void sg_transfer_options_init_sized(sg_transfer_options_t *o, size_t size) {
    init_sized(o, size, default_transfer_options());
}

extern "C" SG_API void sg_transfer_options_init_v01(sg_transfer_options_t *o) {
    sg_transfer_options_init_sized(o, kTransferOptionsSize01);
}
__asm__(".symver sg_transfer_options_init_v01, sg_transfer_options_init@SMARTGEN_0.1");

extern "C" SG_API void sg_transfer_options_init_v03(sg_transfer_options_t *o) {
    sg_transfer_options_init_sized(o, sizeof *o);
}
__asm__(".symver sg_transfer_options_init_v03, sg_transfer_options_init@SMARTGEN_0.3");

extern "C" SG_API void sg_transfer_options_init_v05(sg_transfer_options_t *o) {
    sg_transfer_options_init_sized(o, kTransferOptionsSize01);
}
__asm__(".symver sg_transfer_options_init_v05, sg_transfer_options_init@@SMARTGEN_0.5");

namespace {
sg_status_t start_transfer(bool post_side, sg_session_t sh, const char *rid, sg_kv_handle_t kh, const uint32_t *ids,
                           size_t n, uint64_t num_tokens, const sg_transfer_options_t *options, sg_transfer_t *out,
                           sg_error_info_t *err) {
    return guard(err, [&] {
        auto s = lookup(sessions(), raw(sh), "session");
        auto p = lookup(pools(), raw(kh), "KV");
        need(out, "out");
        if (!ids || !n) fail(SG_ERR_INVALID_ARGUMENT, "block_ids is empty");
        if (p->ctx != s->ctx) fail(SG_ERR_INVALID_ARGUMENT, "the KV handle belongs to another context");
        sg_transfer_options_t o = read_sized(options, default_transfer_options(), "options");
        check_bits(o.flags, kTransferFlags, "options.flags", "SG_TRANSFER_*");
        check_bits(o.paths, kTransferPaths, "options.paths", "SG_PATH_*");
        if (!o.paths) o.paths = SG_PATH_FULL;
        std::span<const uint32_t> table(ids, n);
        std::shared_ptr<sg::select::Profile> profile;
        if (post_side && o.profile) profile = lookup(profiles(), raw(o.profile), "profile");
        auto t = post_side ? s->ctx->post(s, rid, p, table, num_tokens, o, profile.get())
                           : s->ctx->expect(s, rid, p, table, num_tokens, o);
        core::Transfer &xfer = *t;
        *out = wrap<sg_transfer_t>(transfers().add(std::move(t)));
        xfer.ctx->set_api_handle(xfer, *out);
        return SG_OK;
    });
}
}  // namespace

SG_API sg_status_t sg_transfer_expect(sg_session_t s, const char *rid, sg_kv_handle_t dst, const uint32_t *ids, size_t n,
                                      uint64_t num_tokens, const sg_transfer_options_t *o, sg_transfer_t *out,
                                      sg_error_info_t *err) {
    return start_transfer(false, s, rid, dst, ids, n, num_tokens, o, out, err);
}

SG_API sg_status_t sg_transfer_post(sg_session_t s, const char *rid, sg_kv_handle_t src, const uint32_t *ids, size_t n,
                                    uint64_t num_tokens, const sg_transfer_options_t *o, sg_transfer_t *out,
                                    sg_error_info_t *err) {
    return start_transfer(true, s, rid, src, ids, n, num_tokens, o, out, err);
}

SG_API sg_status_t sg_transfer_layer_written(sg_transfer_t h, uint32_t layer, void *cuda_stream) {
    return guard(nullptr, [&] {
        auto t = lookup(transfers(), raw(h), "transfer");
        t->ctx->layer_written(*t, layer, nullptr, 0, 0, cuda_stream);
        return SG_OK;
    });
}

SG_API sg_status_t sg_transfer_test(sg_transfer_t h) {
    return guard(nullptr, [&] {
        auto t = lookup(transfers(), raw(h), "transfer");
        const core::Outcome o = t->ctx->outcome(*t);
        const sg_status_t st = o.status;
        if (st < 0) record(st, o.message, nullptr);
        if (st == SG_IN_PROGRESS) t->ctx->progress_once();
        return st;
    });
}

namespace {
// A failed wait leaves the transfer's detail as the thread's last error.
// A wait whose own timeout passed says so (the transfer goes on; its status is not an error).
void record_failure(core::Transfer &t, sg_status_t st) {
    if (st == SG_ERR_TIMEOUT)
        record(st, "the wait's timeout passed first; the transfer goes on", nullptr);
    else if (st < 0)
        record(st, t.ctx->outcome(t).message, nullptr);
}
}  // namespace

SG_API sg_status_t sg_transfer_wait(sg_transfer_t h, uint64_t timeout_ns) {
    return guard(nullptr, [&] {
        not_in_callback("sg_transfer_wait");
        auto t = lookup(transfers(), raw(h), "transfer");
        sg_status_t st = t->ctx->wait(*t, -1, timeout_ns);
        record_failure(*t, st);
        return st;
    });
}

SG_API sg_status_t sg_transfer_wait_layer(sg_transfer_t h, uint32_t layer, uint64_t timeout_ns) {
    return guard(nullptr, [&] {
        not_in_callback("sg_transfer_wait_layer");
        auto t = lookup(transfers(), raw(h), "transfer");
        if (layer >= t->num_layers()) fail(SG_ERR_OUT_OF_RANGE, "layer " + std::to_string(layer) + " >= num_layers");
        sg_status_t st = t->ctx->wait(*t, layer, timeout_ns);
        record_failure(*t, st);
        return st;
    });
}

SG_API sg_status_t sg_transfer_layer_state(sg_transfer_t h, uint32_t layer, uint32_t *state) {
    return guard(nullptr, [&] {
        auto t = lookup(transfers(), raw(h), "transfer");
        need(state, "state");
        *state = t->ctx->layer_state(*t, layer);
        return SG_OK;
    });
}

SG_API sg_status_t sg_transfer_layer_written_q(sg_transfer_t h, uint32_t layer, const float *queries,
                                               uint32_t num_queries, uint32_t num_q_heads) {
    return guard(nullptr, [&] {
        auto t = lookup(transfers(), raw(h), "transfer");
        if (num_queries && (!queries || !num_q_heads))
            fail(SG_ERR_INVALID_ARGUMENT, "queries is NULL or num_q_heads is 0 with num_queries > 0");
        // Queries feed the proactive path's selection; a SG_PATH_FULL transfer sends the whole layer.
        t->ctx->layer_written(*t, layer, queries, num_queries, num_q_heads);
        return SG_OK;
    });
}

SG_API void(sg_layer_written_init)(sg_layer_written_t *args) { sg_layer_written_init_sized(args, sizeof *args); }
SG_API void sg_layer_written_init_sized(sg_layer_written_t *args, size_t size) {
    init_sized(args, size, zeroed_with_size<sg_layer_written_t>());
}

SG_API sg_status_t sg_transfer_layer_written_ex(sg_transfer_t h, uint32_t layer, const sg_layer_written_t *args) {
    return guard(nullptr, [&] {
        auto t = lookup(transfers(), raw(h), "transfer");
        if (!args) fail(SG_ERR_INVALID_ARGUMENT, "args is NULL");
        const sg_layer_written_t a = read_sized(args, zeroed_with_size<sg_layer_written_t>(), "args");
        if (a.reserved) fail(SG_ERR_INVALID_ARGUMENT, "args.reserved must be 0");
        if (a.queries_mem_kind != SG_MEM_HOST && a.queries_mem_kind != SG_MEM_CUDA)
            fail(SG_ERR_INVALID_ARGUMENT, "args.queries_mem_kind is not SG_MEM_HOST or SG_MEM_CUDA");
        if (a.num_queries && (!a.queries || !a.num_q_heads))
            fail(SG_ERR_INVALID_ARGUMENT, "args.queries is NULL or args.num_q_heads is 0 with num_queries > 0");
        if (a.queries_mem_kind == SG_MEM_CUDA && a.num_queries && !a.cuda_stream)
            fail(SG_ERR_INVALID_ARGUMENT, "device queries need args.cuda_stream (they are read once it passes the layer)");
        t->ctx->layer_written(*t, layer, a.queries, a.num_queries, a.num_q_heads, a.cuda_stream,
                              a.queries_mem_kind == SG_MEM_CUDA);
        return SG_OK;
    });
}

SG_API sg_status_t sg_transfer_wait_layer_state(sg_transfer_t h, uint32_t layer, uint32_t bits, uint64_t timeout_ns) {
    return guard(nullptr, [&] {
        not_in_callback("sg_transfer_wait_layer_state");
        auto t = lookup(transfers(), raw(h), "transfer");
        check_bits(bits, kLayerBits, "bits", "SG_LAYER_*");
        const sg_status_t st = t->ctx->wait_layer_state(*t, layer, bits, timeout_ns);
        record_failure(*t, st);
        return st;
    });
}

SG_API sg_status_t sg_transfer_digests(sg_transfer_t h, uint32_t layer, float *out, size_t cap, size_t *count) {
    return guard(nullptr, [&] {
        auto t = lookup(transfers(), raw(h), "transfer");
        need(count, "count");
        const bool query = size_query(out, cap, "out");
        if (layer >= t->num_layers()) fail(SG_ERR_OUT_OF_RANGE, "layer " + std::to_string(layer) + " >= num_layers");
        size_t n = 0;
        if (!t->ctx->digests(*t, layer, query ? std::span<float>() : std::span<float>(out, cap), n))
            fail(SG_ERR_INVALID_STATE, t->post_side ? "digests are read on the decode side"
                                                    : "the layer is not SG_LAYER_ESSENTIAL (or the transfer lacks SG_PATH_PROACTIVE)");
        *count = n;
        if (query) return SG_OK;
        if (cap < n) fail(SG_ERR_BUFFER_TOO_SMALL, "out needs " + std::to_string(n) + " floats");
        return SG_OK;
    });
}

SG_API sg_status_t sg_transfer_fetch(sg_transfer_t h, uint32_t layer, const uint32_t *blocks, size_t count) {
    return guard(nullptr, [&] {
        auto t = lookup(transfers(), raw(h), "transfer");
        if (count && !blocks) fail(SG_ERR_INVALID_ARGUMENT, "blocks is NULL");
        t->ctx->fetch(*t, layer, std::span<const uint32_t>(blocks, count));
        return SG_OK;
    });
}

SG_API sg_status_t sg_transfer_wait_blocks(sg_transfer_t h, uint32_t layer, const uint32_t *blocks, size_t count,
                                           uint64_t timeout_ns) {
    return guard(nullptr, [&] {
        not_in_callback("sg_transfer_wait_blocks");
        auto t = lookup(transfers(), raw(h), "transfer");
        if (count && !blocks) fail(SG_ERR_INVALID_ARGUMENT, "blocks is NULL");
        const sg_status_t st = t->ctx->wait_blocks(*t, layer, std::span<const uint32_t>(blocks, count), timeout_ns);
        record_failure(*t, st);
        return st;
    });
}

SG_API sg_status_t sg_transfer_residency(sg_transfer_t h, uint32_t layer, uint8_t *bitmap, size_t cap, size_t *num_bits) {
    return guard(nullptr, [&] {
        auto t = lookup(transfers(), raw(h), "transfer");
        need(num_bits, "num_bits");
        const bool query = size_query(bitmap, cap, "bitmap");
        t->ctx->residency(*t, layer, query ? nullptr : bitmap, cap, *num_bits);
        return SG_OK;
    });
}

SG_API sg_status_t sg_transfer_status(sg_transfer_t h, sg_status_t *status, char *msg, size_t cap) {
    return guard(nullptr, [&] {
        auto t = lookup(transfers(), raw(h), "transfer");
        need(status, "status");
        check_detail_buffer(msg, cap);
        const core::Outcome o = t->ctx->outcome(*t);
        *status = o.status;
        copy_detail(o.message, msg, cap);
        return SG_OK;
    });
}

SG_API void sg_transfer_stats_init_sized(sg_transfer_stats_t *s, size_t size) {
    init_sized(s, size, zeroed_with_size<sg_transfer_stats_t>());
}

extern "C" SG_API void sg_transfer_stats_init_v01(sg_transfer_stats_t *s) {
    sg_transfer_stats_init_sized(s, kTransferStatsSize01);
}
__asm__(".symver sg_transfer_stats_init_v01, sg_transfer_stats_init@SMARTGEN_0.1");

extern "C" SG_API void sg_transfer_stats_init_v03(sg_transfer_stats_t *s) { sg_transfer_stats_init_sized(s, sizeof *s); }
__asm__(".symver sg_transfer_stats_init_v03, sg_transfer_stats_init@SMARTGEN_0.3");

extern "C" SG_API void sg_transfer_stats_init_v05(sg_transfer_stats_t *s) {
    sg_transfer_stats_init_sized(s, kTransferStatsSize01);
}
__asm__(".symver sg_transfer_stats_init_v05, sg_transfer_stats_init@@SMARTGEN_0.5");

SG_API sg_status_t sg_transfer_stats(sg_transfer_t h, sg_transfer_stats_t *out) {
    return guard(nullptr, [&] {
        auto t = lookup(transfers(), raw(h), "transfer");
        need(out, "out");
        if (out->struct_size < sizeof(size_t)) fail(SG_ERR_INVALID_ARGUMENT, "out->struct_size is not set");
        sg_transfer_stats_t s = t->ctx->transfer_stats(*t);
        const size_t n = std::min(out->struct_size, sizeof s);
        s.struct_size = n;
        std::memcpy(static_cast<void *>(out), &s, n);
        return SG_OK;
    });
}

SG_API sg_status_t sg_transfer_layer_time(sg_transfer_t h, uint32_t layer, uint64_t *ns) {
    return guard(nullptr, [&] {
        auto t = lookup(transfers(), raw(h), "transfer");
        need(ns, "ns");
        *ns = t->ctx->layer_time(*t, layer);
        return SG_OK;
    });
}

SG_API sg_status_t sg_transfer_cancel(sg_transfer_t h) {
    return guard(nullptr, [&] {
        auto t = lookup(transfers(), raw(h), "transfer");
        t->ctx->cancel(*t, SG_ERR_CANCELED, "canceled by the application");
        return SG_OK;
    });
}

SG_API sg_status_t sg_transfer_wait_quiesced(sg_transfer_t h, uint64_t timeout_ns) {
    return guard(nullptr, [&] {
        not_in_callback("sg_transfer_wait_quiesced");
        auto t = lookup(transfers(), raw(h), "transfer");
        t->ctx->wait_quiesced(*t, timeout_ns);
        return SG_OK;
    });
}

SG_API sg_status_t sg_transfer_release(sg_transfer_t h) {
    return guard(nullptr, [&] {
        if (!h) return SG_OK;
        not_in_callback("sg_transfer_release");
        auto t = transfers().remove(raw(h));
        if (!t) fail(SG_ERR_INVALID_HANDLE, "transfer handle is not live");
        t->ctx->release(*t);
        return SG_OK;
    });
}

}  // extern "C"

// ---- cluster directory ----------------------------------------------------------------------

namespace {

#ifdef SMARTGEN_WITH_DIRECTORY
// A directory handle: the etcd client, and for a published name the thread that answers session
// requests to it the moment they arrive (both sides must load each other's blob within the peer
// timeout), keeping the sessions for sg_directory_accept.
struct DirectoryObj {
    uint64_t ctx_handle = 0;  // 0: lookups only
    std::unique_ptr<sg::directory::Client> client;
    std::mutex mu;
    std::condition_variable cv;
    std::string served;  // the published name whose inbox the thread reads ("" while none)
    std::deque<sg_session_t> accepted;
    bool stopping = false;
    std::thread inbox;
    std::atomic<uint64_t> sessions_accepted{0}, requests_refused{0};

    ~DirectoryObj() {
        {
            std::lock_guard lock(mu);
            stopping = true;
        }
        cv.notify_all();
        if (client) client->interrupt();  // ends the inbox thread's watch now
        if (inbox.joinable()) inbox.join();
        client.reset();  // revokes the lease: the names go at once
    }

    void serve_inbox() {
        std::unique_lock lock(mu);
        while (!stopping) {
            const std::string name = served;
            lock.unlock();
            bool out_of_reach = false;
            try {
                // One watch stream a handle, idle until a request comes (destroy interrupts it).
                auto req = client->take_request(name, sg::now_ns() + 30 * 1000000000ull);
                if (req) answer(*req);
            } catch (const sg::Error &) {
                out_of_reach = true;
            } catch (...) {
                // Out of memory or another library's exception: never the host's end from this
                // thread. Backs off as from an unreachable cluster.
                out_of_reach = true;
            }
            lock.lock();
            if (out_of_reach) cv.wait_for(lock, std::chrono::milliseconds(500), [&] { return stopping; });
        }
    }

    void answer(const sg::directory::InboxEntry &req) {
        auto ctx = contexts().get(ctx_handle);
        if (!ctx) return;
        try {
            sg::wire::Hello peer = counting_auth_failures(*ctx, [&] { return core::parse_metadata(*ctx, req.blob); });
            sg_session_t s = add_session(*ctx, peer, nullptr, false);
            std::lock_guard lock(mu);
            accepted.push_back(s);
            sessions_accepted++;
            cv.notify_all();
        } catch (const sg::Error &e) {
            // Unsigned, signed with another key, corrupt, or a peer we already have a session with.
            requests_refused++;
            ctx->log.log(SG_LOG_WARN, "directory: a session request from " + req.from + " was refused: " + e.message());
        }
    }
};

core::Registry<DirectoryObj> &directories() {
    static core::Registry<DirectoryObj> r(8);
    return r;
}

uint64_t deadline_after(uint64_t timeout_ns) {
    const uint64_t now = sg::now_ns();
    return timeout_ns > UINT64_MAX - now ? UINT64_MAX : now + timeout_ns;
}

std::string name_arg(const char *name) {
    need(name, "name");
    std::string n(name);
    sg::directory::check_name(n);
    return n;
}

void destroy_directories_of(uint64_t ctx_handle) {
    // Each handle's destructor revokes its lease, which withdraws its names at once.
    directories().remove_if([ctx_handle](const DirectoryObj &d) { return d.ctx_handle == ctx_handle; });
}

std::shared_ptr<core::Context> directory_context(const DirectoryObj &d) {
    if (!d.ctx_handle) fail(SG_ERR_INVALID_STATE, "this directory handle was opened without a context");
    return lookup(contexts(), d.ctx_handle, "the directory's context");
}
#endif

sg_directory_options_t default_directory_options() {
    sg_directory_options_t o{};
    o.struct_size = sizeof o;
    o.lease_ttl_ms = 5000;
    o.request_timeout_ms = 1000;
    return o;
}

}  // namespace

SG_API void(sg_directory_options_init)(sg_directory_options_t *options) {
    sg_directory_options_init_sized(options, sizeof *options);
}
SG_API void sg_directory_options_init_sized(sg_directory_options_t *options, size_t size) {
    init_sized(options, size, default_directory_options());
}

// 0.5 appended two counters; the plain function keeps writing the 0.4 struct (see the assert above).
constexpr size_t kDirectoryStatsSize04 = offsetof(sg_directory_stats_t, names_taken_over);
SG_API void(sg_directory_stats_init)(sg_directory_stats_t *stats) {
    sg_directory_stats_init_sized(stats, kDirectoryStatsSize04);
}
SG_API void sg_directory_stats_init_sized(sg_directory_stats_t *stats, size_t size) {
    init_sized(stats, size, zeroed_with_size<sg_directory_stats_t>());
}

#ifdef SMARTGEN_WITH_DIRECTORY

SG_API sg_status_t sg_directory_open(sg_context_t ctx, const sg_directory_options_t *options, sg_directory_t *out,
                                     sg_error_info_t *err) {
    return guard(err, [&] {
        need(out, "out");
        need(options, "options");
        const sg_directory_options_t o = read_sized(options, default_directory_options(), "options");
        if (ctx) (void)lookup(contexts(), raw(ctx), "context");
        if (!o.endpoints) fail(SG_ERR_INVALID_ARGUMENT, "options.endpoints is required");
        sg::directory::Options d;
        d.endpoints = sg::directory::parse_endpoints(o.endpoints);
        if (o.prefix) d.prefix = o.prefix;
        d.lease_ttl_ms = o.lease_ttl_ms ? o.lease_ttl_ms : 5000;
        d.request_timeout_ms = o.request_timeout_ms ? o.request_timeout_ms : 1000;
        auto obj = std::make_shared<DirectoryObj>();
        obj->ctx_handle = ctx ? raw(ctx) : 0;
        obj->client = std::make_unique<sg::directory::Client>(std::move(d));
        // The cluster is there now: one member answered within twice the request timeout, however
        // many members are listed (members that refuse connections are passed at once).
        obj->client->ping(deadline_after(2ull * obj->client->options().request_timeout_ms * 1000000ull));
        *out = wrap<sg_directory_t>(directories().add(std::move(obj)));
        return SG_OK;
    });
}

SG_API sg_status_t sg_directory_publish(sg_directory_t h, const char *name, uint64_t timeout_ns) {
    return guard(nullptr, [&] {
        auto d = lookup(directories(), raw(h), "directory");
        const std::string n = name_arg(name);
        auto ctx = directory_context(*d);
        // An entry under the name that verifies under this context's key is this fleet's (a restarted
        // engine taking its name back); one that does not is another key's, and stays.
        const auto same_key = [&ctx](std::span<const uint8_t> held) {
            try {
                (void)core::parse_metadata(*ctx, held);
                return true;
            } catch (const Error &) {
                return false;
            }
        };
        d->client->publish(n, ctx->metadata(), deadline_after(timeout_ns), same_key);
        std::lock_guard lock(d->mu);
        if (d->served.empty()) {
            d->served = n;
            d->inbox = std::thread([obj = d.get()] { obj->serve_inbox(); });
        }
        return SG_OK;
    });
}

SG_API sg_status_t sg_directory_unpublish(sg_directory_t h, const char *name, uint64_t timeout_ns) {
    return guard(nullptr, [&] {
        auto d = lookup(directories(), raw(h), "directory");
        d->client->unpublish(name_arg(name), deadline_after(timeout_ns));
        return SG_OK;
    });
}

SG_API sg_status_t sg_directory_lookup(sg_directory_t h, const char *name, uint64_t timeout_ns, void *buf, size_t cap,
                                       size_t *len) {
    return guard(nullptr, [&] {
        auto d = lookup(directories(), raw(h), "directory");
        need(len, "len");
        const bool query = size_query(buf, cap, "buf");
        const std::string n = name_arg(name);
        auto blob = d->client->lookup(n, deadline_after(timeout_ns));
        if (!blob) fail(SG_ERR_NOT_FOUND, "no engine is published as \"" + n + "\"");
        *len = blob->size();
        if (query) return SG_OK;
        if (cap < blob->size()) fail(SG_ERR_BUFFER_TOO_SMALL, "the blob needs " + std::to_string(blob->size()) + " bytes");
        std::memcpy(buf, blob->data(), blob->size());
        return SG_OK;
    });
}

SG_API sg_status_t sg_directory_list(sg_directory_t h, const char *name_prefix, uint64_t timeout_ns, char *buf,
                                     size_t cap, size_t *len, size_t *count) {
    return guard(nullptr, [&] {
        auto d = lookup(directories(), raw(h), "directory");
        need(len, "len");
        const bool query = size_query(buf, cap, "buf");
        const auto names = d->client->list(name_prefix ? name_prefix : "", deadline_after(timeout_ns));
        std::string joined;
        for (const auto &n : names) joined.append(n).push_back('\0');
        *len = joined.size();
        if (count) *count = names.size();
        if (query) return SG_OK;
        if (cap < joined.size()) fail(SG_ERR_BUFFER_TOO_SMALL, "the names need " + std::to_string(joined.size()) + " bytes");
        std::memcpy(buf, joined.data(), joined.size());
        return SG_OK;
    });
}

SG_API sg_status_t sg_directory_wait(sg_directory_t h, const char *name, int present, uint64_t timeout_ns) {
    return guard(nullptr, [&] {
        not_in_callback("sg_directory_wait");
        auto d = lookup(directories(), raw(h), "directory");
        const std::string n = name_arg(name);
        if (!d->client->wait(n, present != 0, deadline_after(timeout_ns)))
            fail(SG_ERR_TIMEOUT, "\"" + n + "\" is still " + (present ? "absent" : "published"));
        return SG_OK;
    });
}

SG_API sg_status_t sg_directory_connect(sg_directory_t h, const char *name, const sg_session_options_t *options,
                                        uint64_t timeout_ns, sg_session_t *out, sg_error_info_t *err) {
    return guard(err, [&] {
        not_in_callback("sg_directory_connect");
        auto d = lookup(directories(), raw(h), "directory");
        need(out, "out");
        const std::string n = name_arg(name);
        auto ctx = directory_context(*d);
        const uint64_t deadline = deadline_after(timeout_ns);
        auto blob = d->client->lookup(n, deadline);
        if (!blob) fail(SG_ERR_NOT_FOUND, "no engine is published as \"" + n + "\"");
        // The entry's signature first: a forged one gets nothing of ours, not even our blob.
        sg::wire::Hello peer = counting_auth_failures(*ctx, [&] { return core::parse_metadata(*ctx, *blob); });
        char from[32];
        std::snprintf(from, sizeof from, "ctx-%016llx", static_cast<unsigned long long>(ctx->id));
        d->client->request(n, from, ctx->metadata(), deadline);
        *out = add_session(*ctx, peer, options, false);
        return SG_OK;
    });
}

SG_API sg_status_t sg_directory_accept(sg_directory_t h, uint64_t timeout_ns, sg_session_t *out, sg_error_info_t *err) {
    return guard(err, [&] {
        not_in_callback("sg_directory_accept");
        auto d = lookup(directories(), raw(h), "directory");
        need(out, "out");
        std::unique_lock lock(d->mu);
        if (d->served.empty()) fail(SG_ERR_INVALID_STATE, "nothing is published through this directory handle");
        const auto until = std::chrono::steady_clock::now() + std::chrono::nanoseconds(std::min<uint64_t>(timeout_ns, INT64_MAX / 2));
        if (!d->cv.wait_until(lock, until, [&] { return !d->accepted.empty() || d->stopping; }))
            fail(SG_ERR_TIMEOUT, "no session request arrived");
        if (d->accepted.empty()) fail(SG_ERR_INVALID_STATE, "the directory is being destroyed");
        *out = d->accepted.front();
        d->accepted.pop_front();
        return SG_OK;
    });
}

SG_API sg_status_t sg_directory_stats(sg_directory_t h, sg_directory_stats_t *stats) {
    return guard(nullptr, [&] {
        auto d = lookup(directories(), raw(h), "directory");
        need(stats, "stats");
        if (stats->struct_size < sizeof(size_t))
            fail(SG_ERR_INVALID_ARGUMENT, "stats.struct_size is not set (call sg_directory_stats_init)");
        const sg::directory::Stats c = d->client->stats();
        sg_directory_stats_t s{};
        s.struct_size = sizeof s;
        s.requests = c.requests;
        s.failovers = c.failovers;
        s.keepalives = c.keepalives;
        s.leases_granted = c.leases_granted;
        s.sessions_accepted = d->sessions_accepted.load();
        s.requests_refused = d->requests_refused.load();
        s.names_taken_over = c.names_taken_over;
        s.names_restored = c.names_restored;
        const size_t keep = stats->struct_size;
        std::memcpy(stats, &s, std::min(keep, sizeof s));
        stats->struct_size = std::min(keep, sizeof s);
        return SG_OK;
    });
}

SG_API sg_status_t sg_directory_destroy(sg_directory_t h) {
    return guard(nullptr, [&] {
        not_in_callback("sg_directory_destroy");
        if (!h) return SG_OK;
        if (!directories().remove(raw(h))) fail(SG_ERR_INVALID_HANDLE, "directory handle is not live");
        return SG_OK;
    });
}

#else  // built without the directory (SMARTGEN_DIRECTORY=OFF)

namespace {
void destroy_directories_of(uint64_t) {}

sg_status_t no_directory(sg_error_info_t *err) {
    return guard(err, []() -> sg_status_t {
        fail(SG_ERR_UNSUPPORTED, "this libsmartgen was built without the cluster directory (SMARTGEN_DIRECTORY=OFF)");
    });
}
}  // namespace

SG_API sg_status_t sg_directory_open(sg_context_t, const sg_directory_options_t *, sg_directory_t *, sg_error_info_t *err) {
    return no_directory(err);
}
SG_API sg_status_t sg_directory_publish(sg_directory_t, const char *, uint64_t) { return no_directory(nullptr); }
SG_API sg_status_t sg_directory_unpublish(sg_directory_t, const char *, uint64_t) { return no_directory(nullptr); }
SG_API sg_status_t sg_directory_lookup(sg_directory_t, const char *, uint64_t, void *, size_t, size_t *) {
    return no_directory(nullptr);
}
SG_API sg_status_t sg_directory_list(sg_directory_t, const char *, uint64_t, char *, size_t, size_t *, size_t *) {
    return no_directory(nullptr);
}
SG_API sg_status_t sg_directory_wait(sg_directory_t, const char *, int, uint64_t) { return no_directory(nullptr); }
SG_API sg_status_t sg_directory_connect(sg_directory_t, const char *, const sg_session_options_t *, uint64_t,
                                        sg_session_t *, sg_error_info_t *err) {
    return no_directory(err);
}
SG_API sg_status_t sg_directory_accept(sg_directory_t, uint64_t, sg_session_t *, sg_error_info_t *err) {
    return no_directory(err);
}
SG_API sg_status_t sg_directory_stats(sg_directory_t, sg_directory_stats_t *) { return no_directory(nullptr); }
SG_API sg_status_t sg_directory_destroy(sg_directory_t h) {
    return h ? no_directory(nullptr) : SG_OK;
}

#endif
