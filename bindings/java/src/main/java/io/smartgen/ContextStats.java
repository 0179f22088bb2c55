package io.smartgen;

import io.smartgen.internal.sg_context_stats_t;

/** A snapshot of a context's counters (see sg_context_stats_t for each field). */
public record ContextStats(long bytesDirect, long bytesStaged, long rmaOps, long stagingCopies, long messagesSent,
                           long messagesReceived, long retries, long transfersCompleted, long transfersFailed,
                           long transfersCanceled, long deadlinesHit, long peersLost, long sessionsOpen,
                           long authFailures, long stalls, long registrations, long lanes, long laneFailovers,
                           long lanesLost, long blocksVerified, long verifyMismatches) {
    static ContextStats of(sg_context_stats_t s) {
        return new ContextStats(s.getBytes_direct(), s.getBytes_staged(), s.getRma_ops(), s.getStaging_copies(),
                s.getMessages_sent(), s.getMessages_received(), s.getRetries(), s.getTransfers_completed(),
                s.getTransfers_failed(), s.getTransfers_canceled(), s.getDeadlines_hit(), s.getPeers_lost(),
                s.getSessions_open(), s.getAuth_failures(), s.getStalls(), s.getRegistrations(), s.getLanes(),
                s.getLane_failovers(), s.getLanes_lost(), s.getBlocks_verified(), s.getVerify_mismatches());
    }
}
