package io.smartgen.interop;

import io.smartgen.Context;
import io.smartgen.KvLayout;
import io.smartgen.Listener;
import io.smartgen.Pool;
import io.smartgen.Profile;
import io.smartgen.Session;
import io.smartgen.SmartGenException;
import io.smartgen.Status;
import io.smartgen.Transfer;
import io.smartgen.TransferOptions;
import io.smartgen.TransferStats;
import java.nio.ByteBuffer;
import java.nio.charset.StandardCharsets;
import java.time.Duration;
import java.util.Arrays;
import java.util.Locale;
import java.util.Optional;

/**
 * The Java interop program: one side of the transfer every language agrees on (docs/bindings.md,
 * "The interop program"; examples/interop/interop.c is the reference it follows step by step).
 * One line on stdout; progress on stderr; exit status 0 on success, 1 otherwise.
 */
public final class Interop {
    // The shape every language uses (docs/bindings.md).
    static final int KV_HEADS = 8;
    static final int HEAD_DIM = 128;
    static final int BLOCK_TOKENS = 16;
    static final int PLANE_BYTES = BLOCK_TOKENS * KV_HEADS * HEAD_DIM * 2; // fp16: 32,768 bytes
    static final int PLANES = 2;
    // Logical block i lives at physical block (i * STRIDE + OFFSET) % blocks, differently per side.
    static final int PREFILL_STRIDE = 37;
    static final int PREFILL_OFFSET = 11;
    static final int DECODE_STRIDE = 29;
    static final int DECODE_OFFSET = 5;
    static final String[] REQUEST_IDS = {"interop-full", "interop-selective"};
    static final int REQ_FULL = 0;
    static final int REQ_SELECTIVE = 1;
    static final String READY_PREFIX = "ready ";
    static final String PROFILE_FORMAT = "{\"version\":1,\"model\":\"interop\",\"num_layers\":%d,\"num_kv_heads\":8,"
            + "\"block_tokens\":16,\"defaults\":{\"policy\":\"sinks_recent\",\"budget\":{\"fraction\":0.125},"
            + "\"sinks\":16,\"recent\":64}}";
    /** Between notification polls (Java has no poll on the context's event fd). */
    static final Duration NOTIFY_POLL = Duration.ofMillis(1);
    /** Between connects refused while the peer starts. */
    static final Duration CONNECT_RETRY = Duration.ofMillis(50);

    /** A failure with the status name the result line reports. */
    static final class Failure extends RuntimeException {
        private static final long serialVersionUID = 1L;
        final String statusName;

        Failure(String statusName, String message) {
            super(message);
            this.statusName = statusName;
        }
    }

    private final InteropConfig cfg;
    private final int n;
    private final int[] table;
    /** ramp[j] = 7j mod 256: the plane of base b is ramp[(b * 183) mod 256 ...] (183 = 7^-1 mod 256). */
    private final byte[] ramp = new byte[PLANE_BYTES + 256];
    private final byte[] scratch = new byte[PLANE_BYTES];

    private Context ctx;
    private Listener listener;
    private Session session;
    private Pool pool;
    /** The pool's memory, allocated by this program as an engine owns its KV cache: [layer][plane]. */
    private ByteBuffer[][] regions;
    private Profile profile;
    private final Transfer[] xfer = new Transfer[2];
    private String step = "setup";

    private long bytes;
    private double fullS;
    private double callsNs;
    private boolean fullOk;
    private boolean selectiveOk;

    Interop(InteropConfig cfg) {
        this.cfg = cfg;
        this.n = cfg.tokens / BLOCK_TOKENS;
        this.table = new int[n];
        int stride = cfg.prefill ? PREFILL_STRIDE : DECODE_STRIDE;
        int offset = cfg.prefill ? PREFILL_OFFSET : DECODE_OFFSET;
        for (int i = 0; i < n; i++) {
            table[i] = (int) (((long) i * stride + offset) % cfg.blocks);
        }
        for (int j = 0; j < ramp.length; j++) {
            ramp[j] = (byte) (j * 7);
        }
    }

