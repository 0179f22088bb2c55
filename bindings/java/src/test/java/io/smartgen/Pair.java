package io.smartgen;

import java.security.SecureRandom;
import java.time.Duration;
import java.util.concurrent.CompletableFuture;
import java.util.concurrent.TimeUnit;

/**
 * Two contexts in this JVM over tcp on 127.0.0.1 (port 0), a session between them, and one pool
 * each exported to it: decode listens, prefill connects.
 */
final class Pair implements AutoCloseable {
    static final Duration TIMEOUT = Duration.ofSeconds(20);
    static final KvLayout LAYOUT = KvLayout.of(3, 2, 64, 16, 32); // 4 KiB planes, 32 blocks per layer

    final Context prefillCtx;
    final Context decodeCtx;
    final Session prefill;
    final Session decode;
    final Pool src;
    final Pool dst;

    Pair(EventListener prefillEvents, EventListener decodeEvents) throws Exception {
        byte[] key = new byte[32];
        new SecureRandom().nextBytes(key);
        prefillCtx = Context.builder().provider("tcp").authKey(key).eventListener(prefillEvents).build();
        decodeCtx = Context.builder().provider("tcp").authKey(key).eventListener(decodeEvents).build();
        try (Listener listener = decodeCtx.listen("127.0.0.1", 0)) {
            CompletableFuture<Session> accepted = CompletableFuture.supplyAsync(() -> listener.accept(TIMEOUT));
            prefill = prefillCtx.connect("127.0.0.1", listener.port(), TIMEOUT);
            decode = accepted.get(TIMEOUT.toSeconds(), TimeUnit.SECONDS);
        }
        src = prefillCtx.registerPool(LAYOUT);
        dst = decodeCtx.registerPool(LAYOUT);
        prefill.exportPool(src);
        decode.exportPool(dst);
    }

    Pair() throws Exception {
        this(null, null);
    }

    /** A byte that differs with every argument. */
    static byte pattern(int layer, int plane, int block, int offset) {
        return (byte) (layer * 131 + plane * 71 + block * 29 + offset * 7);
    }

    static void fill(Pool pool, int[] blocks) {
        for (int l = 0; l < pool.layout().numLayers(); l++) {
            for (int p = 0; p < 2; p++) {
                for (int i = 0; i < blocks.length; i++) {
                    var plane = pool.plane(l, p, blocks[i]);
                    for (int o = 0; o < plane.capacity(); o++) {
                        plane.put(o, pattern(l, p, i, o));
                    }
                }
            }
        }
    }

    /** The number of bytes of the request's blocks that differ from the pattern. */
    static long mismatches(Pool pool, int[] blocks) {
        long bad = 0;
        for (int l = 0; l < pool.layout().numLayers(); l++) {
            for (int p = 0; p < 2; p++) {
                for (int i = 0; i < blocks.length; i++) {
                    var plane = pool.plane(l, p, blocks[i]);
                    for (int o = 0; o < plane.capacity(); o++) {
                        if (plane.get(o) != pattern(l, p, i, o)) {
                            bad++;
                        }
                    }
                }
            }
        }
        return bad;
    }

    @Override
    public void close() {
        prefill.close();
        decode.close();
        src.close();
        dst.close();
        prefillCtx.close();
        decodeCtx.close();
    }
}
