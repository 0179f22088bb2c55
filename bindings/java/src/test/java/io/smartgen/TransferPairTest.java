package io.smartgen;

import static org.junit.jupiter.api.Assertions.assertArrayEquals;
import static org.junit.jupiter.api.Assertions.assertEquals;
import static org.junit.jupiter.api.Assertions.assertThrows;
import static org.junit.jupiter.api.Assertions.assertTrue;

import java.nio.charset.StandardCharsets;
import java.time.Duration;
import java.util.Optional;
import org.junit.jupiter.api.Test;

class TransferPairTest {
    // Same tokens, different scattered blocks on each side: the runtime maps one table onto the other.
    static final int[] SRC_BLOCKS = {1, 2, 20, 21, 7, 30, 4};
    static final int[] DST_BLOCKS = {5, 3, 9, 0, 31, 17, 12};
    static final long TOKENS = 7 * 16;

    @Test
    void layersMoveAsTheyAreWrittenAndEveryByteArrives() throws Exception {
        try (Pair pair = new Pair()) {
            Pair.fill(pair.src, SRC_BLOCKS);
            try (Transfer expect = pair.decode.expect("req-1", pair.dst, DST_BLOCKS, TOKENS, TransferOptions.defaults());
                 Transfer post = pair.prefill.post("req-1", pair.src, SRC_BLOCKS, TOKENS,
                         TransferOptions.defaults().priority(3))) {
                assertEquals("req-1", post.requestId());
                for (int l = 0; l < Pair.LAYOUT.numLayers(); l++) {
                    post.layerWritten(l);
                    assertTrue(expect.waitLayer(l, Pair.TIMEOUT), "layer " + l + " ready");
                    assertTrue((expect.layerState(l) & Transfer.LAYER_READY) != 0);
                    assertTrue((post.layerState(l) & Transfer.LAYER_WRITTEN) != 0);
                }
                assertTrue(expect.await(Pair.TIMEOUT));
                assertTrue(post.await(Pair.TIMEOUT));
                assertEquals(Status.OK, expect.status());
                assertEquals(Optional.empty(), expect.error());
                assertEquals(0, Pair.mismatches(pair.dst, DST_BLOCKS));

                long payload = (long) Pair.LAYOUT.numLayers() * 2 * DST_BLOCKS.length * Pair.LAYOUT.planeBytes();
                TransferStats stats = expect.stats();
                assertEquals(payload, stats.bytesFull());
                assertEquals(Pair.LAYOUT.numLayers(), stats.layersReady());
                assertEquals(DST_BLOCKS.length, expect.residency(0).cardinality());
            }
            assertTrue(pair.decodeCtx.stats().transfersCompleted() >= 1);
        }
    }

    @Test
    void allLayersWrittenAtOnceAndNotificationsBothWays() throws Exception {
        try (Pair pair = new Pair()) {
            Pair.fill(pair.src, SRC_BLOCKS);
            assertEquals(Optional.empty(), pair.prefill.nextNotification());
            try (Transfer expect = pair.decode.expect("req-2", pair.dst, DST_BLOCKS, TOKENS, null)) {
                pair.decode.notify("ready req-2");
                byte[] got = poll(pair.prefill);
                assertEquals("ready req-2", new String(got, StandardCharsets.UTF_8));
                try (Transfer post = pair.prefill.post("req-2", pair.src, SRC_BLOCKS, TOKENS,
                        TransferOptions.defaults().paths(TransferOptions.PATH_FULL)
                                .flags(TransferOptions.ALL_LAYERS_WRITTEN))) {
                    assertTrue(expect.await(Pair.TIMEOUT));
                    assertTrue(post.await(Pair.TIMEOUT));
                }
            }
            assertEquals(0, Pair.mismatches(pair.dst, DST_BLOCKS));
            pair.prefill.notify(new byte[] {1, 2, 3});
            assertArrayEquals(new byte[] {1, 2, 3}, poll(pair.decode));
            assertTrue(pair.prefill.close(Pair.TIMEOUT), "graceful close");
            assertTrue(pair.decode.close(Pair.TIMEOUT), "graceful close");
        }
    }

