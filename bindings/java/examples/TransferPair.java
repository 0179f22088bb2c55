package io.smartgen.examples;

import io.smartgen.Context;
import io.smartgen.KvLayout;
import io.smartgen.Listener;
import io.smartgen.Pool;
import io.smartgen.Session;
import io.smartgen.SmartGenException;
import io.smartgen.Transfer;
import io.smartgen.TransferOptions;
import io.smartgen.TransferStats;
import java.io.IOException;
import java.io.InputStream;
import java.io.OutputStream;
import java.nio.ByteBuffer;
import java.nio.file.Path;
import java.security.SecureRandom;
import java.time.Duration;
import java.util.ArrayList;
import java.util.Arrays;
import java.util.HexFormat;
import java.util.List;
import java.util.concurrent.TimeUnit;

/**
 * The smallest complete SmartGen transfer, in two processes on one host (the Java form of
 * examples/c/transfer_pair.c):
 *
 * <pre>
 *   prefill (this JVM)                            decode (a child JVM)
 *   context, listener on 127.0.0.1:0
 *   start the child with the port  -------------> context (its own)
 *   accept  <------------------- bootstrap ------ connect
 *   register + export the source pool             register + export the destination pool
 *   post("req-1", blocks A)                       expect("req-1", blocks B)
 *   layerWritten(0), (1), ...                     waitLayer(0), (1), ...
 *   await                                         await, then check every element
 *   print stats, exit with the child's verdict
 * </pre>
 *
 * Both sides use one layout (2 layers, 2 KV heads, head_dim 64, 16 tokens per block, fp16, K and V
 * separate, 32 blocks per layer) but keep the request's tokens in different blocks: the runtime
 * maps prefill's block table onto decode's. The shared key is SG_AUTH_KEY_FILE's when it is set,
 * else a random one this process makes and hands to the child on its standard input.
 *
 * <p>Usage: TransferPair [--provider NAME]. Exit status 0 when decode received exactly what prefill
 * wrote.
 */
public final class TransferPair {
    static final int NUM_LAYERS = 2;
    static final int NUM_KV_HEADS = 2;
    static final int HEAD_DIM = 64;
    static final int TOKENS_PER_BLOCK = 16;
    static final int POOL_BLOCKS = 32;
    static final int NUM_TOKENS = 100; // 7 blocks: 6 full, the last holds 4 tokens
    static final int TOKEN_ELEMS = NUM_KV_HEADS * HEAD_DIM;
    static final KvLayout LAYOUT = KvLayout.of(NUM_LAYERS, NUM_KV_HEADS, HEAD_DIM, TOKENS_PER_BLOCK, POOL_BLOCKS);

    // Where the request's blocks live on each side: same tokens, different (unordered) block ids.
    static final int[] PREFILL_BLOCKS = {1, 2, 20, 21, 7, 30, 4};
    static final int[] DECODE_BLOCKS = {5, 3, 9, 0, 31, 17, 12};

    static final String REQUEST_ID = "req-1";
    static final Duration TIMEOUT = Duration.ofSeconds(5);
    // Fill values outside the request, so a block written where it should not be is noticed.
    static final short PREFILL_FILL = (short) 0xDEAD;
    static final short DECODE_FILL = (short) 0xBEEF;

    /** Element {@code elem} of token {@code token} in K (kv 0) or V (kv 1) of a layer. */
    static short pattern(int layer, int kv, int token, int elem) {
        int x = layer * 0x9E37 + kv * 0x7F4B + token * 0x0131 + elem * 0x0007;
        return (short) ((x ^ (x >>> 7)) & 0xFFFF);
    }

    /** Byte offset of a token's row inside its layer's K or V region (token-major). */
    static int tokenRow(int[] blockIds, int token) {
        long planeBytes = LAYOUT.planeBytes();
        return (int) (blockIds[token / TOKENS_PER_BLOCK] * planeBytes + (token % TOKENS_PER_BLOCK) * TOKEN_ELEMS * 2L);
    }

    static ByteBuffer region(Pool pool, int layer, int kv) {
        return kv == 0 ? pool.k(layer) : pool.v(layer);
    }

