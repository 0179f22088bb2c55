// The C ABI: KV layouts and registered pools.
#include "abi.hpp"

using namespace sg::abi;
using sg::fail;

extern "C" {

// ---- KV ----
SG_API void(sg_kv_layout_init)(sg_kv_layout_t *l) { sg_kv_layout_init_sized(l, sizeof *l); }
SG_API void sg_kv_layout_init_sized(sg_kv_layout_t *l, size_t size) { init_sized(l, size, default_kv_layout()); }

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

}  // extern "C"