    // In-flight quantization: both sides ask for int8, every pool byte goes quantized, and the wire
    // carries about half of fp16's (codes plus a scale per block, plane and KV head).
    @Test
    void aQuantizedTransferHalvesTheWireBytes() throws Exception {
        try (Pair pair = new Pair()) {
            Pair.fill(pair.src, SRC_BLOCKS);
            TransferOptions quantized = TransferOptions.defaults().wireQuant(TransferOptions.WIRE_QUANT_INT8);
            try (Transfer expect = pair.decode.expect("req-q", pair.dst, DST_BLOCKS, TOKENS, quantized);
                 Transfer post = pair.prefill.post("req-q", pair.src, SRC_BLOCKS, TOKENS,
                         TransferOptions.defaults().wireQuant(TransferOptions.WIRE_QUANT_INT8)
                                 .flags(TransferOptions.ALL_LAYERS_WRITTEN))) {
                assertTrue(expect.await(Pair.TIMEOUT));
                assertTrue(post.await(Pair.TIMEOUT));
                long payload = (long) Pair.LAYOUT.numLayers() * 2 * DST_BLOCKS.length * Pair.LAYOUT.planeBytes();
                TransferStats stats = expect.stats();
                assertEquals(payload, stats.quantizedBytes());
                assertTrue(stats.quantizedWireBytes() * 2 >= payload && stats.quantizedWireBytes() * 100 <= payload * 51,
                        stats.quantizedWireBytes() + " wire bytes for " + payload);
            }
        }
    }

    static byte[] poll(Session session) throws InterruptedException {
        long deadline = System.nanoTime() + Pair.TIMEOUT.toNanos();
        while (System.nanoTime() < deadline) {
            Optional<byte[]> msg = session.nextNotification();
            if (msg.isPresent()) {
                return msg.get();
            }
            Thread.sleep(1);
        }
        throw new AssertionError("no notification within " + Pair.TIMEOUT);
    }

    @Test
    void fusedPoolsMoveTooAndTheirPlanesAreAddressedInsideTheBlock() throws Exception {
        KvLayout fused = Pair.LAYOUT.withPacking(KvLayout.FUSED);
        try (Pair pair = new Pair();
             Pool src = pair.prefillCtx.registerPool(fused);
             Pool dst = pair.decodeCtx.registerPool(fused)) {
            assertEquals(2 * fused.planeBytes(), fused.blockBytes());
            assertEquals(fused.planeBytes(), src.plane(0, 1, 3).capacity());
            pair.prefill.exportPool(src);
            pair.decode.exportPool(dst);
            Pair.fill(src, SRC_BLOCKS);
            try (Transfer expect = pair.decode.expect("fused", dst, DST_BLOCKS, TOKENS, null);
                 Transfer post = pair.prefill.post("fused", src, SRC_BLOCKS, TOKENS,
                         TransferOptions.defaults().flags(TransferOptions.ALL_LAYERS_WRITTEN))) {
                assertTrue(expect.await(Pair.TIMEOUT));
                assertTrue(post.await(Pair.TIMEOUT));
            }
            assertEquals(0, Pair.mismatches(dst, DST_BLOCKS));
        }
    }

    @Test
    void aCancelOnOneSideFailsThePeerWithCanceled() throws Exception {
        try (Pair pair = new Pair();
             Transfer expect = pair.decode.expect("cancel", pair.dst, DST_BLOCKS, TOKENS, null);
             Transfer post = pair.prefill.post("cancel", pair.src, SRC_BLOCKS, TOKENS, null)) {
            expect.cancel(); // no layer was written: nothing can have completed
            SmartGenException e = assertThrows(SmartGenException.class, () -> post.await(Pair.TIMEOUT));
            assertEquals(Status.CANCELED, e.status());
            assertEquals(Status.CANCELED, post.status());
            assertEquals(Status.CANCELED, post.error().orElseThrow().status());
            assertTrue(expect.waitQuiesced(Pair.TIMEOUT));
            assertEquals(Status.Category.RETRY_LATER, e.status().category());
        }
    }

    @Test
    void awaitReturnsFalseOnTimeoutAndTheTransferGoesOn() throws Exception {
        try (Pair pair = new Pair();
             Transfer expect = pair.decode.expect("late", pair.dst, DST_BLOCKS, TOKENS, null)) {
            assertEquals(false, expect.await(Duration.ZERO));
            assertEquals(false, expect.waitLayer(0, Duration.ofMillis(10)));
            assertEquals(Status.IN_PROGRESS, expect.status());
            assertEquals(false, expect.test());
        }
    }
}
