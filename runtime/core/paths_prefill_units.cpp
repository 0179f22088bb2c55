// The selective paths, prefill side: posting the send units that layers written and fetches
// claimed (paths_prefill.cpp), their BlocksReady notices, and the decode side's fetches as they
// arrive. paths_prefill.cpp says how a request is cut into units.
#include "core/paths.hpp"

#include <algorithm>
#include <cstring>

namespace sg::core {

using namespace paths;

// Sends the Selective message that tells the decode side which paths this transfer runs; sent for
// every matched transfer so that the decode side can answer calls about paths the transfer lacks.
void Transfer::announce_paths() {
    path().check_peer(*this);
    wire::Selective m;
    m.decode_xfer_id = id;
    m.paths = paths();
    std::vector<uint8_t> out;
    wire::encode(out, ctx->id, m);
    session->send(out, this);
}

SendUnit *Transfer::next_unit(int pass) {
    if (pass == 0) return sel().demand_queue.empty() ? nullptr : sel().demand_queue.front().get();
    if (pass == 1) return sel().proactive_queue.empty() ? nullptr : sel().proactive_queue.front().get();
    if (!(paths() & SG_PATH_SPECULATIVE)) return nullptr;
    if (session->last_fetch_ns && now_ns() - session->last_fetch_ns < kSpeculativeYieldNs) {
        // Paused, except for a unit already under way that holds blocks a fetch asked for.
        const bool urgent = !sel().speculative_queue.empty() && sel().speculative_queue.front()->urgent;
        return urgent ? sel().speculative_queue.front().get() : nullptr;
    }
    if (!sel().speculative_queue.empty()) return sel().speculative_queue.front().get();
    // Speculative units wait until every written layer's essential blocks are on their way.
    if (!sel().proactive_queue.empty()) return nullptr;
    const uint64_t per_block = block_bytes(pool->layout);
    const size_t max_blocks =
        std::min<size_t>(kMaxBlocksPerMessage, std::max<uint64_t>(1, kSpeculativeUnitBytes / per_block));
    std::vector<uint32_t> want;
    while (sel().spec_order_pos < prefill().order.size()) {
        const uint32_t layer = prefill().order[sel().spec_order_pos];
        Transfer::Layer &L = layers[layer];
        if (!L.out.written()) return nullptr;  // layers go in send order
        const uint32_t nb = uint32_t(L.out.claimed.size());
        while (L.out.spec_cursor < nb && want.size() < max_blocks) {
            if (!L.out.claimed[L.out.spec_cursor]) want.push_back(L.out.spec_cursor);
            L.out.spec_cursor++;
        }
        if (!want.empty()) {
            sel().speculative_queue.push_back(claim(layer, UnitPath::kSpeculative, want));
            return sel().speculative_queue.front().get();
        }
        sel().spec_order_pos++;
    }
    return nullptr;
}

void Transfer::compile_unit(SendUnit &u) {
    u.advance(SendUnit::Step::Compiled);
    const kv::Layout &L = pool->layout;
    Transfer::Layer &layer = layers[u.layer];
    if (u.path->essential && !layer.digests.empty()) {
        // The digests go first, in runs; the notice counts them so the decode side knows when all
        // have arrived, whatever order the provider completes them in.
        // Only blocks that can still be fetched: the unit's own blocks arrive with it, and the
        // decode side digests those from its copy of the keys (the same keys, so the same digests).
        const uint64_t per_block = digest_block_bytes(L);
        const uint32_t nb = request_blocks(*this);
        const uint32_t run = uint32_t(std::max<uint64_t>(1, kDigestChunkBytes / per_block));
        auto in_unit = [&](uint32_t b) { return std::binary_search(u.blocks.begin(), u.blocks.end(), b); };
        for (uint32_t first = 0; first < nb;) {
            if (in_unit(first)) {
                ++first;
                continue;
            }
            uint32_t count = 1;
            while (count < run && first + count < nb && !in_unit(first + count)) ++count;
            wire::Digests m;
            m.decode_xfer_id = id;
            m.layer = u.layer;
            m.first_block = first;
            m.count = count;
            first += count;
            m.elem_bytes = L.elem_bytes;
            m.data.assign(layer.digests.begin() + ptrdiff_t(m.first_block * per_block),
                          layer.digests.begin() + ptrdiff_t((m.first_block + m.count) * per_block));
            std::vector<uint8_t> out;
            wire::encode(out, ctx->id, m);
            session->send(out, this, true);
            u.digest_chunks++;
            stats.digest_bytes += m.data.size();
            stats.bytes += m.data.size();
        }
        std::vector<uint8_t>().swap(layer.digests);
    }
    u.ops.clear();
    if (u.blocks.empty()) return;
    // Equal block sizes on both sides (checked at the match), so a subset of the request is a
    // request of its own: the blocks' ids on each side, with the last block partial only when it
    // is the request's last.
    std::vector<uint32_t> src_ids(u.blocks.size()), dst_ids(u.blocks.size());
    for (size_t i = 0; i < u.blocks.size(); ++i) {
        src_ids[i] = table[u.blocks[i]];
        dst_ids[i] = prefill().dst_table[u.blocks[i]];
    }
    const uint64_t last_first_token = uint64_t(u.blocks.back()) * L.tokens_per_block;
    const uint64_t tokens = uint64_t(u.blocks.size() - 1) * L.tokens_per_block +
                            std::min<uint64_t>(L.tokens_per_block, num_tokens - last_first_token);
    const uint32_t rpl = L.regions_per_layer();
    const uint8_t *bases[2] = {pool->region(u.layer, 0), pool->region(u.layer, rpl - 1)};
    plan::Side src{&L, src_ids};
    plan::Side dst{&prefill().dst->layout, dst_ids};
    plan::Limits limits;
    const uint64_t max_op = std::min(ctx->max_op_bytes_, session->tp->caps().max_msg_size);
    const transport::Capabilities &caps = session->tp->caps();
    const uint64_t spec_op = caps.bulk_apart || caps.local_only ? kApartSpeculativeOpBytes : kSpeculativeOpBytes;
    limits.max_op_bytes = u.path->bulk ? std::min(max_op, spec_op) : max_op;
    if (staged_only()) limits.max_op_bytes = std::min<uint64_t>(limits.max_op_bytes, StagingArea::kSlotBytes);
    limits.max_iov = uint32_t(std::min<uint64_t>(plan::kMaxIov, std::max<uint64_t>(1, session->tp->caps().rma_iov_limit)));
    const plan::LayerPlanStats ps = plan::compile_layer(src, bases, dst, tokens, limits, u.ops);
    stats.segments += ps.segments;
    u.bytes = ps.bytes;
    // Scattered blocks make small writes, each costly on a kernel TCP stack or a shared-memory
    // round trip: pack them through the staging slots, as the full path does for small layers.
    // Speculative bulk over tcp goes unpacked: there the kernel's copy is the cost, and packing and
    // unpacking it took from both sides the CPU a decode step needs (stall 300 -> 90 ms at 10
    // Gbit/s); shm pays a round trip per write, so it packs everything.
    const uint64_t mean = u.ops.empty() ? 0 : ps.bytes / u.ops.size();
    const bool pack_bulk = session->tp->caps().local_only;
    u.staged = staged_only() || // quantized or copied off the device while packing
               (session->have_peer_staging &&
                ((!u.path->bulk || pack_bulk) && ctx->staging_policy_ != SG_STAGING_NEVER &&
                 (ctx->staging_policy_ == SG_STAGING_ALWAYS || (ctx->staging_threshold_ && mean < ctx->staging_threshold_))));
}

void Transfer::count_unit_bytes(const SendUnit &u, uint64_t wire_len, uint64_t payload_len) {
    if (u.path->inflight) (*session).*u.path->inflight += wire_len;
    stats.*u.path->bytes += payload_len;
}

// The other side of count_unit_bytes' in-flight counts: a write completed or was dropped unposted.
void Session::uncount_inflight(const SendUnit &u, uint64_t len) {
    if (u.path->inflight) this->*u.path->inflight -= len;
}

// Posts up to `quota` writes of the transfer's units of one pass (0 on-demand, 1 proactive,
// 2 speculative); returns whether it posted any.
bool Transfer::pump_selective(int pass, uint32_t quota) {
    if (!matched() || finished()) return false;
    session->flush_outbox();
    Session &s = *session;
    uint32_t posted = 0;
    auto &queue = pass == 0 ? sel().demand_queue : pass == 1 ? sel().proactive_queue : sel().speculative_queue;
    // Proactive writes' bound for this call (the context's mutex is held: neither a written layer nor
    // a fetch can come in meanwhile).
    const bool apart = s.tp->caps().bulk_apart;
    // (A transfer whose every layer went whole gives decode nothing to fetch.)
    const bool decode_may_fetch =
        (sel().layers_written == layers.size() && sel().layers_whole < layers.size()) ||
        (s.last_fetch_ns && now_ns() - s.last_fetch_ns < kSpeculativeYieldNs);
    const uint64_t proactive_bound = decode_may_fetch ? kProactiveFetchFriendlyBytes : kProactiveInflightBytes;
    const uint64_t speculative_bound = apart                      ? kApartSpeculativeInflightBytes
                                       : s.tp->caps().local_only ? kLocalSpeculativeInflightBytes
                                                                 : kSpeculativeInflightBytes;
    while (posted < quota) {
        SendUnit *u = next_unit(pass);
        if (!u) break;
        if (u->step() == SendUnit::Step::Claimed) compile_unit(*u);
        while (u->next_op < u->ops.size() && ctx->budget_.has_op_slot() && posted < quota) {
            const uint64_t len = u->ops[u->next_op].len;
            // On-demand writes only wait for operation slots; bulk respects the byte bounds, and
            // speculative bulk its own small bound on top.
            if (pass >= 1 && !s.may_post_bytes(len)) break;
            if (pass == 2 && s.speculative_inflight && s.speculative_inflight + len > speculative_bound) break;
            if (pass == 1 && s.proactive_inflight && s.proactive_inflight + len > proactive_bound) break;
            if (!(u->staged ? post_staged_chunk(u->layer, u->ops, u->next_op, u)
                             : post_write_op(u->layer, u->ops, u->next_op, u)))
                break;
            posted++;
        }
        if (!u->fully_posted()) break;
        sel().posted_units.push_back(std::move(queue.front()));
        queue.pop_front();
    }
    selective_notices();
    return posted > 0;
}

// Sends the notice of every posted unit whose writes are delivered (or ordered before the notice),
// records delivered units, and ends the transfer once every block of every layer is delivered.
void Transfer::selective_notices() {
    if (finished() || !matched()) return;
    const bool saw = session->tp->caps().send_after_write;
    for (size_t i = 0; i < sel().posted_units.size();) {
        SendUnit &u = *sel().posted_units[i];
        if (u.step() == SendUnit::Step::Compiled && u.packs_pending == 0 && (saw || u.outstanding == 0)) {
            send_block_crcs(u.layer);
            for (size_t first = 0; first < std::max<size_t>(1, u.blocks.size()); first += kMaxBlocksPerMessage) {
                wire::BlocksReady m;
                m.decode_xfer_id = id;
                m.layer = u.layer;
                m.path = u.path->bit;
                const size_t end = std::min(u.blocks.size(), first + kMaxBlocksPerMessage);
                m.blocks.assign(u.blocks.begin() + ptrdiff_t(std::min(first, u.blocks.size())), u.blocks.begin() + ptrdiff_t(end));
                m.bytes = u.blocks.empty() ? 0 : u.bytes * m.blocks.size() / u.blocks.size();
                // The last notice of a proactive unit makes the layer essential once the digests it
                // counts have arrived.
                const bool last = end == u.blocks.size();
                m.digest_chunks = last ? u.digest_chunks : 0;
                m.essential = last && u.path->essential;
                m.staged_chunks = layers[u.layer].staged_chunks;
                std::vector<uint8_t> out;
                wire::encode(out, ctx->id, m);
                session->send(out, this);
            }
            u.advance(SendUnit::Step::Noticed);
        }
        if (u.step() != SendUnit::Step::Noticed || u.outstanding) {
            ++i;
            continue;
        }
        Transfer::Layer &L = layers[u.layer];
        for (uint32_t b : u.blocks) residency.set(u.layer, b);
        L.out.delivered_count += uint32_t(u.blocks.size());
        if (u.path->bulk) session->note_bulk_delivered(u.bytes);
        if (u.path->essential) {
            L.essential = true;
            emit(SG_EVENT_ESSENTIAL_READY, u.layer, SG_OK);
        }
        if (L.out.delivered_count == L.out.claimed.size() && !L.ready) mark_ready(u.layer);
        sel().posted_units.erase(sel().posted_units.begin() + ptrdiff_t(i));
        ctx->cv.notify_all();
    }
    if (stats.layers_ready == layers.size()) send_done();
}

void Session::on_fetch(wire::Fetch &m) {
    Transfer *p = matchbook.matched_post(m.request_id);
    if (!p || p->id != m.decode_xfer_id) return;  // released meanwhile
    Transfer &t = *p;
    if (t.finished()) return;  // the decode side learns the status from the transfer
    // A peer whose values fail these checks loses its session, like any other range check of what
    // a peer sends (STYLE 25); its transfers end with SG_ERR_PROTOCOL.
    if (!(t.paths() & SG_PATH_ON_DEMAND)) fail(SG_ERR_PROTOCOL, "the decode side fetched blocks without SG_PATH_ON_DEMAND");
    const uint32_t nb = request_blocks(t);
    if (m.layer >= t.layers.size()) fail(SG_ERR_PROTOCOL, "Fetch names a layer that does not exist");
    for (uint32_t b : m.blocks)
        if (b >= nb) fail(SG_ERR_PROTOCOL, "Fetch names a block beyond the request's block table");
    t.stats.fetch_requests++;
    last_fetch_ns = now_ns();
    Transfer::Layer &L = t.layers[m.layer];
    if (!L.out.written()) {
        // Served as soon as the engine has written the layer.
        // Kept as a set of the request's blocks, so repeated fetches cannot grow it.
        auto &w = L.out.demand_waiting;
        w.insert(w.end(), m.blocks.begin(), m.blocks.end());
        std::sort(w.begin(), w.end());
        w.erase(std::unique(w.begin(), w.end()), w.end());
        return;
    }
    t.release_unposted_speculative(m.layer, m.blocks);
    auto u = t.claim(m.layer, UnitPath::kOnDemand, m.blocks);
    t.stats.fetch_blocks += u->blocks.size();
    if (u->blocks.empty()) return;  // all on their way already
    t.sel().demand_queue.push_back(std::move(u));
    t.pump_selective(0, ctx->budget_.max_ops);
    ctx->wake();
}

}  // namespace sg::core
