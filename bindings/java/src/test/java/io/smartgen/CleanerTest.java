package io.smartgen;

import static org.junit.jupiter.api.Assertions.assertTrue;

import org.junit.jupiter.api.Test;
import org.junit.jupiter.api.Timeout;

/**
 * Transfers a program drops without close() are released by their Cleaner once the GC finds them:
 * 0.4 kept all 200 of them registered to the pool ("used by 201 unreleased transfer(s)") until the
 * context closed.
 */
class CleanerTest {
    static final int[] SRC_BLOCKS = {4, 8, 15};
    static final int[] DST_BLOCKS = {16, 23, 1};

    @Test
    @Timeout(120)
    void droppedTransfersAreReleasedByTheirCleaner() throws Exception {
        try (Pair pair = new Pair()) {
            Pair.fill(pair.src, SRC_BLOCKS);
            dropTransfers(pair, 200);
            long deadline = System.nanoTime() + 60_000_000_000L;
            boolean closed = false;
            while (!closed) {
                System.gc();
                Thread.sleep(20);
                try {
                    pair.dst.close();
                    pair.src.close();
                    closed = true;
                } catch (SmartGenException e) {
                    assertTrue(e.status() == Status.INVALID_STATE, "only 'still used' may refuse: " + e);
                    assertTrue(System.nanoTime() < deadline, "the dropped transfers were never released: " + e.detail());
                }
            }
        }
    }

    /**
     * A pool closed right after a collection releases the transfers the collector found dropped
     * first, on the closing thread: 0.5's Cleaner left 151 of 201 to its own thread, and the close
     * refused "still used" 200 ms after System.gc().
     */
    @Test
    @Timeout(120)
    void aPoolClosedAfterACollectionReleasesTheDroppedTransfersFirst() throws Exception {
        try (Pair pair = new Pair()) {
            Pair.fill(pair.src, SRC_BLOCKS);
            dropTransfers(pair, 100);
            System.gc();
            Thread.sleep(200);
            pair.dst.close(); // no retry: SG_ERR_INVALID_STATE here fails the test
            pair.src.close();
        }
    }

    /** n completed transfers, each side's object dropped: neither is closed. */
    private static void dropTransfers(Pair pair, int n) throws Exception {
        for (int i = 0; i < n; i++) {
            String rid = "dropped-" + i;
            Transfer expect = pair.decode.expect(rid, pair.dst, DST_BLOCKS, 48, null);
            Transfer post = pair.prefill.post(rid, pair.src, SRC_BLOCKS, 48,
                    TransferOptions.defaults().flags(TransferOptions.ALL_LAYERS_WRITTEN));
            assertTrue(expect.await(Pair.TIMEOUT));
            assertTrue(post.await(Pair.TIMEOUT));
        }
    }
}
