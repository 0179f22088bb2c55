// The C ABI: transfers (post, expect, readiness, waits, fetches, statistics).
#include "abi.hpp"

using namespace sg::abi;
using sg::fail;

extern "C" {

// ---- transfers ----
SG_API void sg_transfer_options_init_sized(sg_transfer_options_t *o, size_t size) {
    init_sized(o, size, default_transfer_options());
}

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
        xfer.set_api_handle(*out);
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
        t->layer_written(layer, nullptr, 0, 0, cuda_stream);
        return SG_OK;
    });
}

SG_API sg_status_t sg_transfer_test(sg_transfer_t h) {
    return guard(nullptr, [&] {
        auto t = lookup(transfers(), raw(h), "transfer");
        const core::Outcome o = t->outcome();
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
        record(st, t.outcome().message, nullptr);
}
}  // namespace

SG_API sg_status_t sg_transfer_wait(sg_transfer_t h, uint64_t timeout_ns) {
    return guard(nullptr, [&] {
        not_in_callback("sg_transfer_wait");
        auto t = lookup(transfers(), raw(h), "transfer");
        sg_status_t st = t->wait(-1, timeout_ns);
        record_failure(*t, st);
        return st;
    });
}

SG_API sg_status_t sg_transfer_wait_layer(sg_transfer_t h, uint32_t layer, uint64_t timeout_ns) {
    return guard(nullptr, [&] {
        not_in_callback("sg_transfer_wait_layer");
        auto t = lookup(transfers(), raw(h), "transfer");
        if (layer >= t->num_layers()) fail(SG_ERR_OUT_OF_RANGE, "layer " + std::to_string(layer) + " >= num_layers");
        sg_status_t st = t->wait(layer, timeout_ns);
        record_failure(*t, st);
        return st;
    });
}

SG_API sg_status_t sg_transfer_layer_state(sg_transfer_t h, uint32_t layer, uint32_t *state) {
    return guard(nullptr, [&] {
        auto t = lookup(transfers(), raw(h), "transfer");
        need(state, "state");
        *state = t->layer_state(layer);
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
        t->layer_written(layer, queries, num_queries, num_q_heads);
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
        t->layer_written(layer, a.queries, a.num_queries, a.num_q_heads, a.cuda_stream,
                              a.queries_mem_kind == SG_MEM_CUDA);
        return SG_OK;
    });
}

SG_API sg_status_t sg_transfer_wait_layer_state(sg_transfer_t h, uint32_t layer, uint32_t bits, uint64_t timeout_ns) {
    return guard(nullptr, [&] {
        not_in_callback("sg_transfer_wait_layer_state");
        auto t = lookup(transfers(), raw(h), "transfer");
        check_bits(bits, kLayerBits, "bits", "SG_LAYER_*");
        const sg_status_t st = t->wait_layer_state(layer, bits, timeout_ns);
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
        if (!t->digests(layer, query ? std::span<float>() : std::span<float>(out, cap), n))
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
        t->fetch(layer, std::span<const uint32_t>(blocks, count));
        return SG_OK;
    });
}

SG_API sg_status_t sg_transfer_wait_blocks(sg_transfer_t h, uint32_t layer, const uint32_t *blocks, size_t count,
                                           uint64_t timeout_ns) {
    return guard(nullptr, [&] {
        not_in_callback("sg_transfer_wait_blocks");
        auto t = lookup(transfers(), raw(h), "transfer");
        if (count && !blocks) fail(SG_ERR_INVALID_ARGUMENT, "blocks is NULL");
        const sg_status_t st = t->wait_blocks(layer, std::span<const uint32_t>(blocks, count), timeout_ns);
        record_failure(*t, st);
        return st;
    });
}

SG_API sg_status_t sg_transfer_residency(sg_transfer_t h, uint32_t layer, uint8_t *bitmap, size_t cap, size_t *num_bits) {
    return guard(nullptr, [&] {
        auto t = lookup(transfers(), raw(h), "transfer");
        need(num_bits, "num_bits");
        const bool query = size_query(bitmap, cap, "bitmap");
        t->residency_bitmap(layer, query ? nullptr : bitmap, cap, *num_bits);
        return SG_OK;
    });
}

SG_API sg_status_t sg_transfer_status(sg_transfer_t h, sg_status_t *status, char *msg, size_t cap) {
    return guard(nullptr, [&] {
        auto t = lookup(transfers(), raw(h), "transfer");
        need(status, "status");
        check_detail_buffer(msg, cap);
        const core::Outcome o = t->outcome();
        *status = o.status;
        copy_detail(o.message, msg, cap);
        return SG_OK;
    });
}

SG_API void sg_transfer_stats_init_sized(sg_transfer_stats_t *s, size_t size) {
    init_sized(s, size, zeroed_with_size<sg_transfer_stats_t>());
}

SG_API sg_status_t sg_transfer_stats(sg_transfer_t h, sg_transfer_stats_t *out) {
    return guard(nullptr, [&] {
        auto t = lookup(transfers(), raw(h), "transfer");
        need(out, "out");
        if (out->struct_size < sizeof(size_t)) fail(SG_ERR_INVALID_ARGUMENT, "out->struct_size is not set");
        sg_transfer_stats_t s = t->stats_snapshot();
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
        *ns = t->layer_time(layer);
        return SG_OK;
    });
}

SG_API sg_status_t sg_transfer_cancel(sg_transfer_t h) {
    return guard(nullptr, [&] {
        auto t = lookup(transfers(), raw(h), "transfer");
        t->cancel(SG_ERR_CANCELED, "canceled by the application");
        return SG_OK;
    });
}

SG_API sg_status_t sg_transfer_wait_quiesced(sg_transfer_t h, uint64_t timeout_ns) {
    return guard(nullptr, [&] {
        not_in_callback("sg_transfer_wait_quiesced");
        auto t = lookup(transfers(), raw(h), "transfer");
        t->wait_quiesced(timeout_ns);
        return SG_OK;
    });
}

SG_API sg_status_t sg_transfer_release(sg_transfer_t h) {
    return guard(nullptr, [&] {
        if (!h) return SG_OK;
        not_in_callback("sg_transfer_release");
        auto t = transfers().remove(raw(h));
        if (!t) fail(SG_ERR_INVALID_HANDLE, "transfer handle is not live");
        t->release();
        return SG_OK;
    });
}

}  // extern "C"
