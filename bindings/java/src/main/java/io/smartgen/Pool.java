package io.smartgen;

import io.smartgen.internal.sg_kv_layout_t;
import io.smartgen.internal.smartgen;
import java.nio.ByteBuffer;
import java.nio.ByteOrder;

/**
 * A registered KV pool whose memory is Java's: one direct ByteBuffer per layer for K and one for V
 * (one per layer when fused), page-aligned, zeroed. The pool, held by its open context, keeps them
 * reachable as long as the library may address them, and drops them only once close()
 * deregistered the pool (or the context was closed), so the garbage collector can never free
 * memory a transfer still writes. The buffers handed out are
 * duplicates (own position and limit, same memory, little-endian): fill and read them from any
 * thread, but not while a transfer that uses those blocks runs.
 */
public final class Pool implements AutoCloseable {
    /** Registration needs no more, but fabric registrations are per page: keep regions page-aligned. */
    private static final int PAGE = 4096;

    private final Handle handle;
    private final Context context;
    private final KvLayout layout;
    private volatile ByteBuffer[] k;
    private volatile ByteBuffer[] v;

    private Pool(long handle, Context context, KvLayout layout, ByteBuffer[] k, ByteBuffer[] v) {
        this.handle = new Handle(handle, "Pool");
        this.context = context;
        this.layout = layout;
        this.k = k;
        this.v = v;
    }

    static Pool register(Context ctx, KvLayout layout) {
        long region = layout.regionBytes();
        boolean fused = layout.packing() == KvLayout.FUSED;
        // A shape the library refuses gets no memory: the registration below names the bad field
        // (the library checks the shape before the base pointers).
        boolean allocate = region > 0 && layout.numLayers() > 0;
        if (allocate && region > Integer.MAX_VALUE - 2L * PAGE) {
            throw new IllegalArgumentException("a layer region of " + region
                    + " bytes is more than one direct ByteBuffer holds (2 GiB)");
        }
        int layers = allocate ? layout.numLayers() : 0;
        ByteBuffer[] k = new ByteBuffer[layers];
        ByteBuffer[] v = fused ? null : new ByteBuffer[layers];
        for (int l = 0; l < layers; l++) {
            k[l] = allocateAligned((int) region);
            if (v != null) {
                v[l] = allocateAligned((int) region);
            }
        }
        return registerRegions(ctx, layout, k, v);
    }

    /** Registers these regions (one buffer per layer; v null when fused) and keeps them reachable. */
    private static Pool registerRegions(Context ctx, KvLayout layout, ByteBuffer[] k, ByteBuffer[] v) {
        sg_kv_layout_t native_ = layout.toNative();
        try {
            long[] out = Handle.out();
            smartgen.sgj_kv_register(ctx.handle(), native_, k, v, out);
            Pool pool = new Pool(out[0], ctx, layout, k, v);
            ctx.keep(pool);
            return pool;
        } finally {
            native_.delete();
        }
    }

    /**
     * A pool over direct ByteBuffers the host already has (an engine's KV cache in off-heap
     * memory): one per layer for K (the fused region with FUSED packing) and one for V (SEPARATE
     * only), each at least {@link KvLayout#regionBytes()} long from its position. Registered as they
     * are; the pool keeps them reachable until it is closed.
     */
    static Pool registerBuffers(Context ctx, KvLayout layout, ByteBuffer[] k, ByteBuffer[] v) {
        boolean fused = layout.packing() == KvLayout.FUSED;
        checkCount("k", k, layout.numLayers());
        if (fused ? v != null : v == null) {
            throw new IllegalArgumentException(fused ? "a FUSED pool takes no V buffers" : "a SEPARATE pool needs V buffers");
        }
        if (v != null) {
            checkCount("v", v, layout.numLayers());
        }
        ByteBuffer[] ks = regions(k, layout.regionBytes());
        ByteBuffer[] vs = v == null ? null : regions(v, layout.regionBytes());
        return registerRegions(ctx, layout, ks, vs);
    }

    /**
     * A pool over memory at addresses the host owns: native host memory, or device memory of CUDA
     * device {@code device} ({@link #CUDA}), one address per layer for K (fused region) and V
     * ({@code null} when FUSED). Nothing is copied or kept: the host keeps the memory valid until
     * the pool is closed. Such a pool has no ByteBuffer views ({@link #k} and {@link #v} throw).
     */
    static Pool registerAddresses(Context ctx, KvLayout layout, int memKind, int device, long[] k, long[] v) {
        if (k == null) {
            throw new NullPointerException("k");
        }
        sg_kv_layout_t native_ = layout.toNative();
        try {
            native_.setMem_kind(memKind);
            native_.setDevice(device);
            long[] out = Handle.out();
            smartgen.sgj_kv_register_addresses(ctx.handle(), native_, k.clone(), v == null ? null : v.clone(), out);
            Pool pool = new Pool(out[0], ctx, layout, null, null);
            ctx.keep(pool);
            return pool;
        } finally {
            native_.delete();
        }
    }

