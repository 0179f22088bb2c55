package io.smartgen;

import static org.junit.jupiter.api.Assertions.assertEquals;
import static org.junit.jupiter.api.Assertions.assertThrows;
import static org.junit.jupiter.api.Assertions.assertTrue;

import org.junit.jupiter.api.Test;
import org.junit.jupiter.api.Timeout;

/** The device engine's layer-written call drives a transfer layer by layer; device queries on a host pool are refused. */
class LayerWrittenTest {
    static final int[] SRC_BLOCKS = {4, 8, 15};
    static final int[] DST_BLOCKS = {16, 23, 1};

    @Test
    @Timeout(60)
    void layerWrittenExDrivesATransferLayerByLayer() throws Exception {
        try (Pair pair = new Pair()) {
            Pair.fill(pair.src, SRC_BLOCKS);
            try (Transfer expect = pair.decode.expect("ex", pair.dst, DST_BLOCKS, 48, null);
                 Transfer post = pair.prefill.post("ex", pair.src, SRC_BLOCKS, 48, TransferOptions.defaults())) {
                assertThrows(SmartGenException.class, () -> post.layerWritten(0, null, 0x1000, Pool.CUDA, 1, 2, 0));
                for (int l = 0; l < Pair.LAYOUT.numLayers(); l++) {
                    post.layerWritten(l, null, 0, Pool.HOST, 0, 0, 0);
                }
                assertTrue(expect.await(Pair.TIMEOUT));
                assertTrue(post.await(Pair.TIMEOUT));
            }
            assertEquals(0, Pair.mismatches(pair.dst, DST_BLOCKS));
        }
    }
}
