package io.smartgen;

import io.smartgen.internal.sg_context_options_t;
import io.smartgen.internal.sg_context_stats_t;
import io.smartgen.internal.smartgen;
import java.nio.charset.StandardCharsets;
import java.time.Duration;
import java.util.Set;
import java.util.concurrent.ConcurrentHashMap;

/**
 * One per engine process: the fabric, the progress thread, the registries. Thread-safe, except
 * that {@link #close()} must not run while other threads still call into this context's objects
 * (the header's one exception to its thread-safety rule). Closing it closes, in the library, every
 * session, listener, pool and transfer it still has; their Java objects then answer
 * SG_ERR_INVALID_HANDLE, and their close() does nothing. An open context is never collected, as
 * the library's own context lives until it is destroyed: close every context you create.
 */
public final class Context implements AutoCloseable {
    /**
     * Open contexts, and through them their pools' memory, stay reachable until closed: the library
     * keeps a context (and the peers' access to its exported pools) until it is destroyed, so the
     * garbage collector must not free a pool's buffers because the Java objects were dropped.
     */
    private static final Set<Context> OPEN = ConcurrentHashMap.newKeySet();

    private final Handle handle;
    private final long sink;
    private final Set<Pool> pools = ConcurrentHashMap.newKeySet();

    private Context(long handle, long sink) {
        this.handle = new Handle(handle, "Context");
        this.sink = sink;
    }

    /** A context with every option at its default (the key from SG_AUTH_KEY_FILE). */
    public static Context create() {
        return builder().build();
    }

    public static Builder builder() {
        return new Builder();
    }

    /**
     * Options of a context. Every option left unset means the library's default (the header's
     * "0 means the default"), so {@code builder().build()} is the default context.
     */
    public static final class Builder {
        private String provider;
        private String localAddr;
        private boolean manualProgress;
        private int progressSpinUs;
        private int maxOpsInFlight;
        private int logLevel;
        private int peerTimeoutMs;
        private long maxBytesInFlight;
        private long maxSessionBytesInFlight;
        private int maxTransfersPerSession;
        private byte[] authKey;
        private boolean allowUnauthenticated;
        private int lanes;
        private EventListener eventListener;

        private Builder() {}

        /** "tcp", "shm", "verbs;ofi_rxm", ...; unset ranks what is present. */
        public Builder provider(String provider) {
            this.provider = provider;
            return this;
        }

        /** Address literal(s) the data endpoint binds to; unset is 127.0.0.1. */
        public Builder localAddr(String localAddr) {
            this.localAddr = localAddr;
            return this;
        }

        /** No progress thread: the host calls {@link Context#progress()}. */
        public Builder manualProgress(boolean manualProgress) {
            this.manualProgress = manualProgress;
            return this;
        }

        /** Microseconds the progress thread spins before blocking; 0xFFFFFFFF (-1) blocks at once. */
        public Builder progressSpinUs(int progressSpinUs) {
            this.progressSpinUs = progressSpinUs;
            return this;
        }

        public Builder maxOpsInFlight(int maxOpsInFlight) {
            this.maxOpsInFlight = maxOpsInFlight;
            return this;
        }

        /** One of the SG_LOG_* values of io.smartgen.internal.sg_log_level; 0 is warn. */
        public Builder logLevel(int logLevel) {
            this.logLevel = logLevel;
            return this;
        }

        public Builder peerTimeout(Duration peerTimeout) {
            this.peerTimeoutMs = (int) Math.min(Integer.MAX_VALUE, Math.max(1, peerTimeout.toMillis()));
            return this;
        }

        public Builder maxBytesInFlight(long maxBytesInFlight) {
            this.maxBytesInFlight = maxBytesInFlight;
            return this;
        }

        public Builder maxSessionBytesInFlight(long maxSessionBytesInFlight) {
            this.maxSessionBytesInFlight = maxSessionBytesInFlight;
            return this;
        }

        public Builder maxTransfersPerSession(int maxTransfersPerSession) {
            this.maxTransfersPerSession = maxTransfersPerSession;
            return this;
        }

        /** The pre-shared key (32 to 4096 bytes), copied; unset reads SG_AUTH_KEY_FILE. */
        public Builder authKey(byte[] authKey) {
            this.authKey = authKey == null ? null : authKey.clone();
            return this;
        }

        public Builder allowUnauthenticated(boolean allowUnauthenticated) {
            this.allowUnauthenticated = allowUnauthenticated;
            return this;
        }

        public Builder lanes(int lanes) {
            this.lanes = lanes;
            return this;
        }

        /** Receives the context's transfer events (see {@link EventListener} for the rules). */
        public Builder eventListener(EventListener eventListener) {
            this.eventListener = eventListener;
            return this;
        }

        public Context build() {
            sg_context_options_t o = new sg_context_options_t();
            try {
                smartgen.sg_context_options_init(o);
                o.setManual_progress(manualProgress ? 1 : 0);
                o.setProgress_spin_us(progressSpinUs);
                o.setMax_ops_in_flight(maxOpsInFlight);
                o.setLog_level(logLevel);
                o.setPeer_timeout_ms(peerTimeoutMs);
                o.setMax_bytes_in_flight(maxBytesInFlight);
                o.setMax_session_bytes_in_flight(maxSessionBytesInFlight);
                o.setMax_transfers_per_session(maxTransfersPerSession);
                o.setAllow_unauthenticated(allowUnauthenticated ? 1 : 0);
                o.setLanes(lanes);
                long[] ctx = Handle.out();
                long[] sink = Handle.out();
                smartgen.sgj_context_create(o, provider, localAddr, authKey,
                        eventListener == null ? null : new ListenerDispatcher(eventListener), ctx, sink);
                Context context = new Context(ctx[0], sink[0]);
                OPEN.add(context);
                return context;
            } finally {
                o.delete();
            }
        }
    }

