package io.smartgen;

import io.smartgen.internal.sg_directory_stats_t;
import io.smartgen.internal.sg_status_code;
import io.smartgen.internal.smartgen;
import java.nio.charset.StandardCharsets;
import java.time.Duration;
import java.util.ArrayList;
import java.util.List;
import java.util.Optional;

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

    /**
     * The metadata blob published under {@code name}, or empty when nobody has published it (or
     * its lease ended).
     */
    public Optional<byte[]> lookup(String name, Duration timeout) {
        long h = handle.get();
        while (true) {
            long[] len = Handle.out();
            if (smartgen.sg_directory_lookup(h, name, Handle.nanos(timeout), null, len) == sg_status_code.SG_ERR_NOT_FOUND) {
                return Optional.empty();
            }
            byte[] buf = new byte[(int) len[0]];
            int status = smartgen.sg_directory_lookup(h, name, Handle.nanos(timeout), buf, len);
            if (status == sg_status_code.SG_ERR_NOT_FOUND) {
                return Optional.empty();
            }
            if (status == sg_status_code.SG_OK) {
                return Optional.of(buf);
            }
            // SG_ERR_BUFFER_TOO_SMALL: republished larger between the two calls; again.
        }
    }

    /** The names published under {@code prefix} ("" for all), sorted. */
    public List<String> list(String prefix, Duration timeout) {
        long h = handle.get();
        while (true) {
            long[] len = Handle.out();
            long[] count = Handle.out();
            smartgen.sg_directory_list(h, prefix, Handle.nanos(timeout), null, len, count);
            byte[] buf = new byte[(int) len[0]];
            if (smartgen.sg_directory_list(h, prefix, Handle.nanos(timeout), buf, len, count) != sg_status_code.SG_OK) {
                continue; // a name was published between the two calls
            }
            List<String> names = new ArrayList<>((int) count[0]);
            for (int start = 0, i = 0; i < (int) len[0]; i++) {
                if (buf[i] == 0) {
                    names.add(new String(buf, start, i - start, StandardCharsets.UTF_8));
                    start = i + 1;
                }
            }
            return names;
        }
    }

    /**
     * Waits until {@code name} is published ({@code present}) or gone; {@code false} when the
     * timeout passed first.
     */
    public boolean await(String name, boolean present, Duration timeout) {
        return smartgen.sg_directory_wait(handle.get(), name, present ? 1 : 0, Handle.nanos(timeout))
                == sg_status_code.SG_OK;
    }

    /** A snapshot of a directory handle's counters (see sg_directory_stats_t for each field). */
    public record Stats(long requests, long failovers, long keepalives, long leasesGranted, long sessionsAccepted,
                        long requestsRefused, long namesTakenOver, long namesRestored) {}

    /** The handle's counters now. */
    public Stats stats() {
        sg_directory_stats_t s = new sg_directory_stats_t();
        try {
            smartgen.sg_directory_stats_init(s);
            smartgen.sg_directory_stats(handle.get(), s);
            return new Stats(s.getRequests(), s.getFailovers(), s.getKeepalives(), s.getLeases_granted(),
                    s.getSessions_accepted(), s.getRequests_refused(), s.getNames_taken_over(), s.getNames_restored());
        } finally {
            s.delete();
        }
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
