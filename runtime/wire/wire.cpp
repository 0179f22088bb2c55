// runtime/wire: frame and field encoding. Integers are stored and loaded byte by byte, so the code
// is the same on any host and never does an unaligned access.
//
// Field tags (tag numbers never change meaning within a protocol major; a newer minor adds tags
// with kOptionalBit set, which older decoders skip):
//   Hello          1 proto_major u16, 2 proto_minor u16, 3 ctx_id u64, 4 boot_id bytes,
//                  5 netns_inode u64, 6 endpoint (repeated, one per endpoint, in order), whose
//                  value is itself a field sequence: 1 provider bytes, 2 address bytes;
//                  7 auth mode u32, 8 nonce bytes (32)
//   HandleExport   1 handle_id u64, 2 num_layers u32, 3 num_kv_heads u32, 4 head_dim u32,
//                  5 tokens_per_block u32, 6 num_blocks u64, 7 dtype u32, 8 packing u32,
//                  9 block_order u32, 10 mem_kind u32, 11 block_stride_bytes u64,
//                  12 regions_per_layer u32, 13 regions: packed 24-byte records
//                  {u64 key, u64 base, u64 length}; since 1.4: optional 1 device_direct u32
//                  (0 or 1, SG_MEM_CUDA only: the regions are registered device memory)
//   Expect         1 request_id bytes, 2 decode_xfer_id u64, 3 handle_id u64, 4 num_tokens u64,
//                  5 block_ids: packed u32 array; since 1.3: optional 1 wire_quant u32; since
//                  1.8: optional 2 verify u32 (0 or 1)
//   LayerReady     1 decode_xfer_id u64, 2 layer u32, 3 bytes u64, 4 staged_chunks u32
//   StagedChunk    1 decode_xfer_id u64, 2 layer u32, 3 slot u32, 4 slot_offset u64,
//                  5 segments: packed 20-byte records {u32 region, u64 offset, u64 length};
//                  since 1.3: optional 1 wire_quant u32; since 1.7: optional 2 generation u32
//                  (not 0) and optional 3 crc32c u32, both or neither
//   StagingCredit  1 slot u32
//   TransferDone   1 decode_xfer_id u64, 2 bytes u64
//   Cancel, Error  1 request_id bytes, 2 decode_xfer_id u64, 3 status i32, 4 message bytes,
//                  5 from_post_side u32 (0 or 1)
//   Bye            1 status i32; since 1.1: optional 1 reply u32 (0 or 1)
//   Ping           1 sent_ns u64; since 1.7: optional 1 keepalive_ns u64
//   Notify         1 payload bytes (<= kMaxNotifyBytes)
//   AuthChallenge  1 nonce bytes (32)
//   AuthProof      1 mac bytes (32)
//   AuthResult     1 accepted u32 (0 or 1); since 1.1: optional 1 mac bytes (32)
//   Quiesced       1 decode_xfer_id u64
//   CancelAck      1 request_id bytes, 2 recorded u32 (0 or 1)
//   Reposted       1 request_id bytes
//   Selective      1 decode_xfer_id u64, 2 paths u32
//   Digests        1 decode_xfer_id u64, 2 layer u32, 3 first_block u32, 4 count u32,
//                  5 elem_bytes u32 (2 or 4), 6 data bytes (count x heads x 2 x head_dim elements)
//   BlocksReady    1 decode_xfer_id u64, 2 layer u32, 3 path u32, 4 bytes u64, 5 digest_chunks u32,
//                  6 blocks: packed u32 array, 7 essential u32 (0 or 1), 8 staged_chunks u32
//   Fetch          1 request_id bytes, 2 decode_xfer_id u64, 3 layer u32, 4 blocks: packed u32 array
//   TransferAck    1 decode_xfer_id u64 (since 1.1)
//   Opened         1 status i32, 2 message bytes (since 1.1)
//   Release        1 request_id bytes, 2 decode_xfer_id u64 (since 1.2)
//   BlockCrcs      1 decode_xfer_id u64, 2 layer u32, 3 first_block u32, 4 crcs: packed u32 array,
//                  not empty (since 1.8)
//
// Every tag of v1.0 is required and must appear exactly once, Hello's endpoint excepted (0..n
// times). Strings and packed arrays are required too but may be zero bytes long: requiring them
// means a body cut at a field boundary is refused instead of read as an empty block table. A
// repeated non-repeatable tag is BadValue (which copy would be meant is ambiguous).
// Tags with kOptionalBit are never known in v1.0, so a newer minor's additions are always skipped.
#include "wire/wire.hpp"

#include <cassert>
#include <stdexcept>
#include <string_view>
#include <type_traits>

