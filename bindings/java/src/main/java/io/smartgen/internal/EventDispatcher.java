package io.smartgen.internal;

/**
 * Receives a context's transfer events from the JNI trampoline, on the library's progress thread
 * (or inside {@code Context.progress()} without one). Whatever the subclass throws is logged here:
 * an exception must never stay pending on a library thread.
 */
public abstract class EventDispatcher {
    private static final System.Logger LOG = System.getLogger("io.smartgen");

    private static final ThreadLocal<Boolean> IN_CALLBACK = ThreadLocal.withInitial(() -> Boolean.FALSE);

    /** Whether this thread is inside an event listener (where the library refuses blocking calls). */
    public static boolean inCallback() {
        return IN_CALLBACK.get();
    }

    /** Called by native code only. */
    public final void dispatch(int kind, int layer, int status, long transfer, String requestId, int[] blocks) {
        IN_CALLBACK.set(Boolean.TRUE);
        try {
            deliver(kind, layer, status, transfer, requestId, blocks);
        } catch (Throwable t) {
            LOG.log(System.Logger.Level.WARNING, "SmartGen event listener threw; the event is dropped", t);
        } finally {
            IN_CALLBACK.set(Boolean.FALSE);
        }
    }

    protected abstract void deliver(int kind, int layer, int status, long transfer, String requestId, int[] blocks);
}
