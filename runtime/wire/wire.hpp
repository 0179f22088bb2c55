// runtime/wire: control messages between two SmartGen contexts — encode and decode only.
//
// Depends on nothing else in the runtime but common/layout_desc.hpp. Every message is a frame:
//   u32 magic 'SGW1' | u16 proto_major | u16 proto_minor | u16 type | u16 reserved (0)
//   | u64 sender context id | u32 body_len | body
// and the body is a sequence of fields: u16 tag | u32 len | len bytes. A decoder skips fields whose
// tag it does not know when the tag has kOptionalBit set (a newer minor may add them), and refuses an
// unknown required tag. Integers are little-endian. Every length is checked against what remains, so
// a truncated or corrupt message is refused with a reason, never read past its end.
#pragma once

#include "common/layout_desc.hpp"

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

namespace sg::wire {

inline constexpr uint32_t kMagic = 0x31574753u;  // bytes "SGW1" on the wire (little-endian)
inline constexpr uint16_t kProtoMajor = 1;
// 1.1: AuthResult carries a MAC (role-bound bootstrap verdicts), TransferAck, Bye replies.
// 1.2: Release. 1.3: in-flight quantization (Expect's and StagedChunk's wire_quant).
// 1.4: device pools registered with the provider (HandleExport's device_direct).
// 1.5: a striped transport frames its messages to a 1.5 peer (transport/lanes.cpp): no change to
//      these frames, only the envelope the lanes put around them.
// 1.6: a striped transport answers a lane-loss notice with LaneFenced once its own connection on
//      that lane is closed, and sends a write that broke a lane again only after the peer's answer
//      (docs/protocol.md 3.1); with a 1.5 peer such a write fails instead. No change to these frames.
// 1.7: a lane given up is closed in two steps and then used again (lanes heal); the envelope's
//      lane notices carry the lane's epoch. StagedChunk's optional generation and CRC32C; Ping's
//      optional keepalive_ns.
// 1.8: end-to-end verification (SG_TRANSFER_VERIFY): Expect's optional verify; BlockCrcs.
inline constexpr uint16_t kProtoMinor = 8;
inline constexpr uint16_t kOptionalBit = 0x8000;
inline constexpr size_t kFrameHeaderBytes = 4 + 2 + 2 + 2 + 2 + 8 + 4;
// Largest frame either side sends or accepts (receive buffers are this size).
inline constexpr size_t kMaxFrameBytes = 256 * 1024;

enum class MsgType : uint16_t {
    Hello = 1,         // endpoint names and host identity (bootstrap and metadata blobs)
    HandleExport = 2,  // a KV pool's layout and the keys of its regions
    Expect = 3,        // decode -> prefill: request id, destination handle and block table
    LayerReady = 4,    // prefill -> decode: every byte of a layer of a transfer is in place
    StagedChunk = 5,   // prefill -> decode: a staging slot holds these segments, unpack them
    StagingCredit = 6, // decode -> prefill: a staging slot is free again
    TransferDone = 7,  // prefill -> decode: all layers sent
    Cancel = 8,        // either way: the transfer is canceled (status carried)
    Error = 9,         // either way: the transfer failed (status and message)
    Bye = 10,          // graceful close of the session
    Ping = 11,         // liveness: sent when a session has been quiet, so silence means loss
    Notify = 12,       // an application's own small message (first token, positions, ids)
    AuthChallenge = 13,  // a fresh nonce the peer must prove key possession against
    AuthProof = 14,      // HMAC over the transcript, answering a challenge
    AuthResult = 15,     // whether the sender accepted the peer's proof
    Quiesced = 16,       // prefill -> decode: no write for this Expect will come any more
    CancelAck = 17,      // decode -> prefill: a cancel by request id arrived (see TransferError)
    Reposted = 18,       // prefill -> decode: a request id canceled before its match is posted again
    // Selective paths (SG_PATH_PROACTIVE / ON_DEMAND / SPECULATIVE):
    Selective = 19,      // prefill -> decode: the matched transfer runs these paths
    Digests = 20,        // prefill -> decode: a run of one layer's page digests
    BlocksReady = 21,    // prefill -> decode: these blocks of a layer are in place (one send unit)
    Fetch = 22,          // decode -> prefill: send these blocks of a layer first
    // Since 1.1:
    TransferAck = 23,    // decode -> prefill: every byte of the transfer is in place (it completed)
    Opened = 24,         // bootstrap, each way, last: whether the sender could open its session
    // Since 1.2:
    Release = 25,        // decode -> prefill: the decode side is done with a selective transfer (not a failure)
    // Since 1.8 (sent only to a peer of 1.8 or later):
    BlockCrcs = 26,      // prefill -> decode: what a layer's blocks must hold, checked as they arrive
};
inline constexpr MsgType kLastMsgType = MsgType::BlockCrcs;

inline constexpr size_t kNonceBytes = 32;
inline constexpr size_t kMacBytes = 32;  // HMAC-SHA256
enum class AuthMode : uint32_t { None = 0, HmacSha256 = 1 };

inline constexpr size_t kMaxNotifyBytes = 4096;

enum class DecodeError {
    None = 0,
    Truncated,       // fewer bytes than a length says
    BadMagic,
    VersionMismatch, // another protocol major
    UnknownType,
    UnknownRequiredField,
    MissingField,
    BadValue,        // a field has the wrong size or an impossible value
    TooLarge,
};

const char *decode_error_str(DecodeError e);

struct FrameHeader {
    uint16_t proto_major = kProtoMajor;
    uint16_t proto_minor = kProtoMinor;
    MsgType type = MsgType::Hello;
    uint64_t sender_ctx = 0;
    uint32_t body_len = 0;
};

struct Hello {
    uint16_t proto_major = kProtoMajor;
    uint16_t proto_minor = kProtoMinor;
    uint64_t ctx_id = 0;                  // random per context, names the sender in every frame
    std::string boot_id;                  // /proc/sys/kernel/random/boot_id
    uint64_t netns_inode = 0;             // stat(/proc/self/ns/net).st_ino
    struct Endpoint {
        std::string provider;             // "tcp;ofi_rxm", "shm", ...
        std::vector<uint8_t> address;     // fi_getname() bytes
    };
    std::vector<Endpoint> endpoints;      // one per provider the context opened
    AuthMode auth = AuthMode::None;       // what the sender requires of its peers
    std::vector<uint8_t> nonce;           // kNonceBytes, fresh per bootstrap (binds the proofs)
};

struct Region {
    uint64_t key = 0;    // remote key of the region's registration
    uint64_t base = 0;   // address to use in RMA: virtual address (FI_MR_VIRT_ADDR) or 0 (offsets)
    uint64_t length = 0;
};

// The layout descriptor is shared with kv/ (which may not use wire/), so it lives in common/.
using LayoutDesc = sg::LayoutDesc;

struct HandleExport {
    uint64_t handle_id = 0;          // the exporter's id of the pool, used in Expect
    LayoutDesc layout;
    // Region r of layer l: regions[l * regions_per_layer + r]; r = 0 is K (or fused), 1 is V.
    uint32_t regions_per_layer = 0;
    std::vector<Region> regions;
    // Since 1.4: an SG_MEM_CUDA pool whose regions the provider registered (FI_HMEM): written by
    // RMA like host memory. Without it a device pool's regions carry no key and every byte for it
    // goes through the staging slots.
    bool device_direct = false;
};

struct Expect {
    std::string request_id;
    uint64_t decode_xfer_id = 0;     // the decode side's id for this transfer, echoed back
    uint64_t handle_id = 0;          // destination pool (an exported handle of the sender)
    uint64_t num_tokens = 0;
    std::vector<uint32_t> block_ids;
    uint32_t wire_quant = 0;         // since 1.3: the SG_WIRE_QUANT_* the decode side consents to
    uint32_t verify = 0;             // since 1.8: 1 asks for BlockCrcs (the decode side checks them)
};

struct LayerReady {
    uint64_t decode_xfer_id = 0;
    uint32_t layer = 0;
    uint64_t bytes = 0;
    // StagedChunk notices of this layer sent before this notice. Providers may complete a large
    // (rendezvous) message after a later small one, so the receiver counts unpacked chunks instead
    // of trusting arrival order.
    uint32_t staged_chunks = 0;
};

struct Segment {
    uint32_t region = 0;   // index into the destination handle's regions
    uint64_t offset = 0;   // byte offset inside that region
    uint64_t length = 0;
};

struct StagedChunk {
    uint64_t decode_xfer_id = 0;
    uint32_t layer = 0;
    uint32_t slot = 0;           // staging slot on the receiver
    uint64_t slot_offset = 0;    // byte offset of the first segment inside the slot
    std::vector<Segment> segments;  // packed back to back in the slot, in this order
    // Since 1.3: SG_WIRE_QUANT_* of every segment (quant/quant.hpp gives their wire form; a
    // segment's length stays its length in the pool). 0: raw bytes.
    uint32_t wire_quant = 0;
    // Since 1.7, both or neither: the slot's generation (each chunk the sender writes into the slot
    // counts one, from 1; it only grows) and the CRC32C of the chunk's bytes in the slot, as they
    // travel. The receiver refuses a generation that did not grow and a chunk whose bytes do not
    // match. 0: not sent (an older peer).
    uint32_t generation = 0;
    uint32_t crc32c = 0;
};

// A staging slot's generation (StagedChunk, since 1.7) counts from 1 and wraps from UINT32_MAX to 1;
// the receiver takes a chunk only if its generation grew (the wrap counts as growing).
constexpr uint32_t next_generation(uint32_t g) { return g == UINT32_MAX ? 1 : g + 1; }
constexpr bool generation_grew(uint32_t last, uint32_t g) { return g > last || (last == UINT32_MAX && g == 1); }

struct StagingCredit {
    uint32_t slot = 0;
};

struct TransferDone {
    uint64_t decode_xfer_id = 0;
    uint64_t bytes = 0;
};

struct TransferError {  // Cancel and Error share this body
    std::string request_id;
    uint64_t decode_xfer_id = 0;  // 0 when unknown (e.g. the prefill side cancels before a match)
    int32_t status = 0;
    std::string message;
    // Which side sent it: a context can post and expect the same request id on one session, and
    // each side numbers its transfers on its own, so the id alone is ambiguous.
    uint32_t from_post_side = 0;
};

struct Quiesced {
    uint64_t decode_xfer_id = 0;
};

struct CancelAck {
    std::string request_id;
    uint32_t recorded = 0;  // 1: no expect of the id existed, so decode remembers the cancel
};

struct Reposted {
    std::string request_id;
};

struct Selective {
    uint64_t decode_xfer_id = 0;
    uint32_t paths = 0;  // SG_PATH_* bits
};

// Digests of blocks [first_block, first_block + count) of a layer: per block and KV head, the
// element-wise min then max of the keys, in the pool's dtype (min and max of stored keys are stored
// keys, so fp16/bf16 lose nothing).
struct Digests {
    uint64_t decode_xfer_id = 0;
    uint32_t layer = 0;
    uint32_t first_block = 0;
    uint32_t count = 0;
    uint32_t elem_bytes = 0;  // 4 fp32, 2 fp16/bf16 (the pool's dtype)
    std::vector<uint8_t> data;
};

struct BlocksReady {
    uint64_t decode_xfer_id = 0;
    uint32_t layer = 0;
    uint32_t path = 0;            // one SG_PATH_* bit
    uint64_t bytes = 0;           // payload bytes of these blocks
    uint32_t digest_chunks = 0;   // proactive: Digests messages of this layer sent before this notice
    std::vector<uint32_t> blocks; // logical block indices, ascending
    uint32_t essential = 0;       // 1 on the last notice of a layer's proactive unit
    // StagedChunk notices of this layer sent before this notice (all units together): the blocks
    // are in place once the receiver has unpacked that many chunks of the layer.
    uint32_t staged_chunks = 0;
};

// Since 1.8: the content CRCs (kv::content_crc) of blocks [first_block, first_block + crcs.size())
// of a layer, numbered as the decode side's block table. Sent before the layer's first notice; the
// decode side checks each block once its bytes are in place.
struct BlockCrcs {
    uint64_t decode_xfer_id = 0;
    uint32_t layer = 0;
    uint32_t first_block = 0;
    std::vector<uint32_t> crcs;
};

struct Fetch {
    std::string request_id;
    uint64_t decode_xfer_id = 0;
    uint32_t layer = 0;
    std::vector<uint32_t> blocks;  // logical block indices
};

struct Bye {
    int32_t status = 0;
    // Since 1.1: 1 when this Bye answers the peer's. The side that closes waits for the answer, so
    // it knows the peer has read everything sent before its Bye.
    uint32_t reply = 0;
};

struct TransferAck {
    uint64_t decode_xfer_id = 0;
};

// 1.2: replaces "Cancel with status 0 from the decode side", which peers before 1.2 still send.
struct Release {
    std::string request_id;
    uint64_t decode_xfer_id = 0;
};

// The last bootstrap frame each way (1.1): both sides report whether they opened the session, so a
// session exists on both sides or on neither (a provider mismatch used to fail one side only).
struct Opened {
    int32_t status = 0;   // sg_status_t: 0 opened
    std::string message;  // why not, for the peer's error
};

struct Ping {
    uint64_t sent_ns = 0;  // sender's CLOCK_MONOTONIC, for diagnostics only
    // Since 1.7 (optional): how often the sender needs a frame from us to keep the session, in ns
    // (its peer timeout / 8). 0: not said (an older peer).
    uint64_t keepalive_ns = 0;
};

struct Notify {
    std::vector<uint8_t> payload;  // at most kMaxNotifyBytes
};

struct AuthChallenge {
    std::vector<uint8_t> nonce;  // kNonceBytes
};

struct AuthProof {
    std::vector<uint8_t> mac;  // kMacBytes
};

struct AuthResult {
    uint32_t accepted = 0;  // 1: the peer's proof matched our key
    std::vector<uint8_t> mac;  // since 1.1, bootstrap only: auth::bootstrap_verdict (kMacBytes), or empty
};

// Encoding appends one whole frame (header + body) to out.
void encode(std::vector<uint8_t> &out, uint64_t sender_ctx, const Hello &m);
void encode(std::vector<uint8_t> &out, uint64_t sender_ctx, const HandleExport &m);
void encode(std::vector<uint8_t> &out, uint64_t sender_ctx, const Expect &m);
void encode(std::vector<uint8_t> &out, uint64_t sender_ctx, const LayerReady &m);
void encode(std::vector<uint8_t> &out, uint64_t sender_ctx, const StagedChunk &m);
void encode(std::vector<uint8_t> &out, uint64_t sender_ctx, const StagingCredit &m);
void encode(std::vector<uint8_t> &out, uint64_t sender_ctx, const TransferDone &m);
void encode(std::vector<uint8_t> &out, uint64_t sender_ctx, const TransferError &m, MsgType type);
void encode(std::vector<uint8_t> &out, uint64_t sender_ctx, const Bye &m);
void encode(std::vector<uint8_t> &out, uint64_t sender_ctx, const Ping &m);
void encode(std::vector<uint8_t> &out, uint64_t sender_ctx, const Notify &m);
void encode(std::vector<uint8_t> &out, uint64_t sender_ctx, const AuthChallenge &m);
void encode(std::vector<uint8_t> &out, uint64_t sender_ctx, const AuthProof &m);
void encode(std::vector<uint8_t> &out, uint64_t sender_ctx, const AuthResult &m);
void encode(std::vector<uint8_t> &out, uint64_t sender_ctx, const Quiesced &m);
void encode(std::vector<uint8_t> &out, uint64_t sender_ctx, const CancelAck &m);
void encode(std::vector<uint8_t> &out, uint64_t sender_ctx, const Reposted &m);
void encode(std::vector<uint8_t> &out, uint64_t sender_ctx, const Selective &m);
void encode(std::vector<uint8_t> &out, uint64_t sender_ctx, const Digests &m);
void encode(std::vector<uint8_t> &out, uint64_t sender_ctx, const BlocksReady &m);
void encode(std::vector<uint8_t> &out, uint64_t sender_ctx, const Fetch &m);
void encode(std::vector<uint8_t> &out, uint64_t sender_ctx, const TransferAck &m);
void encode(std::vector<uint8_t> &out, uint64_t sender_ctx, const Release &m);
void encode(std::vector<uint8_t> &out, uint64_t sender_ctx, const Opened &m);
void encode(std::vector<uint8_t> &out, uint64_t sender_ctx, const BlockCrcs &m);

// Parses the frame header and checks magic, major version and that body_len fits in `frame`.
// On success `body` is the body's bytes (a view into frame).
DecodeError decode_header(std::span<const uint8_t> frame, FrameHeader &hdr, std::span<const uint8_t> &body);

// Body decoders; each checks every field and refuses unknown required tags.
DecodeError decode(std::span<const uint8_t> body, Hello &m);
DecodeError decode(std::span<const uint8_t> body, HandleExport &m);
DecodeError decode(std::span<const uint8_t> body, Expect &m);
DecodeError decode(std::span<const uint8_t> body, LayerReady &m);
DecodeError decode(std::span<const uint8_t> body, StagedChunk &m);
DecodeError decode(std::span<const uint8_t> body, StagingCredit &m);
DecodeError decode(std::span<const uint8_t> body, TransferDone &m);
DecodeError decode(std::span<const uint8_t> body, TransferError &m);
DecodeError decode(std::span<const uint8_t> body, Bye &m);
DecodeError decode(std::span<const uint8_t> body, Ping &m);
DecodeError decode(std::span<const uint8_t> body, Notify &m);
DecodeError decode(std::span<const uint8_t> body, AuthChallenge &m);
DecodeError decode(std::span<const uint8_t> body, AuthProof &m);
DecodeError decode(std::span<const uint8_t> body, AuthResult &m);
DecodeError decode(std::span<const uint8_t> body, Quiesced &m);
DecodeError decode(std::span<const uint8_t> body, CancelAck &m);
DecodeError decode(std::span<const uint8_t> body, Reposted &m);
DecodeError decode(std::span<const uint8_t> body, Selective &m);
DecodeError decode(std::span<const uint8_t> body, Digests &m);
DecodeError decode(std::span<const uint8_t> body, BlocksReady &m);
DecodeError decode(std::span<const uint8_t> body, Fetch &m);
DecodeError decode(std::span<const uint8_t> body, TransferAck &m);
DecodeError decode(std::span<const uint8_t> body, Release &m);
DecodeError decode(std::span<const uint8_t> body, Opened &m);
DecodeError decode(std::span<const uint8_t> body, BlockCrcs &m);

// For tests of forward compatibility: appends a field with an arbitrary tag to the last frame in
// `out` (fixing its body_len), as a newer peer would.
void append_raw_field(std::vector<uint8_t> &out, size_t frame_start, uint16_t tag, std::span<const uint8_t> value);

}  // namespace sg::wire