    static void fillAll(Pool pool, short value) {
        for (int l = 0; l < NUM_LAYERS; l++) {
            for (int kv = 0; kv < 2; kv++) {
                ByteBuffer r = region(pool, l, kv);
                for (int i = 0; i < r.capacity(); i += 2) {
                    r.putShort(i, value);
                }
            }
        }
    }

    static Context context(String provider, byte[] key) {
        return Context.builder().provider(provider).authKey(key).build();
    }

    // ---- decode: the child ----------------------------------------------------------------------

    /** Counts the request's mismatched elements, and the blocks outside it that were written. */
    static long verify(Pool pool) {
        long bad = 0;
        for (int l = 0; l < NUM_LAYERS; l++) {
            for (int kv = 0; kv < 2; kv++) {
                ByteBuffer r = region(pool, l, kv);
                for (int t = 0; t < NUM_TOKENS; t++) {
                    int row = tokenRow(DECODE_BLOCKS, t);
                    for (int e = 0; e < TOKEN_ELEMS; e++) {
                        short got = r.getShort(row + 2 * e);
                        if (got != pattern(l, kv, t, e) && bad++ < 5) {
                            System.err.printf("[decode] layer %d %c token %d elem %d: got 0x%04x want 0x%04x%n", l,
                                    kv == 0 ? 'K' : 'V', t, e, got & 0xFFFF, pattern(l, kv, t, e) & 0xFFFF);
                        }
                    }
                }
                for (int b = 0; b < POOL_BLOCKS; b++) {
                    final int block = b;
                    if (Arrays.stream(DECODE_BLOCKS).anyMatch(x -> x == block)) {
                        continue;
                    }
                    for (int o = 0; o < LAYOUT.planeBytes(); o += 2) {
                        if (r.getShort((int) (b * LAYOUT.planeBytes()) + o) != DECODE_FILL) {
                            if (bad++ < 5) {
                                System.err.printf("[decode] layer %d %c block %d (not in the request) was written%n",
                                        l, kv == 0 ? 'K' : 'V', b);
                            }
                            break;
                        }
                    }
                }
            }
        }
        return bad;
    }

    static int runDecode(int port, String provider, byte[] key) {
        try (Context ctx = context(provider, key);
             Session session = ctx.connect("127.0.0.1", port, TIMEOUT);
             Pool pool = ctx.registerPool(LAYOUT)) {
            System.out.printf("[decode] connected to 127.0.0.1:%d over %s%n", port, session.provider());
            fillAll(pool, DECODE_FILL);
            // Exporting is what lets this peer (and only this peer) write into the pool.
            session.exportPool(pool);
            long bad;
            try (Transfer xfer = session.expect(REQUEST_ID, pool, DECODE_BLOCKS, NUM_TOKENS, null)) {
                // Layers become ready one by one; an engine would start decoding layer l here.
                for (int l = 0; l < NUM_LAYERS; l++) {
                    if (!xfer.waitLayer(l, TIMEOUT)) {
                        System.err.println("[decode] layer " + l + " not ready within " + TIMEOUT);
                        return 1;
                    }
                    System.out.printf("[decode] layer %d ready (%.1f us)%n", l, xfer.layerTime(l).toNanos() / 1e3);
                }
                if (!xfer.await(TIMEOUT)) {
                    System.err.println("[decode] transfer not complete within " + TIMEOUT);
                    return 1;
                }
                bad = verify(pool);
            }
            System.out.println(bad == 0
                    ? "[decode] " + REQUEST_ID + ": all " + NUM_TOKENS + " tokens x " + NUM_LAYERS + " layers x K/V match"
                    : "[decode] " + REQUEST_ID + ": " + bad + " mismatches");
            return bad == 0 ? 0 : 1;
        } catch (SmartGenException e) {
            System.err.println("[decode] " + e.getMessage());
            return 1;
        }
    }

    // ---- prefill: this process ----------------------------------------------------------------------

    static void fillRequest(Pool pool) {
        for (int l = 0; l < NUM_LAYERS; l++) {
            for (int kv = 0; kv < 2; kv++) {
                ByteBuffer r = region(pool, l, kv);
                for (int t = 0; t < NUM_TOKENS; t++) {
                    int row = tokenRow(PREFILL_BLOCKS, t);
                    for (int e = 0; e < TOKEN_ELEMS; e++) {
                        r.putShort(row + 2 * e, pattern(l, kv, t, e));
                    }
                }
            }
        }
    }