    static void progress(InteropConfig cfg, String fmt, Object... args) {
        System.err.println("[java " + (cfg == null ? "?" : cfg.role) + "] " + String.format(Locale.ROOT, fmt, args));
    }

    private void progress(String fmt, Object... args) {
        progress(cfg, fmt, args);
    }

    // ---- pool and bytes ------------------------------------------------------------------------

    private int patternOffset(int layer, int plane, int logical, int req) {
        int base = (layer * 131 + plane * 71 + logical * 29 + req * 13) & 0xFF;
        return (base * 183) & 0xFF;
    }

    private ByteBuffer planeAt(int layer, int plane, int logical) {
        int start = Math.multiplyExact(table[logical], PLANE_BYTES);
        return regions[layer][plane].slice(start, PLANE_BYTES);
    }

    private long requestBytes() {
        return (long) cfg.layers * PLANES * n * PLANE_BYTES;
    }

    private void fillRequest(int req) {
        for (int l = 0; l < cfg.layers; l++) {
            for (int p = 0; p < PLANES; p++) {
                for (int i = 0; i < n; i++) {
                    planeAt(l, p, i).put(ramp, patternOffset(l, p, i, req), PLANE_BYTES);
                }
            }
        }
    }

    private void clearRequest() {
        byte[] zeros = new byte[PLANE_BYTES];
        for (int l = 0; l < cfg.layers; l++) {
            for (int p = 0; p < PLANES; p++) {
                for (int i = 0; i < n; i++) {
                    planeAt(l, p, i).put(zeros);
                }
            }
        }
    }

    private void verifyRequest(int req) {
        for (int l = 0; l < cfg.layers; l++) {
            for (int p = 0; p < PLANES; p++) {
                for (int i = 0; i < n; i++) {
                    planeAt(l, p, i).get(scratch);
                    int from = patternOffset(l, p, i, req);
                    int o = Arrays.mismatch(scratch, 0, PLANE_BYTES, ramp, from, from + PLANE_BYTES);
                    if (o >= 0) {
                        throw new Failure("MISMATCH", String.format(Locale.ROOT,
                                "%s: layer %d %s logical block %d (physical %d) offset %d: got 0x%02x, want 0x%02x",
                                REQUEST_IDS[req], l, p == 0 ? "K" : "V", i, table[i], o, scratch[o] & 0xFF,
                                ramp[from + o] & 0xFF));
                    }
                }
            }
        }
        bytes += requestBytes();
    }

    // ---- context, pool, session -------------------------------------------------------------------

    private Duration timeout() {
        return Duration.ofSeconds(cfg.timeoutS);
    }

    private void openContext() {
        regions = new ByteBuffer[cfg.layers][PLANES];
        for (ByteBuffer[] layer : regions) {
            for (int p = 0; p < PLANES; p++) {
                layer[p] = ByteBuffer.allocateDirect(Math.multiplyExact(cfg.blocks, PLANE_BYTES));
            }
        }
        step = "sg_context_create";
        // provider tcp;ofi_rxm, local_addr 127.0.0.1, the key from SG_AUTH_KEY_FILE.
        ctx = Context.builder().provider("tcp").build();
        step = "sg_kv_register";
        // Memory this program allocated, registered as it is (nothing copied): one K and one V
        // region per layer, the engine-owned registration a serving engine uses.
        ByteBuffer[] k = new ByteBuffer[cfg.layers];
        ByteBuffer[] v = new ByteBuffer[cfg.layers];
        for (int l = 0; l < cfg.layers; l++) {
            k[l] = regions[l][0];
            v[l] = regions[l][1];
        }
        pool = ctx.registerPool(KvLayout.of(cfg.layers, KV_HEADS, HEAD_DIM, BLOCK_TOKENS, cfg.blocks), k, v);
    }

