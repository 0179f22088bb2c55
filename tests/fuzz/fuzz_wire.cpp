// Fuzzer: the wire decoder (runtime/wire) on arbitrary bytes.
//
// The input is one frame as it would arrive from a peer. decode_header runs on it; when the header
// is valid, the body goes through the decoder of its type. Whatever the header says, the body is
// also run through every other decoder, so each decoder sees every shape of body the corpus holds.
// Each message that decodes is re-encoded and decoded again, and the two encodings must be equal
// (decode and encode agree on every field; a decoder that accepts a value its encoder cannot
// represent is a finding). Nothing here needs a context, so it runs at full speed.
#include "wire/wire.hpp"

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <span>
#include <vector>

using namespace sg::wire;

namespace {

[[noreturn]] void mismatch(const char *what) {
    std::fprintf(stderr, "fuzz_wire: %s: re-encoding a decoded message does not round-trip\n", what);
    std::abort();
}

template <class M> void check_round_trip(const M &m, const char *what) {
    std::vector<uint8_t> a, b;
    encode(a, 42, m);
    FrameHeader h;
    std::span<const uint8_t> body;
    if (decode_header(a, h, body) != DecodeError::None) mismatch(what);
    M again;
    if (decode(body, again) != DecodeError::None) mismatch(what);
    encode(b, 42, again);
    if (a != b) mismatch(what);
}

void check_round_trip(const TransferError &m, MsgType type) {
    std::vector<uint8_t> a, b;
    encode(a, 42, m, type);
    FrameHeader h;
    std::span<const uint8_t> body;
    if (decode_header(a, h, body) != DecodeError::None || h.type != type) mismatch("TransferError");
    TransferError again;
    if (decode(body, again) != DecodeError::None) mismatch("TransferError");
    encode(b, 42, again, type);
    if (a != b) mismatch("TransferError");
}

template <class M> bool try_decode(std::span<const uint8_t> body, const char *what) {
    M m;
    if (decode(body, m) != DecodeError::None) return false;
    check_round_trip(m, what);
    return true;
}

// Every decoder on the body; the one the header names is just one of them.
void decode_all(std::span<const uint8_t> body) {
    try_decode<Hello>(body, "Hello");
    try_decode<HandleExport>(body, "HandleExport");
    try_decode<Expect>(body, "Expect");
    try_decode<LayerReady>(body, "LayerReady");
    try_decode<StagedChunk>(body, "StagedChunk");
    try_decode<StagingCredit>(body, "StagingCredit");
    try_decode<TransferDone>(body, "TransferDone");
    {
        TransferError m;
        if (decode(body, m) == DecodeError::None) {
            check_round_trip(m, MsgType::Cancel);
            check_round_trip(m, MsgType::Error);
        }
    }
    try_decode<Bye>(body, "Bye");
    try_decode<Ping>(body, "Ping");
    try_decode<Notify>(body, "Notify");
    try_decode<AuthChallenge>(body, "AuthChallenge");
    try_decode<AuthProof>(body, "AuthProof");
    try_decode<AuthResult>(body, "AuthResult");
    try_decode<Quiesced>(body, "Quiesced");
    try_decode<CancelAck>(body, "CancelAck");
    try_decode<Reposted>(body, "Reposted");
    try_decode<Selective>(body, "Selective");
    try_decode<Digests>(body, "Digests");
    try_decode<BlocksReady>(body, "BlocksReady");
    try_decode<Fetch>(body, "Fetch");
    try_decode<TransferAck>(body, "TransferAck");
    try_decode<Opened>(body, "Opened");
    try_decode<Release>(body, "Release");
    try_decode<BlockCrcs>(body, "BlockCrcs");
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    const std::span<const uint8_t> frame(data, size);
    FrameHeader h;
    std::span<const uint8_t> body;
    const DecodeError e = decode_header(frame, h, body);
    (void)decode_error_str(e);
    if (e == DecodeError::None) {
        if (body.size() != h.body_len || body.data() != data + kFrameHeaderBytes) {
            std::fprintf(stderr, "fuzz_wire: decode_header's body is not the frame's body\n");
            std::abort();
        }
        decode_all(body);
    } else if (size > kFrameHeaderBytes) {
        // A bad header (magic, version, type) says nothing about the body: decode it anyway.
        decode_all(frame.subspan(kFrameHeaderBytes));
    }
    return 0;
}