    /** The same program as a child JVM, in the decode role. */
    static Process startDecode(int port, String provider, byte[] key) throws IOException {
        List<String> cmd = new ArrayList<>();
        cmd.add(Path.of(System.getProperty("java.home"), "bin", "java").toString());
        for (String prop : new String[] {"smartgen.jni.path", "java.library.path"}) {
            if (System.getProperty(prop) != null) {
                cmd.add("-D" + prop + "=" + System.getProperty(prop));
            }
        }
        cmd.addAll(List.of("-cp", System.getProperty("java.class.path"), TransferPair.class.getName(),
                "--decode-port", Integer.toString(port)));
        if (provider != null) {
            cmd.addAll(List.of("--provider", provider));
        }
        Process child = new ProcessBuilder(cmd).redirectOutput(ProcessBuilder.Redirect.INHERIT)
                .redirectError(ProcessBuilder.Redirect.INHERIT).start();
        try (OutputStream in = child.getOutputStream()) {
            in.write(key == null ? new byte[0] : HexFormat.of().formatHex(key).getBytes());
        }
        return child;
    }

    static int runPrefill(String provider, byte[] key) throws Exception {
        Process child = null;
        try (Context ctx = context(provider, key);
             Listener listener = ctx.listen("127.0.0.1", 0);
             Pool pool = ctx.registerPool(LAYOUT)) {
            child = startDecode(listener.port(), provider, key);
            try (Session session = listener.accept(Duration.ofSeconds(30))) {
                System.out.println("[prefill] accepted a session over " + session.provider());
                fillAll(pool, PREFILL_FILL);
                fillRequest(pool);
                session.exportPool(pool);
                try (Transfer xfer = session.post(REQUEST_ID, pool, PREFILL_BLOCKS, NUM_TOKENS,
                        TransferOptions.defaults())) {
                    // As the forward pass finishes each layer, the runtime may send it.
                    for (int l = 0; l < NUM_LAYERS; l++) {
                        xfer.layerWritten(l);
                    }
                    if (!xfer.await(TIMEOUT)) {
                        System.err.println("[prefill] transfer not complete within " + TIMEOUT);
                        return 1;
                    }
                    TransferStats s = xfer.stats();
                    System.out.printf("[prefill] sent %d bytes in %d RMA ops (%d segments, %d staged)%n", s.bytes(),
                            s.rmaOps(), s.segments(), s.stagedBytes());
                }
            }
            if (!child.waitFor(60, TimeUnit.SECONDS)) {
                System.err.println("[prefill] the decode process did not finish");
                return 1;
            }
            int verdict = child.exitValue();
            child = null;
            return verdict;
        } catch (SmartGenException e) {
            System.err.println("[prefill] " + e.getMessage());
            return 1;
        } finally {
            if (child != null) {
                child.destroyForcibly();
            }
        }
    }

    public static void main(String[] args) throws Exception {
        String provider = null;
        int decodePort = -1;
        for (int i = 0; i + 1 < args.length; i += 2) {
            if (args[i].equals("--provider")) {
                provider = args[i + 1];
            } else if (args[i].equals("--decode-port")) {
                decodePort = Integer.parseInt(args[i + 1]);
            }
        }
        String keyFile = System.getenv("SG_AUTH_KEY_FILE");
        boolean ownKey = keyFile == null || keyFile.isEmpty();
        int rc;
        if (decodePort >= 0) {
            rc = runDecode(decodePort, provider, ownKey ? readKey(System.in) : null);
        } else {
            byte[] key = null;
            if (ownKey) {
                key = new byte[32];
                new SecureRandom().nextBytes(key);
            }
            rc = runPrefill(provider, key);
            System.out.println(rc == 0 ? "transfer_pair: OK" : "transfer_pair: FAILED");
        }
        System.exit(rc);
    }

    static byte[] readKey(InputStream in) throws IOException {
        return HexFormat.of().parseHex(new String(in.readAllBytes()).trim());
    }
}
