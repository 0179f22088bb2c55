// Unit tests for runtime/wire: round trips, forward compatibility, and refusal of every malformed
// input (truncations, corruptions, a random-mutation loop meant to run under ASan/UBSan).
#include "wire/wire.hpp"

#include <gtest/gtest.h>

#include <cstring>
#include <memory>
#include <random>
#include <set>
#include <string>
#include <tuple>
#include <vector>

namespace sg::wire {
// The structs have no operator== (LayoutDesc, from common/, has one); these let the tests compare
// whole messages.
static auto tie(const Hello::Endpoint &e) { return std::tie(e.provider, e.address); }
static auto tie(const Region &r) { return std::tie(r.key, r.base, r.length); }
static auto tie(const Segment &s) { return std::tie(s.region, s.offset, s.length); }
static bool operator==(const Hello::Endpoint &a, const Hello::Endpoint &b) { return tie(a) == tie(b); }
static bool operator==(const Region &a, const Region &b) { return tie(a) == tie(b); }
static bool operator==(const Segment &a, const Segment &b) { return tie(a) == tie(b); }
static bool operator==(const Hello &a, const Hello &b) {
    return std::tie(a.proto_major, a.proto_minor, a.ctx_id, a.boot_id, a.netns_inode, a.endpoints, a.auth, a.nonce) ==
           std::tie(b.proto_major, b.proto_minor, b.ctx_id, b.boot_id, b.netns_inode, b.endpoints, b.auth, b.nonce);
}
static bool operator==(const HandleExport &a, const HandleExport &b) {
    return std::tie(a.handle_id, a.layout, a.regions_per_layer, a.regions, a.device_direct) ==
           std::tie(b.handle_id, b.layout, b.regions_per_layer, b.regions, b.device_direct);
}
static bool operator==(const Expect &a, const Expect &b) {
    return std::tie(a.request_id, a.decode_xfer_id, a.handle_id, a.num_tokens, a.block_ids, a.wire_quant, a.verify) ==
           std::tie(b.request_id, b.decode_xfer_id, b.handle_id, b.num_tokens, b.block_ids, b.wire_quant, b.verify);
}
static bool operator==(const LayerReady &a, const LayerReady &b) {
    return std::tie(a.decode_xfer_id, a.layer, a.bytes, a.staged_chunks) ==
           std::tie(b.decode_xfer_id, b.layer, b.bytes, b.staged_chunks);
}
static bool operator==(const StagedChunk &a, const StagedChunk &b) {
    return std::tie(a.decode_xfer_id, a.layer, a.slot, a.slot_offset, a.segments, a.wire_quant, a.generation, a.crc32c) ==
           std::tie(b.decode_xfer_id, b.layer, b.slot, b.slot_offset, b.segments, b.wire_quant, b.generation, b.crc32c);
}
static bool operator==(const StagingCredit &a, const StagingCredit &b) { return a.slot == b.slot; }
static bool operator==(const TransferDone &a, const TransferDone &b) {
    return a.decode_xfer_id == b.decode_xfer_id && a.bytes == b.bytes;
}
static bool operator==(const TransferError &a, const TransferError &b) {
    return std::tie(a.request_id, a.decode_xfer_id, a.status, a.message, a.from_post_side) ==
           std::tie(b.request_id, b.decode_xfer_id, b.status, b.message, b.from_post_side);
}
static bool operator==(const Bye &a, const Bye &b) { return a.status == b.status && a.reply == b.reply; }
}  // namespace sg::wire