    long handle() {
        return handle.get();
    }

    /** A registered pool's memory stays reachable while the context may address it. */
    void keep(Pool pool) {
        pools.add(pool);
    }

    void forget(Pool pool) {
        pools.remove(pool);
    }

    /**
     * Opens the cluster directory for this context ({@code endpoints}: "http://10.0.0.1:2379,...";
     * {@code prefix} null for "/smartgen/"; a null or zero duration for the library's default).
     */
    public Directory openDirectory(String endpoints, String prefix, Duration leaseTtl, Duration requestTimeout) {
        long[] out = Handle.out();
        smartgen.sgj_directory_open(handle.get(), endpoints, prefix, leaseTtl == null ? 0 : (int) leaseTtl.toMillis(),
                requestTimeout == null ? 0 : (int) requestTimeout.toMillis(), out);
        return new Directory(out[0]);
    }

    /** Listens on addr:port (port 0 picks a free one: read it with {@link Listener#port()}). */
    public Listener listen(String addr, int port) {
        long[] out = Handle.out();
        smartgen.sg_listener_create(handle.get(), addr, port, out);
        return new Listener(out[0]);
    }

    /** Connects to a listener and runs the bootstrap and key exchange, waiting up to timeout. */
    public Session connect(String addr, int port, Duration timeout) {
        return Session.connect(this, addr, port, timeout);
    }

    /** Allocates a pool of the layout's shape (direct ByteBuffers) and registers it. */
    public Pool registerPool(KvLayout layout) {
        return Pool.register(this, layout);
    }

    /**
     * Registers the engine's own KV memory, given as direct ByteBuffers (one per layer for K, the
     * fused region with FUSED packing; one per layer for V, or {@code null} when FUSED), each at
     * least {@code layout.regionBytes()} long from its position. Nothing is copied; the pool keeps
     * the buffers reachable until it is closed.
     */
    public Pool registerPool(KvLayout layout, java.nio.ByteBuffer[] k, java.nio.ByteBuffer[] v) {
        return Pool.registerBuffers(this, layout, k, v);
    }

    /**
     * Registers the engine's own KV memory by address (native or CUDA device memory: {@link
     * Pool#HOST} or {@link Pool#CUDA} with its device ordinal), one address per layer for K and V
     * ({@code v} null when FUSED). The memory is the host's and must stay valid until the pool is
     * closed; the pool has no ByteBuffer views of it.
     */
    public Pool registerPool(KvLayout layout, int memKind, int device, long[] k, long[] v) {
        return Pool.registerAddresses(this, layout, memKind, device, k, v);
    }

    /** The provider the context runs on ("tcp;ofi_rxm", "shm", ...). */
    public String provider() {
        byte[] buf = new byte[256];
        smartgen.sg_context_provider(handle.get(), buf);
        return Text.fromNulTerminated(buf);
    }

    /** Drives progress once, without blocking; needed only with manual progress. */
    public void progress() {
        smartgen.sg_context_progress(handle.get());
    }

    public void setParam(int param, long value) {
        smartgen.sg_context_set_param(handle.get(), param, value);
    }

    public long param(int param) {
        long[] out = Handle.out();
        smartgen.sg_context_get_param(handle.get(), param, out);
        return out[0];
    }

    public ContextStats stats() {
        sg_context_stats_t s = new sg_context_stats_t();
        try {
            smartgen.sg_context_stats_init(s);
            smartgen.sg_context_stats(handle.get(), s);
            return ContextStats.of(s);
        } finally {
            s.delete();
        }
    }

    /** The counters in the Prometheus text format. */
    public String metricsText() {
        long h = handle.get();
        while (true) {
            long[] len = Handle.out();
            smartgen.sg_context_metrics_text(h, null, len);
            byte[] buf = new byte[(int) len[0] + 1];
            try {
                smartgen.sg_context_metrics_text(h, buf, len);
                return new String(buf, 0, (int) len[0], StandardCharsets.UTF_8);
            } catch (SmartGenException e) {
                if (e.code() != Status.BUFFER_TOO_SMALL.code()) {
                    throw e; // counters grew between the two calls otherwise: ask again
                }
            }
        }
    }

    /** Destroys the context (idempotent). */
    @Override
    public void close() {
        if (io.smartgen.internal.EventDispatcher.inCallback()) {
            closeLocked(); // refused by the library there (SG_ERR_INVALID_STATE); never wait for a cleaner
            return;
        }
        // Not while a cleaner releases one of the objects it would destroy (Cleaning).
        Cleaning.TEARDOWN.writeLock().lock();
        try {
            closeLocked();
        } finally {
            Cleaning.TEARDOWN.writeLock().unlock();
        }
    }

    private void closeLocked() {
        long h = handle.take();
        if (h == 0) {
            return;
        }
        try {
            smartgen.sgj_context_destroy(h, sink);
        } catch (SmartGenException e) {
            if (e.code() == Status.INVALID_STATE.code()) {
                handle.restore(h); // called from an event listener: the context lives on
                throw e;
            }
            if (e.code() != Status.INVALID_HANDLE.code()) {
                throw e;
            }
        } finally {
            if (handle.isClosed()) {
                pools.clear(); // the library deregistered them with the context
                OPEN.remove(this);
            }
        }
    }

    public boolean isClosed() {
        return handle.isClosed();
    }

    /** "MAJOR.MINOR.PATCH" of the loaded library. */
    public static String libraryVersion() {
        return smartgen.sg_version_string();
    }
}
