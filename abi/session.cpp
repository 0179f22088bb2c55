// The C ABI: listeners, sessions, notifications and the metadata path.
#include "abi.hpp"

using namespace sg::abi;
using sg::fail;

extern "C" {

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

}  // extern "C"

namespace sg::abi {
sg_session_t add_session(core::Context &ctx, const sg::wire::Hello &peer, const sg_session_options_t *options,
                         bool authenticated) {
    sg_session_options_t o = read_sized(options, default_session_options(), "options");
    auto s = ctx.open_session(peer, o, authenticated);
    return wrap<sg_session_t>(sessions().add(std::move(s)));
}
}  // namespace sg::abi

extern "C" {

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
        return s->wait_ready(timeout_ns);
    });
}

SG_API sg_status_t sg_session_export_kv(sg_session_t sh, sg_kv_handle_t kh) {
    return guard(nullptr, [&] {
        auto s = lookup(sessions(), raw(sh), "session");
        auto p = lookup(pools(), raw(kh), "KV");
        if (p->ctx != s->ctx) fail(SG_ERR_INVALID_ARGUMENT, "the KV handle belongs to another context");
        s->export_kv(*p);
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
        s->notify(std::span(static_cast<const uint8_t *>(data), len));
        return SG_OK;
    });
}

SG_API sg_status_t sg_session_next_notification(sg_session_t sh, void *buf, size_t cap, size_t *len) {
    return guard(nullptr, [&] {
        auto s = lookup(sessions(), raw(sh), "session");
        need(len, "len");
        const bool query = size_query(buf, cap, "buf");
        // SG_ERR_AGAIN is the normal "nothing yet", not recorded as an error.
        return s->next_notification(buf, cap, query, *len);
    });
}

SG_API sg_status_t sg_session_error(sg_session_t sh, sg_status_t *status, char *msg, size_t cap) {
    return guard(nullptr, [&] {
        auto s = lookup(sessions(), raw(sh), "session");
        need(status, "status");
        check_detail_buffer(msg, cap);
        const core::Outcome o = s->outcome();
        *status = o.status;
        copy_detail(o.message, msg, cap);
        return SG_OK;
    });
}

SG_API sg_status_t sg_session_close(sg_session_t sh, uint64_t timeout_ns) {
    return guard(nullptr, [&] {
        not_in_callback("sg_session_close");
        auto s = lookup(sessions(), raw(sh), "session");
        s->close_gracefully(timeout_ns);
        return SG_OK;
    });
}

SG_API sg_status_t sg_session_destroy(sg_session_t sh) {
    return guard(nullptr, [&] {
        not_in_callback("sg_session_destroy");
        if (!sh) return SG_OK;
        auto s = sessions().remove(raw(sh));
        if (!s) fail(SG_ERR_INVALID_HANDLE, "session handle is not live");
        s->close();
        return SG_OK;
    });
}

}  // extern "C"
