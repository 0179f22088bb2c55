// What the entry points' files share (abi/*.cpp, one per section of the header): the error funnel
// guard(), the handle registries, and the argument checks every entry point applies alike. Internal
// to libsmartgen: nothing here is exported (abi/smartgen.map exports the sg_ names only).
#pragma once

#include "core/core.hpp"
#include "core/registry.hpp"
#include "core/selection.hpp"
#ifdef SMARTGEN_WITH_DIRECTORY
#include "directory/directory.hpp"
#endif

#include <smartgen/smartgen.h>


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
#include <optional>
#include <stdexcept>
#include <string_view>

namespace sg::abi {

namespace core = sg::core;

inline thread_local std::string t_last_error;

// Keeps prefix + detail as this thread's last error and in *err. Never throws and, when memory has
// run out, never allocates: the thread's message is then cut to the buffer it already holds.
sg_status_t record(sg_status_t status, std::string_view prefix, std::string_view detail,
                   sg_error_info_t *err) noexcept;

sg_status_t record(sg_status_t status, std::string_view message, sg_error_info_t *err) noexcept;

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
inline core::Registry<core::Context> &contexts() {
    static core::Registry<core::Context> r(1);
    return r;
}
inline core::Registry<core::KvPool> &pools() {
    static core::Registry<core::KvPool> r(2);
    return r;
}
inline core::Registry<core::Listener> &listeners() {
    static core::Registry<core::Listener> r(3);
    return r;
}
inline core::Registry<core::Session> &sessions() {
    static core::Registry<core::Session> r(4);
    return r;
}
inline core::Registry<sg::select::Profile> &profiles() {
    static core::Registry<sg::select::Profile> r(6);
    return r;
}

inline core::Registry<core::RequestSelector> &selectors() {
    static core::Registry<core::RequestSelector> r(7);
    return r;
}

inline core::Registry<core::Transfer> &transfers() {
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
// old size (sg_directory_stats_init and sg_context_stats_init in 0.5) — under a new default version
// only if a released version already wrote more (sg_transfer_options_init). docs/abi.md, "Growing a
// struct".
static_assert(sizeof(sg_error_info_t) == 528 && sizeof(sg_context_options_t) == 144 &&
                  sizeof(sg_context_stats_t) == 176 && sizeof(sg_kv_layout_t) == 88 &&
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
inline void not_in_callback(const char *fn) {
    if (core::in_event_callback())
        fail(SG_ERR_INVALID_STATE, std::string(fn) + " may not be called from a transfer event callback (it blocks)");
}

// The bits each flags field knows. A bit outside them is refused, never ignored: a caller compiled
// against a newer header must learn that this library does not do what the bit asks.
constexpr uint32_t kTransferFlags = SG_TRANSFER_ALL_LAYERS_WRITTEN;
constexpr uint32_t kTransferPaths = SG_PATH_FULL | SG_PATH_PROACTIVE | SG_PATH_ON_DEMAND | SG_PATH_SPECULATIVE;
constexpr uint32_t kLayerBits = SG_LAYER_WRITTEN | SG_LAYER_READY | SG_LAYER_ESSENTIAL;

void check_bits(uint32_t value, uint32_t known, const char *field, const char *family);

void need(const void *p, const char *name);

// The one rule for a caller buffer that comes with a size out-parameter (the header's "Caller
// buffers"): NULL with capacity 0 asks for the size, NULL with a capacity is refused. Checked before
// anything is computed or written; true for a size query.
bool size_query(const void *buf, size_t cap, const char *name);

// An optional error-detail string, cut to fit (as in sg_error_info_t): msg NULL with cap 0 skips it.
void check_detail_buffer(const char *msg, size_t cap);
void copy_detail(const std::string &s, char *msg, size_t cap);

void copy_string(const std::string &s, char *buf, size_t cap);

// An IPv4 literal in dotted-quad form or an IPv6 literal (a scope, "fe80::1%eth0", allowed): what
// the header promises local_addr is. Host names and the short IPv4 forms ("127.1") are refused,
// rather than resolved into an address the caller did not name.
void check_ip_literal(const char *addr, const char *field);

// Replaces the fields left 0 by their defaults (the one table: sg::defaults, common/common.hpp;
// SG_PROGRESS_SPIN_NONE by the runtime's 0 µs) and refuses values outside a field's domain,
// naming the field.
void resolve_option_defaults(sg_context_options_t &o);

inline sg_context_options_t default_context_options() {
    sg_context_options_t o{};
    o.struct_size = sizeof o;
    o.header_version = SG_VERSION_NUMBER;
    o.progress_spin_us = defaults::kProgressSpinUs;
    o.max_ops_in_flight = defaults::kMaxOpsInFlight;
    o.log_level = SG_LOG_WARN;
    o.peer_timeout_ms = 0;  // the core's default: defaults::kPeerTimeoutMs, or SG_PEER_TIMEOUT_MS
    o.max_bytes_in_flight = defaults::kMaxBytesInFlight;
    o.max_session_bytes_in_flight = defaults::kMaxSessionBytesInFlight;
    o.max_transfers_per_session = defaults::kMaxTransfersPerSession;
    return o;
}

inline sg_transfer_options_t default_transfer_options() {
    sg_transfer_options_t o{};
    o.struct_size = sizeof o;
    o.paths = SG_PATH_FULL;
    return o;
}

inline sg_directory_options_t default_directory_options() {
    sg_directory_options_t o{};
    o.struct_size = sizeof o;
    o.lease_ttl_ms = defaults::kLeaseTtlMs;
    o.request_timeout_ms = defaults::kRequestTimeoutMs;
    return o;
}

inline sg_session_options_t default_session_options() {
    sg_session_options_t o{};
    o.struct_size = sizeof o;
    return o;
}

inline core::ParamBounds bounds_of(sg_param_t p) { return core::param_bounds(p); }


inline sg_kv_layout_t default_kv_layout() {
    auto l = zeroed_with_size<sg_kv_layout_t>();
    l.dtype = SG_DTYPE_FP16;
    l.packing = SG_KV_SEPARATE;
    l.block_order = SG_BLOCK_TOKEN_MAJOR;
    l.mem_kind = SG_MEM_HOST;
    return l;
}

inline sg_kv_layout_t read_layout(const sg_kv_layout_t *in) {
    need(in, "layout");
    return read_sized(in, default_kv_layout(), "layout");
}

// Made by accept, connect, the metadata path and the directory's inbox alike (session.cpp).
sg_session_t add_session(core::Context &ctx, const sg::wire::Hello &peer, const sg_session_options_t *options,
                         bool authenticated);

// A bootstrap that a peer failed to authenticate is counted before its error goes on.
template <class F> auto counting_auth_failures(core::Context &ctx, F &&bootstrap) {
    try {
        return bootstrap();
    } catch (const sg::Error &e) {
        ctx.count_refused_session(e);
        throw;
    }
}

// A context's directory handles, destroyed with it (directory.cpp).
void destroy_directories_of(uint64_t ctx_handle);

}  // namespace sg::abi

