package io.smartgen;

import static org.junit.jupiter.api.Assertions.assertEquals;
import static org.junit.jupiter.api.Assertions.assertThrows;
import static org.junit.jupiter.api.Assertions.assertTrue;

import java.lang.reflect.Field;
import java.nio.ByteBuffer;
import org.junit.jupiter.api.Test;
import org.junit.jupiter.api.Timeout;

/**
 * Pools over memory the engine owns, as a serving engine registers its KV cache: direct
 * ByteBuffers it allocated (fused K+V, a padded block stride), and native memory given by address.
 * A transfer lands in each byte for byte, and the padding stays as the engine left it.
 */
class EngineMemoryTest {
    static final int[] SRC_BLOCKS = {4, 8, 15};
    static final int[] DST_BLOCKS = {16, 23, 1};
    static final long TOKENS = 3 * 16;
    static final byte PAD = (byte) 0xEE;

    private static void move(Pair pair, Pool dst, String rid) {
        try (Transfer expect = pair.decode.expect(rid, dst, DST_BLOCKS, TOKENS, null);
             Transfer post = pair.prefill.post(rid, pair.src, SRC_BLOCKS, TOKENS,
                     TransferOptions.defaults().flags(TransferOptions.ALL_LAYERS_WRITTEN))) {
            assertTrue(expect.await(Pair.TIMEOUT));
            assertTrue(post.await(Pair.TIMEOUT));
        }
    }

    @Test
    @Timeout(60)
    void directBuffersTheEngineOwnsFusedAndPadded() throws Exception {
        try (Pair pair = new Pair()) {
            Pair.fill(pair.src, SRC_BLOCKS);
            long plane = Pair.LAYOUT.planeBytes();
            KvLayout layout = Pair.LAYOUT.withPacking(KvLayout.FUSED).withBlockStrideBytes(2 * plane + 256);
            int region = (int) layout.regionBytes();
            ByteBuffer[] engine = new ByteBuffer[layout.numLayers()];
            for (int l = 0; l < engine.length; l++) {
                engine[l] = ByteBuffer.allocateDirect(region);
                for (int i = 0; i < region; i++) {
                    engine[l].put(i, PAD);
                }
            }
            try (Pool dst = pair.decodeCtx.registerPool(layout, engine, null)) {
                pair.decode.exportPool(dst);
                move(pair, dst, "engine-buffers");
                assertEquals(0, Pair.mismatches(dst, DST_BLOCKS));
            }
            // The engine's buffers themselves: K and V where the layout says, padding untouched.
            for (int l = 0; l < engine.length; l++) {
                for (int b : DST_BLOCKS) {
                    int at = (int) (b * layout.blockStrideBytes());
                    for (int o = (int) (2 * plane); o < layout.blockStrideBytes(); o++) {
                        assertEquals(PAD, engine[l].get(at + o), "padding byte " + o + " of block " + b + " written");
                    }
                }
            }
            assertThrows(IllegalArgumentException.class,
                    () -> pair.decodeCtx.registerPool(layout, new ByteBuffer[] {ByteBuffer.allocate(region)}, null));
        }
    }

    @Test
    @Timeout(60)
    void nativeMemoryByAddress() throws Exception {
        Field f = Class.forName("sun.misc.Unsafe").getDeclaredField("theUnsafe");
        f.setAccessible(true);
        sun.misc.Unsafe unsafe = (sun.misc.Unsafe) f.get(null);
        try (Pair pair = new Pair()) {
            Pair.fill(pair.src, SRC_BLOCKS);
            KvLayout layout = Pair.LAYOUT;
            long region = layout.regionBytes();
            long[] k = new long[layout.numLayers()];
            long[] v = new long[layout.numLayers()];
            for (int l = 0; l < k.length; l++) {
                k[l] = unsafe.allocateMemory(region);
                v[l] = unsafe.allocateMemory(region);
                unsafe.setMemory(k[l], region, (byte) 0);
                unsafe.setMemory(v[l], region, (byte) 0);
            }
            try {
                try (Pool dst = pair.decodeCtx.registerPool(layout, Pool.HOST, 0, k, v)) {
                    pair.decode.exportPool(dst);
                    move(pair, dst, "engine-addresses");
                    assertThrows(IllegalStateException.class, () -> dst.k(0), "no ByteBuffer view by address");
                }
                long bad = 0;
                long plane = layout.planeBytes();
                for (int l = 0; l < k.length; l++) {
                    for (int p = 0; p < 2; p++) {
                        for (int i = 0; i < DST_BLOCKS.length; i++) {
                            long base = (p == 0 ? k[l] : v[l]) + DST_BLOCKS[i] * plane;
                            for (int o = 0; o < plane; o++) {
                                if (unsafe.getByte(base + o) != Pair.pattern(l, p, i, o)) {
                                    bad++;
                                }
                            }
                        }
                    }
                }
                assertEquals(0, bad, "bytes differing in the engine's native memory");
            } finally {
                for (int l = 0; l < k.length; l++) {
                    unsafe.freeMemory(k[l]);
                    unsafe.freeMemory(v[l]);
                }
            }
        }
    }
}