namespace sg::wire {
namespace {

using Bytes = std::span<const uint8_t>;
using E = DecodeError;

constexpr size_t kFieldHeaderBytes = 2 + 4;
constexpr size_t kMaxBodyBytes = kMaxFrameBytes - kFrameHeaderBytes;
// Names are short in practice; the bound keeps a peer from filling our tables with junk.
constexpr size_t kMaxNameBytes = 255;     // request_id, boot_id, provider
constexpr size_t kMaxAddressBytes = 1024; // libfabric names are <= FI_NAME_MAX (64); leave room
// An Endpoint costs ~60 bytes in memory for a 6-byte empty field; bound the amplification.
constexpr size_t kMaxEndpoints = 64;
constexpr size_t kRegionBytes = 24, kSegmentBytes = 20;

// ---- little-endian primitives ----

template <class T> T load(const uint8_t *p) {
    static_assert(std::is_unsigned_v<T>);
    T v = 0;
    for (size_t i = 0; i < sizeof(T); ++i) v = static_cast<T>(v | static_cast<T>(p[i]) << (8 * i));
    return v;
}

template <class T> void store(uint8_t *p, T v) {
    for (size_t i = 0; i < sizeof(T); ++i) p[i] = static_cast<uint8_t>(v >> (8 * i));
}

template <class T> void put(std::vector<uint8_t> &out, T v) {
    const auto u = static_cast<std::make_unsigned_t<T>>(v);
    for (size_t i = 0; i < sizeof(T); ++i) out.push_back(static_cast<uint8_t>(u >> (8 * i)));
}

// ---- encoding ----

template <class F> void encode_frame(std::vector<uint8_t> &out, uint64_t sender_ctx, MsgType type, F &&fields) {
    const size_t start = out.size();
    put<uint32_t>(out, kMagic);
    put<uint16_t>(out, kProtoMajor);
    put<uint16_t>(out, kProtoMinor);
    put<uint16_t>(out, static_cast<uint16_t>(type));
    put<uint16_t>(out, 0);
    put<uint64_t>(out, sender_ctx);
    put<uint32_t>(out, 0);  // body_len, patched below
    fields();
    // Frames over kMaxFrameBytes are the caller's bug; the peer refuses them as TooLarge.
    store<uint32_t>(&out[start + kFrameHeaderBytes - 4],
                    static_cast<uint32_t>(out.size() - start - kFrameHeaderBytes));
}

// Returns where the value starts, for end_field to compute its length.
size_t begin_field(std::vector<uint8_t> &out, uint16_t tag) {
    put<uint16_t>(out, tag);
    put<uint32_t>(out, 0);
    return out.size();
}

void end_field(std::vector<uint8_t> &out, size_t value_start) {
    store<uint32_t>(&out[value_start - 4], static_cast<uint32_t>(out.size() - value_start));
}

template <class T> void int_field(std::vector<uint8_t> &out, uint16_t tag, T v) {
    put<uint16_t>(out, tag);
    put<uint32_t>(out, sizeof(T));
    put<T>(out, v);
}

void bytes_field(std::vector<uint8_t> &out, uint16_t tag, const void *data, size_t n) {
    put<uint16_t>(out, tag);
    put<uint32_t>(out, static_cast<uint32_t>(n));
    const auto *p = static_cast<const uint8_t *>(data);
    out.insert(out.end(), p, p + n);
}

void str_field(std::vector<uint8_t> &out, uint16_t tag, std::string_view s) {
    bytes_field(out, tag, s.data(), s.size());
}

// ---- decoding ----

// A message's fields are tags 1..count; `repeated` is a bit mask (bit = 1 << tag) of those that
// may appear any number of times. All others must appear exactly once.
// Optional tags (kOptionalBit | 1..optional) are the ones this minor knows: passed to `field` with
// the bit set, at most once each, never required.
struct Fields {
    uint16_t count;
    uint32_t repeated = 0;
    uint16_t optional = 0;
};

// Walks the field sequence, handing known tags to `field(tag, value)`.
template <class F> DecodeError walk(Bytes body, Fields spec, F &&field) {
    if (body.size() > kMaxBodyBytes) return E::TooLarge;
    uint32_t seen = 0;
    uint64_t seen_optional = 0;
    while (!body.empty()) {
        if (body.size() < kFieldHeaderBytes) return E::Truncated;
        const uint16_t tag = load<uint16_t>(body.data());
        const uint32_t len = load<uint32_t>(body.data() + 2);
        body = body.subspan(kFieldHeaderBytes);
        if (len > body.size()) return E::Truncated;
        const Bytes value = body.first(len);
        body = body.subspan(len);
        if (tag & kOptionalBit) {
            const uint16_t n = uint16_t(tag & ~kOptionalBit);
            if (n == 0 || n > spec.optional) continue;
            const uint64_t bit = 1ull << (n & 63);
            if (seen_optional & bit) return E::BadValue;
            seen_optional |= bit;
            if (const E e = field(tag, value); e != E::None) return e;
            continue;
        }
        if (tag == 0 || tag > spec.count) return E::UnknownRequiredField;
        const uint32_t bit = 1u << tag;
        if (seen & bit & ~spec.repeated) return E::BadValue;
        seen |= bit;
        if (const E e = field(tag, value); e != E::None) return e;
    }
    const uint32_t required = ((2u << spec.count) - 2) & ~spec.repeated;
    return (seen & required) == required ? E::None : E::MissingField;
}

template <class T> DecodeError get(Bytes v, T &out) {
    if (v.size() != sizeof(T)) return E::BadValue;
    out = static_cast<T>(load<std::make_unsigned_t<T>>(v.data()));
    return E::None;
}

DecodeError get(Bytes v, std::string &out, size_t max_bytes) {
    if (v.size() > max_bytes) return E::BadValue;
    out.assign(reinterpret_cast<const char *>(v.data()), v.size());
    return E::None;
}

DecodeError get(Bytes v, std::vector<uint8_t> &out, size_t max_bytes) {
    if (v.size() > max_bytes) return E::BadValue;
    out.assign(v.begin(), v.end());
    return E::None;
}

// Packed fixed-size records: the count comes from the field length, which walk() has already
// checked against the body, so the allocation is bounded by what the peer actually sent.
template <size_t N, class T, class Parse> DecodeError get_records(Bytes v, std::vector<T> &out, Parse &&parse) {
    if (v.size() % N != 0) return E::BadValue;
    out.resize(v.size() / N);
    for (size_t i = 0; i < out.size(); ++i) parse(v.data() + i * N, out[i]);
    return E::None;
}

constexpr DecodeError kUnreachable = E::UnknownRequiredField;  // walk() only passes known tags

}  // namespace

const char *decode_error_str(DecodeError e) {
    switch (e) {
    case E::None: return "ok";
    case E::Truncated: return "truncated";
    case E::BadMagic: return "bad magic";
    case E::VersionMismatch: return "protocol major version mismatch";
    case E::UnknownType: return "unknown message type";
    case E::UnknownRequiredField: return "unknown required field";
    case E::MissingField: return "missing field";
    case E::BadValue: return "bad field value";
    case E::TooLarge: return "frame too large";
    }
    return "unknown decode error";
}

// ---- encoders ----

void encode(std::vector<uint8_t> &out, uint64_t sender_ctx, const Hello &m) {
    encode_frame(out, sender_ctx, MsgType::Hello, [&] {
        int_field(out, 1, m.proto_major);
        int_field(out, 2, m.proto_minor);
        int_field(out, 3, m.ctx_id);
        str_field(out, 4, m.boot_id);
        int_field(out, 5, m.netns_inode);
        for (const Hello::Endpoint &ep : m.endpoints) {
            const size_t at = begin_field(out, 6);
            str_field(out, 1, ep.provider);
            bytes_field(out, 2, ep.address.data(), ep.address.size());
            end_field(out, at);
        }
        int_field(out, 7, static_cast<uint32_t>(m.auth));
        bytes_field(out, 8, m.nonce.data(), m.nonce.size());
    });
}

void encode(std::vector<uint8_t> &out, uint64_t sender_ctx, const HandleExport &m) {
    encode_frame(out, sender_ctx, MsgType::HandleExport, [&] {
        const LayoutDesc &l = m.layout;
        int_field(out, 1, m.handle_id);
        int_field(out, 2, l.num_layers);
        int_field(out, 3, l.num_kv_heads);
        int_field(out, 4, l.head_dim);
        int_field(out, 5, l.tokens_per_block);
        int_field(out, 6, l.num_blocks);
        int_field(out, 7, l.dtype);
        int_field(out, 8, l.packing);
        int_field(out, 9, l.block_order);
        int_field(out, 10, l.mem_kind);
        int_field(out, 11, l.block_stride_bytes);
        int_field(out, 12, m.regions_per_layer);
        const size_t at = begin_field(out, 13);
        for (const Region &r : m.regions) {
            put(out, r.key);
            put(out, r.base);
            put(out, r.length);
        }
        end_field(out, at);
        if (m.device_direct) int_field(out, kOptionalBit | 1, uint32_t(1));
    });
}

void encode(std::vector<uint8_t> &out, uint64_t sender_ctx, const Expect &m) {
    encode_frame(out, sender_ctx, MsgType::Expect, [&] {
        str_field(out, 1, m.request_id);
        int_field(out, 2, m.decode_xfer_id);
        int_field(out, 3, m.handle_id);
        int_field(out, 4, m.num_tokens);
        const size_t at = begin_field(out, 5);
        out.reserve(out.size() + 4 * m.block_ids.size());
        for (uint32_t id : m.block_ids) put(out, id);
        end_field(out, at);
        if (m.wire_quant) int_field(out, kOptionalBit | 1, m.wire_quant);
        if (m.verify) int_field(out, kOptionalBit | 2, m.verify);
    });
}

void encode(std::vector<uint8_t> &out, uint64_t sender_ctx, const LayerReady &m) {
    encode_frame(out, sender_ctx, MsgType::LayerReady, [&] {
        int_field(out, 1, m.decode_xfer_id);
        int_field(out, 2, m.layer);
        int_field(out, 3, m.bytes);
        int_field(out, 4, m.staged_chunks);
    });
}

void encode(std::vector<uint8_t> &out, uint64_t sender_ctx, const StagedChunk &m) {
    encode_frame(out, sender_ctx, MsgType::StagedChunk, [&] {
        int_field(out, 1, m.decode_xfer_id);
        int_field(out, 2, m.layer);
        int_field(out, 3, m.slot);
        int_field(out, 4, m.slot_offset);
        const size_t at = begin_field(out, 5);
        for (const Segment &s : m.segments) {
            put(out, s.region);
            put(out, s.offset);
            put(out, s.length);
        }
        end_field(out, at);
        if (m.wire_quant) int_field(out, kOptionalBit | 1, m.wire_quant);
        if (m.generation) {
            int_field(out, kOptionalBit | 2, m.generation);
            int_field(out, kOptionalBit | 3, m.crc32c);
        }
    });
}

void encode(std::vector<uint8_t> &out, uint64_t sender_ctx, const StagingCredit &m) {
    encode_frame(out, sender_ctx, MsgType::StagingCredit, [&] { int_field(out, 1, m.slot); });
}

void encode(std::vector<uint8_t> &out, uint64_t sender_ctx, const TransferDone &m) {
    encode_frame(out, sender_ctx, MsgType::TransferDone, [&] {
        int_field(out, 1, m.decode_xfer_id);
        int_field(out, 2, m.bytes);
    });
}

void encode(std::vector<uint8_t> &out, uint64_t sender_ctx, const TransferError &m, MsgType type) {
    assert(type == MsgType::Cancel || type == MsgType::Error);
    encode_frame(out, sender_ctx, type, [&] {
        str_field(out, 1, m.request_id);
        int_field(out, 2, m.decode_xfer_id);
        int_field(out, 3, m.status);
        str_field(out, 4, m.message);
        int_field(out, 5, m.from_post_side);
    });
}

void encode(std::vector<uint8_t> &out, uint64_t sender_ctx, const Quiesced &m) {
    encode_frame(out, sender_ctx, MsgType::Quiesced, [&] { int_field(out, 1, m.decode_xfer_id); });
}

void encode(std::vector<uint8_t> &out, uint64_t sender_ctx, const CancelAck &m) {
    encode_frame(out, sender_ctx, MsgType::CancelAck, [&] {
        str_field(out, 1, m.request_id);
        int_field(out, 2, m.recorded);
    });
}

void encode(std::vector<uint8_t> &out, uint64_t sender_ctx, const Reposted &m) {
    encode_frame(out, sender_ctx, MsgType::Reposted, [&] { str_field(out, 1, m.request_id); });
}

static void u32_array_field(std::vector<uint8_t> &out, uint16_t tag, const std::vector<uint32_t> &v) {
    const size_t at = begin_field(out, tag);
    out.reserve(out.size() + 4 * v.size());
    for (uint32_t x : v) put(out, x);
    end_field(out, at);
}

void encode(std::vector<uint8_t> &out, uint64_t sender_ctx, const Selective &m) {
    encode_frame(out, sender_ctx, MsgType::Selective, [&] {
        int_field(out, 1, m.decode_xfer_id);
        int_field(out, 2, m.paths);
    });
}

void encode(std::vector<uint8_t> &out, uint64_t sender_ctx, const Digests &m) {
    encode_frame(out, sender_ctx, MsgType::Digests, [&] {
        int_field(out, 1, m.decode_xfer_id);
        int_field(out, 2, m.layer);
        int_field(out, 3, m.first_block);
        int_field(out, 4, m.count);
        int_field(out, 5, m.elem_bytes);
        bytes_field(out, 6, m.data.data(), m.data.size());
    });
}

void encode(std::vector<uint8_t> &out, uint64_t sender_ctx, const BlocksReady &m) {
    encode_frame(out, sender_ctx, MsgType::BlocksReady, [&] {
        int_field(out, 1, m.decode_xfer_id);
        int_field(out, 2, m.layer);
        int_field(out, 3, m.path);
        int_field(out, 4, m.bytes);
        int_field(out, 5, m.digest_chunks);
        u32_array_field(out, 6, m.blocks);
        int_field(out, 7, m.essential);
        int_field(out, 8, m.staged_chunks);
    });
}

void encode(std::vector<uint8_t> &out, uint64_t sender_ctx, const Fetch &m) {
    encode_frame(out, sender_ctx, MsgType::Fetch, [&] {
        str_field(out, 1, m.request_id);
        int_field(out, 2, m.decode_xfer_id);
        int_field(out, 3, m.layer);
        u32_array_field(out, 4, m.blocks);
    });
}

void encode(std::vector<uint8_t> &out, uint64_t sender_ctx, const Bye &m) {
    encode_frame(out, sender_ctx, MsgType::Bye, [&] {
        int_field(out, 1, m.status);
        if (m.reply) int_field(out, kOptionalBit | 1, m.reply);
    });
}

void encode(std::vector<uint8_t> &out, uint64_t sender_ctx, const Opened &m) {
    encode_frame(out, sender_ctx, MsgType::Opened, [&] {
        int_field(out, 1, m.status);
        str_field(out, 2, m.message);
    });
}

void encode(std::vector<uint8_t> &out, uint64_t sender_ctx, const BlockCrcs &m) {
    encode_frame(out, sender_ctx, MsgType::BlockCrcs, [&] {
        int_field(out, 1, m.decode_xfer_id);
        int_field(out, 2, m.layer);
        int_field(out, 3, m.first_block);
        u32_array_field(out, 4, m.crcs);
    });
}

void encode(std::vector<uint8_t> &out, uint64_t sender_ctx, const TransferAck &m) {
    encode_frame(out, sender_ctx, MsgType::TransferAck, [&] { int_field(out, 1, m.decode_xfer_id); });
}

void encode(std::vector<uint8_t> &out, uint64_t sender_ctx, const Release &m) {
    encode_frame(out, sender_ctx, MsgType::Release, [&] {
        str_field(out, 1, m.request_id);
        int_field(out, 2, m.decode_xfer_id);
    });
}

void encode(std::vector<uint8_t> &out, uint64_t sender_ctx, const Ping &m) {
    encode_frame(out, sender_ctx, MsgType::Ping, [&] {
        int_field(out, 1, m.sent_ns);
        if (m.keepalive_ns) int_field(out, kOptionalBit | 1, m.keepalive_ns);
    });
}

void encode(std::vector<uint8_t> &out, uint64_t sender_ctx, const Notify &m) {
    encode_frame(out, sender_ctx, MsgType::Notify,
                 [&] { bytes_field(out, 1, m.payload.data(), m.payload.size()); });
}

void encode(std::vector<uint8_t> &out, uint64_t sender_ctx, const AuthChallenge &m) {
    encode_frame(out, sender_ctx, MsgType::AuthChallenge, [&] { bytes_field(out, 1, m.nonce.data(), m.nonce.size()); });
}

void encode(std::vector<uint8_t> &out, uint64_t sender_ctx, const AuthProof &m) {
    encode_frame(out, sender_ctx, MsgType::AuthProof, [&] { bytes_field(out, 1, m.mac.data(), m.mac.size()); });
}

void encode(std::vector<uint8_t> &out, uint64_t sender_ctx, const AuthResult &m) {
    encode_frame(out, sender_ctx, MsgType::AuthResult, [&] {
        int_field(out, 1, m.accepted);
        if (!m.mac.empty()) bytes_field(out, kOptionalBit | 1, m.mac.data(), m.mac.size());
    });
}

void append_raw_field(std::vector<uint8_t> &out, size_t frame_start, uint16_t tag, std::span<const uint8_t> value) {
    if (frame_start > out.size() || out.size() - frame_start < kFrameHeaderBytes)
        throw std::out_of_range("append_raw_field: no frame header at frame_start");
    bytes_field(out, tag, value.data(), value.size());
    store<uint32_t>(&out[frame_start + kFrameHeaderBytes - 4],
                    static_cast<uint32_t>(out.size() - frame_start - kFrameHeaderBytes));
}

// ---- decoders ----

// On Truncated because the body is incomplete, hdr is already filled: a stream reader can use
// body_len to know how many more bytes to wait for. TooLarge is checked first so that such a reader
// never waits for a frame its buffer could not hold. The reserved u16 is ignored (a later minor may
// give it a meaning that older peers can safely miss).
DecodeError decode_header(std::span<const uint8_t> frame, FrameHeader &hdr, std::span<const uint8_t> &body) {
    if (frame.size() < kFrameHeaderBytes) return E::Truncated;
    const uint8_t *p = frame.data();
    if (load<uint32_t>(p) != kMagic) return E::BadMagic;
    hdr.proto_major = load<uint16_t>(p + 4);
    hdr.proto_minor = load<uint16_t>(p + 6);
    const uint16_t type = load<uint16_t>(p + 8);
    hdr.sender_ctx = load<uint64_t>(p + 12);
    hdr.body_len = load<uint32_t>(p + 20);
    if (hdr.proto_major != kProtoMajor) return E::VersionMismatch;
    if (type < static_cast<uint16_t>(MsgType::Hello) || type > static_cast<uint16_t>(kLastMsgType))
        return E::UnknownType;
    hdr.type = static_cast<MsgType>(type);
    if (hdr.body_len > kMaxBodyBytes) return E::TooLarge;
    if (hdr.body_len > frame.size() - kFrameHeaderBytes) return E::Truncated;
    body = frame.subspan(kFrameHeaderBytes, hdr.body_len);
    return E::None;
}

DecodeError decode(std::span<const uint8_t> body, Hello &m) {
    m.endpoints.clear();
    uint32_t auth = 0;
    const E e = walk(body, {8, 1u << 6}, [&](uint16_t tag, Bytes v) {
        switch (tag) {
        case 1: return get(v, m.proto_major);
        case 2: return get(v, m.proto_minor);
        case 3: return get(v, m.ctx_id);
        case 4: return get(v, m.boot_id, kMaxNameBytes);
        case 5: return get(v, m.netns_inode);
        case 6: {
            if (m.endpoints.size() == kMaxEndpoints) return E::BadValue;
            Hello::Endpoint &ep = m.endpoints.emplace_back();
            return walk(v, {2}, [&](uint16_t etag, Bytes ev) {
                return etag == 1 ? get(ev, ep.provider, kMaxNameBytes) : get(ev, ep.address, kMaxAddressBytes);
            });
        }
        case 7: return get(v, auth);
        // Empty when the sender has no key: nothing to bind.
        case 8: return v.empty() || v.size() == kNonceBytes ? get(v, m.nonce, kNonceBytes) : E::BadValue;
        }
        return kUnreachable;
    });
    if (e != E::None) return e;
    if (auth > static_cast<uint32_t>(AuthMode::HmacSha256)) return E::BadValue;
    m.auth = static_cast<AuthMode>(auth);
    return E::None;
}

DecodeError decode(std::span<const uint8_t> body, HandleExport &m) {
    LayoutDesc &l = m.layout;
    uint32_t device_direct = 0;
    const E e = walk(body, {13, 0, 1}, [&](uint16_t tag, Bytes v) {
        switch (tag) {
        case kOptionalBit | 1: return get(v, device_direct);
        case 1: return get(v, m.handle_id);
        case 2: return get(v, l.num_layers);
        case 3: return get(v, l.num_kv_heads);
        case 4: return get(v, l.head_dim);
        case 5: return get(v, l.tokens_per_block);
        case 6: return get(v, l.num_blocks);
        case 7: return get(v, l.dtype);
        case 8: return get(v, l.packing);
        case 9: return get(v, l.block_order);
        case 10: return get(v, l.mem_kind);
        case 11: return get(v, l.block_stride_bytes);
        case 12: return get(v, m.regions_per_layer);
        case 13:
            return get_records<kRegionBytes>(v, m.regions, [](const uint8_t *p, Region &r) {
                r.key = load<uint64_t>(p);
                r.base = load<uint64_t>(p + 8);
                r.length = load<uint64_t>(p + 16);
            });
        }
        return kUnreachable;
    });
    if (e != E::None) return e;
    // Consumers index regions[l * regions_per_layer + r]; an inconsistent export must not get
    // that far. The product cannot overflow: both factors are u32.
    if (l.block_stride_bytes == 0 ||
        m.regions.size() != static_cast<uint64_t>(l.num_layers) * m.regions_per_layer)
        return E::BadValue;
    if (device_direct > 1 || (device_direct && l.mem_kind == 0 /* SG_MEM_HOST */)) return E::BadValue;
    m.device_direct = device_direct != 0;
    return E::None;
}

DecodeError decode(std::span<const uint8_t> body, Expect &m) {
    const E e = walk(body, {5, 0, 2}, [&](uint16_t tag, Bytes v) {
        switch (tag) {
        case kOptionalBit | 1: return get(v, m.wire_quant);
        case kOptionalBit | 2: return get(v, m.verify);
        case 1: return get(v, m.request_id, kMaxNameBytes);
        case 2: return get(v, m.decode_xfer_id);
        case 3: return get(v, m.handle_id);
        case 4: return get(v, m.num_tokens);
        case 5: return get_records<4>(v, m.block_ids, [](const uint8_t *p, uint32_t &id) { id = load<uint32_t>(p); });
        }
        return kUnreachable;
    });
    return e == E::None && m.verify > 1 ? E::BadValue : e;
}

DecodeError decode(std::span<const uint8_t> body, LayerReady &m) {
    return walk(body, {4}, [&](uint16_t tag, Bytes v) {
        switch (tag) {
        case 1: return get(v, m.decode_xfer_id);
        case 2: return get(v, m.layer);
        case 3: return get(v, m.bytes);
        case 4: return get(v, m.staged_chunks);
        }
        return kUnreachable;
    });
}

DecodeError decode(std::span<const uint8_t> body, StagedChunk &m) {
    bool have_crc = false;
    const E e = walk(body, {5, 0, 3}, [&](uint16_t tag, Bytes v) {
        switch (tag) {
        case kOptionalBit | 1: return get(v, m.wire_quant);
        case kOptionalBit | 2: return get(v, m.generation);
        case kOptionalBit | 3: have_crc = true; return get(v, m.crc32c);
        case 1: return get(v, m.decode_xfer_id);
        case 2: return get(v, m.layer);
        case 3: return get(v, m.slot);
        case 4: return get(v, m.slot_offset);
        case 5:
            return get_records<kSegmentBytes>(v, m.segments, [](const uint8_t *p, Segment &s) {
                s.region = load<uint32_t>(p);
                s.offset = load<uint64_t>(p + 4);
                s.length = load<uint64_t>(p + 12);
            });
        }
        return kUnreachable;
    });
    // A generation of 0 would read as "not sent", and a CRC without it as a check of nothing.
    return e == E::None && have_crc != (m.generation != 0) ? E::BadValue : e;
}

DecodeError decode(std::span<const uint8_t> body, StagingCredit &m) {
    return walk(body, {1}, [&](uint16_t, Bytes v) { return get(v, m.slot); });
}

DecodeError decode(std::span<const uint8_t> body, TransferDone &m) {
    return walk(body, {2}, [&](uint16_t tag, Bytes v) {
        return tag == 1 ? get(v, m.decode_xfer_id) : get(v, m.bytes);
    });
}

DecodeError decode(std::span<const uint8_t> body, TransferError &m) {
    const E e = walk(body, {5}, [&](uint16_t tag, Bytes v) {
        switch (tag) {
        case 1: return get(v, m.request_id, kMaxNameBytes);
        case 2: return get(v, m.decode_xfer_id);
        case 3: return get(v, m.status);
        case 4: return get(v, m.message, kMaxBodyBytes);
        case 5: return get(v, m.from_post_side);
        }
        return kUnreachable;
    });
    return e == E::None && m.from_post_side > 1 ? E::BadValue : e;
}

DecodeError decode(std::span<const uint8_t> body, Bye &m) {
    const E e = walk(body, {1, 0, 1}, [&](uint16_t tag, Bytes v) { return tag == 1 ? get(v, m.status) : get(v, m.reply); });
    return e == E::None && m.reply > 1 ? E::BadValue : e;
}

DecodeError decode(std::span<const uint8_t> body, Opened &m) {
    return walk(body, {2}, [&](uint16_t tag, Bytes v) { return tag == 1 ? get(v, m.status) : get(v, m.message, kMaxBodyBytes); });
}

DecodeError decode(std::span<const uint8_t> body, BlockCrcs &m) {
    const E e = walk(body, {4}, [&](uint16_t tag, Bytes v) {
        switch (tag) {
        case 1: return get(v, m.decode_xfer_id);
        case 2: return get(v, m.layer);
        case 3: return get(v, m.first_block);
        case 4: return get_records<4>(v, m.crcs, [](const uint8_t *p, uint32_t &crc) { crc = load<uint32_t>(p); });
        }
        return kUnreachable;
    });
    return e == E::None && m.crcs.empty() ? E::BadValue : e;
}

DecodeError decode(std::span<const uint8_t> body, TransferAck &m) {
    return walk(body, {1}, [&](uint16_t, Bytes v) { return get(v, m.decode_xfer_id); });
}

DecodeError decode(std::span<const uint8_t> body, Release &m) {
    return walk(body, {2}, [&](uint16_t tag, Bytes v) {
        return tag == 1 ? get(v, m.request_id, kMaxNameBytes) : get(v, m.decode_xfer_id);
    });
}

DecodeError decode(std::span<const uint8_t> body, Ping &m) {
    return walk(body, {1, 0, 1}, [&](uint16_t tag, Bytes v) { return tag == 1 ? get(v, m.sent_ns) : get(v, m.keepalive_ns); });
}

DecodeError decode(std::span<const uint8_t> body, Notify &m) {
    return walk(body, {1}, [&](uint16_t, Bytes v) { return get(v, m.payload, kMaxNotifyBytes); });
}

DecodeError decode(std::span<const uint8_t> body, AuthChallenge &m) {
    return walk(body, {1}, [&](uint16_t, Bytes v) { return v.size() == kNonceBytes ? get(v, m.nonce, kNonceBytes) : E::BadValue; });
}

DecodeError decode(std::span<const uint8_t> body, AuthProof &m) {
    return walk(body, {1}, [&](uint16_t, Bytes v) { return v.size() == kMacBytes ? get(v, m.mac, kMacBytes) : E::BadValue; });
}

DecodeError decode(std::span<const uint8_t> body, AuthResult &m) {
    const E e = walk(body, {1, 0, 1}, [&](uint16_t tag, Bytes v) {
        if (tag == 1) return get(v, m.accepted);
        return v.size() == kMacBytes ? get(v, m.mac, kMacBytes) : E::BadValue;
    });
    if (e == E::None && m.accepted > 1) return E::BadValue;
    return e;
}

DecodeError decode(std::span<const uint8_t> body, Quiesced &m) {
    return walk(body, {1}, [&](uint16_t, Bytes v) { return get(v, m.decode_xfer_id); });
}

DecodeError decode(std::span<const uint8_t> body, CancelAck &m) {
    const E e = walk(body, {2}, [&](uint16_t tag, Bytes v) {
        return tag == 1 ? get(v, m.request_id, kMaxNameBytes) : get(v, m.recorded);
    });
    return e == E::None && m.recorded > 1 ? E::BadValue : e;
}

DecodeError decode(std::span<const uint8_t> body, Reposted &m) {
    return walk(body, {1}, [&](uint16_t, Bytes v) { return get(v, m.request_id, kMaxNameBytes); });
}

DecodeError decode(std::span<const uint8_t> body, Selective &m) {
    return walk(body, {2}, [&](uint16_t tag, Bytes v) { return tag == 1 ? get(v, m.decode_xfer_id) : get(v, m.paths); });
}

DecodeError decode(std::span<const uint8_t> body, Digests &m) {
    const E e = walk(body, {6}, [&](uint16_t tag, Bytes v) {
        switch (tag) {
        case 1: return get(v, m.decode_xfer_id);
        case 2: return get(v, m.layer);
        case 3: return get(v, m.first_block);
        case 4: return get(v, m.count);
        case 5: return get(v, m.elem_bytes);
        case 6: return get(v, m.data, kMaxBodyBytes);
        }
        return kUnreachable;
    });
    if (e != E::None) return e;
    if (m.elem_bytes != 2 && m.elem_bytes != 4) return E::BadValue;
    return E::None;
}

DecodeError decode(std::span<const uint8_t> body, BlocksReady &m) {
    return walk(body, {8}, [&](uint16_t tag, Bytes v) {
        switch (tag) {
        case 1: return get(v, m.decode_xfer_id);
        case 2: return get(v, m.layer);
        case 3: return get(v, m.path);
        case 4: return get(v, m.bytes);
        case 5: return get(v, m.digest_chunks);
        case 6: return get_records<4>(v, m.blocks, [](const uint8_t *p, uint32_t &id) { id = load<uint32_t>(p); });
        case 7: return get(v, m.essential);
        case 8: return get(v, m.staged_chunks);
        }
        return kUnreachable;
    });
}

DecodeError decode(std::span<const uint8_t> body, Fetch &m) {
    return walk(body, {4}, [&](uint16_t tag, Bytes v) {
        switch (tag) {
        case 1: return get(v, m.request_id, kMaxNameBytes);
        case 2: return get(v, m.decode_xfer_id);
        case 3: return get(v, m.layer);
        case 4: return get_records<4>(v, m.blocks, [](const uint8_t *p, uint32_t &id) { id = load<uint32_t>(p); });
        }
        return kUnreachable;
    });
}

}  // namespace sg::wire
