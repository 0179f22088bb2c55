// The staging variants (staging.hpp): a staged chunk's copies for each kind of pool memory and
// wire coding, run without the context's mutex. Device memory goes through the CUDA plugin: raw
// chunks straight between the slot and the device, quantized ones through host memory, where the
// codec (quant/) runs.
#include <cstdio>
#include <cstring>
#include <span>

#include "core/core.hpp"
#include "core/cuda_plugin.hpp"
#include "core/staging.hpp"

namespace sg::core {

namespace {

using SourcePieces = std::span<const std::pair<const uint8_t *, uint64_t>>;

// ---- pack: pool pieces into the slot ----

uint32_t copy_pieces(SourcePieces pieces, uint8_t *slot) {
    uint32_t crc = 0;
    for (auto [src, len] : pieces) {
        crc = crc32c_copy(crc, slot, src, len);
        slot += len;
    }
    return crc;
}

// Each segment's pieces (host memory) coded into the slot.
void encode_segments(const PackJob &p, SourcePieces pieces, uint8_t *slot) {
    kernels::QuantCode code{};
    quant::code_of(p.wire_quant, code);  // checked when the transfer was posted
    const kv::Layout &peer = p.t->prefill().dst->layout;
    for (const PackJob::QuantSegment &q : p.quant_segments) {
        quant::encode(peer, q.region_in_layer, q.offset, q.length, q.shape, pieces.first(q.pieces), code, slot);
        pieces = pieces.subspan(q.pieces);
        slot += q.shape.wire_bytes();
    }
}

void pack_host_raw(PackJob &p, uint8_t *slot) {
    if (p.checked) {
        p.crc = copy_pieces(p.pieces, slot);
        return;
    }
    for (auto [src, len] : p.pieces) {
        std::memcpy(slot, src, len);
        slot += len;
    }
}

// The codec and the device copy write the slot themselves: the CRC reads what they wrote, while it
// is still in cache.
void pack_host_quantized(PackJob &p, uint8_t *slot) {
    encode_segments(p, p.pieces, slot);
    if (p.checked) p.crc = crc32c(0, slot, p.used);
}

void pack_device_raw(PackJob &p, uint8_t *slot) {
    cuda_stage_out(p.src_device, p.pieces, slot);
    if (p.checked) p.crc = crc32c(0, slot, p.used);
}

void pack_device_quantized(PackJob &p, uint8_t *slot) {
    thread_local std::vector<uint8_t> from_device;
    thread_local std::vector<std::pair<const uint8_t *, uint64_t>> host_pieces;
    from_device.resize(p.payload);
    cuda_stage_out(p.src_device, p.pieces, from_device.data());
    // The same pieces, now in host memory back to back.
    host_pieces.clear();
    uint64_t at = 0;
    for (auto [src, len] : p.pieces) {
        host_pieces.emplace_back(from_device.data() + at, len);
        at += len;
    }
    encode_segments(p, host_pieces, slot);
    if (p.checked) p.crc = crc32c(0, slot, p.used);
}

// ---- unpack: the slot into the pool ----

uint8_t *segment_in_pool(const UnpackJob &u, const wire::Segment &seg) {
    const kv::Layout &L = u.t->pool->layout;
    const uint32_t layer = seg.region / L.regions_per_layer(), region = seg.region % L.regions_per_layer();
    return u.t->pool->region(layer, region) + seg.offset;  // checked by on_staged_chunk
}

bool checked(const UnpackJob &u) { return u.chunk.generation != 0; }

uint64_t slot_bytes(const UnpackJob &u) {
    uint64_t n = 0;
    if (u.chunk.wire_quant)
        for (const quant::Shape &shape : u.shapes) n += shape.wire_bytes();
    else
        for (const wire::Segment &seg : u.chunk.segments) n += seg.length;
    return n;
}

// The chunk's bytes checked where they lie, before a copy that is not ours (codec, device) reads them.
void check_in_slot(const UnpackJob &u, const uint8_t *src) {
    if (checked(u)) check_chunk_crc(u, crc32c(0, src, slot_bytes(u)));
}

// Each segment decoded from the slot into out(i, segment), one after the other.
template <class Out>
void decode_segments(UnpackJob &u, const uint8_t *src, Out out) {
    check_in_slot(u, src);
    const kv::Layout &L = u.t->pool->layout;
    kernels::QuantCode code{};
    quant::code_of(u.chunk.wire_quant, code);
    for (size_t i = 0; i < u.chunk.segments.size(); ++i) {
        const wire::Segment &seg = u.chunk.segments[i];
        const quant::Shape &shape = u.shapes[i];
        quant::decode(L, seg.region % L.regions_per_layer(), seg.offset, seg.length, shape, src, code, out(i, seg));
        u.wire_bytes += shape.wire_bytes();
        src += shape.wire_bytes();
    }
}

// The check rides the copy: the bytes checked are the bytes the pool got. A mismatch fails the
// transfer, whose blocks the host then must not use.
void unpack_host_raw(UnpackJob &u, const uint8_t *src) {
    const bool check = checked(u);  // an older peer's chunk carries no CRC: plain copies
    uint32_t crc = 0;
    for (const wire::Segment &seg : u.chunk.segments) {
        uint8_t *dst = segment_in_pool(u, seg);
        if (check)
            crc = crc32c_copy(crc, dst, src, seg.length);
        else
            std::memcpy(dst, src, seg.length);
        src += seg.length;
    }
    if (check) check_chunk_crc(u, crc);
}

void unpack_host_quantized(UnpackJob &u, const uint8_t *src) {
    decode_segments(u, src, [&](size_t, const wire::Segment &seg) { return segment_in_pool(u, seg); });
}

thread_local std::vector<std::pair<uint8_t *, uint64_t>> device_pieces;

void collect_device_pieces(const UnpackJob &u) {
    device_pieces.clear();
    for (const wire::Segment &seg : u.chunk.segments) device_pieces.emplace_back(segment_in_pool(u, seg), seg.length);
}

void unpack_device_raw(UnpackJob &u, const uint8_t *src) {
    check_in_slot(u, src);
    collect_device_pieces(u);
    cuda_stage_in(u.t->pool->layout.device, device_pieces, src);
}

void unpack_device_quantized(UnpackJob &u, const uint8_t *src) {
    thread_local std::vector<uint8_t> decoded;
    uint64_t total = 0;
    for (const wire::Segment &seg : u.chunk.segments) total += seg.length;
    decoded.resize(total);
    uint64_t at = 0;
    decode_segments(u, src, [&](size_t, const wire::Segment &seg) {
        uint8_t *out = decoded.data() + at;
        at += seg.length;
        return out;
    });
    collect_device_pieces(u);
    cuda_stage_in(u.t->pool->layout.device, device_pieces, decoded.data());
}

constexpr StagingVariant kVariants[2][2] = {
    {{"host, raw", pack_host_raw, unpack_host_raw}, {"host, quantized", pack_host_quantized, unpack_host_quantized}},
    {{"device, raw", pack_device_raw, unpack_device_raw},
     {"device, quantized", pack_device_quantized, unpack_device_quantized}},
};

}  // namespace

void check_chunk_crc(const UnpackJob &u, uint32_t crc) {
    const wire::StagedChunk &m = u.chunk;
    if (crc == m.crc32c) return;
    char hex[64];
    std::snprintf(hex, sizeof hex, "CRC32C %08x, the notice says %08x", crc, m.crc32c);
    throw Error(SG_ERR_TRANSPORT, "the staged chunk of layer " + std::to_string(m.layer) + " in slot " +
                                      std::to_string(m.slot) + " (generation " + std::to_string(m.generation) +
                                      ") does not hold the bytes its notice describes: " + hex +
                                      " (a torn write, or a late copy of an earlier chunk)");
}

const StagingVariant &staging_variant(bool device_memory, bool quantized) {
    return kVariants[device_memory][quantized];
}

}  // namespace sg::core