    private void openSession() {
        if (cfg.listen) {
            step = "sg_listener_create";
            listener = ctx.listen(cfg.addr, cfg.port);
            progress("listening on %s:%d", cfg.addr, listener.port());
            step = "sg_session_accept";
            session = listener.accept(timeout());
            // One peer is all this program takes; the session outlives its listener.
            listener.close();
            listener = null;
        } else {
            connect();
        }
        step = "sg_session_export_kv";
        session.exportPool(pool);
        progress("session with %s:%d over %s", cfg.addr, cfg.port, session.provider());
    }

    /** The listener may not be up yet: a refused connect is retried until --timeout-s. */
    private void connect() {
        step = "sg_session_connect";
        long deadline = System.nanoTime() + timeout().toNanos();
        while (true) {
            long left = Math.max(0, deadline - System.nanoTime());
            try {
                session = ctx.connect(cfg.addr, cfg.port, Duration.ofNanos(left));
                return;
            } catch (SmartGenException e) {
                if (e.code() != Status.CONNECT.code() || System.nanoTime() + CONNECT_RETRY.toNanos() >= deadline) {
                    throw e;
                }
            }
            sleep(CONNECT_RETRY);
        }
    }

    private static void sleep(Duration d) {
        try {
            Thread.sleep(d.toMillis());
        } catch (InterruptedException e) {
            Thread.currentThread().interrupt();
            throw new Failure("SG_ERR_CANCELED", "interrupted");
        }
    }

    // ---- notifications ------------------------------------------------------------------------

    private void sendReady(int req) {
        step = "sg_session_notify";
        session.notify((READY_PREFIX + REQUEST_IDS[req]).getBytes(StandardCharsets.UTF_8));
    }

    private void awaitReady(int req) {
        String want = READY_PREFIX + REQUEST_IDS[req];
        long deadline = System.nanoTime() + timeout().toNanos();
        while (true) {
            step = "sg_session_next_notification";
            Optional<byte[]> msg = session.nextNotification();
            if (msg.isPresent()) {
                byte[] got = msg.get();
                int len = got.length;
                if (len > 0 && got[len - 1] == 0) {
                    len--; // a peer that sends a trailing NUL is read as one that does not
                }
                String text = new String(got, 0, len, StandardCharsets.UTF_8);
                if (text.equals(want)) {
                    return;
                }
                throw new Failure("SG_ERR_PROTOCOL", "expected the notification '" + want + "', got '"
                        + text.substring(0, Math.min(200, text.length())) + "'");
            }
            step = "sg_session_error";
            Optional<SmartGenException> lost = session.error();
            if (lost.isPresent()) {
                throw new Failure(lost.get().status().name(),
                        "session lost while waiting for '" + want + "': " + lost.get().detail());
            }
            if (System.nanoTime() >= deadline) {
                throw new Failure("SG_ERR_TIMEOUT", "no '" + want + "' notification within --timeout-s " + cfg.timeoutS);
            }
            sleep(NOTIFY_POLL);
        }
    }

    // ---- the two roles ------------------------------------------------------------------------------

    private void waitFor(String call, int req, boolean done) {
        if (!done) {
            throw new Failure("SG_ERR_TIMEOUT", call + "(" + REQUEST_IDS[req] + "): not done within --timeout-s "
                    + cfg.timeoutS);
        }
    }

    private void postRequest(int req) {
        awaitReady(req);
        TransferOptions options = TransferOptions.defaults().flags(TransferOptions.ALL_LAYERS_WRITTEN);
        if (req == REQ_FULL) {
            options.paths(TransferOptions.PATH_FULL);
        } else {
            options.paths(TransferOptions.PATH_PROACTIVE | TransferOptions.PATH_ON_DEMAND
                    | TransferOptions.PATH_SPECULATIVE).profile(profile);
        }
        step = "sg_transfer_post";
        long start = System.nanoTime();
        xfer[req] = session.post(REQUEST_IDS[req], pool, table, cfg.tokens, options);
        // Complete only once the decode side confirmed every byte in place.
        step = "sg_transfer_wait";
        waitFor("sg_transfer_wait", req, xfer[req].await(timeout()));
        if (req == REQ_FULL) {
            fullS = (System.nanoTime() - start) / 1e9;
        }
        bytes += requestBytes();
        progress("%s delivered and confirmed", REQUEST_IDS[req]);
        step = "sg_transfer_release";
        xfer[req].close(); // the blocks are refilled for the next request
        xfer[req] = null;
    }