    /** Host memory ({@code SG_MEM_HOST}). */
    public static final int HOST = 0;
    /** CUDA device memory ({@code SG_MEM_CUDA}; needs the library's CUDA plugin). */
    public static final int CUDA = 1;

    private static void checkCount(String what, ByteBuffer[] buffers, int layers) {
        if (buffers == null || buffers.length != layers) {
            throw new IllegalArgumentException(what + " must hold one buffer per layer (" + layers + ")");
        }
    }

    /** Each buffer from its position, as long as a region: direct, and long enough. */
    private static ByteBuffer[] regions(ByteBuffer[] buffers, long regionBytes) {
        ByteBuffer[] out = new ByteBuffer[buffers.length];
        for (int i = 0; i < buffers.length; i++) {
            ByteBuffer b = buffers[i];
            if (b == null || !b.isDirect()) {
                throw new IllegalArgumentException("buffer " + i + " is not a direct ByteBuffer (heap memory moves)");
            }
            if (b.remaining() < regionBytes) {
                throw new IllegalArgumentException("buffer " + i + " has " + b.remaining()
                        + " bytes from its position; a region needs " + regionBytes);
            }
            out[i] = b.slice().limit((int) regionBytes).slice();
        }
        return out;
    }

    /** alignedSlice also rounds the end down to the unit: allocate whole pages, plus one to align. */
    private static ByteBuffer allocateAligned(int bytes) {
        int pages = (int) (((long) bytes + PAGE - 1) / PAGE);
        return ByteBuffer.allocateDirect((pages + 1) * PAGE).alignedSlice(PAGE).limit(bytes).slice();
    }

    long handle() {
        return handle.get();
    }

    public KvLayout layout() {
        return layout;
    }

    /** Layer {@code layer}'s K region (with FUSED packing, its K+V region). */
    public ByteBuffer k(int layer) {
        return view(k, layer);
    }

    /** Layer {@code layer}'s V region; IllegalStateException with FUSED packing. */
    public ByteBuffer v(int layer) {
        if (layout.packing() == KvLayout.FUSED) {
            throw new IllegalStateException("a fused pool has no separate V region");
        }
        return view(v, layer);
    }

    /** The K (plane 0) or V (plane 1) plane of one block, as its own buffer (fused pools too). */
    public ByteBuffer plane(int layer, int plane, long block) {
        if (plane != 0 && plane != 1) {
            throw new IllegalArgumentException("plane is 0 (K) or 1 (V), not " + plane);
        }
        boolean fused = layout.packing() == KvLayout.FUSED;
        ByteBuffer region = plane == 0 || fused ? k(layer) : v(layer);
        long offset = block * layout.blockBytes() + (fused ? plane * layout.planeBytes() : 0);
        int start = Math.toIntExact(offset);
        return region.position(start).limit(start + (int) layout.planeBytes()).slice().order(ByteOrder.LITTLE_ENDIAN);
    }

    private ByteBuffer view(ByteBuffer[] regions, int layer) {
        if (handle.isClosed()) {
            throw new SmartGenException(Status.INVALID_HANDLE.code(), "the Pool is closed");
        }
        if (regions == null) {
            throw new IllegalStateException("a pool registered by address has no ByteBuffer view of its memory");
        }
        return regions[layer].duplicate().order(ByteOrder.LITTLE_ENDIAN);
    }

    /**
     * Deregisters the pool, then lets its memory go (idempotent). SG_ERR_INVALID_STATE while a
     * transfer that uses it is unreleased; the pool then stays open. Transfers the program dropped
     * without close() and the collector has found unreachable are released first, on this thread,
     * rather than whenever the cleaner thread gets to them: after {@code System.gc()} such a pool
     * closes at once.
     */
    @Override
    public void close() {
        try {
            Closing.release(handle, smartgen::sg_kv_deregister);
        } catch (SmartGenException e) {
            if (e.code() != Status.INVALID_STATE.code() || Cleaning.drain() == 0) {
                throw e;
            }
            Closing.release(handle, smartgen::sg_kv_deregister);
        }
        if (handle.isClosed()) {
            context.forget(this);
            k = null;
            v = null;
        }
    }
}
