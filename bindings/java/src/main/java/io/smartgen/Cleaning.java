package io.smartgen;

import java.lang.ref.PhantomReference;
import java.lang.ref.Reference;
import java.lang.ref.ReferenceQueue;
import java.util.Set;
import java.util.concurrent.ConcurrentHashMap;
import java.util.concurrent.locks.ReentrantReadWriteLock;

/**
 * The safety net for objects a program drops without close(): once the collector finds one
 * unreachable, its library handle is released, and a warning logged that it had to be (close them:
 * a GC may come late, and until it does the handle holds library memory and, for a transfer, its
 * pool). The releases run on the net's own daemon thread, never in a finalizer, and never together
 * with a context's destroy, which the header forbids to run concurrently with any call on the
 * context's objects. A java.lang.ref.Cleaner did this before, on its own schedule only: after 201
 * dropped transfers, System.gc() and 200 ms, 151 still held their pool. {@link #drain()} runs, on the
 * caller's thread, every release the collector has already made due (Pool.close does before it
 * refuses).
 */
final class Cleaning {
    private static final System.Logger LOG = System.getLogger("io.smartgen");
    private static final ReferenceQueue<Object> DUE = new ReferenceQueue<>();
    /** The nets not yet run: a PhantomReference must stay reachable to be enqueued. */
    private static final Set<Net> PENDING = ConcurrentHashMap.newKeySet();
    /** Held exclusively by Context.close (sg_context_destroy), shared by every release here. */
    static final ReentrantReadWriteLock TEARDOWN = new ReentrantReadWriteLock();

    static {
        Thread t = new Thread(Cleaning::runDue, "smartgen-cleaner");
        t.setDaemon(true);
        t.start();
    }

    private Cleaning() {}

    /** One dropped object's release; it captures the handle, never the owner (that would keep it reachable). */
    private static final class Net extends PhantomReference<Object> {
        private final Handle handle;
        private final Closing.Release release;
        private final String kind;

        Net(Object owner, Handle handle, Closing.Release release, String kind) {
            super(owner, DUE);
            this.handle = handle;
            this.release = release;
            this.kind = kind;
        }

        /** Runs once, on whichever thread dequeued it first. */
        void run() {
            if (!PENDING.remove(this)) {
                return;
            }
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
        }
    }

    /** Releases {@code handle} with {@code release} once {@code owner} is unreachable, unless closed first. */
    static void register(Object owner, Handle handle, Closing.Release release, String kind) {
        PENDING.add(new Net(owner, handle, release, kind));
    }

    /**
     * Runs every release the collector has made due, on this thread; returns how many ran. Not from
     * an event listener (the library refuses releases there): it then leaves them to the cleaner.
     */
    static int drain() {
        if (io.smartgen.internal.EventDispatcher.inCallback()) {
            return 0;
        }
        int ran = 0;
        for (Reference<?> r; (r = DUE.poll()) != null; ran++) {
            ((Net) r).run();
        }
        return ran;
    }

    private static void runDue() {
        for (;;) {
            try {
                ((Net) DUE.remove()).run();
            } catch (InterruptedException e) {
                // a daemon thread nobody interrupts; go on
            }
        }
    }
}
