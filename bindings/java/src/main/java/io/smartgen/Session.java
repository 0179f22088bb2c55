package io.smartgen;

import io.smartgen.internal.sg_session_options_t;
import io.smartgen.internal.sg_status_code;
import io.smartgen.internal.smartgen;
import java.time.Duration;
import java.util.Optional;

/**
 * An authenticated link to one peer context; thread-safe. {@link #close(Duration)} is the graceful
 * close (drains, then tells the peer); {@link #close()} destroys at once, canceling what is left.
 */
public final class Session implements AutoCloseable {
    private final Handle handle;

    private Session(long handle) {
        this.handle = new Handle(handle, "Session");
        Cleaning.register(this, this.handle, smartgen::sg_session_destroy, "Session");
    }

    /** A session the library made (by name, through the directory). */
    static Session adopt(long handle) {
        return new Session(handle);
    }

    static Session accept(long listener, Duration timeout) {
        sg_session_options_t o = new sg_session_options_t();
        try {
            smartgen.sg_session_options_init(o);
            long[] out = Handle.out();
            smartgen.sg_session_accept(listener, o, Handle.nanos(timeout), out);
            return new Session(out[0]);
        } finally {
            o.delete();
        }
    }

    static Session connect(Context ctx, String addr, int port, Duration timeout) {
        sg_session_options_t o = new sg_session_options_t();
        try {
            smartgen.sg_session_options_init(o);
            long[] out = Handle.out();
            smartgen.sg_session_connect(ctx.handle(), addr, port, o, Handle.nanos(timeout), out);
            return new Session(out[0]);
        } finally {
            o.delete();
        }
    }

    /** Registers the pool for this session and sends its descriptor to the peer (idempotent). */
    public void exportPool(Pool pool) {
        smartgen.sg_session_export_kv(handle.get(), pool.handle());
    }

    /**
     * Decode side: expects request {@code requestId} into {@code dst} at {@code blockIds} (one
     * block per {@code tokensPerBlock} tokens of {@code numTokens}); the pool must be exported.
     */
    public Transfer expect(String requestId, Pool dst, int[] blockIds, long numTokens, TransferOptions options) {
        long[] out = Handle.out();
        TransferOptions.withNative(options, o ->
                smartgen.sg_transfer_expect(handle.get(), requestId, dst.handle(), blockIds, numTokens, o, out));
        return new Transfer(out[0], requestId, true);
    }

    /** Prefill side: posts request {@code requestId} from {@code src} at {@code blockIds}. */
    public Transfer post(String requestId, Pool src, int[] blockIds, long numTokens, TransferOptions options) {
        long[] out = Handle.out();
        TransferOptions.withNative(options, o ->
                smartgen.sg_transfer_post(handle.get(), requestId, src.handle(), blockIds, numTokens, o, out));
        return new Transfer(out[0], requestId, true);
    }

    /** Sends a small message (1 to 4096 bytes) to the peer, in order with the session's traffic. */
    public void notify(byte[] message) {
        smartgen.sg_session_notify(handle.get(), message);
    }

    public void notify(String message) {
        notify(Text.utf8(message));
    }

    /** Takes the oldest notification that arrived, or empty when none is waiting. */
    public Optional<byte[]> nextNotification() {
        long h = handle.get();
        while (true) {
            long[] len = Handle.out();
            if (smartgen.sg_session_next_notification(h, null, len) == sg_status_code.SG_ERR_AGAIN) {
                return Optional.empty();
            }
            byte[] buf = new byte[(int) len[0]];
            int status = smartgen.sg_session_next_notification(h, buf, len);
            if (status == sg_status_code.SG_OK) {
                return Optional.of(buf);
            }
            // Another thread took that one in between (SG_ERR_AGAIN, SG_ERR_BUFFER_TOO_SMALL): look again.
        }
    }

    /** Why the session is no longer usable (SG_ERR_PEER_LOST, ...), or empty while it is. */
    public Optional<SmartGenException> error() {
        long[] status = Handle.out();
        byte[] msg = new byte[512];
        smartgen.sg_session_error(handle.get(), status, msg);
        return status[0] == 0 ? Optional.empty()
                : Optional.of(new SmartGenException((int) status[0], Text.fromNulTerminated(msg)));
    }

    /** Waits until a session made from metadata is authenticated; true when ready. */
    public boolean waitReady(Duration timeout) {
        return smartgen.sg_session_wait_ready(handle.get(), Handle.nanos(timeout)) == sg_status_code.SG_OK;
    }

    public String provider() {
        byte[] buf = new byte[256];
        smartgen.sg_session_provider(handle.get(), buf);
        return Text.fromNulTerminated(buf);
    }

    /**
     * Graceful close: takes no new transfers, waits for its transfers to finish and quiesce, tells
     * the peer and waits for its answer. True when closed; false when the timeout passed first (call
     * again, or {@link #close()}). The object still needs {@link #close()} afterwards.
     */
    public boolean close(Duration timeout) {
        return smartgen.sg_session_close(handle.get(), Handle.nanos(timeout)) == sg_status_code.SG_OK;
    }

    /** Destroys the session at once, canceling its unfinished transfers (idempotent). */
    @Override
    public void close() {
        Closing.release(handle, smartgen::sg_session_destroy);
    }
}
