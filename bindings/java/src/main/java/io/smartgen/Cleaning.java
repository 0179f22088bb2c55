package io.smartgen;

import java.lang.ref.Cleaner;
import java.util.concurrent.locks.ReentrantReadWriteLock;

/**
 * The safety net for objects a program drops without close(): a Cleaner releases their library
 * handle once they are unreachable, and logs that it had to (close them: a GC may come late, and
 * until it does the handle holds library memory and, for a transfer, its pool). The release runs on
 * the cleaner's own daemon thread, never in a finalizer, and never together with a context's
 * destroy, which the header forbids to run concurrently with any call on the context's objects.
 */
final class Cleaning {
    private static final System.Logger LOG = System.getLogger("io.smartgen");
    private static final Cleaner CLEANER = Cleaner.create(r -> {
        Thread t = new Thread(r, "smartgen-cleaner");
        t.setDaemon(true);
        return t;
    });
    /** Held exclusively by Context.close (sg_context_destroy), shared by every cleaner release. */
    static final ReentrantReadWriteLock TEARDOWN = new ReentrantReadWriteLock();

    private Cleaning() {}

    /** Releases {@code handle} with {@code release} once {@code owner} is unreachable, unless closed first. */
    static void register(Object owner, Handle handle, Closing.Release release, String kind) {
        // The action captures the handle, never the owner (that would keep it reachable).
        CLEANER.register(owner, () -> {
            TEARDOWN.readLock().lock();
            try {
                long h = handle.take();
                if (h == 0) {
                    return; // closed by the program, or by its context
                }
                LOG.log(System.Logger.Level.WARNING,
                        "a " + kind + " was dropped without close(); released by its cleaner (close it when done)");
                release.run(h);
            } catch (RuntimeException e) {
                // SG_ERR_INVALID_HANDLE: its context was closed first and destroyed it; nothing else
                // is the program's to handle on this thread.
            } finally {
                TEARDOWN.readLock().unlock();
            }
        });
    }
}
