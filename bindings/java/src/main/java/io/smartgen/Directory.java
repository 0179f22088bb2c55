package io.smartgen;

import io.smartgen.internal.smartgen;
import java.time.Duration;

/**
 * A handle on the cluster directory (docs/directory.md): engines publish themselves under a name
 * in an etcd cluster and open sessions to each other by name. Thread-safe. Closing it withdraws
 * its names at once; closing its context closes it too.
 */
public final class Directory implements AutoCloseable {
    private final Handle handle;

    Directory(long handle) {
        this.handle = new Handle(handle, "Directory");
        Cleaning.register(this, this.handle, smartgen::sg_directory_destroy, "Directory");
    }

    /**
     * Publishes the context's signed metadata under {@code name}; SG_ERR_AUTH_FAILED when an
     * engine of another key holds the name.
     */
    public void publish(String name, Duration timeout) {
        smartgen.sg_directory_publish(handle.get(), name, Handle.nanos(timeout));
    }

    /** Removes a name this handle published. */
    public void unpublish(String name, Duration timeout) {
        smartgen.sg_directory_unpublish(handle.get(), name, Handle.nanos(timeout));
    }

    /** A session to the engine published as {@code name} (its entry must verify under the key). */
    public Session connect(String name, Duration timeout) {
        long[] out = Handle.out();
        smartgen.sg_directory_connect(handle.get(), name, null, Handle.nanos(timeout), out);
        return Session.adopt(out[0]);
    }

    /** The next session an engine opened to one of this handle's names. */
    public Session accept(Duration timeout) {
        long[] out = Handle.out();
        smartgen.sg_directory_accept(handle.get(), Handle.nanos(timeout), out);
        return Session.adopt(out[0]);
    }

    @Override
    public void close() {
        Closing.release(handle, smartgen::sg_directory_destroy);
    }
}
