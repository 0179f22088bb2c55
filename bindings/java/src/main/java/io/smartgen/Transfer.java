package io.smartgen;

import io.smartgen.internal.sg_status_code;
import io.smartgen.internal.sg_transfer_stats_t;
import io.smartgen.internal.smartgen;
import io.smartgen.internal.smartgenConstants;
import java.time.Duration;
import java.util.BitSet;
import java.util.Optional;

/**
 * One request's KV on one side. Thread-safe. The waits return false when their timeout passes
 * first (the transfer goes on) and throw the transfer's own error when it failed. close() releases
 * it: an incomplete transfer is canceled, and close() returns once it is quiesced.
 */
public final class Transfer implements AutoCloseable {
    /** Prefill side: the engine marked the layer written. */
    public static final int LAYER_WRITTEN = (int) smartgenConstants.SG_LAYER_WRITTEN;
    /** Prefill: all its bytes delivered; decode: all its bytes in place. */
    public static final int LAYER_READY = (int) smartgenConstants.SG_LAYER_READY;
    /** Proactive path: the layer's essential blocks and digests delivered / in place. */
    public static final int LAYER_ESSENTIAL = (int) smartgenConstants.SG_LAYER_ESSENTIAL;

    private final Handle handle;
    private final String requestId;
    private final boolean owned;

    Transfer(long handle, String requestId, boolean owned) {
        this.handle = new Handle(handle, "Transfer");
        this.requestId = requestId;
        this.owned = owned;
        if (owned) {
            Cleaning.register(this, this.handle, smartgen::sg_transfer_release, "Transfer");
        }
    }

    /** The library's handle seen from an event: close() does not release it. */
    static Transfer borrowed(long handle, String requestId) {
        return new Transfer(handle, requestId, false);
    }

    public String requestId() {
        return requestId;
    }

    /** Prefill side: the engine finished writing the layer; the runtime may send it. */
    public void layerWritten(int layer) {
        smartgen.sg_transfer_layer_written(handle.get(), layer);
    }

    /**
     * As {@link #layerWritten(int)}, with the layer's last prompt queries (fp32
     * [numQueries][numQHeads][head_dim], after RoPE) for query-aware selection.
     */
    public void layerWritten(int layer, float[] queries, int numQueries, int numQHeads) {
        smartgen.sg_transfer_layer_written_q(handle.get(), layer, queries, numQueries, numQHeads);
    }

    /**
     * As {@link #layerWritten(int)} for a device engine (sg_transfer_layer_written_ex): the layer's
     * last prompt queries either in host memory ({@code hostQueries}, else null) or on the pool's
     * CUDA device ({@code deviceQueries}, an address, with {@code queriesMemKind} {@link Pool#CUDA}),
     * and the {@code cudaStream} (a cudaStream_t address, 0 for none) whose kernels write the layer:
     * the library orders its reads after them.
     */
    public void layerWritten(int layer, float[] hostQueries, long deviceQueries, int queriesMemKind, int numQueries,
                             int numQHeads, long cudaStream) {
        smartgen.sgj_transfer_layer_written_ex(handle.get(), layer, hostQueries, deviceQueries, numQueries, numQHeads,
                queriesMemKind, cudaStream);
    }

    /** Non-blocking: true when complete; throws the transfer's error. */
    public boolean test() {
        return waited(() -> smartgen.sg_transfer_test(handle.get()));
    }

    /** Waits for completion: true when complete, false when the timeout passed first. */
    public boolean await(Duration timeout) {
        return waited(() -> smartgen.sg_transfer_wait(handle.get(), Handle.nanos(timeout)));
    }

    /** Waits for one layer to be ready (decode: its bytes are in place). */
    public boolean waitLayer(int layer, Duration timeout) {
        return waited(() -> smartgen.sg_transfer_wait_layer(handle.get(), layer, Handle.nanos(timeout)));
    }

    /** Waits until every LAYER_* bit of {@code bits} is set for the layer. */
    public boolean waitLayerState(int layer, int bits, Duration timeout) {
        return waited(() -> smartgen.sg_transfer_wait_layer_state(handle.get(), layer, bits, Handle.nanos(timeout)));
    }

