// What the host does with a transfer (transfer.hpp, "The host's verbs"): the ABI's calls on one,
// each taking the context's mutex itself. The engine's steps that move its bytes are the
// transfer's private methods (transfer.cpp, scheduler.cpp, staging.cpp, paths_*.cpp).
#include <unistd.h>

#include <algorithm>
#include <cstring>

#include "core/paths.hpp"

namespace sg::core {

using paths::kMaxBlocksPerMessage;
using paths::request_blocks;

namespace {

void check_layer(const Transfer &t, uint32_t layer) {
    if (layer >= t.num_layers())
        fail(SG_ERR_OUT_OF_RANGE,
             "layer " + std::to_string(layer) + " >= num_layers " + std::to_string(t.num_layers()));
}

}  // namespace

Outcome Transfer::outcome() const {
    std::lock_guard lock(ctx->mu);
    return {status, error};
}

uint32_t Transfer::layer_state(uint32_t layer) const {
    check_layer(*this, layer);
    std::lock_guard lock(ctx->mu);
    const Transfer::Layer &L = layers[layer];
    return (L.out.written() ? SG_LAYER_WRITTEN : 0u) | (L.ready ? SG_LAYER_READY : 0u) |
           (L.essential ? SG_LAYER_ESSENTIAL : 0u);
}

uint64_t Transfer::layer_time(uint32_t layer) const {
    check_layer(*this, layer);
    std::lock_guard lock(ctx->mu);
    const Transfer::Layer &L = layers[layer];
    const uint64_t from = std::max(stats.start_ns, L.out.written_ns);
    return L.ready && L.ready_ns > from ? L.ready_ns - from : 0;
}

void Transfer::residency_bitmap(uint32_t layer, uint8_t *bitmap, size_t cap, size_t &num_bits) const {
    check_layer(*this, layer);
    std::lock_guard lock(ctx->mu);
    const size_t nb = residency.num_blocks();
    num_bits = nb;  // reported also when the buffer is too small (the caller-buffer rule)
    if (!bitmap) return;
    if (cap < (nb + 7) / 8) fail(SG_ERR_BUFFER_TOO_SMALL, "bitmap needs " + std::to_string((nb + 7) / 8) + " bytes");
    residency.copy_layer(layer, bitmap);
}

sg_transfer_stats_t Transfer::stats_snapshot() const {
    std::lock_guard lock(ctx->mu);
    sg_transfer_stats_t s = stats;
    s.bytes_full = path().whole ? s.bytes : 0;
    return s;
}

sg_status_t Transfer::wait_layer_state(uint32_t layer, uint32_t bits, uint64_t timeout_ns) {
    check_layer(*this, layer);
    const Transfer::Layer &L = layers[layer];
    bool no_proactive = false;
    const sg_status_t st = wait_for(timeout_ns, [&] {
        // The decode side learns the paths at the match; without the proactive path the essential
        // bit never comes.
        no_proactive = (bits & SG_LAYER_ESSENTIAL) && paths() && !(paths() & SG_PATH_PROACTIVE);
        if (no_proactive) return true;
        return (!(bits & SG_LAYER_WRITTEN) || L.out.written() || !post_side) && (!(bits & SG_LAYER_READY) || L.ready) &&
               (!(bits & SG_LAYER_ESSENTIAL) || L.essential);
    });
    if (no_proactive)
        fail(SG_ERR_INVALID_STATE, "SG_LAYER_ESSENTIAL needs SG_PATH_PROACTIVE, which the transfer lacks");
    return st;
}

sg_status_t Transfer::wait_blocks(uint32_t layer, std::span<const uint32_t> blocks, uint64_t timeout_ns) {
    check_layer(*this, layer);
    for (size_t i = 0; i < blocks.size(); ++i)
        if (blocks[i] >= residency.num_blocks())
            fail(SG_ERR_OUT_OF_RANGE, "blocks[" + std::to_string(i) + "] is beyond the request's block table");
    // Resident blocks stay usable whatever happens to the transfer later (a lease that ended, a
    // peer that went away): they are checked first.
    return wait_for(timeout_ns, [&] {
        for (uint32_t b : blocks)
            if (!residency.test(layer, b)) return false;
        return true;
    });
}

void Transfer::fetch(uint32_t layer, std::span<const uint32_t> blocks) {
    if (post_side) fail(SG_ERR_INVALID_STATE, "sg_transfer_fetch is for the decode (expecting) side");
    if (layer >= layers.size())
        fail(SG_ERR_OUT_OF_RANGE, "layer " + std::to_string(layer) + " >= num_layers " + std::to_string(layers.size()));
    const uint32_t nb = request_blocks(*this);
    for (size_t i = 0; i < blocks.size(); ++i)
        if (blocks[i] >= nb)
            fail(SG_ERR_OUT_OF_RANGE, "blocks[" + std::to_string(i) + "] = " + std::to_string(blocks[i]) +
                                          " is beyond the request's " + std::to_string(nb) + " blocks");
    std::lock_guard lock(ctx->mu);
    if (finished()) {
        if (status < 0) fail(status, error);
        return;  // complete: every block is resident
    }
    if (!paths())
        fail(SG_ERR_INVALID_STATE, "the prefill side has not started this transfer yet (wait for SG_LAYER_ESSENTIAL)");
    if (!(paths() & SG_PATH_ON_DEMAND)) fail(SG_ERR_INVALID_STATE, "the transfer was posted without SG_PATH_ON_DEMAND");
    Transfer::Layer &L = layers[layer];
    std::vector<uint32_t> fresh;
    bool all_resident = true;
    for (uint32_t b : blocks) {
        if (residency.test(layer, b)) continue;
        all_resident = false;
        if (!L.in.requested[b]) {
            L.in.requested[b] = 1;
            fresh.push_back(b);
        }
    }
    stats.fetch_requests++;
    stats.fetch_blocks += fresh.size();
    if (all_resident) {
        emit(SG_EVENT_BLOCKS_READY, layer, SG_OK, blocks);
        return;
    }
    decode().fetches.push_back({layer, {blocks.begin(), blocks.end()}});
    for (size_t first = 0; first < fresh.size(); first += kMaxBlocksPerMessage) {
        wire::Fetch m;
        m.request_id = request_id;
        m.decode_xfer_id = id;
        m.layer = layer;
        m.blocks.assign(fresh.begin() + ptrdiff_t(first),
                        fresh.begin() + ptrdiff_t(std::min(fresh.size(), first + kMaxBlocksPerMessage)));
        std::vector<uint8_t> out;
        wire::encode(out, ctx->id, m);
        session->send(out);
    }
    ctx->wake();
}

bool Transfer::digests(uint32_t layer, std::span<float> out, size_t &floats) {
    std::lock_guard lock(ctx->mu);
    Transfer::Layer &L = layers[layer];
    if (!post_side && L.essential && L.in.digests_deferred) {
        L.in.digests_deferred = false;
        digest_proactive_blocks(layer);
    }
    if (post_side || !L.essential || L.digests.empty()) return false;
    const kv::Layout &KL = pool->layout;
    floats = kernels::digest_floats(request_blocks(*this), KL.num_kv_heads, KL.head_dim);
    if (out.size() < floats) return true;  // the caller asked for the count, or its buffer is short
    const size_t elem = L.digests.size() / floats;
    float *dst = out.data();
    if (elem == 4) {
        std::memcpy(dst, L.digests.data(), floats * 4);
        return true;
    }
    // Straight into the caller's buffer, one loop per dtype so that each vectorises: a layer's
    // digests are a million values at 8K tokens, converted under the context's lock while the host
    // waits for its first token (a loop with the dtype test inside, into a fresh vector copied
    // again, took 3-4 ms a layer).
    const uint8_t *src = L.digests.data();
    if (KL.dtype == SG_DTYPE_BF16) {
        for (size_t i = 0; i < floats; ++i) {
            uint16_t h;
            std::memcpy(&h, src + 2 * i, 2);
            dst[i] = kernels::bf16_to_float(h);
        }
    } else {
        for (size_t i = 0; i < floats; ++i) {
            uint16_t h;
            std::memcpy(&h, src + 2 * i, 2);
            dst[i] = kernels::fp16_to_float(h);
        }
    }
    return true;
}

sg_status_t Transfer::wait_for(uint64_t timeout_ns, const std::function<bool()> &pred) {
    const uint64_t deadline = now_ns() + std::min<uint64_t>(timeout_ns, uint64_t(1) << 62);
    std::unique_lock lock(ctx->mu);
    while (!pred() && !finished()) {
        if (now_ns() >= deadline) return SG_ERR_TIMEOUT;
        ctx->wait_step(lock, deadline);
    }
    drain_events(lock, deadline);
    if (pred()) return SG_OK;
    return status;
}

void Transfer::set_api_handle(void *handle) {
    api_handle.store(handle, std::memory_order_release);
    if (ctx->opt_.event_fn) ctx->wake();  // events that waited for the handle may go now
}

void Transfer::wait_quiesced(uint64_t timeout_ns) {
    const uint64_t deadline = now_ns() + std::min<uint64_t>(timeout_ns, uint64_t(1) << 62);
    std::unique_lock lock(ctx->mu);
    for (note_quiesced(); !is_quiesced(); note_quiesced()) {
        const uint64_t now = now_ns();
        if (now >= deadline)
            fail(SG_ERR_TIMEOUT, finished() ? "the peer has not confirmed that its writes stopped"
                                            : "the transfer is still in progress");
        ctx->wait_step(lock, deadline);
    }
    drain_events(lock, deadline);
}

sg_status_t Transfer::wait(int64_t layer, uint64_t timeout_ns) {
    const uint64_t deadline = now_ns() + std::min<uint64_t>(timeout_ns, uint64_t(1) << 62);
    std::unique_lock lock(ctx->mu);
    auto done = [&] {
        if (finished()) return true;
        return layer >= 0 && layers[size_t(layer)].ready;
    };
    while (!done()) {
        const uint64_t now = now_ns();
        if (now >= deadline) return SG_ERR_TIMEOUT;
        if (ctx->progress_.joinable()) {
            ctx->cv.wait_for(lock, std::chrono::nanoseconds(std::min<uint64_t>(deadline - now, 50000000)));
        } else {
            if (!ctx->poll_locked()) {
                lock.unlock();
                ::usleep(20);
                lock.lock();
            }
            ctx->schedule_locked();
            ctx->run_copies(lock);
        }
    }
    drain_events(lock, deadline);
    if (layer >= 0 && layers[size_t(layer)].ready) return SG_OK;
    return status;
}

void Transfer::layer_written(uint32_t layer, const float *queries, uint32_t num_queries, uint32_t num_q_heads,
                             void *cuda_stream, bool device_queries) {
    if (!post_side) fail(SG_ERR_INVALID_STATE, "layer_written is for the prefill (posting) side");
    if (layer >= layers.size())
        fail(SG_ERR_OUT_OF_RANGE, "layer " + std::to_string(layer) + " >= num_layers " + std::to_string(layers.size()));
    std::shared_ptr<StreamEvent> written;
    if (cuda_stream) {
        if (pool->layout.mem_kind != SG_MEM_CUDA)
            fail(SG_ERR_INVALID_ARGUMENT, "cuda_stream is for SG_MEM_CUDA pools (this one is host memory)");
        written = std::make_shared<StreamEvent>(pool->layout.device, cuda_stream);
    }
    if (device_queries && num_queries && pool->layout.mem_kind != SG_MEM_CUDA)
        fail(SG_ERR_INVALID_ARGUMENT, "device queries are for SG_MEM_CUDA pools (this one is host memory)");
    path().layer_written(*this, layer, LayerWrite{queries, num_queries, num_q_heads, device_queries, std::move(written)});
}

void Transfer::cancel(sg_status_t why, const std::string &message) {
    std::lock_guard lock(ctx->mu);
    if (finished()) return;
    fail_with(why, message, true);
}

void Transfer::release() {
    released.store(true, std::memory_order_release);  // its events are dropped from now on
    std::unique_lock lock(ctx->mu);
    if (!finished()) {
        if (post_side)
            fail_with(SG_ERR_CANCELED, "released before completion", true);
        else
            path().release_unfinished(*this);
    }
    // Quiesce: no operation of ours may still reference the transfer, and on the decode side the
    // peer must have confirmed that its writes stopped. A silent peer is lost after
    // peer_timeout_ms anyway; one that keeps talking but never confirms is treated as broken.
    const uint64_t deadline = now_ns() + std::max<uint64_t>(5000000000ull, 2 * ctx->peer_timeout_ns_ + 1000000000ull);
    for (note_quiesced(); !is_quiesced() && now_ns() < deadline; note_quiesced())
        ctx->wait_step(lock, deadline);
    if (!post_side && !is_quiesced())
        session->lose(SG_ERR_PROTOCOL,
                          "the peer did not confirm that its writes for '" + request_id + "' stopped");
    Session &s = *session;
    if (inflight) {
        // Completions still name this transfer: keep it alive until the context goes away rather
        // than let a late completion touch freed memory.
        ctx->log.log(SG_LOG_ERROR,
                     "transfer '" + request_id + "' released with " + std::to_string(inflight) +
                         " operation(s) still in flight after the release wait; kept until the context is destroyed");
        ctx->lingering_.push_back(shared_from_this());
    }
    if (post_side) {
        s.matchbook.forget_post(*this);
    } else {
        s.matchbook.forget_expect(id);
    }
    ctx->active_.erase(
        std::remove_if(ctx->active_.begin(), ctx->active_.end(), [&](const auto &p) { return p.get() == this; }),
        ctx->active_.end());
    if (finished()) advance(plan::TransferState::Released);
    if (!inflight) {
        // Nothing of ours references it now: its queued events (never delivered once released) go,
        // and the pool may be deregistered at once.
        const auto ours = [&](const Context::Event &e) { return e.t.get() == this; };
        const auto n = std::count_if(ctx->events_.begin(), ctx->events_.end(), ours);
        ctx->events_.erase(std::remove_if(ctx->events_.begin(), ctx->events_.end(), ours), ctx->events_.end());
        events_queued.fetch_sub(uint32_t(n), std::memory_order_acq_rel);
        let_go_of_pool();
    }
}

}  // namespace sg::core
