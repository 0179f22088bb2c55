// Internal to core/: a transfer's path as a table. Streaming the whole cache (SG_PATH_FULL) and the
// selective paths (any of SG_PATH_PROACTIVE, SG_PATH_ON_DEMAND, SG_PATH_SPECULATIVE) differ in a
// handful of steps; each path is one TransferPath holding those steps, chosen once per transfer
// (Transfer::set_paths: the prefill side at post, the decode side when the peer's Selective
// message names the paths). Nothing else in core/ asks which path a transfer runs. Within the
// selective paths, the scheduler's passes (on-demand, then proactive, then speculative) pick the
// send units' queue (Transfer::next_unit), and each send unit carries the row of its path
// (UnitPath): what its bytes count as, what bounds them, how they travel.
#pragma once

#include "smartgen/smartgen.h"

#include <cstdint>
#include <memory>
#include <vector>

namespace sg::select {
struct Profile;
}

namespace sg::core {

class Session;
class Transfer;
class StreamEvent;

// A written layer's selection, made without the context's mutex and committed under it.
struct PreparedLayer {
    std::vector<uint32_t> selected;
    std::vector<uint8_t> digests;
};

// What the host said when it marked a layer written (Transfer::layer_written), checked.
struct LayerWrite {
    const float *queries = nullptr;
    uint32_t num_queries = 0, num_q_heads = 0;
    bool device_queries = false;            // queries is memory of the pool's device
    std::shared_ptr<StreamEvent> written;   // the layer is written once this event passed
};

struct TransferPath {
    const char *name;
    // Its bytes are the whole cache (sg_transfer_stats_t::bytes_full counts them).
    bool whole;

    // ---- Prefill side, with the context's mutex held unless said otherwise ----
    // At post, before the mutex is taken (selecting takes time): what the path needs per layer,
    // and the selection of layers already written (SG_TRANSFER_ALL_LAYERS_WRITTEN) into prepared.
    void (*prepare)(Transfer &t, const select::Profile *profile, std::vector<PreparedLayer> &prepared);
    // At post: the layers written before it count as written.
    void (*commit_written)(Transfer &t, std::vector<PreparedLayer> &prepared);
    // At match: what the peer's pool must share beyond being mappable (SG_ERR_LAYOUT_MISMATCH).
    void (*check_peer)(const Transfer &t);
    // One scheduler turn in pass `pass` (plan::PathClass) of at most quota operations: whether
    // it posted anything.
    bool (*pump)(Transfer &t, int pass, uint32_t quota);
    // The host wrote a layer: queued for selection, for its stream, or marked written at once.
    void (*layer_written)(Transfer &t, uint32_t layer, LayerWrite &&w);

    // ---- Decode side ----
    // The peer named the paths (its Selective message).
    void (*begin_decode)(Transfer &t);
    // A staged chunk of the layer landed: what becomes ready with it.
    void (*chunk_landed)(Transfer &t, uint32_t layer);
    // The host released it before it finished: a selective transfer ends there (done early, not
    // a failure); a whole one is canceled.
    void (*release_unfinished)(Transfer &t);

    static const TransferPath kFull;
    static const TransferPath kSelective;
    // The path of a transfer with these SG_PATH_* bits (0: not known yet, the whole cache).
    static const TransferPath &of(uint32_t paths);
};

// The selective paths a send unit goes under, a row each: chosen once, when the unit claims its
// blocks (prefill side), or when a BlocksReady names the path (decode side).
struct UnitPath {
    const char *name;
    uint32_t bit;                          // its SG_PATH_* bit, as the wire names it
    uint64_t sg_transfer_stats_t::*bytes;  // the statistic its payload counts in, on both sides
    uint64_t Session::*inflight;           // the session's in-flight bytes that bound it (NULL: none
                                           // beyond the operation slots)
    bool urgent;     // a fetch's reply: ahead of everything else on the transport
    bool bulk;       // background bulk: writes of its own size, packed into staging slots only where
                     // the provider is local, its delivery rate measures the link (Session::bulk_rate)
    bool essential;  // carries the layer's digests, and its delivery makes the layer essential

    static const UnitPath kProactive, kOnDemand, kSpeculative;
    // The row of an SG_PATH_* bit; SG_ERR_PROTOCOL for a value that names no selective path (a
    // peer's BlocksReady).
    static const UnitPath &of(uint32_t bit);
};

}  // namespace sg::core
