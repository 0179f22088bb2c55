// The C ABI: profiles and selectors.
#include "abi.hpp"

using namespace sg::abi;
using sg::fail;

extern "C" {

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

SG_API sg_status_t sg_selector_create(sg_profile_t ph, const sg_kv_layout_t *layout, uint64_t num_tokens,
                                      sg_selector_t *out, sg_error_info_t *err) {
    return guard(err, [&] {
        auto p = lookup(profiles(), raw(ph), "profile");
        need(out, "out");
        need(layout, "layout");
        const sg::kv::Layout shape = sg::kv::make_layout_shape(read_layout(layout));
        *out = wrap<sg_selector_t>(selectors().add(std::make_shared<core::RequestSelector>(*p, shape, num_tokens)));
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
        *floats = size_t(s->digest_floats());
        return SG_OK;
    });
}

namespace {
// A pool layout handed with a selector call, as the runtime's layout.
sg::kv::Layout pool_layout(const sg_kv_layout_t *layout, const uint32_t *ids) {
    need(layout, "layout");
    need(ids, "block_ids");
    return sg::kv::make_layout(read_layout(layout));
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
        const sg::kv::Layout kl = pool_layout(layout, ids);
        s->digest(kl, k_region_of(layout, layer), std::span(ids, n), out, cap);
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
        std::optional<sg::kv::Layout> keys;
        const uint8_t *k_region = nullptr;
        if (in.keys_layout) {
            keys = pool_layout(in.keys_layout, in.block_ids);
            k_region = k_region_of(in.keys_layout, layer);
        }
        const auto &chosen =
            s->select(layer, si, keys ? &*keys : nullptr, k_region, std::span(in.block_ids, keys ? in.num_block_ids : 0));
        *count = chosen.size();
        if (query) return SG_OK;
        if (cap < chosen.size())
            fail(SG_ERR_BUFFER_TOO_SMALL, "the selection holds " + std::to_string(chosen.size()) + " blocks");
        std::copy(chosen.begin(), chosen.end(), blocks);
        return SG_OK;
    });
}

SG_API sg_status_t sg_selector_budget_blocks(sg_selector_t h, uint32_t layer, uint64_t *blocks) {
    return guard(nullptr, [&] {
        auto s = lookup(selectors(), raw(h), "selector");
        need(blocks, "blocks");
        *blocks = s->budget_blocks(layer);
        return SG_OK;
    });
}

}  // extern "C"
