package io.smartgen;

import io.smartgen.internal.smartgen;
import java.time.Duration;

/** A bootstrap listener; thread-safe. Sessions it accepted outlive it. */
public final class Listener implements AutoCloseable {
    private final Handle handle;

    Listener(long handle) {
        this.handle = new Handle(handle, "Listener");
        Cleaning.register(this, this.handle, smartgen::sg_listener_destroy, "Listener");
    }

    /** The port it is bound to (the one port 0 picked). */
    public int port() {
        long[] out = Handle.out();
        smartgen.sg_listener_port(handle.get(), out);
        return (int) out[0];
    }

    /**
     * Accepts one peer and runs the bootstrap and key exchange, waiting up to timeout; throws
     * SG_ERR_TIMEOUT when none finished in time (a handshake under way goes on with the next call).
     */
    public Session accept(Duration timeout) {
        return Session.accept(handle.get(), timeout);
    }

    /** Closes the listener (idempotent). */
    @Override
    public void close() {
        Closing.release(handle, smartgen::sg_listener_destroy);
    }
}
