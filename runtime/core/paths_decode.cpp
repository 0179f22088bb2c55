// The selective paths on the decode side: residency of blocks as BlocksReady notices arrive (after
// the staged chunks they count), page digests received or computed for proactive blocks, a layer
// essential, fetches (SG_PATH_ON_DEMAND) and their BLOCKS_READY events, and release before every
// block came.
#include "core/paths.hpp"

#include <algorithm>
#include <cstring>

namespace sg::core {

using namespace paths;

namespace {

// BlocksReady notices of one layer waiting for the staged chunks they count: a real prefill side
// has at most a slot's worth of chunks (StagingArea::kSlots) in flight, so a peer past this bound
// is not waiting for chunks but piling notices up.
constexpr size_t kMaxHeldNotices = 4096;

}  // namespace

// ---- decode: residency, digests, fetches ---------------------------------------------------------

void Transfer::maybe_essential(uint32_t layer) {
    Transfer::Layer &L = layers[layer];
    if (L.essential || !L.in.essential_notice || L.in.digest_chunks_received < L.in.digest_chunks_announced) return;
    // A layer that came whole is attended whole; its digests wait until asked for (digests()).
    if (L.in.proactive_blocks.size() == request_blocks(*this))
        L.in.digests_deferred = true;
    else
        digest_proactive_blocks(layer);
    L.essential = true;
    emit(SG_EVENT_ESSENTIAL_READY, layer, SG_OK);
    complete_if_done();  // the last digests may be what the transfer waited for
    ctx->signal_event();
    ctx->cv.notify_all();
}

// Decode: the digests of the layer's proactive blocks, which the prefill side does not send (they
// are resident, so their keys are here).
void Transfer::digest_proactive_blocks(uint32_t layer) {
    Transfer::Layer &L = layers[layer];
    const kv::Layout &KL = pool->layout;
    const uint32_t nb = request_blocks(*this);
    const uint64_t floats_per_block = kernels::digest_floats(1, KL.num_kv_heads, KL.head_dim);
    const uint64_t per_block = floats_per_block * KL.elem_bytes;
    if (L.digests.empty()) L.digests.resize(size_t(nb) * per_block);
    if (L.digests.size() != size_t(nb) * per_block) return;  // the peer's element size: refused on arrival
    const uint8_t *k_region = pool->region(layer, 0);
    // One digest call for the whole blocks (a device pool's runs once on the device), one for the
    // request's partial last block.
    std::vector<uint32_t> index, physical;
    uint32_t partial = nb;
    for (uint32_t b : L.in.proactive_blocks) {
        if (b >= nb) continue;
        if (uint64_t(b + 1) * KL.tokens_per_block > num_tokens) {
            partial = b;
            continue;
        }
        index.push_back(b);
        physical.push_back(table[b]);
    }
    std::vector<float> out(index.size() * floats_per_block);
    layer_digest(KL, k_region, physical, uint64_t(physical.size()) * KL.tokens_per_block, out.data());
    for (size_t i = 0; i < index.size(); ++i)
        encode_digests(KL, out.data() + i * floats_per_block, floats_per_block,
                       L.digests.data() + size_t(index[i]) * per_block);
    if (partial < nb) {
        const uint64_t tokens = num_tokens - uint64_t(partial) * KL.tokens_per_block;
        out.resize(floats_per_block);
        layer_digest(KL, k_region, std::span<const uint32_t>(&table[partial], 1), tokens, out.data());
        encode_digests(KL, out.data(), floats_per_block, L.digests.data() + size_t(partial) * per_block);
    }
    std::vector<uint32_t>().swap(L.in.proactive_blocks);
}

void Transfer::check_fetches(uint32_t layer) {
    for (size_t i = 0; i < decode().fetches.size();) {
        auto &f = decode().fetches[i];
        bool all = f.layer == layer;
        for (size_t k = 0; all && k < f.blocks.size(); ++k) all = residency.test(layer, f.blocks[k]);
        if (!all) {
            ++i;
            continue;
        }
        emit(SG_EVENT_BLOCKS_READY, layer, SG_OK, f.blocks);
        decode().fetches.erase(decode().fetches.begin() + ptrdiff_t(i));
    }
}

void Transfer::decode_block_resident(uint32_t layer, std::span<const uint32_t> blocks, const UnitPath &path,
                                    uint64_t bytes) {
    Transfer::Layer &L = layers[layer];
    if (!L.in.expected_crcs.empty()) {
        std::vector<uint32_t> landed;
        for (uint32_t b : blocks)
            if (!residency.test(layer, b)) landed.push_back(b);
        if (!verify_blocks(layer, landed)) return;
    }
    for (uint32_t b : blocks) {
        if (residency.test(layer, b)) continue;
        residency.set(layer, b);
        L.in.resident_count++;
        if (b < L.in.requested.size()) L.in.requested[b] = 0;
    }
    stats.bytes += bytes;
    stats.*path.bytes += bytes;
    if (L.in.resident_count == request_blocks(*this) && !L.ready) mark_ready(layer);
    check_fetches(layer);
    complete_if_done();
    ctx->signal_event();
    ctx->cv.notify_all();
}

void Transfer::apply_blocks_ready(const wire::BlocksReady &m) {
    const UnitPath &path = UnitPath::of(m.path);  // checked when the notice arrived
    if (path.essential) {
        auto &mine = layers[m.layer].in.proactive_blocks;
        mine.insert(mine.end(), m.blocks.begin(), m.blocks.end());
    }
    if (m.essential) {
        Transfer::Layer &L = layers[m.layer];
        L.in.essential_notice = true;
        L.in.digest_chunks_announced = m.digest_chunks;
    }
    decode_block_resident(m.layer, m.blocks, path, m.bytes);
    if (finished()) return;  // verification failed it
    if (m.essential) maybe_essential(m.layer);
}

void Transfer::apply_held_notices(uint32_t layer) {
    auto &held = layers[layer].in.held_notices;
    for (size_t i = 0; i < held.size();) {
        if (held[i].staged_chunks > layers[layer].staged_chunks) {
            ++i;
            continue;
        }
        const wire::BlocksReady m = std::move(held[i]);
        held.erase(held.begin() + ptrdiff_t(i));
        apply_blocks_ready(m);
        if (finished()) return;
    }
}

Transfer *Session::running_expect(uint64_t decode_xfer_id) {
    Transfer *t = matchbook.expect(decode_xfer_id);
    if (!t || t->finished()) return nullptr;
    // The first word from the prefill side about it: it matched our Expect.
    if (t->state() == plan::TransferState::Unmatched) t->advance(plan::TransferState::Running);
    return t;
}

void Session::on_selective(wire::Selective &m) {
    Transfer *running = running_expect(m.decode_xfer_id);
    if (!running) return;
    Transfer &t = *running;
    t.set_paths(m.paths);
    t.path().begin_decode(t);
    ctx->cv.notify_all();
}

void Session::on_digests(wire::Digests &m) {
    Transfer *t = running_expect(m.decode_xfer_id);
    if (!t) return;
    const kv::Layout &L = t->pool->layout;
    if (m.elem_bytes != L.elem_bytes) fail(SG_ERR_PROTOCOL, "Digests in another element size than the pool's");
    const uint64_t per_block = kernels::digest_floats(1, L.num_kv_heads, L.head_dim) * m.elem_bytes;
    const uint32_t nb = request_blocks(*t);
    if (m.layer >= t->layers.size() || m.first_block > nb || m.count > nb - m.first_block ||
        m.data.size() != m.count * per_block)
        fail(SG_ERR_PROTOCOL, "Digests outside the request or of the wrong size");
    Transfer::Layer &TL = t->layers[m.layer];
    if (TL.digests.empty()) TL.digests.resize(nb * per_block);
    if (TL.digests.size() != nb * per_block) fail(SG_ERR_PROTOCOL, "Digests change their element size");
    if (!m.data.empty()) std::memcpy(TL.digests.data() + m.first_block * per_block, m.data.data(), m.data.size());
    t->stats.digest_bytes += m.data.size();
    t->stats.bytes += m.data.size();
    TL.in.digest_chunks_received++;
    t->maybe_essential(m.layer);
}

void Session::on_blocks_ready(wire::BlocksReady &m) {
    Transfer *t = running_expect(m.decode_xfer_id);
    if (!t) return;
    const uint32_t nb = request_blocks(*t);
    if (m.layer >= t->layers.size()) fail(SG_ERR_PROTOCOL, "BlocksReady names a layer that does not exist");
    (void)UnitPath::of(m.path);  // SG_ERR_PROTOCOL for a path that is not a selective one
    for (uint32_t b : m.blocks)
        if (b >= nb) fail(SG_ERR_PROTOCOL, "BlocksReady names a block beyond the request");
    Transfer::Layer &L = t->layers[m.layer];
    if (L.staged_chunks < m.staged_chunks) {
        // Staged chunks it counts are still on their way (the provider may complete a
        // later small message before an earlier large one).
        if (L.in.held_notices.size() >= kMaxHeldNotices)
            fail(SG_ERR_PROTOCOL, "BlocksReady notices pile up for staged chunks that never come");
        L.in.held_notices.push_back(std::move(m));
        return;
    }
    t->apply_blocks_ready(m);
}

// ---- API -----------------------------------------------------------------------------------------

// Decode side: the host is done with a selective transfer before every block came (what it did not
// need never moves). Not a failure on either side; the prefill side stops and confirms with
// Quiesced, which release waits for.
void Transfer::end_by_release() {
    finish(SG_OK, {});
    std::vector<uint8_t> out;
    if (session->peer_minor >= 2) {
        wire::encode(out, ctx->id, wire::Release{request_id, id});
    } else {
        // Peers before 1.2 know a release as a Cancel with status 0 from the decode side.
        wire::TransferError m;
        m.request_id = request_id;
        m.decode_xfer_id = id;
        m.status = 0;
        m.message = "released by the decode side";
        m.from_post_side = 0;
        wire::encode(out, ctx->id, m, wire::MsgType::Cancel);
    }
    session->send(out);
}

}  // namespace sg::core