namespace {

using namespace sg::wire;
using Buf = std::vector<uint8_t>;
using Bytes = std::span<const uint8_t>;
using E = DecodeError;

constexpr uint64_t kCtx = 0xfedcba9876543210ull;
constexpr size_t kBodyLenAt = kFrameHeaderBytes - 4;

// ---- sample messages ----

Hello sample_hello() {
    Hello m;
    m.ctx_id = 0x0123456789abcdefull;
    m.boot_id = "6a1f1c2e-8d3b-4c5a-9e7f-0a1b2c3d4e5f";
    m.netns_inode = 4026531840ull;
    m.endpoints.push_back({"tcp;ofi_rxm", {0x02, 0x00, 0x1f, 0x90, 0x7f, 0x00, 0x00, 0x01}});
    m.endpoints.push_back({"shm", {}});
    m.endpoints.push_back({"", {0x00, 0xff, 0x00}});
    m.auth = AuthMode::HmacSha256;
    for (size_t i = 0; i < kNonceBytes; ++i) m.nonce.push_back(uint8_t(i * 7 + 1));
    return m;
}

HandleExport sample_export(uint32_t layers = 3, uint32_t per_layer = 2) {
    HandleExport m;
    m.handle_id = 77;
    m.layout = {layers, 8, 128, 16, 4096, 2, 1, 0, 1, 0};
    m.layout.block_stride_bytes = 8ull * 128 * 16 * 2;
    m.regions_per_layer = per_layer;
    for (uint32_t i = 0; i < layers * per_layer; ++i)
        m.regions.push_back({0xA000000000000000ull + i, 0x7f0000000000ull + i * 0x100000000ull, 1ull << 34});
    return m;
}

Expect sample_expect(size_t blocks) {
    Expect m;
    m.request_id = "cmpl-8f2e9a41";
    m.decode_xfer_id = 0xffffffffffffffffull;
    m.handle_id = 3;
    m.num_tokens = blocks * 16 - 5;
    for (size_t i = 0; i < blocks; ++i) m.block_ids.push_back(static_cast<uint32_t>(i * 2654435761u));
    return m;
}

StagedChunk sample_chunk() {
    StagedChunk m;
    m.decode_xfer_id = 9;
    m.layer = 31;
    m.slot = 5;
    m.slot_offset = 1ull << 40;
    m.segments = {{0, 0, 4096}, {1, 0xfffffffffffff000ull, 4096}, {0xffffffffu, 123, 0}};
    return m;
}

TransferError sample_error() {
    TransferError m;
    m.request_id = "req-1";
    m.decode_xfer_id = 12;
    m.status = -7;
    m.message = std::string("peer went away\0with a NUL", 25);
    m.from_post_side = 1;
    return m;
}

// Frame of one of every type (Cancel and Error both), small enough for mutations to hit every part.
std::vector<Buf> corpus() {
    std::vector<Buf> frames;
    auto add = [&](auto &&enc) { enc(frames.emplace_back()); };
    add([](Buf &b) { encode(b, kCtx, sample_hello()); });
    add([](Buf &b) { encode(b, kCtx, Hello{}); });
    add([](Buf &b) { encode(b, kCtx, sample_export(2, 2)); });
    add([](Buf &b) { encode(b, kCtx, sample_expect(7)); });
    add([](Buf &b) { encode(b, kCtx, Expect{}); });
    add([](Buf &b) { encode(b, kCtx, LayerReady{1, 2, 3}); });
    add([](Buf &b) { encode(b, kCtx, sample_chunk()); });
    add([](Buf &b) { encode(b, kCtx, StagingCredit{4}); });
    add([](Buf &b) { encode(b, kCtx, TransferDone{5, 6}); });
    add([](Buf &b) { encode(b, kCtx, sample_error(), MsgType::Cancel); });
    add([](Buf &b) { encode(b, kCtx, sample_error(), MsgType::Error); });
    add([](Buf &b) { encode(b, kCtx, Bye{-1}); });
    add([](Buf &b) { encode(b, kCtx, Ping{123456789}); });
    add([](Buf &b) { encode(b, kCtx, Notify{{1, 2, 3, 4, 5}}); });
    add([](Buf &b) { encode(b, kCtx, AuthChallenge{std::vector<uint8_t>(kNonceBytes, 0x5a)}); });
    add([](Buf &b) { encode(b, kCtx, AuthProof{std::vector<uint8_t>(kMacBytes, 0xa5)}); });
    add([](Buf &b) { encode(b, kCtx, AuthResult{1}); });
    add([](Buf &b) { encode(b, kCtx, Quiesced{77}); });
    add([](Buf &b) { encode(b, kCtx, CancelAck{"req-9", 1}); });
    add([](Buf &b) { encode(b, kCtx, Reposted{"req-9"}); });
    add([](Buf &b) { encode(b, kCtx, Selective{8, 0xe}); });
    add([](Buf &b) { encode(b, kCtx, Digests{8, 1, 2, 1, 2, {1, 2, 3, 4}}); });
    add([](Buf &b) { encode(b, kCtx, BlocksReady{8, 1, 2, 3, 4, {5, 6}, 1}); });
    add([](Buf &b) { encode(b, kCtx, Fetch{"req-9", 8, 1, {5, 6}}); });
    add([](Buf &b) { encode(b, kCtx, Bye{0, 1}); });
    add([](Buf &b) { encode(b, kCtx, TransferAck{8}); });
    add([](Buf &b) { encode(b, kCtx, Opened{-7, "no provider in common"}); });
    add([](Buf &b) { encode(b, kCtx, Release{"req-9", 8}); });
    add([](Buf &b) { encode(b, kCtx, BlockCrcs{8, 1, 2, {0xdeadbeef, 7}}); });
    return frames;
}

// Decodes a whole frame with the decoder its type names.
DecodeError decode_frame(Bytes frame) {
    FrameHeader h;
    Bytes body;
    if (E e = decode_header(frame, h, body); e != E::None) return e;
    switch (h.type) {
    case MsgType::Hello: { Hello m; return decode(body, m); }
    case MsgType::HandleExport: { HandleExport m; return decode(body, m); }
    case MsgType::Expect: { Expect m; return decode(body, m); }
    case MsgType::LayerReady: { LayerReady m; return decode(body, m); }
    case MsgType::StagedChunk: { StagedChunk m; return decode(body, m); }
    case MsgType::StagingCredit: { StagingCredit m; return decode(body, m); }
    case MsgType::TransferDone: { TransferDone m; return decode(body, m); }
    case MsgType::Cancel:
    case MsgType::Error: { TransferError m; return decode(body, m); }
    case MsgType::Bye: { Bye m; return decode(body, m); }
    case MsgType::Ping: { Ping m; return decode(body, m); }
    case MsgType::Notify: { Notify m; return decode(body, m); }
    case MsgType::AuthChallenge: { AuthChallenge m; return decode(body, m); }
    case MsgType::AuthProof: { AuthProof m; return decode(body, m); }
    case MsgType::AuthResult: { AuthResult m; return decode(body, m); }
    case MsgType::Quiesced: { Quiesced m; return decode(body, m); }
    case MsgType::CancelAck: { CancelAck m; return decode(body, m); }
    case MsgType::Reposted: { Reposted m; return decode(body, m); }
    case MsgType::Selective: { Selective m; return decode(body, m); }
    case MsgType::Digests: { Digests m; return decode(body, m); }
    case MsgType::BlocksReady: { BlocksReady m; return decode(body, m); }
    case MsgType::Fetch: { Fetch m; return decode(body, m); }
    case MsgType::TransferAck: { TransferAck m; return decode(body, m); }
    case MsgType::Opened: { Opened m; return decode(body, m); }
    case MsgType::Release: { Release m; return decode(body, m); }
    case MsgType::BlockCrcs: { BlockCrcs m; return decode(body, m); }
    }
    return E::UnknownType;
}

// Runs every body decoder on the same bytes, whatever they are.
void decode_as_every_type(Bytes body) {
    Hello a; HandleExport b; Expect c; LayerReady d; StagedChunk e; StagingCredit f; TransferDone g;
    TransferError h; Bye i; Ping j; Notify k; AuthChallenge l; AuthProof m; AuthResult n;
    Quiesced o; CancelAck p; Reposted q; Selective r; Digests s; BlocksReady t; Fetch u; BlockCrcs v;
    (void)decode(body, a); (void)decode(body, b); (void)decode(body, c); (void)decode(body, d);
    (void)decode(body, e); (void)decode(body, f); (void)decode(body, g); (void)decode(body, h);
    (void)decode(body, i); (void)decode(body, j); (void)decode(body, k); (void)decode(body, l);
    (void)decode(body, m); (void)decode(body, n); (void)decode(body, o); (void)decode(body, p);
    (void)decode(body, q); (void)decode(body, r); (void)decode(body, s); (void)decode(body, t);
    (void)decode(body, u); (void)decode(body, v);
}

// An exact-size heap copy, so that reading one byte past the end trips AddressSanitizer.
struct Exact {
    std::unique_ptr<uint8_t[]> p;
    size_t n;
    explicit Exact(Bytes b) : p(new uint8_t[b.size() ? b.size() : 1]), n(b.size()) {
        if (n) std::memcpy(p.get(), b.data(), n);
    }
    Bytes span() const { return {p.get(), n}; }
};

Bytes body_of(const Buf &frame) {
    FrameHeader h;
    Bytes body;
    EXPECT_EQ(decode_header(frame, h, body), E::None);
    return body;
}

template <class M, class... Type> M round_trip(const M &in, Type... type) {
    Buf buf;
    encode(buf, kCtx, in, type...);
    FrameHeader h;
    Bytes body;
    EXPECT_EQ(decode_header(buf, h, body), E::None);
    EXPECT_EQ(h.proto_major, kProtoMajor);
    EXPECT_EQ(h.proto_minor, kProtoMinor);
    EXPECT_EQ(h.sender_ctx, kCtx);
    EXPECT_EQ(h.body_len, buf.size() - kFrameHeaderBytes);
    EXPECT_EQ(body.size(), h.body_len);
    M out;
    EXPECT_EQ(decode(body, out), E::None);
    return out;
}

// Hand-built bodies, for inputs the encoders never produce.
struct Body {
    Buf b;
    Body &raw(uint16_t tag, const Buf &v) {
        le(tag, 2, b);
        le(v.size(), 4, b);
        b.insert(b.end(), v.begin(), v.end());
        return *this;
    }
    Body &num(uint16_t tag, uint64_t v, size_t bytes) {
        Buf x;
        le(v, bytes, x);
        return raw(tag, x);
    }
    static void le(uint64_t v, size_t bytes, Buf &out) {
        for (size_t i = 0; i < bytes; ++i) out.push_back(static_cast<uint8_t>(v >> (8 * i)));
    }
};

// ---- round trips ----

TEST(WireRoundTrip, Hello) {
    EXPECT_EQ(round_trip(sample_hello()), sample_hello());
    Hello bare;  // empty boot id, no endpoints
    bare.proto_minor = 9;
    EXPECT_EQ(round_trip(bare), bare);
}

TEST(WireRoundTrip, HandleExport) {
    EXPECT_EQ(round_trip(sample_export()), sample_export());
    EXPECT_EQ(round_trip(sample_export(80, 1)), sample_export(80, 1));
    EXPECT_EQ(round_trip(sample_export(0, 2)), sample_export(0, 2));  // no regions
    HandleExport device = sample_export();
    device.layout.mem_kind = 1;  // SG_MEM_CUDA
    device.device_direct = true;
    EXPECT_EQ(round_trip(device), device);
}

TEST(WireRoundTrip, Expect) {
    const Expect big = sample_expect(20000);
    EXPECT_EQ(round_trip(big), big);
    Expect empty;
    EXPECT_EQ(round_trip(empty), empty);
    Expect longest = sample_expect(1);
    longest.request_id.assign(255, 'x');
    EXPECT_EQ(round_trip(longest), longest);
}

TEST(WireRoundTrip, SmallMessages) {
    const LayerReady lr{0x1122334455667788ull, 0xdeadbeef, 1ull << 63, 0xfeedu};
    EXPECT_EQ(round_trip(lr), lr);
    EXPECT_EQ(round_trip(sample_chunk()), sample_chunk());
    EXPECT_EQ(round_trip(StagedChunk{1, 2, 3, 4, {}}), (StagedChunk{1, 2, 3, 4, {}}));
    EXPECT_EQ(round_trip(StagingCredit{0xffffffffu}), StagingCredit{0xffffffffu});
    EXPECT_EQ(round_trip(TransferDone{7, 1ull << 50}), (TransferDone{7, 1ull << 50}));
    EXPECT_EQ(round_trip(Bye{-2147483647 - 1}), Bye{-2147483647 - 1});
    EXPECT_EQ(round_trip(Bye{0}), Bye{0});
    EXPECT_EQ(round_trip(Bye{0, 1}), (Bye{0, 1}));
    EXPECT_EQ(round_trip(Ping{0xfedcba9876543210ull}).sent_ns, 0xfedcba9876543210ull);
    EXPECT_EQ(round_trip(Ping{0xfedcba9876543210ull}).keepalive_ns, 0u);  // what a 1.6 peer sends
    EXPECT_EQ(round_trip(Ping{1, 250000000}).keepalive_ns, 250000000u);
    const std::vector<uint8_t> note(4096, 0x5a);
    EXPECT_EQ(round_trip(Notify{note}).payload, note);
}

TEST(WireRoundTrip, AuthMessages) {
    const std::vector<uint8_t> nonce(kNonceBytes, 0x11), mac(kMacBytes, 0x22);
    EXPECT_EQ(round_trip(AuthChallenge{nonce}).nonce, nonce);
    EXPECT_EQ(round_trip(AuthProof{mac}).mac, mac);
    EXPECT_EQ(round_trip(AuthResult{1}).accepted, 1u);
    EXPECT_EQ(round_trip(AuthResult{0}).accepted, 0u);
    EXPECT_EQ(round_trip(Quiesced{1ull << 60}).decode_xfer_id, 1ull << 60);
    const CancelAck ack = round_trip(CancelAck{"r", 1});
    EXPECT_EQ(ack.request_id, "r");
    EXPECT_EQ(ack.recorded, 1u);
    EXPECT_EQ(round_trip(Reposted{"again"}).request_id, "again");
    // A nonce or MAC of another length is refused rather than padded or cut.
    for (size_t n : {size_t(0), size_t(31), size_t(33)}) {
        Buf b;
        encode(b, kCtx, AuthProof{std::vector<uint8_t>(n, 1)});
        FrameHeader h;
        Bytes body;
        ASSERT_EQ(decode_header(b, h, body), E::None);
        AuthProof p;
        EXPECT_EQ(decode(body, p), E::BadValue) << n;
    }
    Buf b;
    encode(b, kCtx, AuthResult{2});
    FrameHeader h;
    Bytes body;
    ASSERT_EQ(decode_header(b, h, body), E::None);
    AuthResult r;
    EXPECT_EQ(decode(body, r), E::BadValue);
    // A Hello's nonce is empty (no key) or exactly 32 bytes.
    Hello hello = sample_hello();
    hello.nonce.resize(16);
    Buf hb;
    encode(hb, kCtx, hello);
    ASSERT_EQ(decode_header(hb, h, body), E::None);
    Hello back;
    EXPECT_EQ(decode(body, back), E::BadValue);
}

TEST(WireRoundTrip, SelectivePathMessages) {
    const Selective sel = round_trip(Selective{1ull << 40, 0xe});
    EXPECT_EQ(sel.decode_xfer_id, 1ull << 40);
    EXPECT_EQ(sel.paths, 0xeu);
    const Digests d = round_trip(Digests{9, 3, 100, 2, 2, std::vector<uint8_t>(2 * 2 * 2 * 8, 0x3c)});
    EXPECT_EQ(d.layer, 3u);
    EXPECT_EQ(d.first_block, 100u);
    EXPECT_EQ(d.count, 2u);
    EXPECT_EQ(d.elem_bytes, 2u);
    EXPECT_EQ(d.data, std::vector<uint8_t>(64, 0x3c));
    const BlocksReady r = round_trip(BlocksReady{9, 3, 2, 4096, 5, {1, 7, 70000}, 1});
    EXPECT_EQ(r.path, 2u);
    EXPECT_EQ(r.bytes, 4096u);
    EXPECT_EQ(r.digest_chunks, 5u);
    EXPECT_EQ(r.blocks, (std::vector<uint32_t>{1, 7, 70000}));
    EXPECT_EQ(r.essential, 1u);
    const Fetch f = round_trip(Fetch{"req", 9, 3, {4, 5}});
    EXPECT_EQ(f.request_id, "req");
    EXPECT_EQ(f.layer, 3u);
    EXPECT_EQ(f.blocks, (std::vector<uint32_t>{4, 5}));
    // Digest elements are 2 or 4 bytes: anything else is refused.
    Buf b;
    encode(b, kCtx, Digests{9, 0, 0, 1, 3, {1, 2, 3}});
    FrameHeader h;
    Bytes body;
    ASSERT_EQ(decode_header(b, h, body), E::None);
    Digests bad;
    EXPECT_EQ(decode(body, bad), E::BadValue);
}

TEST(WireRoundTrip, CancelAndErrorShareABody) {
    for (MsgType t : {MsgType::Cancel, MsgType::Error}) {
        EXPECT_EQ(round_trip(sample_error(), t), sample_error());
        EXPECT_EQ(round_trip(TransferError{}, t), TransferError{});
        Buf buf;
        encode(buf, kCtx, sample_error(), t);
        FrameHeader h;
        Bytes body;
        ASSERT_EQ(decode_header(buf, h, body), E::None);
        EXPECT_EQ(h.type, t);
    }
}

TEST(WireHeader, FramesAppendAndTrailingBytesAreIgnored) {
    Buf buf;
    encode(buf, 1, LayerReady{1, 2, 3});
    const size_t second = buf.size();
    encode(buf, 2, sample_expect(10));
    FrameHeader h;
    Bytes body;
    ASSERT_EQ(decode_header(buf, h, body), E::None);  // the second frame trails the first
    EXPECT_EQ(h.type, MsgType::LayerReady);
    EXPECT_EQ(h.sender_ctx, 1u);
    LayerReady lr;
    ASSERT_EQ(decode(body, lr), E::None);
    EXPECT_EQ(lr, (LayerReady{1, 2, 3}));
    ASSERT_EQ(decode_header(Bytes(buf).subspan(second), h, body), E::None);
    EXPECT_EQ(h.type, MsgType::Expect);
    EXPECT_EQ(h.sender_ctx, 2u);
    Expect ex;
    ASSERT_EQ(decode(body, ex), E::None);
    EXPECT_EQ(ex, sample_expect(10));
}

TEST(WireHeader, LayoutIsLittleEndianAsDocumented) {
    Buf buf;
    encode(buf, 0x0807060504030201ull, Bye{0x44332211});
    // Magic bytes from the constant: kMagic spells "SWW1" in memory, not the "SGW1" the header says.
    const uint8_t m0 = kMagic & 0xff, m1 = (kMagic >> 8) & 0xff, m2 = (kMagic >> 16) & 0xff, m3 = kMagic >> 24;
    const Buf want = {m0, m1, m2, m3, 1, 0, uint8_t(kProtoMinor), 0, 10, 0, 0, 0, 1, 2, 3, 4, 5, 6, 7, 8, 10, 0, 0, 0,
                      1, 0, 4, 0, 0, 0, 0x11, 0x22, 0x33, 0x44};
    EXPECT_EQ(buf, want);
    EXPECT_EQ(kFrameHeaderBytes, 24u);
}

// ---- truncation ----

// Every strict prefix of the frame is refused by the header; every strict prefix of the body is
// refused by the body decoder when `every_body_prefix_fails` (the last field is required).
template <class M> void check_truncations(const Buf &frame, bool every_body_prefix_fails) {
    for (size_t n = 0; n < frame.size(); ++n) {
        const Exact cut(Bytes(frame).first(n));
        FrameHeader h;
        Bytes body;
        ASSERT_NE(decode_header(cut.span(), h, body), E::None) << "prefix " << n;
        if (n >= kFrameHeaderBytes) {
            EXPECT_EQ(decode_header(cut.span(), h, body), E::Truncated);
        }
    }
    const Bytes body = body_of(frame);
    for (size_t n = 0; n < body.size(); ++n) {
        const Exact cut(body.first(n));
        M m;
        const E e = decode(cut.span(), m);
        if (every_body_prefix_fails) {
            EXPECT_NE(e, E::None) << "body prefix " << n;
        }
        if (e != E::None) {
            EXPECT_TRUE(e == E::Truncated || e == E::MissingField) << decode_error_str(e);
        }
    }
}

TEST(WireTruncation, Expect) {
    Buf frame;
    encode(frame, kCtx, sample_expect(40));
    check_truncations<Expect>(frame, true);
}

TEST(WireTruncation, StagedChunk) {
    Buf frame;
    encode(frame, kCtx, sample_chunk());
    check_truncations<StagedChunk>(frame, true);
}

TEST(WireTruncation, Hello) {
    Buf frame;
    encode(frame, kCtx, sample_hello());
    // A body cut between two endpoints is a valid Hello with fewer endpoints.
    check_truncations<Hello>(frame, false);
}

// ---- header corruption ----

TEST(WireHeader, BadMagic) {
    Buf buf;
    encode(buf, kCtx, Bye{});
    buf[3] ^= 0x01;
    FrameHeader h;
    Bytes body;
    EXPECT_EQ(decode_header(buf, h, body), E::BadMagic);
}

TEST(WireHeader, OtherMajorIsRefusedOtherMinorIsNot) {
    Buf buf;
    encode(buf, kCtx, sample_chunk());
    FrameHeader h;
    Bytes body;
    Buf major = buf;
    major[4] = kProtoMajor + 1;
    EXPECT_EQ(decode_header(major, h, body), E::VersionMismatch);
    Buf minor = buf;
    minor[6] = kProtoMinor + 1;
    ASSERT_EQ(decode_header(minor, h, body), E::None);
    EXPECT_EQ(h.proto_minor, kProtoMinor + 1);
    StagedChunk m;
    ASSERT_EQ(decode(body, m), E::None);
    EXPECT_EQ(m, sample_chunk());
}

TEST(WireHeader, UnknownType) {
    Buf buf;
    encode(buf, kCtx, Bye{});
    FrameHeader h;
    Bytes body;
    for (int t : {0, int(kLastMsgType) + 1, 0x100, 0xffff}) {
        buf[8] = static_cast<uint8_t>(t);
        buf[9] = static_cast<uint8_t>(t >> 8);
        EXPECT_EQ(decode_header(buf, h, body), E::UnknownType) << t;
    }
}

TEST(WireHeader, TooLargeWinsOverTruncated) {
    Buf buf;
    encode(buf, kCtx, Bye{});
    FrameHeader h;
    Bytes body;
    auto set_body_len = [&](uint32_t n) {
        for (int i = 0; i < 4; ++i) buf[kBodyLenAt + i] = static_cast<uint8_t>(n >> (8 * i));
    };
    set_body_len(static_cast<uint32_t>(kMaxFrameBytes - kFrameHeaderBytes));
    EXPECT_EQ(decode_header(buf, h, body), E::Truncated);  // the largest legal frame, not all here
    EXPECT_EQ(h.body_len, kMaxFrameBytes - kFrameHeaderBytes);  // a stream reader learns what to await
    set_body_len(static_cast<uint32_t>(kMaxFrameBytes - kFrameHeaderBytes + 1));
    EXPECT_EQ(decode_header(buf, h, body), E::TooLarge);
    set_body_len(0xffffffffu);
    EXPECT_EQ(decode_header(buf, h, body), E::TooLarge);
}

TEST(WireBody, BodyLargerThanAnyFrameIsRefused) {
    Buf big = Body{}.raw(0x8001, Buf(kMaxFrameBytes, 0)).b;
    Bye m;
    EXPECT_EQ(decode(big, m), E::TooLarge);
}

// ---- fields ----

TEST(WireFields, UnknownOptionalFieldsAreSkippedInEveryType) {
    const Buf extra = {1, 2, 3, 4, 5};
    for (const Buf &orig : corpus()) {
        Buf buf = orig;
        append_raw_field(buf, 0, kOptionalBit | 7, extra);
        append_raw_field(buf, 0, 0xffff, {});
        append_raw_field(buf, 0, kOptionalBit | 0x7ff, extra);  // a number no minor has used yet
        EXPECT_EQ(decode_frame(buf), E::None);
        EXPECT_EQ(body_of(buf).size(), body_of(orig).size() + 3 * 6 + 2 * extra.size());
    }
    Buf buf;
    encode(buf, kCtx, sample_chunk());
    append_raw_field(buf, 0, kOptionalBit | 42, extra);
    StagedChunk m;
    ASSERT_EQ(decode(body_of(buf), m), E::None);
    EXPECT_EQ(m, sample_chunk());
}

// A staged chunk's check (1.7) is its slot's generation and the CRC32C of its bytes, both or
// neither: a CRC alone, or a generation of 0 (which reads as "not sent"), is refused.
TEST(WireFields, AStagedChunksCheckComesWhole) {
    StagedChunk checked = sample_chunk();
    checked.generation = 0xfffffffeu;
    checked.crc32c = 0;
    EXPECT_EQ(round_trip(checked), checked);
    checked.crc32c = 0xe3069283u;
    EXPECT_EQ(round_trip(checked), checked);
    const Buf crc = {1, 2, 3, 4}, zero = {0, 0, 0, 0};
    StagedChunk m;
    Buf alone;
    encode(alone, kCtx, sample_chunk());
    append_raw_field(alone, 0, kOptionalBit | 3, crc);
    EXPECT_EQ(decode(body_of(alone), m), E::BadValue);
    Buf generation_zero = alone;
    append_raw_field(generation_zero, 0, kOptionalBit | 2, zero);
    m = {};
    EXPECT_EQ(decode(body_of(generation_zero), m), E::BadValue);
    Buf generation_only;
    encode(generation_only, kCtx, sample_chunk());
    append_raw_field(generation_only, 0, kOptionalBit | 2, crc);
    m = {};
    EXPECT_EQ(decode(body_of(generation_only), m), E::BadValue);
}

// Both sides count a slot's generations with the same two helpers: from 1, UINT32_MAX then 1.
TEST(WireFields, AGenerationWrapsToOneAndStillGrows) {
    EXPECT_EQ(next_generation(0), 1u);
    EXPECT_EQ(next_generation(41), 42u);
    EXPECT_EQ(next_generation(UINT32_MAX), 1u);
    EXPECT_TRUE(generation_grew(0, 1));
    EXPECT_TRUE(generation_grew(41, 43));  // a write that failed skips one
    EXPECT_TRUE(generation_grew(UINT32_MAX, 1));
    EXPECT_FALSE(generation_grew(42, 42));
    EXPECT_FALSE(generation_grew(42, 7));
    EXPECT_FALSE(generation_grew(UINT32_MAX - 1, 1));
}

// 1.8: an Expect may ask for BlockCrcs; the CRCs of a layer's blocks come as a non-empty run.
TEST(WireFields, VerificationAsksOnceAndItsCrcsComeAsARun) {
    Expect asks = sample_expect(3);
    asks.verify = 1;
    EXPECT_EQ(round_trip(asks), asks);
    Buf two;
    encode(two, kCtx, sample_expect(3));
    append_raw_field(two, 0, kOptionalBit | 2, Buf{2, 0, 0, 0});
    Expect m;
    EXPECT_EQ(decode(body_of(two), m), E::BadValue);

    const BlockCrcs crcs{8, 3, 5, {0xdeadbeefu, 0, 0xffffffffu}};
    Buf frame;
    encode(frame, kCtx, crcs);
    BlockCrcs back;
    ASSERT_EQ(decode(body_of(frame), back), E::None);
    EXPECT_EQ(back.decode_xfer_id, 8u);
    EXPECT_EQ(back.layer, 3u);
    EXPECT_EQ(back.first_block, 5u);
    EXPECT_EQ(back.crcs, crcs.crcs);
    Buf empty;
    encode(empty, kCtx, BlockCrcs{8, 3, 5, {}});
    EXPECT_EQ(decode(body_of(empty), back), E::BadValue);
}

TEST(WireFields, AppendRawFieldPatchesTheRightFrame) {
    Buf buf;
    encode(buf, kCtx, Bye{3});
    const size_t second = buf.size();
    encode(buf, kCtx, TransferDone{1, 2});
    append_raw_field(buf, second, kOptionalBit | 3, Buf{9, 9});
    EXPECT_EQ(decode_frame(buf), E::None);
    EXPECT_EQ(decode_frame(Bytes(buf).subspan(second)), E::None);
    FrameHeader h;
    Bytes body;
    ASSERT_EQ(decode_header(Bytes(buf).subspan(second), h, body), E::None);
    EXPECT_EQ(h.body_len, 2 * (6 + 8) + 6 + 2);
    EXPECT_THROW(append_raw_field(buf, buf.size() - 10, 1, {}), std::out_of_range);
}

TEST(WireFields, UnknownRequiredFieldIsRefused) {
    for (uint16_t tag : {uint16_t{0}, uint16_t{6}, uint16_t{42}, uint16_t{0x7fff}}) {
        Buf buf;
        encode(buf, kCtx, sample_expect(3));
        append_raw_field(buf, 0, tag, Buf{1});
        EXPECT_EQ(decode_frame(buf), E::UnknownRequiredField) << tag;
    }
    for (const Buf &orig : corpus()) {
        Buf buf = orig;
        append_raw_field(buf, 0, 0x4000, {});
        EXPECT_EQ(decode_frame(buf), E::UnknownRequiredField);
    }
}

TEST(WireFields, WrongSizeIntegerIsBadValue) {
    LayerReady lr;
    EXPECT_EQ(decode(Body{}.num(1, 1, 8).num(2, 2, 4).num(3, 3, 8).num(4, 0, 4).b, lr), E::None);
    EXPECT_EQ(decode(Body{}.num(1, 1, 8).num(2, 2, 8).num(3, 3, 8).num(4, 0, 4).b, lr), E::BadValue);
    EXPECT_EQ(decode(Body{}.num(1, 1, 4).num(2, 2, 4).num(3, 3, 8).num(4, 0, 4).b, lr), E::BadValue);
    EXPECT_EQ(decode(Body{}.num(1, 1, 8).num(2, 2, 4).num(3, 3, 0).num(4, 0, 4).b, lr), E::BadValue);
    EXPECT_EQ(decode(Body{}.num(1, 1, 8).num(2, 2, 4).num(3, 3, 8).num(4, 0, 8).b, lr), E::BadValue);
    Bye bye;
    EXPECT_EQ(decode(Body{}.num(1, 1, 2).b, bye), E::BadValue);
    Hello hello;
    EXPECT_EQ(decode(Body{}.num(1, 1, 4).num(2, 0, 2).num(3, 0, 8).raw(4, {}).num(5, 0, 8).b, hello), E::BadValue);
}

TEST(WireFields, MissingRequiredField) {
    LayerReady lr;
    EXPECT_EQ(decode(Body{}.num(1, 1, 8).num(3, 3, 8).b, lr), E::MissingField);
    for (const Buf &frame : corpus()) {  // an empty body misses everything, in every type
        Buf empty(frame.begin(), frame.begin() + kFrameHeaderBytes);
        for (size_t i = 0; i < 4; ++i) empty[kBodyLenAt + i] = 0;
        EXPECT_EQ(decode_frame(empty), E::MissingField);
    }
    Expect ex;  // an empty block table is fine, an absent one is not
    EXPECT_EQ(decode(Body{}.raw(1, {'r'}).num(2, 1, 8).num(3, 1, 8).num(4, 1, 8).raw(5, {}).b, ex), E::None);
    EXPECT_EQ(decode(Body{}.raw(1, {'r'}).num(2, 1, 8).num(3, 1, 8).num(4, 1, 8).b, ex), E::MissingField);
}

TEST(WireFields, DuplicateFieldIsBadValue) {
    Buf buf;
    encode(buf, kCtx, LayerReady{1, 2, 3});
    append_raw_field(buf, 0, 2, Buf{4, 0, 0, 0});
    EXPECT_EQ(decode_frame(buf), E::BadValue);
}

TEST(WireFields, RequestIdLongerThan255IsBadValue) {
    Expect ex = sample_expect(2);
    ex.request_id.assign(256, 'r');
    Buf buf;
    encode(buf, kCtx, ex);
    EXPECT_EQ(decode_frame(buf), E::BadValue);
    TransferError te = sample_error();
    te.request_id.assign(256, 'r');
    buf.clear();
    encode(buf, kCtx, te, MsgType::Cancel);
    EXPECT_EQ(decode_frame(buf), E::BadValue);
}

TEST(WireFields, PackedArraysMustHoldWholeRecords) {
    auto expect_body = [](Buf ids) {
        return Body{}.raw(1, {}).num(2, 1, 8).num(3, 1, 8).num(4, 1, 8).raw(5, std::move(ids)).b;
    };
    Expect ex;
    EXPECT_EQ(decode(expect_body(Buf(8, 1)), ex), E::None);
    EXPECT_EQ(ex.block_ids, (std::vector<uint32_t>{0x01010101u, 0x01010101u}));
    EXPECT_EQ(decode(expect_body(Buf(7, 1)), ex), E::BadValue);
    auto chunk_body = [](Buf segs) {
        return Body{}.num(1, 1, 8).num(2, 1, 4).num(3, 1, 4).num(4, 1, 8).raw(5, std::move(segs)).b;
    };
    StagedChunk sc;
    EXPECT_EQ(decode(chunk_body(Buf(40, 0)), sc), E::None);
    EXPECT_EQ(sc.segments.size(), 2u);
    EXPECT_EQ(decode(chunk_body(Buf(24, 0)), sc), E::BadValue);
}

TEST(WireFields, InconsistentHandleExportIsBadValue) {
    HandleExport m = sample_export(3, 2);
    m.regions.pop_back();
    Buf buf;
    encode(buf, kCtx, m);
    EXPECT_EQ(decode_frame(buf), E::BadValue);
    m = sample_export(3, 2);
    m.layout.block_stride_bytes = 0;
    buf.clear();
    encode(buf, kCtx, m);
    EXPECT_EQ(decode_frame(buf), E::BadValue);
    // Host memory registered "as device memory" is a contradiction, not a hint to ignore.
    m = sample_export(3, 2);
    m.layout.mem_kind = 0;
    m.device_direct = true;
    buf.clear();
    encode(buf, kCtx, m);
    EXPECT_EQ(decode_frame(buf), E::BadValue);
}

TEST(WireFields, HelloEndpointsAreBounded) {
    Hello m = sample_hello();
    m.endpoints.assign(64, {"tcp", {1, 2, 3}});
    EXPECT_EQ(round_trip(m), m);
    m.endpoints.push_back({"tcp", {}});
    Buf buf;
    encode(buf, kCtx, m);
    EXPECT_EQ(decode_frame(buf), E::BadValue);
    m = sample_hello();
    m.endpoints[0].provider.assign(256, 'p');
    buf.clear();
    encode(buf, kCtx, m);
    EXPECT_EQ(decode_frame(buf), E::BadValue);
}

TEST(WireFields, EndpointFieldsFollowTheSameRules) {
    const Buf base = Body{}.num(1, 1, 2).num(2, 0, 2).num(3, 5, 8).raw(4, {}).num(5, 6, 8).num(7, 0, 4).raw(8, {}).b;
    auto with_endpoint = [&](const Buf &ep) {
        Buf b = base;
        Body::le(6, 2, b);
        Body::le(ep.size(), 4, b);
        b.insert(b.end(), ep.begin(), ep.end());
        return b;
    };
    Hello m;
    EXPECT_EQ(decode(with_endpoint(Body{}.raw(1, {'x'}).raw(kOptionalBit | 9, {1}).raw(2, {7}).b), m), E::None);
    ASSERT_EQ(m.endpoints.size(), 1u);
    EXPECT_EQ(m.endpoints[0], (Hello::Endpoint{"x", {7}}));
    EXPECT_EQ(decode(with_endpoint(Body{}.raw(1, {'x'}).b), m), E::MissingField);
    EXPECT_EQ(decode(with_endpoint(Body{}.raw(1, {}).raw(2, {}).raw(3, {}).b), m), E::UnknownRequiredField);
    Buf cut = Body{}.raw(1, {'x'}).raw(2, {7}).b;
    cut.pop_back();
    EXPECT_EQ(decode(with_endpoint(cut), m), E::Truncated);
}

TEST(WireFields, ErrorStrings) {
    std::set<std::string> seen;
    for (int i = 0; i <= static_cast<int>(E::TooLarge); ++i) {
        const char *s = decode_error_str(static_cast<E>(i));
        ASSERT_NE(s, nullptr);
        EXPECT_GT(std::strlen(s), 0u);
        seen.insert(s);
    }
    EXPECT_EQ(seen.size(), static_cast<size_t>(E::TooLarge) + 1);
}

// ---- random mutations ----

// Meant to run under -fsanitize=address,undefined: any read past a buffer (each input is an
// exact-size heap copy) or any UB aborts the test.
TEST(WireFuzz, RandomMutationsNeverCrash) {
    const std::vector<Buf> frames = corpus();
    std::mt19937_64 rng(20240611);
    auto below = [&](size_t n) { return static_cast<size_t>(rng() % n); };
    size_t accepted = 0, refused = 0;
    for (int iter = 0; iter < 20000; ++iter) {
        Buf f = frames[below(frames.size())];
        const int mutations = 1 + static_cast<int>(below(3));
        for (int k = 0; k < mutations && !f.empty(); ++k) {
            switch (below(6)) {
            case 0:  // flip bits (biased toward the body, where the decoders are)
                f[below(f.size())] ^= static_cast<uint8_t>(1u << below(8));
                break;
            case 1:  // random byte
                f[below(f.size())] = static_cast<uint8_t>(rng());
                break;
            case 2:  // truncate
                f.resize(below(f.size() + 1));
                break;
            case 3: {  // overwrite a u32 (often a field length) with an extreme or near value
                if (f.size() < 4) break;
                const uint32_t values[] = {0, 1, 3, 0x7fffffffu, 0xffffffffu, static_cast<uint32_t>(f.size()),
                                           static_cast<uint32_t>(rng())};
                const uint32_t v = values[below(std::size(values))];
                const size_t at = below(f.size() - 3);
                for (int i = 0; i < 4; ++i) f[at + i] = static_cast<uint8_t>(v >> (8 * i));
                break;
            }
            case 4: {  // insert random bytes in the middle
                const size_t at = below(f.size() + 1);
                Buf junk(1 + below(8));
                for (auto &b : junk) b = static_cast<uint8_t>(rng());
                f.insert(f.begin() + static_cast<std::ptrdiff_t>(at), junk.begin(), junk.end());
                break;
            }
            case 5:  // make body_len claim whatever is there, so body decoders see the mutation
                if (f.size() >= kFrameHeaderBytes) {
                    const uint32_t n = static_cast<uint32_t>(f.size() - kFrameHeaderBytes);
                    for (int i = 0; i < 4; ++i) f[kBodyLenAt + i] = static_cast<uint8_t>(n >> (8 * i));
                }
                break;
            }
        }
        const Exact frame(f);
        (decode_frame(frame.span()) == E::None ? accepted : refused)++;
        if (f.size() >= kFrameHeaderBytes) decode_as_every_type(Exact(Bytes(f).subspan(kFrameHeaderBytes)).span());
    }
    // Both outcomes must occur, or the loop tested nothing.
    EXPECT_GT(accepted, 100u);
    EXPECT_GT(refused, 100u);
}

}  // namespace

TEST(WireFields, AuthResultCarriesItsOptionalMacOnceAndOfTheRightSize) {
    AuthResult r;
    r.accepted = 1;
    r.mac.assign(kMacBytes, 0xab);
    Buf buf;
    encode(buf, kCtx, r);
    AuthResult back;
    ASSERT_EQ(decode(body_of(buf), back), E::None);
    EXPECT_EQ(back.mac, r.mac);
    Buf twice = buf;
    append_raw_field(twice, 0, kOptionalBit | 1, Buf(kMacBytes, 1));
    EXPECT_EQ(decode(body_of(twice), back), E::BadValue);
    Buf short_mac;
    encode(short_mac, kCtx, AuthResult{1, {}});
    append_raw_field(short_mac, 0, kOptionalBit | 1, Buf(5, 1));
    EXPECT_EQ(decode(body_of(short_mac), back), E::BadValue);
}
