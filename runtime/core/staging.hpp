// Internal to core/ (core.hpp is the folder's header): a staged chunk on each side — reserved and
// counted under the context's mutex, copied without it (staging.cpp) — and the staging variants:
// how a chunk's bytes are copied for each kind of pool memory and wire coding (staging_copy.cpp).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "quant/quant.hpp"
#include "wire/wire.hpp"

namespace sg::core {

class Transfer;
struct SendUnit;
struct StagingVariant;

// The prefill side's half: post_staged_chunk reserves the slots and counts the chunk under the
// mutex, run_packs packs it with the mutex let go and then hands it to the provider under it.
// Notices of its layer or unit wait until it is handed over (packs_pending), so none overtakes its
// data.
struct PackJob {
    std::shared_ptr<Transfer> t;              // holds the session (whose pack slot is written) and the unit
    const StagingVariant *variant = nullptr;  // chosen when the chunk is reserved
    uint32_t layer = 0;
    SendUnit *unit = nullptr;
    uint32_t lslot = 0, rslot = 0;
    uint64_t used = 0;                                         // bytes of the slot (and on the wire)
    uint64_t payload = 0;                                      // pool bytes they carry: used, or more when quantized
    std::vector<std::pair<const uint8_t *, uint64_t>> pieces;  // source ranges, in slot order
    // Quantized chunks (wire_quant != 0): each segment's pieces (a count into `pieces`), where it
    // lands on the peer, and its wire shape.
    uint32_t wire_quant = 0;
    int32_t src_device = -1;  // the source pool's CUDA device: pieces are device addresses
    std::string error;        // the device copy failed: the transfer fails with this
    sg_status_t error_status = SG_OK;
    struct QuantSegment {
        uint32_t pieces;
        uint32_t region_in_layer;
        uint64_t offset, length;
        quant::Shape shape;
    };
    std::vector<QuantSegment> quant_segments;
    wire::StagedChunk chunk;  // its notice; generation and CRC are set when it is handed over
    uint32_t crc = 0;         // CRC32C of the slot's `used` bytes, computed by the pack
    bool checked = true;      // the peer reads the CRC (wire 1.7): a 1.6 peer's pack copies only
    bool packed = false;      // copied; waiting for the provider (it answered EAGAIN)
};

// The decode side's half: checked under the mutex (on_staged_chunk) and copied into the pool
// outside it (run_unpacks): a chunk is up to a 4 MiB slot, too long to keep API threads and the
// other sessions waiting.
struct UnpackJob {
    std::shared_ptr<Transfer> t;              // holds the pool and the session (whose slot is read)
    const StagingVariant *variant = nullptr;  // chosen when the chunk is checked
    wire::StagedChunk chunk;
    std::vector<quant::Shape> shapes;  // quantized chunks: each segment's, as checked on arrival
    uint64_t wire_bytes = 0;           // quantized chunks: the slot bytes their segments took
    // The device copy failed, or the slot's bytes are not the ones the notice describes: the
    // transfer fails with this.
    std::string error;
    sg_status_t error_status = SG_OK;
};

// The check of a chunk whose notice carries one (wire 1.7): `crc` is what the unpack read from the
// slot. Throws sg::Error(SG_ERR_TRANSPORT) naming the chunk when they differ: the slot held bytes
// other than the chunk's (a torn write, or a late copy of an earlier one).
void check_chunk_crc(const UnpackJob &u, uint32_t crc);

// How a staged chunk's bytes move, one table per variant: the pool's memory (host, or CUDA device
// memory through the CUDA plugin) times the wire coding (raw, or quantized: quant/). Chosen once
// per chunk by staging_variant where the chunk is made; the copies never branch on either again.
// Both run without the context's mutex and throw sg::Error (a device copy that failed).
struct StagingVariant {
    const char *name;
    // The chunk's pieces (pool memory) into its pack slot, and p.crc: the CRC32C of the slot's
    // p.used bytes, folded into the copy where the copy is ours.
    void (*pack)(PackJob &p, uint8_t *slot);
    // The chunk's segments from the receive slot (src: the chunk's first byte) into the pool;
    // when the notice carries a CRC, the slot's bytes are checked (check_chunk_crc) in the same
    // pass where the copy is ours, else before they are copied.
    void (*unpack)(UnpackJob &u, const uint8_t *src);
};
const StagingVariant &staging_variant(bool device_memory, bool quantized);

}  // namespace sg::core
