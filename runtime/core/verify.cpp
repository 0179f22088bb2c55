// End-to-end verification (SG_TRANSFER_VERIFY, wire 1.8): the prefill side sends the content CRC of
// every block of a layer (kv::content_crc, numbered as the decode side's block table) before the
// layer's first notice, and the decode side checks each block once its bytes are in place. It
// catches what the staged chunks' own check cannot see: a direct RMA write that landed wrong or
// not at all, a block table that pointed the bytes elsewhere, a pool overwritten after it landed
// and before it was declared ready. A mismatch fails the transfer on both sides.
#include "core/core.hpp"
#include "core/paths.hpp"

#include <array>
#include <cstdio>

namespace sg::core {

using paths::request_blocks;

namespace {

// 16384 CRCs make a 64 KiB frame, well under wire::kMaxFrameBytes.
constexpr uint64_t kCrcsPerMessage = 16384;

std::array<const uint8_t *, 2> layer_bases(const KvPool &pool, uint32_t layer) {
    return {pool.region(layer, 0), pool.layout.regions_per_layer() > 1 ? pool.region(layer, 1) : nullptr};
}

}  // namespace

void Transfer::send_block_crcs(uint32_t layer) {
    Prefill &P = prefill();
    Layer &L = layers[layer];
    if (!P.send_crcs || L.out.crcs_sent) return;
    L.out.crcs_sent = true;
    const uint32_t dst_tpb = P.dst->layout.tokens_per_block;
    const uint64_t nb = kv::blocks_for(num_tokens, dst_tpb);
    const auto bases = layer_bases(*pool, layer);
    wire::BlockCrcs m;
    m.decode_xfer_id = id;
    m.layer = layer;
    for (uint64_t first = 0; first < nb; first += kCrcsPerMessage) {
        const uint64_t end = std::min(nb, first + kCrcsPerMessage);
        m.first_block = uint32_t(first);
        m.crcs.clear();
        for (uint64_t b = first; b < end; ++b)
            m.crcs.push_back(kv::content_crc(pool->layout, bases.data(), table, b * dst_tpb,
                                             std::min(num_tokens, (b + 1) * dst_tpb)));
        std::vector<uint8_t> out;
        wire::encode(out, ctx->id, m);
        session->send(out);
    }
}

bool Transfer::verify_blocks(uint32_t layer, std::span<const uint32_t> blocks) {
    Layer &L = layers[layer];
    if (L.in.expected_crcs.empty() || finished()) return !finished();
    const uint32_t tpb = pool->layout.tokens_per_block;
    const auto bases = layer_bases(*pool, layer);
    for (uint32_t b : blocks) {
        if (!L.in.crc_known[b]) continue;
        const uint64_t first = uint64_t(b) * tpb, end = std::min(num_tokens, first + tpb);
        const uint32_t got = kv::content_crc(pool->layout, bases.data(), table, first, end);
        ctx->counters.blocks_verified++;
        if (got == L.in.expected_crcs[b]) continue;
        ctx->counters.verify_mismatches++;
        char crcs[64];
        std::snprintf(crcs, sizeof crcs, "CRC32C %08x, the sender's %08x", got, L.in.expected_crcs[b]);
        const std::string why = "verification: layer " + std::to_string(layer) + " block " + std::to_string(b) +
                                " (tokens " + std::to_string(first) + ".." + std::to_string(end - 1) + ", pool block " +
                                std::to_string(table[b]) + ") holds other bytes than were sent: " + crcs;
        ctx->log.log(SG_LOG_ERROR, "transfer '" + request_id + "': " + why);
        fail_with(SG_ERR_TRANSPORT, why, true);
        return false;
    }
    return true;
}

bool Transfer::verify_layer(uint32_t layer) {
    if (layers[layer].in.expected_crcs.empty()) return !finished();
    std::vector<uint32_t> all(request_blocks(*this));
    for (uint32_t b = 0; b < all.size(); ++b) all[b] = b;
    return verify_blocks(layer, all);
}

void Session::on_block_crcs(wire::BlockCrcs &m) {
    Transfer *t = running_expect(m.decode_xfer_id);
    if (!t) return;
    const uint32_t nb = request_blocks(*t);
    if (m.layer >= t->layers.size() || m.first_block > nb || m.crcs.size() > nb - m.first_block)
        fail(SG_ERR_PROTOCOL, "BlockCrcs outside the request");
    // A device pool's bytes are not for the CPU to read: its chunks' own CRCs are all it gets.
    if (t->pool->layout.mem_kind != SG_MEM_HOST) return;
    Transfer::Layer &L = t->layers[m.layer];
    if (L.in.expected_crcs.empty()) {
        L.in.expected_crcs.assign(nb, 0);
        L.in.crc_known.assign(nb, 0);
    }
    for (size_t i = 0; i < m.crcs.size(); ++i) {
        const uint32_t b = m.first_block + uint32_t(i);
        // Blocks in place before their CRC came are not checked afterwards: the CRC leads the
        // notices, so that only happens with a peer that breaks the order, which gains nothing.
        if (t->residency.test(m.layer, b)) continue;
        L.in.expected_crcs[b] = m.crcs[i];
        L.in.crc_known[b] = 1;
    }
}

}  // namespace sg::core
