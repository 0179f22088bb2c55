package io.smartgen;

import io.smartgen.internal.sg_event_kind;

/**
 * One transfer event. The transfer is a borrowed view of the library's handle, valid during the
 * callback (its close() releases nothing); compare {@link #requestId()} to find your own object.
 * A newer library may send kinds this binding does not name: {@link #kind()} keeps the number.
 */
public final class Event {
    public static final int LAYER_READY = sg_event_kind.SG_EVENT_LAYER_READY;
    public static final int FINISHED = sg_event_kind.SG_EVENT_FINISHED;
    public static final int QUIESCED = sg_event_kind.SG_EVENT_QUIESCED;
    public static final int ESSENTIAL_READY = sg_event_kind.SG_EVENT_ESSENTIAL_READY;
    public static final int BLOCKS_READY = sg_event_kind.SG_EVENT_BLOCKS_READY;
    public static final int LEASE_EXPIRED = sg_event_kind.SG_EVENT_LEASE_EXPIRED;

    private final int kind;
    private final int layer;
    private final Status status;
    private final Transfer transfer;
    private final String requestId;
    private final int[] blocks;

    Event(int kind, int layer, Status status, Transfer transfer, String requestId, int[] blocks) {
        this.kind = kind;
        this.layer = layer;
        this.status = status;
        this.transfer = transfer;
        this.requestId = requestId;
        this.blocks = blocks == null ? new int[0] : blocks;
    }

    public int kind() {
        return kind;
    }

    /** The layer of the per-layer kinds; 0 otherwise. */
    public int layer() {
        return layer;
    }

    /** OK, or how the transfer (FINISHED, QUIESCED) or the fetch (BLOCKS_READY) ended. */
    public Status status() {
        return status;
    }

    public Transfer transfer() {
        return transfer;
    }

    public String requestId() {
        return requestId;
    }

    /** BLOCKS_READY: the logical blocks the fetch asked for; else empty. */
    public int[] blocks() {
        return blocks.clone();
    }

    @Override
    public String toString() {
        return "Event[kind=" + kind + ", layer=" + layer + ", status=" + status + ", request=" + requestId + "]";
    }
}