    /** Request 0's bytes were written before the session was made (see run). */
    private void runPrefill() {
        postRequest(REQ_FULL);
        fullOk = true;
        if (!cfg.selective) {
            return;
        }
        fillRequest(REQ_SELECTIVE);
        step = "sg_profile_parse";
        profile = Profile.parse(String.format(Locale.ROOT, PROFILE_FORMAT, cfg.layers));
        postRequest(REQ_SELECTIVE);
        selectiveOk = true;
    }

    /** Decode: clear the destination, expect, then tell the prefill side it may post. */
    private long expectRequest(int req) {
        clearRequest();
        step = "sg_transfer_expect";
        long start = System.nanoTime();
        // Default options: the decode side follows the paths of the post.
        xfer[req] = session.expect(REQUEST_IDS[req], pool, table, cfg.tokens, TransferOptions.defaults());
        sendReady(req);
        return start;
    }

    private void receiveFull() {
        long start = expectRequest(REQ_FULL);
        step = "sg_transfer_wait";
        waitFor("sg_transfer_wait", REQ_FULL, xfer[REQ_FULL].await(timeout()));
        fullS = (System.nanoTime() - start) / 1e9;
        verifyRequest(REQ_FULL);
        fullOk = true;
        progress("%s: every byte checked (%.3f s)", REQUEST_IDS[REQ_FULL], fullS);
    }

    private void receiveSelective() {
        long start = expectRequest(REQ_SELECTIVE);
        Transfer x = xfer[REQ_SELECTIVE];
        step = "sg_transfer_wait_layer_state(SG_LAYER_ESSENTIAL)";
        for (int l = 0; l < cfg.layers; l++) {
            waitFor(step, REQ_SELECTIVE, x.waitLayerState(l, Transfer.LAYER_ESSENTIAL, timeout()));
        }
        int[] fetch = {1, n / 2, n - 2};
        step = "sg_transfer_fetch";
        x.fetch(0, fetch);
        step = "sg_transfer_wait_blocks";
        waitFor(step, REQ_SELECTIVE, x.waitBlocks(0, fetch, timeout()));
        // The speculative path brings whatever the proactive path and the fetch did not.
        step = "sg_transfer_wait";
        waitFor(step, REQ_SELECTIVE, x.await(timeout()));
        verifyRequest(REQ_SELECTIVE);
        step = "sg_transfer_stats";
        TransferStats stats = x.stats();
        progress("%s: every byte checked (%.3f s); bytes proactive %d, on demand %d, speculative %d; %d fetch requests",
                REQUEST_IDS[REQ_SELECTIVE], (System.nanoTime() - start) / 1e9, stats.bytesProactive(),
                stats.bytesOnDemand(), stats.bytesSpeculative(), stats.fetchRequests());
        step = "sg_transfer_release";
        x.close();
        xfer[REQ_SELECTIVE] = null;
        selectiveOk = true;
    }

    /** The binding's own cost of one call: a non-blocking query on a live, completed transfer. */
    private void measureCalls() {
        Transfer x = xfer[REQ_FULL];
        step = "sg_transfer_layer_state";
        int state = 0;
        long start = System.nanoTime();
        for (long i = 0; i < cfg.calls; i++) {
            state = x.layerState(0);
        }
        callsNs = (System.nanoTime() - start) / (double) cfg.calls;
        if ((state & Transfer.LAYER_READY) == 0) {
            throw new Failure("SG_ERR_INVALID_STATE", "layer 0 of a completed transfer reads state 0x"
                    + Integer.toHexString(state));
        }
        progress("%d calls of Transfer.layerState: %.1f ns each", cfg.calls, callsNs);
    }

