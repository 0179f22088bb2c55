// The C ABI: contexts (options, parameters, statistics, metrics text) and the provider query.
#include "abi.hpp"

using namespace sg::abi;
using sg::fail;

extern "C" {

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

SG_API sg_status_t sg_context_destroy(sg_context_t h) {
    return guard(nullptr, [&] {
        not_in_callback("sg_context_destroy");
        if (!h) return SG_OK;
        auto ctx = contexts().remove(raw(h));
        if (!ctx) fail(SG_ERR_INVALID_HANDLE, "context handle is not live");
        // Its names first: an entry left published would send peers to a context that is gone.
        destroy_directories_of(raw(h));
        core::Context *c = ctx.get();
        for (auto &t : transfers().remove_if([c](const core::Transfer &t) { return t.ctx == c; })) t->release();
        for (auto &s : sessions().remove_if([c](const core::Session &s) { return s.ctx == c; })) s->close();
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

// 0.5 appended the verification counters; the plain function keeps writing the 0.4 struct (abi.hpp).
constexpr size_t kContextStatsSize04 = offsetof(sg_context_stats_t, blocks_verified);
SG_API void(sg_context_stats_init)(sg_context_stats_t *s) { sg_context_stats_init_sized(s, kContextStatsSize04); }
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
        const std::string text = ctx->metrics_text();
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

}  // extern "C"
