package io.smartgen;

import io.smartgen.internal.sg_transfer_stats_t;

/** A snapshot of one transfer's statistics (see sg_transfer_stats_t for each field). */
public record TransferStats(long bytes, long rmaOps, long segments, long stagedBytes, long stagingCopies,
                            long layersReady, long startNs, long endNs, long bytesFull, long bytesProactive,
                            long bytesOnDemand, long bytesSpeculative, long digestBytes, long fetchRequests,
                            long fetchBlocks, long quantizedBytes, long quantizedWireBytes) {
    static TransferStats of(sg_transfer_stats_t s) {
        return new TransferStats(s.getBytes(), s.getRma_ops(), s.getSegments(), s.getStaged_bytes(),
                s.getStaging_copies(), s.getLayers_ready(), s.getStart_ns(), s.getEnd_ns(), s.getBytes_full(),
                s.getBytes_proactive(), s.getBytes_on_demand(), s.getBytes_speculative(), s.getDigest_bytes(),
                s.getFetch_requests(), s.getFetch_blocks(), s.getQuantized_bytes(), s.getQuantized_wire_bytes());
    }
}