    private void runDecode() {
        receiveFull();
        if (cfg.selective) {
            receiveSelective();
        }
        if (cfg.calls > 0) {
            measureCalls();
        }
        step = "sg_transfer_release";
        xfer[REQ_FULL].close();
        xfer[REQ_FULL] = null;
    }

    // ---- one run ----------------------------------------------------------------------------------

    /** The result line; the first failure is the reason, later ones only logged. */
    String run() {
        String reason = null;
        try {
            openContext();
            // The prefill side writes request 0 before it has a session, so the decode side's full_s
            // counts the transfer and the ready round trip, not the time the peer took to write it.
            if (cfg.prefill) {
                fillRequest(REQ_FULL);
            }
            openSession();
            if (cfg.prefill) {
                runPrefill();
            } else {
                runDecode();
            }
            // Graceful: returns once the peer has read everything this side sent.
            step = "sg_session_close";
            if (!session.close(timeout())) {
                throw new Failure("SG_ERR_TIMEOUT", "sg_session_close: not done within --timeout-s " + cfg.timeoutS);
            }
        } catch (Failure f) {
            reason = f.statusName + ": " + f.getMessage();
        } catch (SmartGenException e) {
            reason = e.status().name() + ": " + step + ": " + (e.detail().isEmpty() ? "(no detail)" : e.detail());
        }
        if (reason != null) {
            progress("%s", reason);
        }
        String late = cleanup();
        if (reason == null && late != null) {
            reason = late;
        }
        if (reason == null && !(fullOk && (selectiveOk || !cfg.selective))) {
            reason = "SG_ERR_INTERNAL: finished without completing every transfer";
        }
        if (reason != null) {
            return "interop lang=java role=" + cfg.role + " result=FAILED reason=\""
                    + reason.replace('"', '\'').replace('\n', ' ').replace('\r', ' ') + "\"";
        }
        double gbps = fullS > 0 ? requestBytes() / fullS / 1e9 : 0.0;
        return String.format(Locale.ROOT, "interop lang=java role=%s result=ok full=ok selective=%s bytes=%d "
                + "full_s=%.6f full_gbps=%.3f calls_ns=%.1f", cfg.role, cfg.selective ? "ok" : "skipped", bytes,
                fullS, gbps, callsNs);
    }

    /**
     * Reverse order of creation: transfers (they use the pool), profile, session, listener, pool,
     * context. Returns the first failure, if any.
     */
    private String cleanup() {
        String first = null;
        AutoCloseable[] all = {xfer[1], xfer[0], profile, session, listener, pool, ctx};
        for (AutoCloseable c : all) {
            if (c == null) {
                continue;
            }
            try {
                c.close();
            } catch (Exception e) {
                String what = e instanceof SmartGenException ? ((SmartGenException) e).status().name() + ": close: "
                        + ((SmartGenException) e).detail() : "SG_ERR_INTERNAL: close: " + e;
                progress("%s", what);
                if (first == null) {
                    first = what;
                }
            }
        }
        return first;
    }

    public static void main(String[] args) {
        InteropConfig cfg;
        try {
            cfg = InteropConfig.parse(args);
        } catch (Failure f) {
            System.err.println(InteropConfig.USAGE);
            String role = InteropConfig.roleIn(args);
            System.out.println("interop lang=java role=" + role + " result=FAILED reason=\"" + f.statusName + ": "
                    + f.getMessage().replace('"', '\'') + "\"");
            System.exit(1);
            return;
        }
        if (cfg == null) {
            System.out.println(InteropConfig.USAGE);
            return;
        }
        String line = new Interop(cfg).run();
        System.out.println(line);
        System.out.flush();
        System.exit(line.contains(" result=ok ") ? 0 : 1);
    }
}