    /** The layer's LAYER_* bits now. */
    public int layerState(int layer) {
        return (int) smartgen.sgj_transfer_layer_state(handle.get(), layer);
    }

    /** Decode side, on-demand path: asks for logical blocks of a layer; returns at once. */
    public void fetch(int layer, int... blocks) {
        smartgen.sg_transfer_fetch(handle.get(), layer, blocks);
    }

    /** Decode side: waits until the given logical blocks of a layer are resident. */
    public boolean waitBlocks(int layer, int[] blocks, Duration timeout) {
        return waited(() -> smartgen.sg_transfer_wait_blocks(handle.get(), layer, blocks, Handle.nanos(timeout)));
    }

    /** Bit i set when the bytes of this side's block_ids[i] are in place (prefill: delivered). */
    public BitSet residency(int layer) {
        long h = handle.get();
        long[] bits = Handle.out();
        smartgen.sg_transfer_residency(h, layer, null, bits);
        byte[] map = new byte[(int) ((bits[0] + 7) / 8)];
        smartgen.sg_transfer_residency(h, layer, map, bits);
        return BitSet.valueOf(map);
    }

    /** Decode side, proactive path: the layer's page digests as received. */
    public float[] digests(int layer) {
        long h = handle.get();
        long[] count = Handle.out();
        smartgen.sg_transfer_digests(h, layer, null, count);
        float[] out = new float[(int) count[0]];
        smartgen.sg_transfer_digests(h, layer, out, count);
        return out;
    }

    /** OK when complete, IN_PROGRESS while running, or the transfer's error status. */
    public Status status() {
        long[] status = Handle.out();
        smartgen.sg_transfer_status(handle.get(), status, null);
        return Status.of((int) status[0]);
    }

    /** The transfer's error with its detail, or empty while it runs or once it completed. */
    public Optional<SmartGenException> error() {
        long[] status = Handle.out();
        byte[] msg = new byte[512];
        smartgen.sg_transfer_status(handle.get(), status, msg);
        return status[0] < 0 ? Optional.of(new SmartGenException((int) status[0], Text.fromNulTerminated(msg)))
                : Optional.empty();
    }

    public TransferStats stats() {
        sg_transfer_stats_t s = new sg_transfer_stats_t();
        try {
            smartgen.sg_transfer_stats_init(s);
            smartgen.sg_transfer_stats(handle.get(), s);
            return TransferStats.of(s);
        } finally {
            s.delete();
        }
    }

    /** Time until the layer became ready; zero while it is not. */
    public Duration layerTime(int layer) {
        long[] ns = Handle.out();
        smartgen.sg_transfer_layer_time(handle.get(), layer, ns);
        return Duration.ofNanos(ns[0]);
    }

    /** Cancels on this side and tells the peer; returns at once. */
    public void cancel() {
        smartgen.sg_transfer_cancel(handle.get());
    }

    /** Waits until no operation of the finished transfer can touch its blocks any more. */
    public boolean waitQuiesced(Duration timeout) {
        return smartgen.sg_transfer_wait_quiesced(handle.get(), Handle.nanos(timeout)) == sg_status_code.SG_OK;
    }

    private interface Wait {
        int run();
    }

    /**
     * True for SG_OK. A failure of the transfer itself may have happened in the background, where
     * the waiting thread's error message says nothing: the detail then comes from the transfer.
     */
    private boolean waited(Wait wait) {
        try {
            return wait.run() == sg_status_code.SG_OK;
        } catch (SmartGenException e) {
            if (!e.detail().isEmpty() || e.code() == Status.INVALID_HANDLE.code()) {
                throw e;
            }
            SmartGenException own = error().orElse(null);
            throw own != null && own.code() == e.code() && !own.detail().isEmpty() ? own : e;
        }
    }

    /** Releases the transfer (idempotent); a borrowed one from an event is left alone. */
    @Override
    public void close() {
        if (!owned) {
            return;
        }
        Closing.release(handle, smartgen::sg_transfer_release);
    }
}
